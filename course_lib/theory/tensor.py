"""Formulas of tensor and sequence parallelism: communication, activation and parameter memory (lesson 04).

Communication (Shoeybi et al. 2019, Megatron-LM; Korthikanti et al. 2022, sequence parallelism), per
transformer layer and micro-batch of B x T tokens, C = d_model, b bytes per element, t = tp > 1:

    tensor parallel      forward  2 all-reduce      of B T C b   (after attention, after the MLP: g)
                         backward 2 all-reduce      of B T C b   (before qkv and fc: f)
    + sequence parallel  forward  2 all-gather  + 2 reduce-scatter of B T C b
                         backward 4 all-gather  + 2 reduce-scatter (qkv and fc gather their input again)

An all-reduce is a reduce-scatter plus an all-gather, so sequence parallelism moves the same bytes forward;
the extra backward all-gathers buy the memory saving (the gathered input is not kept). Per rank, a ring
sends 2(t-1)/t of the payload for an all-reduce and (t-1)/t for an all-gather or reduce-scatter.

Activation memory saved for backward by one layer of `course_lib.model.GPT` per rank, in elements per
token (the same accounting as `course_lib.theory.memory.activation_elements_per_layer`, F = d_ff, H heads):

    no parallelism       8C + 2F                  + fp32: 4 + H
    tensor parallel      4C + (4C + 2F) / t       + fp32: 4 + H/t     (LayerNorm inputs and outputs are whole)
    + sequence parallel  (8C + 2F) / t            + fp32: (4 + H) / t (everything divided by t)
"""

from __future__ import annotations

from course_lib.config import ModelConfig
from course_lib.theory.comm import bus_factor

__all__ = ["layer_collectives", "model_collectives", "bytes_sent_per_rank", "activation_elements_per_layer",
           "activation_bytes_per_layer", "param_counts_per_rank", "param_bytes_per_rank"]


def _add(table: dict, phase: str, op: str, calls: int, nbytes: int) -> None:
    if calls:
        row = table.setdefault((phase, op), {"calls": 0, "bytes": 0})
        row["calls"] += calls
        row["bytes"] += calls * nbytes


def layer_collectives(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sequence_parallel: bool = False,
                      dtype_bytes: int = 4) -> dict:
    """Collectives of one transformer layer: {(phase, op): {"calls": n, "bytes": payload bytes}} (see above)."""
    table: dict = {}
    if tp == 1:
        return table
    s = batch * seq_len * cfg.d_model * dtype_bytes          # one (B, T, C) activation
    if sequence_parallel:
        _add(table, "forward", "all_gather", 2, s)
        _add(table, "forward", "reduce_scatter", 2, s)
        _add(table, "backward", "all_gather", 4, s)
        _add(table, "backward", "reduce_scatter", 2, s)
    else:
        _add(table, "forward", "all_reduce", 2, s)
        _add(table, "backward", "all_reduce", 2, s)
    return table


