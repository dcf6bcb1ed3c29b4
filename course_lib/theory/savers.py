"""Memory savers by formula: activation checkpointing, attention scores, budget fitting (lesson 07).

Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): cut the L
blocks into segments of k blocks; the forward keeps only each segment's input (one (B, T, C) tensor, ``s``
bytes) and throws the rest away; backward recomputes one segment at a time. With ``A`` the bytes one block
saves for backward (:func:`course_lib.theory.memory.activation_bytes`, ``per_layer``):

    held between forward and backward   ceil(L/k) x s            (instead of L x A)
    peak while backward recomputes      ceil(L/k) x s + k x A      (+ the gradients backward holds then;
                                                                    the segment's input is its first block's)
    best k                              sqrt(L x s / A): the peak is then about 2 sqrt(L s A), O(sqrt(L))

The price is one extra forward of every checkpointed block: 4 matmul passes instead of 3 (forward 1,
backward 2), +33% FLOPs whatever k is. "The sqrt(L) rule" is the case A = s (a segment boundary as large
as what a block keeps inside): k = sqrt(L).

Attention: naive attention keeps its softmax output, a (B, H, T, T) tensor per layer; the fused kernels
of ``scaled_dot_product_attention`` (FlashAttention, Dao et al. 2022; memory-efficient attention, Rabe &
Staats 2021) keep only the output and one log-sum-exp per query row, (B, H, T): O(T) instead of O(T^2).

Budget fitting (:func:`fit_budget`): model state (fp32 Adam: 16 bytes per parameter, or 4 with ZeRO-Offload,
which moves the gradients and the optimizer state to the CPU) plus the activation peak of one micro-batch must fit
in the device's budget; gradient accumulation keeps the global batch while shrinking the micro-batch.
"""

from __future__ import annotations

import math

import torch

from course_lib.config import ModelConfig
from course_lib.theory.planner import layer_activation_bytes
from course_lib.theory.memory import (activation_bytes, dtype_bytes, num_param_tensors, per_rank_bytes,
                                      training_memory_bytes)
from course_lib.reference import reference_for

__all__ = ["attention_saved_bytes", "model_activation_bytes", "checkpointed_activation_bytes",
           "selective_layer_bytes", "korthikanti_layer_bytes", "best_checkpoint_every", "recompute_flops",
           "recompute_flops_ratio", "plan_bytes",
           "planner_bytes", "fit_budget"]


def attention_saved_bytes(batch: int, n_head: int, seq_len: int, head_dim: int, kind: str = "naive",
                          dtype=torch.float32) -> int:
    """Bytes one causal attention ``softmax(q k^T / sqrt(D) + mask) v`` keeps for backward (q, k, v given).

    naive: q, k (for q k^T), the softmax output P (B, H, T, T) and v (for P v): 3 BHTD + BHT^2 elements.
    sdpa (fused, CPU flash kernel; GPU flash / memory-efficient kernels alike): q, k, v, the output
    (B, H, T, D) and the log-sum-exp of each row (B, H, T) in fp32: 4 BHTD elements + 4 BHT bytes.
    """
    b = dtype_bytes(dtype)
    qkv = batch * n_head * seq_len * head_dim * b
    if kind == "naive":
        return 3 * qkv + batch * n_head * seq_len * seq_len * b
    if kind == "sdpa":
        return 4 * qkv + 4 * batch * n_head * seq_len
    raise ValueError(f"kind={kind!r}: use 'naive' or 'sdpa'")


@reference_for("07-activation-estimator")
def model_activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int | None = None, dtype=torch.float32,
                           attention: str = "sdpa") -> dict:
    """:func:`course_lib.theory.memory.activation_bytes` for SDPA, or for naive attention: each layer keeps the
    softmax output (B, H, T, T) instead of SDPA's log-sum-exp (B, H, T, fp32). Same keys.

    The MLP is the one ``cfg.mlp`` names, counted as lesson 08's planner counts it
    (`course_lib.theory.planner.layer_activation_bytes`, ``mlp``): GELU keeps 2 (B, T, F) tensors, the course's
    GPT's; SwiGLU (Llama) keeps 4 (gate output, SiLU output, up output, their product). The rest of the block is
    the course's GPT's (LayerNorm, multi-head attention)."""
    T = cfg.seq_len if seq_len is None else seq_len
    out = dict(activation_bytes(cfg, batch_size, T, dtype))
    extra = _mlp_elements_beyond_gelu(cfg, batch_size, T) * dtype_bytes(dtype)
    if attention == "naive":
        extra += batch_size * cfg.n_head * T * (T * dtype_bytes(dtype) - 4)
    elif attention != "sdpa":
        raise ValueError(f"attention={attention!r}: use 'sdpa' or 'naive'")
    out["per_layer"] += extra
    out["layers"] = cfg.n_layer * out["per_layer"]
    out["total"] = out["layers"] + out["other"]
    return out


