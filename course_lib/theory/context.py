"""Formulas of context parallelism: communication, attention work and activation memory per rank (lesson 10).

One layer, one micro-batch of B sequences of s tokens, C = d_model, b bytes per element, cp ranks, n = s/cp tokens
per rank. One K/V chunk is a rank's keys and values: kv = 2 B n C b bytes. As `course_lib.parallel.context_attention`
implements them (payloads counted as `ContextCounter` counts them: a send its tensor, an all-gather its output, a
reduce-scatter and an all-to-all their input):

    ring (Liu et al. 2023)   forward   cp-1 sends of kv      (every other rank's K/V passes by once)
                             backward  cp-1 sends of kv      (K/V travel the ring again: not kept from forward)
                                     + cp   sends of kv      (the dK/dV accumulator of each chunk travels with it,
                                                              and makes one last hop home)
    all-gather (Llama 3)     forward   1 all-gather of 2 B s C b      (K/V of the whole sequence)
                             backward  1 reduce-scatter of 2 B s C b  (dK/dV summed back to their owners)
    Ulysses (Jacobs 2023)    forward   4 all-to-alls of B s C b / cp  (q, k, v to head shards, the output back)
                             backward  4 all-to-alls of B s C b / cp  (the same, reversed)

What a rank puts on the wire is the send itself for the ring and (cp-1)/cp of the payload for the collectives
(`bytes_sent_per_rank`): per layer forward the ring and all-gather both send 2 B C b (s - n), Ulysses
4 B C b (s - n)/cp, which *shrinks* as cp grows: Ulysses' advantage, bought with cp | n_head.

Attention work under the causal mask, counted in score elements of the chunk pairs actually computed (a pair whose
keys all follow its queries is skipped; a diagonal pair is computed whole and masked):

    contiguous split (cp chunks of s/cp)        rank i: (i + 1) (s/cp)^2          the last rank does cp x the first
    balanced split (2cp chunks of s/2cp;        rank i: (2cp + 1) (s/2cp)^2       the same on every rank
    rank i holds chunks i and 2cp-1-i)

Activations saved per layer per rank (`course_lib.theory.tensor.activation_bytes_per_layer` of n tokens: every
activation is per token, and block attention saves q, k, v, the output and one log-sum-exp per row and head, as SDPA
does; the ring's output is laid out (B, n, H, D) in memory, so it is also the projection's input, as SDPA's is).
All-gather CP keeps the gathered K/V of the whole sequence as well, 2 B s C b: it stops shrinking with cp. Ulysses
keeps the attention output twice, head-sharded (B, H/cp, s, D) for the attention's backward and back in sequence
shards as the projection's input: B n C b more than the ring (`extra_activation_bytes`).

With grouped-query attention (Llama 3: 8 KV heads) K and V are ``kv_dim = n_kv_head x head_dim`` wide, not C: the
ring's and the all-gather's bytes, and the all-gather's kept K/V, shrink by n_head / n_kv_head (``kv_dim=``; default
C, the course's GPT). Under tensor parallelism a rank holds 1/tp of the heads: pass C/tp and kv_dim/tp. The 3D
planner (`course_lib.theory.planner`, lesson 08) prices a layout's cp dimension with these formulas.
"""

from __future__ import annotations

from course_lib.config import ModelConfig
from course_lib.theory import tensor as tensor_theory
from course_lib.theory.comm import bus_factor

__all__ = ["VARIANTS", "kv_chunk_bytes", "layer_comm", "bytes_sent_per_rank", "causal_work_per_rank", "work_imbalance",
           "extra_activation_bytes", "activation_bytes_per_layer"]

VARIANTS = ("ring", "all_gather", "ulysses")     # as `course_lib.parallel.context_attention.VARIANTS`


