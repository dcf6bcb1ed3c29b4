"""Measuring how fast a training step runs: time, throughput, FLOPs, peak FLOP/s and MFU (lesson 01).

Everything a lesson prints as "measured" names the machine it came from (`course_lib.measure.hardware.hardware_label`).

- Time: :class:`Timer` and :func:`time_fn` (warm-up, then the median of several repeats; on GPU
  ``torch.cuda.synchronize`` before reading the clock, because kernels run asynchronously); :class:`Stopwatch`
  (CUDA events, never a synchronize) for work between point-to-point messages; :func:`interval_union` /
  :func:`intervals_length` for the busy time of a profiled timeline.
- Compute: :func:`count_flops` (``torch.utils.flop_counter.FlopCounterMode`` with the CPU attention
  kernel registered), :func:`tokens_per_s`, :func:`mfu`, :func:`peak_flops` (the datasheet row of
  `course_lib.measure.hardware.GPU_SPECS`, else :func:`measure_peak_matmul_flops`, as on a CPU, which has no datasheet number
  that matters).

Bytes are counted in `course_lib.measure.memory_stats`, collectives in `course_lib.measure.collective_counter`, and numbers get their
units from `course_lib.measure.units`.

MFU (model FLOPs utilisation) follows PaLM (Chowdhery et al. 2022, appendix B): achieved *model*
FLOP/s (6N + attention per token, no recomputation) divided by the device's peak dense FLOP/s.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable

import torch

from course_lib.runtime import nccl_rules
from course_lib.measure.hardware import default_device, gpu_spec

# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (no-op on CPU). Never while a receive is pending: on a GPU this waits for NCCL's
    streams too (`course_lib.runtime.nccl_rules`, rule 3, checks it on CPU runs)."""
    nccl_rules.note_synchronize()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


class Timer:
    """Wall-clock timer that synchronises the GPU at start and stop.

    >>> with Timer() as t:
    ...     _ = sum(range(1000))
    >>> t.seconds > 0
    True
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


class Stopwatch:
    """Timestamps of device work that never block the host while it runs: CUDA events on a GPU, read once the work
    is done; ``time.perf_counter`` on a CPU. Every process of a machine shares perf_counter's clock, so the ranks'
    timelines line up; on a GPU each rank's events are placed on that clock by one reference point, taken when the
    stopwatch is made (make it when nothing is pending, e.g. right after a barrier).

        clock = Stopwatch(device)
        t0 = clock.stamp(); work(); t1 = clock.stamp()
        clock.seconds(t1) - clock.seconds(t0)    # on a GPU: waits for the events, so call it after the work

    Unlike `Timer`, it never calls ``torch.cuda.synchronize()``, which would wait for NCCL's pending receives too
    (`course_lib.runtime.nccl_rules`, rule 3): the way to time work between point-to-point messages (lesson 03).
    """

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else default_device()
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            self.reference.synchronize()
        self.t_reference = time.perf_counter()

    def stamp(self):
        """Now, on the device's timeline: a float (CPU) or a recorded CUDA event (GPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamp) -> float:
        """A stamp as ``time.perf_counter`` seconds (on a GPU, once its event has happened)."""
        if not self.cuda:
            return stamp
        stamp.synchronize()
        return self.t_reference + self.reference.elapsed_time(stamp) / 1e3


def time_fn(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
            device: torch.device | str | None = None, return_all: bool = False):
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls.

    The median (not the mean) because a shared machine produces occasional slow outliers.
    With ``return_all=True`` returns the list of all timed repeats instead.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one timed repeat")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            fn()
        times.append(t.seconds)
    return times if return_all else statistics.median(times)


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Throughput in tokens per second."""
    return tokens / seconds


def mfu(flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (a fraction, 0..1); from a throughput,
    ``mfu(tokens_per_s_per_gpu * flops_per_token, peak)``.

    ``peak_flops_per_s`` must be the *dense* peak of the dtype the matmuls run in (H100 SXM bf16: 989.4e12,
    ``hardware.GPU_SPECS["H100"]``), not the datasheet's headline 1,979e12, which assumes 2:4 structured sparsity
    (NVIDIA's H100 table marks it "* Shown with sparsity. Specifications 1/2 lower without sparsity"). torchtitan
    divides by the same number (``torchtitan/tools/utils.py``, ``get_peak_flops``: "# NOTE: Specifications are
    one-half lower without sparsity." ... ``return 989e12`` for H100 SXM)."""
    return flops_per_s / peak_flops_per_s


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def _sdpa_fwd_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_bwd_flops_no_recompute(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                 out_shape=None, **kwargs) -> int:
    # Model FLOPs: backward of two matmuls = 2 x forward (grad w.r.t. both operands of QK^T and PV).
    from torch.utils.flop_counter import sdpa_flop_count
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter_mapping() -> dict:
    """Extra ``custom_mapping`` for ``FlopCounterMode`` used by :func:`count_flops`.

    Two things differ from the stock counter (torch 2.x):
    1. the CPU attention kernel ``_scaled_dot_product_flash_attention_for_cpu`` has no formula there,
       so attention would count as 0 FLOPs on CPU; we register the same formula as for the GPU kernels;
    2. the GPU flash/efficient backward formulas include recomputing ``Q K^T`` (hardware FLOPs); MFU
       uses *model* FLOPs (PaLM, appendix B), so we count attention backward as 2 x forward everywhere.
    """
    aten = torch.ops.aten
    mapping = {}
    fwd = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    for name in fwd:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_fwd_flops
        if hasattr(aten, name + "_backward"):
            mapping[getattr(aten, name + "_backward")] = _sdpa_bwd_flops_no_recompute
    return mapping


