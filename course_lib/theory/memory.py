"""Bytes of training memory by formula: model state and activations (lessons 01, 05, 07).

Model state (Rajbhandari et al. 2020, "ZeRO", section 3.1): for P parameters,

    parameters  P x bytes(dtype)
    gradients   P x bytes(dtype)
    optimizer   k x P x bytes(dtype)   k = 2 for Adam/AdamW (exp_avg, exp_avg_sq), 1 for SGD with
                                       momentum, 0 for plain SGD; torch's Adam adds a 4-byte ``step``
                                       counter per parameter *tensor* (``step_counters``)

so fp32 Adam is 4P + 4P + 8P = 16P bytes. Mixed precision with Adam (Micikevicius et al. 2018) keeps
bf16/fp16 parameters and gradients (2P + 2P) plus fp32 master weights, momentum and variance
(4P + 4P + 4P): also 16P bytes, the "16 bytes per parameter" rule.

Activations: :func:`activation_bytes` counts, tensor by tensor, what autograd saves for the backward
pass of ``course_lib.model.GPT`` with ``scaled_dot_product_attention`` on CPU (dropout 0), derived from
``course_lib.measure.memory_stats.SavedActivations`` and checked against it in tests/test_theory.py.
"""

from __future__ import annotations

import torch

from course_lib.config import ModelConfig
from course_lib.reference import reference_for

DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8,
               "float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype (``torch.bfloat16`` or a name such as ``"bf16"``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of torch.float32, torch.bfloat16, torch.float16") from None


def num_param_tensors(cfg: ModelConfig) -> int:
    """Number of parameter tensors of ``course_lib.model.GPT(cfg)`` (torch's Adam keeps one step counter each).

    Per layer: ln1, qkv, proj, ln2, fc, proj: one weight each, plus one bias each when ``cfg.bias``.
    Plus token and position embedding, ln_f (weight, bias), and the head when it is not tied.
    """
    per_layer = 6 * (2 if cfg.bias else 1)
    return cfg.n_layer * per_layer + 2 + (2 if cfg.bias else 1) + (0 if cfg.tie_embeddings else 1)


@reference_for("01-training-memory")
def training_memory_bytes(cfg: ModelConfig | int, optimizer: str = "adam", dtype=torch.float32,
                          step_counters: int = 0) -> dict:
    """Bytes of parameters, gradients and optimizer state for a model (or a parameter count).

    Returns ``dict(params=, grads=, optimizer=, total=)``. ``step_counters``: number of 4-byte step
    tensors the optimizer keeps (torch Adam: one per parameter tensor, see :func:`num_param_tensors`).
    """
    P = cfg if isinstance(cfg, int) else cfg.num_params()
    b = dtype_bytes(dtype)
    try:
        k = OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATES)}") from None
    opt = k * P * b + (4 * step_counters if k == 2 else 0)
    out = dict(params=P * b, grads=P * b, optimizer=opt)
    out["total"] = sum(out.values())
    return out


def mixed_precision_bytes(n_params: int) -> dict:
    """Adam with bf16/fp16 compute and fp32 master weights: the 16P rule (ZeRO paper, K = 12).

    Returns ``dict(params=2P, grads=2P, master=4P, optimizer=8P, total=16P)``.
    """
    P = n_params
    out = dict(params=2 * P, grads=2 * P, master=4 * P, optimizer=8 * P)
    out["total"] = sum(out.values())
    return out


