"""Lesson 12, section 3: what the LM head's GEMM costs at a vocabulary one short of a multiple of 128 and padded up to
it, measured on this device, beside the tile and wave count the planner's model gives on a GPU (lesson 08)."""

from __future__ import annotations

import math

import torch

from course_lib.measure import hardware, speed
from course_lib.theory.planner.matmuls import TILES, quantization

__all__ = ["head_gemm_times", "head_tiles"]


def head_gemm_times(tokens: int, d_model: int, vocab: int, multiple: int = 128, device=None,
                    dtypes=(torch.float32, torch.bfloat16), repeats: int = 7) -> list[dict]:
    """The LM head's forward GEMM, (tokens x d_model) @ (d_model x V), at V = vocab and at V padded up to a multiple
    of `multiple`, in each dtype, timed side by side (alternating, the median of `repeats`). Per row: dtype, V,
    seconds, and the seconds per *useful* FLOP scaled to the unpadded GEMM's ("useful_s": the time the padded GEMM
    would need for the unpadded work, so that equal numbers mean padding cost nothing)."""
    device = torch.device(device) if device is not None else hardware.default_device()
    padded = math.ceil(vocab / multiple) * multiple
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in dtypes:
        x = torch.randn(tokens, d_model, generator=g).to(device, dtype)
        ws = {v: torch.randn(d_model, v, generator=g).to(device, dtype) for v in (vocab, padded)}
        times = {v: [] for v in ws}
        for _ in range(repeats):                                     # alternate: a slow spell hits both
            for v, w in ws.items():
                times[v] += speed.time_fn(lambda: x @ w, warmup=1, repeats=1, device=device, return_all=True)
        for v in ws:
            s = sorted(times[v])[len(times[v]) // 2]
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), vocab=v, seconds=s,
                             useful_s=s * vocab / v, tflop_s=2 * tokens * d_model * v / s / 1e12))
    return rows


def head_tiles(tokens: int, vocab: int, multiple: int = 128, gpu: str = "H100") -> list[dict]:
    """The same GEMM on a GPU of the datasheet table (`measure.hardware.GPU_SPECS`), counted, not measured: tiles
    (the better of `theory.planner.matmuls.TILES`), waves on its SMs, and the fraction of the launched work that is
    the GEMM's own (`quantization`), at V = vocab and padded."""
    spec = hardware.GPU_SPECS[gpu]
    out = []
    for v in (vocab, math.ceil(vocab / multiple) * multiple):
        best = max(TILES, key=lambda t: quantization(tokens, v, spec.sms, tiles=(t,)))
        tiles = math.ceil(tokens / best[0]) * math.ceil(v / best[1])
        out.append(dict(gpu=spec.name, sms=spec.sms, vocab=v, tile=best, tiles=tiles,
                        waves=math.ceil(tiles / spec.sms), fraction=quantization(tokens, v, spec.sms)))
    return out