def model_collectives(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sequence_parallel: bool = False,
                      dtype_bytes: int = 4) -> dict:
    """Collectives of one forward + backward of `apply_tensor_parallel(GPT)` with vocab-parallel loss.

    Besides the layers: the vocab-parallel embedding sums its partial lookups (an all-reduce; a reduce-scatter
    with SP, whose backward is an all-gather); the tied head is column-parallel (f: an all-reduce backward;
    with SP an all-gather forward, all-gather + reduce-scatter backward); the cross-entropy all-reduces the
    max (B T fp32 numbers) and the sum of exponentials with the target logit (2 B T fp32 numbers) forward.
    """
    table: dict = {}
    if tp == 1:
        return table
    for key, row in layer_collectives(cfg, batch, seq_len, tp, sequence_parallel, dtype_bytes).items():
        _add(table, *key, row["calls"] * cfg.n_layer, row["bytes"] // row["calls"])
    s, n = batch * seq_len * cfg.d_model * dtype_bytes, batch * seq_len
    if sequence_parallel:
        _add(table, "forward", "reduce_scatter", 1, s)        # embedding
        _add(table, "backward", "all_gather", 1, s)
        _add(table, "forward", "all_gather", 1, s)            # head input
        _add(table, "backward", "all_gather", 1, s)
        _add(table, "backward", "reduce_scatter", 1, s)
    else:
        _add(table, "forward", "all_reduce", 1, s)            # embedding (g)
        _add(table, "backward", "all_reduce", 1, s)           # head input (f)
    row = table.setdefault(("forward", "all_reduce"), {"calls": 0, "bytes": 0})
    row["calls"] += 2                                         # cross-entropy: max, then (sum exp, target)
    row["bytes"] += 4 * n + 4 * 2 * n
    return table


def bytes_sent_per_rank(table: dict, tp: int) -> float:
    """What one rank sends over a ring for the collectives in `table` (payload x bus factor)."""
    return sum(row["bytes"] * bus_factor(op.replace("_into_tensor", ""), tp) for (_, op), row in table.items())


def activation_elements_per_layer(cfg: ModelConfig, batch: int, seq_len: int, tp: int = 1,
                                  sequence_parallel: bool = False) -> dict:
    """Elements one layer saves for backward on one rank: dict(main=, fp32=) (see the module docstring)."""
    bt, C, F, H = batch * seq_len, cfg.d_model, cfg.d_ff, cfg.n_head
    if sequence_parallel:
        return dict(main=bt * (8 * C + 2 * F) // tp, fp32=bt * (4 + H) // tp)
    return dict(main=bt * (4 * C + (4 * C + 2 * F) // tp), fp32=bt * (4 + H // tp))


def activation_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int, tp: int = 1,
                               sequence_parallel: bool = False, dtype_bytes: int = 4) -> int:
    """Bytes one layer saves for backward on one rank (activations in `dtype_bytes`, statistics in fp32)."""
    e = activation_elements_per_layer(cfg, batch, seq_len, tp, sequence_parallel)
    return e["main"] * dtype_bytes + e["fp32"] * 4


def param_counts_per_rank(cfg: ModelConfig, tp: int) -> dict:
    """Parameters one rank holds under `apply_tensor_parallel` (tied embedding split along the vocabulary).

    sharded: qkv (3C^2 + 3C), attn.proj weight C^2, fc (FC + F), mlp.proj weight FC per layer, embedding VC
    -> divided by t; replicated: LayerNorms (4C per layer, 2C final), row-parallel biases (2C per layer),
    position embedding (T_max C).
    """
    C, F, L = cfg.d_model, cfg.d_ff, cfg.n_layer
    b = 1 if cfg.bias else 0
    sharded = L * (3 * C * C + 3 * C * b + C * C + F * C + F * b + F * C) + cfg.vocab_size * C
    replicated = L * (2 * C * (1 + b) + 2 * C * b) + C * (1 + b) + cfg.seq_len * C
    return dict(sharded=sharded // tp, replicated=replicated, total=sharded // tp + replicated)


def param_bytes_per_rank(cfg: ModelConfig, tp: int, dtype_bytes: int = 4) -> int:
    return param_counts_per_rank(cfg, tp)["total"] * dtype_bytes


def layer_time_estimate(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int, flops_per_s: float,
                        link_bytes_per_s: float, dtype_bytes: int = 2) -> dict:
    """Seconds of one layer's forward + backward on one rank: compute (6 x its matmul weights + attention,
    divided by tp, at `flops_per_s`) vs its 4 tensor-parallel all-reduces on a ring at `link_bytes_per_s`
    per GPU, one direction (no overlap, no latency). Returns dict(compute_s=, comm_s=, comm_fraction=)."""
    C, F = cfg.d_model, cfg.d_ff
    tokens = micro_batch * seq_len
    flops = tokens * (6 * (4 * C * C + 2 * C * F) + 12 * seq_len * C) / tp
    compute = flops / flops_per_s
    comm = bytes_sent_per_rank(layer_collectives(cfg, micro_batch, seq_len, tp, False, dtype_bytes), tp) / link_bytes_per_s
    return dict(compute_s=compute, comm_s=comm, comm_fraction=comm / (compute + comm))