def _mlp_elements_beyond_gelu(cfg: ModelConfig, batch_size: int, seq_len: int) -> int:
    """Elements one block's MLP keeps beyond the GELU MLP that `activation_bytes` counts (0 for GELU): the
    planner's MLP count for ``cfg`` minus its count for the same block with GELU (both 16-bit bytes, halved)."""
    def mlp(c):
        return layer_activation_bytes(c, 1, seq_len, batch_size)["mlp"] / 2
    return round(mlp(cfg) - mlp(cfg.replace(mlp="gelu")))


def selective_layer_bytes(cfg: ModelConfig, batch_size: int, seq_len: int | None = None,
                          dtype=torch.float32) -> int:
    """Bytes one block keeps under selective checkpointing that saves the outputs of the matmuls and of
    attention, and recomputes the rest (LayerNorms, GELU, residual adds; torchtitan's "op" policy):
    the block's input C, the outputs of qkv 3C, attention C (+ log-sum-exp H, fp32), proj C, fc F and
    mlp.proj C per token: 7C + F elements + 4H bytes."""
    T = cfg.seq_len if seq_len is None else seq_len
    bt = batch_size * T
    return bt * ((7 * cfg.d_model + cfg.d_ff) * dtype_bytes(dtype) + 4 * cfg.n_head)