def activation_elements_per_layer(cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> dict:
    """Elements autograd saves for one transformer block of ``course_lib.model.GPT`` (SDPA, dropout 0).

    Per token (C = d_model, F = d_ff, H = n_head), read off ``SavedActivations.by_shape``:
      ln1 input C, ln1 output C (the qkv matmul's input), qkv output 3C (SDPA keeps q, k, v: views of it),
      SDPA output C (also the output projection's input: the CPU kernel writes it in (B, T, H, D) layout,
      so ``transpose(1, 2).contiguous()`` copies nothing), ln2 input C, ln2 output C,
      fc output F (GELU's input), GELU output F (the second matmul's input)        -> 8C + 2F  (activation dtype)
      mean and 1/std of each LayerNorm (2 x 2) and SDPA's log-sum-exp (H)          -> 4 + H   (fp32)
    """
    T = cfg.seq_len if seq_len is None else seq_len
    bt = batch_size * T
    return dict(main=bt * (8 * cfg.d_model + 2 * cfg.d_ff), fp32=bt * (4 + cfg.n_head))


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int | None = None, dtype=torch.float32) -> dict:
    """Bytes saved for backward by one forward + loss of ``course_lib.model.GPT`` (SDPA on CPU, dropout 0).

    Returns ``dict(per_layer=, layers=, other=, total=)``: ``layers = n_layer x per_layer``; ``other``:
    token ids and targets (int64), positions (int64), ln_f input and output, its mean and 1/std, the
    log-softmax output of the loss (B x T x V, fp32: the loss upcasts) and the loss's 4-byte weight.
    The logits themselves are not kept (log-softmax saves its output, not its input).
    """
    T = cfg.seq_len if seq_len is None else seq_len
    b = dtype_bytes(dtype)
    e = activation_elements_per_layer(cfg, batch_size, T)
    per_layer = e["main"] * b + e["fp32"] * 4
    bt = batch_size * T
    other = (2 * bt * 8 + T * 8            # idx, targets, positions (int64)
             + 2 * bt * cfg.d_model * b    # ln_f input, output
             + 2 * bt * 4                  # ln_f mean, 1/std
             + bt * cfg.vocab_size * 4     # log_softmax output (fp32)
             + 4)                          # cross-entropy total weight
    layers = cfg.n_layer * per_layer
    return dict(per_layer=per_layer, layers=layers, other=other, total=layers + other)


# ---------------------------------------------------------------------------------------------
# ZeRO: model state per rank when it is sharded over N data-parallel ranks (lesson 05)
# ---------------------------------------------------------------------------------------------