def kv_chunk_bytes(batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
                   kv_dim: int | None = None) -> int:
    """Bytes of one rank's keys and values, 2 B (s/cp) C b (C -> ``kv_dim`` with GQA)."""
    return 2 * batch * (seq_len // cp) * (d_model if kv_dim is None else kv_dim) * dtype_bytes


def layer_comm(variant: str, batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
               kv_dim: int | None = None) -> dict:
    """{(phase, op): {"calls": n, "bytes": payload}} of one layer's attention on one rank (see the module docstring);
    ``kv_dim``: the width of K and V (n_kv_head x head_dim with GQA; default ``d_model``)."""
    if cp == 1:
        return {}
    kv_dim = d_model if kv_dim is None else kv_dim
    kv = kv_chunk_bytes(batch, seq_len, d_model, cp, dtype_bytes, kv_dim)
    if variant == "ring":
        return {("forward", "send"): {"calls": cp - 1, "bytes": (cp - 1) * kv},
                ("backward", "send"): {"calls": 2 * cp - 1, "bytes": (2 * cp - 1) * kv}}
    whole = 2 * batch * seq_len * kv_dim * dtype_bytes
    if variant == "all_gather":
        return {("forward", "all_gather"): {"calls": 1, "bytes": whole},
                ("backward", "reduce_scatter"): {"calls": 1, "bytes": whole}}
    if variant == "ulysses":
        four = 2 * batch * seq_len * (d_model + kv_dim) * dtype_bytes // cp      # q and the output; k and v
        return {("forward", "all_to_all"): {"calls": 4, "bytes": four},
                ("backward", "all_to_all"): {"calls": 4, "bytes": four}}
    raise ValueError(f"variant={variant!r}: use 'ring', 'all_gather' or 'ulysses'")


def bytes_sent_per_rank(table: dict, cp: int, phase: str | None = None) -> float:
    """What one rank puts on the wire for `table` (a send: itself; a collective: payload x (cp-1)/cp)."""
    return sum(row["bytes"] * (1.0 if op == "send" else bus_factor(op, cp))
               for (ph, op), row in table.items() if phase in (None, ph))


def causal_work_per_rank(seq_len: int, cp: int, split: str = "balanced", batch: int = 1, n_head: int = 1) -> list[int]:
    """Score elements each rank computes in one causal attention forward, fully masked chunk pairs skipped."""
    if split == "contiguous":
        n = seq_len // cp
        return [batch * n_head * (i + 1) * n * n for i in range(cp)]
    if split == "balanced":
        c = seq_len // (2 * cp)
        return [batch * n_head * (2 * cp + 1) * c * c for _ in range(cp)]
    raise ValueError(f"split={split!r}: use 'balanced' or 'contiguous'")


def work_imbalance(seq_len: int, cp: int, split: str = "balanced") -> float:
    """The busiest rank's attention work over the least busy one's (cp for the contiguous split, 1 balanced)."""
    w = causal_work_per_rank(seq_len, cp, split)
    return max(w) / min(w)


def extra_activation_bytes(variant: str, batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
                           kv_dim: int | None = None) -> int:
    """Bytes one layer keeps on one rank beyond what its own s/cp tokens keep: all-gather the gathered K/V of the
    whole sequence, 2 B s kv_dim b; Ulysses its output a second time, B (s/cp) C b; the ring nothing."""
    if cp == 1 or variant == "ring":
        return 0
    if variant == "all_gather":
        return 2 * batch * seq_len * (d_model if kv_dim is None else kv_dim) * dtype_bytes
    if variant == "ulysses":
        return batch * (seq_len // cp) * d_model * dtype_bytes
    raise ValueError(f"variant={variant!r}: use 'ring', 'all_gather' or 'ulysses'")


def activation_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int, cp: int, variant: str = "ring",
                               dtype_bytes: int = 4) -> int:
    """Bytes one layer saves for backward on one rank under context parallelism (see the module docstring)."""
    own = tensor_theory.activation_bytes_per_layer(cfg, batch, seq_len // cp, dtype_bytes=dtype_bytes)
    return own + extra_activation_bytes(variant, batch, seq_len, cfg.d_model, cp, dtype_bytes)