def count_flops(fn: Callable[[], object], model_flops: bool = True, by_op: bool = False) -> int | dict[str, int]:
    """FLOPs executed by ``fn()`` as counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Counts matmuls (mm, addmm, bmm, attention) only: 2 FLOPs per multiply-add. Elementwise ops,
    softmax, layer norm, the loss and the optimizer step are not counted (they are a small
    fraction of a transformer's FLOPs, and are memory-bound anyway).
    With ``model_flops=True`` attention uses :func:`flop_counter_mapping` (CPU kernel counted,
    no recompute); with ``False`` the stock counter is used unchanged. ``by_op=True`` returns the count per op
    (``{"aten.mm": ..., ...}``, summing to the total) instead of the total.
    """
    from torch.utils.flop_counter import FlopCounterMode
    mapping = flop_counter_mapping() if model_flops else None
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    if by_op:
        return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    return int(counter.get_total_flops())


_BEST_MATMUL: dict[tuple[str, str], float] = {}  # best matmul FLOP/s seen in this process, per (device, dtype)


def record_matmul_flops(device, dtype: torch.dtype, flop_s: float) -> None:
    """Remember an achieved matmul FLOP/s (lesson 01's ``matmul_sweep`` calls this): on a CPU the peak
    is the best matmul seen, so no measurement reads above 100% of "peak"."""
    key = (str(torch.device(device)), str(dtype).replace("torch.", ""))
    _BEST_MATMUL[key] = max(_BEST_MATMUL.get(key, 0.0), flop_s)


@functools.lru_cache(maxsize=None)
def _measured_peak_cached(device_str: str, dtype_str: str, sizes: tuple, threads: int) -> float:
    device = torch.device(device_str)
    dtype = getattr(torch, dtype_str)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = min(time_fn(lambda: torch.mm(a, b), warmup=2, repeats=7, device=device, return_all=True))
        best = max(best, 2 * n ** 3 / seconds)
    return best


def measure_peak_matmul_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                              n: int | None = None) -> float:
    """Achieved FLOP/s of large square matmuls: the practical peak of this device (cached per process).

    On a CPU there is no datasheet number worth quoting (it depends on cores, vector width, clock
    and what else runs), so the course measures it: fp32, the best of n = 256, 512, 1024 (or the given
    ``n``). On a GPU, bf16, n = 8192. Each size reports its best of 7 repeats (as STREAM reports its
    best rate): what the hardware can do when nothing else runs; a shared machine slows the others.
    A better matmul recorded earlier (:func:`record_matmul_flops`) raises it.
    """
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if n is not None:
        sizes = (n,)
    else:
        sizes = (8192,) if device.type == "cuda" else (256, 512, 1024)
    dtype_str = str(dtype).replace("torch.", "")
    measured = _measured_peak_cached(str(device), dtype_str, sizes, torch.get_num_threads())
    return max(measured, _BEST_MATMUL.get((str(device), dtype_str), 0.0))


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) for the device: the datasheet for known GPUs, else measured."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(device))
        if spec is not None:
            return spec.bf16_tflops * 1e12, f"datasheet bf16 dense ({spec.name})"
    return measure_peak_matmul_flops(device, dtype), "measured (best fp32 matmul)" if device.type == "cpu" \
        else "measured (bf16 matmul, GPU not in table)"


# ---------------------------------------------------------------------------------------------
# Timelines: the busy time of a profiled trace (lessons 01, 02)
# ---------------------------------------------------------------------------------------------


def interval_union(intervals) -> list[list[float]]:
    """Merge (start, end) intervals into disjoint, sorted ones: the time during which at least one was open."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def intervals_length(intervals) -> float:
    """Total length of disjoint intervals (e.g. `interval_union`'s)."""
    return sum(e - s for s, e in intervals)
