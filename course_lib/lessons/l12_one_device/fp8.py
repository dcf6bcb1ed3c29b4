"""Lesson 12's FP8 experiments: what a scale's granularity does to the round trip, FP8 training against bf16, and
when an FP8 GEMM is fast (only on tensor cores that have it). The technique: `course_lib.parallel.float8`."""

from __future__ import annotations

import copy
import logging

import torch

from course_lib.config import ModelConfig
from course_lib.data import get_batch, text_corpus
from course_lib.measure import hardware, speed
from course_lib.model import build_model
from course_lib.parallel import float8 as f8

__all__ = ["hide_pytree_enum_notes", "import_torchao_float8", "fp8_gemm_available", "keep_head", "float8_linears",
           "outlier_activations", "round_trip_by_granularity",
           "outlier_sweep", "loss_curves",
           "matmul_speed"]


class _EnumNote(logging.Filter):
    """Drops torch 2.14's note that registering an Enum with its pytree is deprecated; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "register_constant() on Enum subclasses is deprecated" not in record.getMessage()


_ENUM_NOTE = _EnumNote()


def hide_pytree_enum_notes() -> None:
    """Keep two log lines out of the lesson's output from now on: torchao 0.18 registers two Enums
    (``KernelPreference``, ``ScaleCalculationMode``) with torch's pytree when it is imported (transformers imports it
    too), and torch 2.14 logs each as deprecated (``torch.utils._pytree``: "Calling register_constant() on Enum
    subclasses is deprecated"): notes for torchao's maintainers, not for the learner. Other records of that logger
    still show. Call it before transformers or torchao is first imported; calling it again changes nothing."""
    logging.getLogger("torch.utils._pytree").addFilter(_ENUM_NOTE)


def import_torchao_float8():
    """``torchao.float8``, the library twin of `parallel.float8`, with `hide_pytree_enum_notes` in force."""
    hide_pytree_enum_notes()
    import torchao.float8 as ao

    return ao


def keep_head(module, fqn: str) -> bool:
    """torchao's module_filter_fn: every linear but the LM head goes to FP8 (the head's logits feed the softmax)."""
    return fqn != "head"


def float8_linears(model: torch.nn.Module) -> torch.nn.Module:
    """The ladder's fp8 rung: every linear of `model` but the LM head to FP8, tensorwise (torchao's default recipe)."""
    return f8.to_float8_training(model, "tensorwise", module_filter_fn=keep_head)


def fp8_gemm_available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(True, "") where FP8 GEMMs run on tensor cores (CUDA compute capability 8.9 or newer: Ada, Hopper,
    Blackwell), else (False, why). `torch._scaled_mm` still runs on a CPU, by dequantizing: right numerics, no speed."""
    device = torch.device(device) if device is not None else hardware.default_device()
    if device.type != "cuda":
        return False, (f"{device.type}: torch._scaled_mm dequantizes to fp32 here (numerics only, no FP8 "
                       f"arithmetic); FP8 tensor cores need a GPU of compute capability 8.9 or newer")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: FP8 tensor cores need sm_89 or newer"
    return True, ""