@reference_for("05-memory-formula")
def zero_model_state_bytes(n_params: int, world_size: int, stage: int, mixed: bool = True,
                           offload: str | None = None, step_counters: int = 0) -> dict:
    """Bytes of model state per rank under ZeRO stage 0-3 with Adam (Rajbhandari et al. 2020, section 5).

    Mixed precision (bf16/fp16 parameters and gradients, fp32 master weights + Adam moments, K = 12):

        stage 0 (DDP)   2P + 2P + 12P          = 16P
        stage 1         2P + 2P + 12P/N        =  4P + 12P/N
        stage 2         2P + 2P/N + 12P/N      =  2P + 14P/N
        stage 3         (2P + 2P + 12P)/N      = 16P/N

    fp32 (``mixed=False``): parameters 4P, gradients 4P, Adam moments 8P (no separate master copy), so
    stage 1 = 8P + 8P/N, stage 2 = 4P + 12P/N, stage 3 = 16P/N.
    ``offload="optimizer"`` is ZeRO-Offload (Ren et al. 2021, section 4.1; DeepSpeed ``offload_optimizer``, stage 1-3):
    the gradients and the optimizer state (with the master weights) live in CPU memory, where the optimizer step
    runs; only the 16-bit parameters stay on the device: 2P of 16P (2P/N under stage 3), as DeepSpeed's
    ``estimate_zero2_model_states_mem_needs(..., cpu_offload=True)`` counts. ``offload="param"`` (stage 3 only,
    ZeRO-Infinity's ``offload_param``) moves the parameters too: nothing of the model state stays on the device
    between uses.
    ``step_counters``: torch Adam's 4-byte step tensors, one per parameter tensor (not sharded).

    Returns ``dict(params=, grads=, optimizer=, total=, cpu=)``: ``total`` is on the device, ``cpu`` offloaded.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (plain data parallelism), 1, 2 or 3")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one rank")
    if offload not in (None, "optimizer", "param"):
        raise ValueError(f"offload={offload!r}: use None, 'optimizer' or 'param'")
    if offload == "param" and stage != 3:
        raise ValueError(f"offload='param' needs stage 3 (stage={stage}): only ZeRO-3 shards parameters")
    if offload is not None and stage == 0:
        raise ValueError(f"offload={offload!r} needs ZeRO stage 1-3 (stage=0): DeepSpeed offloads the optimizer "
                         "partitions that ZeRO creates")
    P, N = n_params, world_size
    b = 2 if mixed else 4                       # bytes of a parameter / gradient element
    k = 12 if mixed else 8                      # optimizer bytes per parameter (master + m + v, or m + v)
    params = b * P / N if stage >= 3 else b * P
    grads = b * P / N if stage >= 2 else b * P
    optimizer = k * P / N if stage >= 1 else k * P
    optimizer += 4 * step_counters
    cpu = 0.0
    if offload is not None:                     # ZeRO-Offload: gradients and optimizer state to the CPU
        cpu, grads, optimizer = grads + optimizer, 0.0, 0.0
    if offload == "param":
        cpu, params = cpu + params, 0.0
    out = dict(params=params, grads=grads, optimizer=optimizer)
    out["total"] = params + grads + optimizer
    out["cpu"] = cpu
    return out


def usable_offload(stage: int, offload: str | None) -> tuple[str | None, str]:
    """The offload a ZeRO ``stage`` supports: ``(offload, note)``, with the choice dropped and the reason in ``note``
    where the stage cannot offload it (the calculators' dropdowns)."""
    if offload == "param" and stage != 3:
        return None, "parameter offload needs stage 3: ignored"
    if offload is not None and stage == 0:
        return None, "offload needs ZeRO stage 1-3: ignored"
    return offload, ""


def zero_bytes_per_param(stage: int, world_size: int, mixed: bool = True) -> float:
    """Model-state bytes per parameter per rank: 16 for DDP, 4 + 12/N for ZeRO-1, ... (mixed precision)."""
    return zero_model_state_bytes(1, world_size, stage, mixed)["total"]


def zero_saving(stage: int, world_size: int, mixed: bool = True) -> float:
    """Fraction of DDP's model-state memory that ZeRO `stage` saves per rank (0.0 .. 1.0)."""
    return 1 - zero_bytes_per_param(stage, world_size, mixed) / zero_bytes_per_param(0, world_size, mixed)


def per_rank_bytes(cfg: ModelConfig, world_size: int, stage: int, offload: str | None = None, mixed: bool = True,
                   micro_batch: int = 1) -> dict:
    """Per-rank bytes by formula of training `cfg` with ZeRO `stage` on `world_size` ranks (lesson 05's calculator):
    params / grads / optimizer (on the device), cpu (offloaded), activations (one micro-batch, not sharded by
    ZeRO), device_total, and the number of parameter tensors."""
    s = zero_model_state_bytes(cfg.num_params(), world_size, stage, mixed, offload)
    act = activation_bytes(cfg, micro_batch, dtype="bf16" if mixed else "fp32")["total"]
    return dict(params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=act, cpu=s["cpu"],
                device_total=s["total"] + act, num_param_tensors=num_param_tensors(cfg))


def padded_numel(sizes, world_size: int) -> int:
    """Parameters after padding every tensor to a multiple of N (how the course's ZeRO and FSDP2 shard)."""
    return sum(-(-n // world_size) * world_size for n in sizes)


def zero_comm_bytes(n_params: int, world_size: int, stage: int, bytes_per_elem: int = 4) -> dict:
    """Bytes one rank sends per training step over a ring, for N ranks and P parameters (ZeRO section 7).

    DDP: all-reduce of the gradients, 2(N-1)/N x bP. ZeRO-1/2: reduce-scatter of the gradients + all-gather
    of the parameters, (N-1)/N x bP each: the same 2(N-1)/N x bP. ZeRO-3: the parameters are all-gathered
    twice (forward and backward) plus the reduce-scatter: 3(N-1)/N x bP, 1.5x DDP.
    Returns ``dict(all_reduce=, all_gather=, reduce_scatter=, total=, vs_ddp=)``.
    """
    N, bP = world_size, bytes_per_elem * n_params
    f = (N - 1) / N
    if stage == 0:
        out = dict(all_reduce=2 * f * bP, all_gather=0.0, reduce_scatter=0.0)
    elif stage in (1, 2):
        out = dict(all_reduce=0.0, all_gather=f * bP, reduce_scatter=f * bP)
    elif stage == 3:
        out = dict(all_reduce=0.0, all_gather=2 * f * bP, reduce_scatter=f * bP)
    else:
        raise ValueError(f"stage={stage}: ZeRO stages are 0, 1, 2 or 3")
    out["total"] = sum(out.values())
    out["vs_ddp"] = out["total"] / (2 * f * bP) if N > 1 else float("nan")
    return out
