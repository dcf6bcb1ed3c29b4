"""Where one training step's time goes, read from ``torch.profiler`` (lesson 12).

:func:`profile_step` runs a step under the profiler and sorts the *self* time of what ran (CPU operators on a CPU,
kernels on a GPU: the device's own clock) into five kinds (:func:`classify`), lists the top kernels, counts the
kernels a step launches (what ``torch.compile`` fuses away) and, on a CPU, the step's peak of allocated bytes from the
profiler's memory events. Lesson 01's `breakdown` splits a step by *when* (compute, communication, idle); this splits
it by *what*.

    matmul       mm, addmm, bmm, cuBLAS / CUTLASS GEMMs, fp8 scaled_mm: the work MFU counts
    attention    the fused attention kernels (SDPA, flash, memory-efficient) and the naive path's softmax
    elementwise  every other operator or kernel: norms, GELU, adds, copies, casts, the loss, embedding lookups
    optimizer    what runs inside ``optimizer.step`` (torch.optim's record_function scope; on a GPU the kernels
                 named adam / foreach / multi_tensor)
    other        the rest: autograd bookkeeping, compiled regions whose kernels the profiler cannot see inside
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from course_lib.measure.speed import synchronize

__all__ = ["CATEGORIES", "classify", "profile_step"]

CATEGORIES = ("matmul", "attention", "elementwise", "optimizer", "other")

_KINDS = (    # the first that matches names the kind; order matters ("_fused_adamw_" is no elementwise op)
    ("optimizer", re.compile(r"adam|_foreach_|multi_tensor|Optimizer\.", re.I)),
    ("attention", re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|attention|(?<!log)_softmax", re.I)),
    ("matmul", re.compile(r"(^|::|_)(add|b|baddb|addb)?mm($|_|\b)|gemm|cublas|cutlass|nvjet|xmma|matmul|linear", re.I)),
    ("elementwise", re.compile(r"^aten::|elementwise|vectorized|triton_(poi|red|per)|reduce|norm|copy|fill|index|gelu",
                               re.I)),
)


@contextlib.contextmanager
def _quiet_fd2():
    """File descriptor 2 sent to /dev/null inside the block: the profiler's C++ start/stop lines (``USDT: ...
    profiler_start``; KINETO_LOG_LEVEL does not silence them in torch 2.14) stay out of a notebook's output. Only the
    profiler's start and stop run inside; the profiled steps keep their stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def classify(name: str) -> str:
    """The kind (one of `CATEGORIES`) of a profiled operator or kernel, from its name alone.

    >>> [classify(n) for n in ("aten::addmm", "aten::_softmax", "aten::_log_softmax", "aten::_fused_adamw_",
    ...                        "aten::gelu", "CompiledFunction")]
    ['matmul', 'attention', 'elementwise', 'optimizer', 'elementwise', 'other']
    """
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def _ancestors(event):
    p = event.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _in_optimizer(event) -> bool:
    return any(p.name.startswith(("Optimizer.step", "Optimizer.zero_grad")) for p in _ancestors(event))


def _peak_allocated(prof, device_type: DeviceType) -> int | None:
    """Largest running sum of the bytes allocated (minus freed) on one device type while profiling: the step's own
    peak above what was allocated before it. None where the profiler's memory events cannot be read."""
    try:
        events = [e for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == device_type]
    except AttributeError:                  # a torch whose profiler keeps its results elsewhere
        return None
    events.sort(key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def profile_step(step: Callable[[], object], device: torch.device | str | None = None, steps: int = 1,
                 top: int = 8) -> dict:
    """Profile ``steps`` calls of ``step()`` (already warmed up: compiled, allocator primed) and return, per step:

    ``seconds``: self time per kind ({category: s}, `CATEGORIES`), ``total_s`` their sum, ``share`` the fractions;
    ``top``: the ``top`` kernels by self time (name, category, self_s, calls); ``kernels``: kernels launched (GPU)
    or top-level ATen operators dispatched (CPU; the C++ kernels of ``torch.compile`` run inside one compiled
    region and are not counted); ``peak_bytes``: on a CPU, the peak of bytes allocated during the step above what
    was allocated before it (the profiler's memory events), None on a GPU (use the CUDA allocator's statistics);
    ``clock``: which time was read.
    """
    device = torch.device(device or "cpu")
    gpu = device.type == "cuda"
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    prof = profile(activities=activities, profile_memory=not gpu)
    with _quiet_fd2():                                   # Kineto writes "profiler_start" to file descriptor 2
        prof.start()
    try:
        for _ in range(steps):
            step()
        synchronize(device)
    finally:
        with _quiet_fd2():
            prof.stop()
    events = [e for e in prof.events() if not e.name.startswith("[")]          # leave out [memory] and the like
    if gpu:
        work = [(e, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA]
        kernels = len(work)
    else:
        work = [(e, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU]
        kernels = sum(1 for e in events if e.name.startswith("aten::")
                      and not any(p.name.startswith("aten::") for p in _ancestors(e)))
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, list] = {}
    for e, us in work:
        kind = "optimizer" if not gpu and _in_optimizer(e) else classify(e.name)
        seconds[kind] += us / 1e6 / steps
        entry = by_name.setdefault(e.name, [kind, 0.0, 0])
        entry[1] += us / 1e6 / steps
        entry[2] += 1
    total = sum(seconds.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(seconds=seconds, total_s=total,
                share={k: (v / total if total else 0.0) for k, v in seconds.items()},
                top=[dict(name=n, category=k, self_s=s, calls=c // steps) for n, (k, s, c) in ranked],
                kernels=kernels // steps, peak_bytes=None if gpu else _peak_allocated(prof, DeviceType.CPU),
                clock="self CUDA time of kernels" if gpu else "self CPU time of operators")