def outlier_activations(tokens: int = 256, channels: int = 512, outliers: int = 4, factor: float = 100.0,
                        seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic activation (tokens x channels) and its outlier channels: Gaussian, with `outliers` channels, all
    among the first 128, `factor` times larger, the pattern Dettmers et al. 2022 (LLM.int8()) report in the hidden
    states of large transformers (here made up, and said so). Returns (x, the outlier channels' indices)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=g)
    where = torch.randperm(min(128, channels), generator=g)[:outliers]
    x[:, where] *= factor
    return x, where


def round_trip_by_granularity(x: torch.Tensor, outlier_channels: torch.Tensor | None = None,
                              dtype: torch.dtype = f8.E4M3) -> list[dict]:
    """The round trip of x (tokens x channels) through `dtype` with one scale per tensor, per row (token), per
    column (channel) and per 1 x 128 tile: the relative error on the ordinary channels (all but
    `outlier_channels`) and on the outlier channels, and the fraction of the ordinary values that became zero."""
    ordinary = torch.ones(x.shape[1], dtype=torch.bool)
    if outlier_channels is not None:
        ordinary[outlier_channels] = False
    rows = []
    for name, (data, deq) in {
        "per tensor": _roundtrip(x, dtype, None),
        "per row (token)": _roundtrip(x, dtype, -1),
        "per column (channel)": _roundtrip(x, dtype, 0),
        "1 x 128 tiles": _roundtrip_blocks(x, dtype),
    }.items():
        rows.append(dict(granularity=name, ordinary=f8.round_trip_error(x[:, ordinary], deq[:, ordinary]),
                         outliers=(f8.round_trip_error(x[:, ~ordinary], deq[:, ~ordinary])
                                   if (~ordinary).any() else float("nan")),
                         zeros=(data[:, ordinary].float() == 0).float().mean().item()))
    return rows


def outlier_sweep(factors=(1e1, 1e2, 1e3, 1e4, 1e5), dtype: torch.dtype = f8.E4M3, seed: int = 0) -> list[dict]:
    """`round_trip_by_granularity` of `outlier_activations` at each outlier factor: one row per (factor,
    granularity)."""
    out = []
    for factor in factors:
        x, where = outlier_activations(factor=factor, seed=seed)
        out += [dict(factor=factor, **row) for row in round_trip_by_granularity(x, where, dtype)]
    return out


def _roundtrip(x, dtype, axis):
    data, scale = f8.quantize(x, dtype, axis=axis)
    return data, f8.dequantize(data, scale)


def _roundtrip_blocks(x, dtype):
    data, scale = f8.quantize_blocks(x, (1, 128), dtype)
    return data, f8.dequantize_blocks(data, scale)


def loss_curves(cfg: ModelConfig, steps: int, batch_size: int, lr: float = 3e-3, seed: int = 0,
                recipes: tuple[str, ...] = ("bf16", "tensorwise", "rowwise")) -> dict[str, list[float]]:
    """Train the same initial GPT for `steps` AdamW steps on the same batches, once per recipe: "bf16" (bf16
    autocast, fp32 weights) or an FP8 recipe (every linear but the head in FP8, the rest under the same bf16
    autocast). {recipe: losses}. The batches: windows of real text, the standard library's sources as bytes
    (course_lib.data.text_corpus; cfg.vocab_size must be 256)."""
    if cfg.vocab_size != 256:
        raise ValueError(f"cfg.vocab_size={cfg.vocab_size}: loss_curves trains on bytes, use a config with "
                         f"vocab_size=256 (e.g. the 'small' preset)")
    device = hardware.default_device()
    base = build_model(cfg, seed=seed)
    corpus = text_corpus(max_bytes=4_000_000)
    batches = [get_batch(corpus, batch_size, cfg.seq_len, step, seed=seed, device=device) for step in range(steps)]
    curves = {}
    for recipe in recipes:
        model = copy.deepcopy(base).to(device)
        if recipe != "bf16":
            f8.to_float8_training(model, recipe, module_filter_fn=keep_head)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[recipe] = losses
    return curves


def matmul_speed(m: int, k: int, n: int, device: torch.device | str | None = None, repeats: int = 5) -> dict:
    """Seconds of one (m, k) @ (k, n) GEMM in bf16 and through FP8 (the casts included, tensorwise and rowwise),
    measured side by side; FLOP/s of each. On a CPU the FP8 path dequantizes: it is slower, and that is the
    measurement, not a tuning problem."""
    device = torch.device(device) if device is not None else hardware.default_device()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    b = torch.randn(k, n, generator=g).to(device, torch.bfloat16)
    flops = 2 * m * k * n
    out = {}
    for name, fn in (("bf16", lambda: a @ b), ("fp8 tensorwise", lambda: f8.fp8_matmul(a, b, "tensorwise")),
                     ("fp8 rowwise", lambda: f8.fp8_matmul(a, b, "rowwise"))):
        seconds = speed.time_fn(fn, warmup=1, repeats=repeats, device=device)
        out[name] = dict(seconds=seconds, flop_s=flops / seconds)
    ok, why = fp8_gemm_available(device)
    out["fp8_tensor_cores"], out["why_not"] = ok, why
    out["hardware"] = hardware.hardware_label(device=device)
    return out