@reference_for("07-activation-estimator")
def checkpointed_activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int | None = None,
                                  every: int | None = None, dtype=torch.float32, attention: str = "sdpa",
                                  selective: bool = False) -> dict:
    """Activation bytes of one forward + loss + backward of ``course_lib.model.GPT`` when every ``every`` blocks
    form one checkpointed segment (``None``: no checkpointing).

    Returns ``dict(held=, peak=, per_layer=, boundary=, segments=, other=)``: ``held`` what the forward leaves
    for backward; ``boundary`` = s, a segment's input (B, T, C); ``peak`` the backward's largest moment, the
    larger of two: the loss's backward (held + two (B, T, V) fp32 gradients: log-softmax's and the logits') and
    the last segment recomputed (held - the log-softmax output + k x per_layer: the segment's input is held
    already, the gradient of its output takes the place of an s) while an MLP's backward holds a (B, T, F)
    gradient. Without checkpointing (and selective): held + the larger of the two gradients.
    ``held`` matches ``LiveActivations`` to the token ids (inputs, not created by the forward); the gradients of
    ``peak`` are an approximation of backward's working set: within 2% on the lesson's small models, and
    7-12% under the measurement on a d_model 256 model, where several (B, T, F) gradients are alive at once.
    ``selective=True``: every block keeps :func:`selective_layer_bytes` and recomputes only cheap operators.
    """
    T = cfg.seq_len if seq_len is None else seq_len
    base = model_activation_bytes(cfg, batch_size, T, dtype, attention)
    L, A, other = cfg.n_layer, base["per_layer"], base["other"]
    b = dtype_bytes(dtype)
    s = batch_size * T * cfg.d_model * b
    loss_grads = 2 * batch_size * T * cfg.vocab_size * 4
    mlp_grad = batch_size * T * cfg.d_ff * b
    if every is not None and every < 1:
        raise ValueError(f"every={every}: checkpoint every k >= 1 blocks, or None for no checkpointing")
    if selective:
        held = L * selective_layer_bytes(cfg, batch_size, T, dtype) + other
        return dict(held=held, peak=held + max(loss_grads, mlp_grad), per_layer=A, boundary=s, segments=L,
                    other=other)
    if every is None:
        held = L * A + other
        return dict(held=held, peak=held + max(loss_grads, mlp_grad), per_layer=A, boundary=s, segments=0,
                    other=other)
    k = min(every, L)
    segments = math.ceil(L / k)
    held = segments * s + other
    # recomputing: the loss's log-softmax output is freed, the segment's k blocks are back (their first input is
    # the held boundary), the gradient of the segment's output (B, T, C) replaces it, an MLP gradient (B, T, F)
    peak = held + max(loss_grads, k * A - loss_grads // 2 + mlp_grad)
    return dict(held=held, peak=peak, per_layer=A, boundary=s, segments=segments, other=other)


def korthikanti_layer_bytes(cfg: ModelConfig, seq_len: int | None = None, selective: bool = False) -> dict:
    """Activation bytes per token of one transformer block in 16-bit, as Korthikanti et al. (2022) count them
    (section 4.1, equation 1: ``sbh(34 + 5as/h)`` bytes per layer; no parallelism, naive attention, dropout masks
    included): ``34C + 5aT`` per token, ``a`` heads, ``T`` the sequence length. ``selective=True`` recomputes the
    attention core (section 5): ``34C``. Returns ``dict(per_token=, boundary=2C, ratio=)``: ``ratio`` is A/s,
    a block's activations over its 16-bit input, the ratio the sqrt(L s / A) rule needs."""
    T = cfg.seq_len if seq_len is None else seq_len
    C, a = cfg.d_model, cfg.n_head
    per_token = 34 * C + (0 if selective else 5 * a * T)
    return dict(per_token=per_token, boundary=2 * C, ratio=per_token / (2 * C))


def best_checkpoint_every(n_layer: int, per_layer: float, boundary: float) -> dict:
    """The k that minimises ceil(L/k) s + k A (the backward peak of the blocks' activations), and the
    continuous optimum sqrt(L s / A). Returns ``dict(every=, continuous=, peak=)``."""
    def peak(k):
        return math.ceil(n_layer / k) * boundary + k * per_layer
    best = min(range(1, n_layer + 1), key=lambda k: (peak(k), k))
    return dict(every=best, continuous=math.sqrt(n_layer * boundary / per_layer), peak=peak(best))


def recompute_flops(cfg: ModelConfig, batch_size: int, every: int, seq_len: int | None = None) -> float:
    """Matmul FLOPs that backward recomputes with segments of ``every`` blocks (model FLOPs, as counted by
    ``course_lib.measure.speed.count_flops``): one forward of every block, 2 B T (4C^2 + 2CF) + 4 B T^2 C, less one
    matmul per segment: torch's non-reentrant checkpoint stops recomputing a segment as soon as every tensor
    backward needs is back, so the last block's ``mlp.proj`` (2 B T F C; nothing keeps its output) is skipped."""
    T = cfg.seq_len if seq_len is None else seq_len
    bt, C, Fd = batch_size * T, cfg.d_model, cfg.d_ff
    block = 2 * bt * (4 * C * C + 2 * C * Fd) + 4 * batch_size * T * T * C
    segments = math.ceil(cfg.n_layer / min(every, cfg.n_layer))
    return cfg.n_layer * block - segments * 2 * bt * Fd * C


def recompute_flops_ratio(checkpointed_fraction: float = 1.0) -> float:
    """Training FLOPs with checkpointing / without: forward 1 + backward 2 = 3 units, + 1 recomputed
    forward of the checkpointed part (the fraction of the forward's FLOPs inside checkpointed blocks)."""
    return (3 + checkpointed_fraction) / 3


def plan_bytes(cfg: ModelConfig, micro_batch: int, every: int | None = None, offload: str | None = None,
               seq_len: int | None = None) -> dict:
    """Device bytes of one training plan: fp32 AdamW model state (16P + torch's 4-byte step counters; with
    ``offload='optimizer'``, ZeRO-Offload on one device, the gradients and the moments live in CPU memory and only
    the 4P of parameters stay) + the activation peak of one micro-batch."""
    if offload not in (None, "optimizer"):
        raise ValueError(f"offload={offload!r}: one device offloads None or 'optimizer'")
    state = training_memory_bytes(cfg, "adamw", torch.float32, step_counters=num_param_tensors(cfg))
    device_state = state["params"] if offload == "optimizer" else state["total"]
    act = checkpointed_activation_bytes(cfg, micro_batch, seq_len, every)["peak"]
    return dict(state=device_state, activations=act, cpu=state["total"] - device_state, total=device_state + act)


def planner_bytes(cfg: ModelConfig, world_size: int = 1, stage: int = 0, offload: str | None = None,
                  mixed: bool = True, micro_batch: int = 1, every: int | None = None,
                  global_batch: int | None = None) -> dict:
    """Lesson 05's `per_rank_bytes` with the activations of one micro-batch under checkpointing every ``every``
    blocks (the backward's peak); ``accum_steps`` = global batch / (micro-batch x ranks) (lesson 07's planner)."""
    out = dict(per_rank_bytes(cfg, world_size, stage, offload, mixed, micro_batch))
    act = checkpointed_activation_bytes(cfg, micro_batch, every=every, dtype="bf16" if mixed else "fp32")["peak"]
    out["device_total"] += act - out["activations"]
    out["activations"] = act
    gb = global_batch or micro_batch * world_size
    out["accum_steps"] = max(1, gb // (micro_batch * world_size))
    return out


@reference_for("07-budget-fitter")
def fit_budget(budget_bytes: float, candidates, global_batch: int, everys=(None, 1, 2, 4),
               offloads=(None,), seq_len: int | None = None) -> dict | None:
    """The largest model (most parameters) among ``candidates`` that trains within ``budget_bytes`` per device.

    A plan is (micro_batch, every, offload): ``micro_batch`` divides ``global_batch`` (accumulation steps =
    global_batch / micro_batch keep the global batch), ``every`` from ``everys`` (None: no checkpointing),
    ``offload`` from ``offloads``. Of the plans that fit the largest model, the cheapest in time: no offload
    before offload, no checkpointing before checkpointing, then the largest micro-batch, then the least memory.
    Returns ``dict(name, params, micro_batch, accum_steps, every, offload, bytes)`` or None when nothing fits.
    """
    best = None
    for cfg in sorted(candidates, key=lambda c: c.num_params(), reverse=True):
        plans = []
        for mb in (m for m in range(global_batch, 0, -1) if global_batch % m == 0):
            for k in everys:
                for off in offloads:
                    b = plan_bytes(cfg, mb, k, off, seq_len)["total"]
                    if b <= budget_bytes:
                        plans.append(((off is not None, k is not None, -mb, b), mb, k, off, b))
        if plans:
            _, mb, k, off, b = min(plans, key=lambda p: p[0])
            best = dict(name=cfg.name, params=cfg.num_params(), micro_batch=mb, accum_steps=global_batch // mb,
                        every=k, offload=off, bytes=b)
            break
    return best
