"""Which size an experiment runs at here: a CPU size (minutes on a 2-core laptop), a GPU size when its ranks get a GPU
each, and a smaller CPU size for ``course lab-report --quick`` (``COURSE_QUICK=1``); every lesson prints `sizes_label`.
"""

from __future__ import annotations

import os

from course_lib.dist import pick_backend

__all__ = ["on_gpus", "quick_run", "by_device", "sizes_label"]


def on_gpus(nprocs: int = 1) -> bool:
    """Whether `nprocs` ranks get one GPU each on this machine (`course_lib.dist.pick_backend`)."""
    return pick_backend(nprocs, announce=False) == "nccl"


def quick_run() -> bool:
    """Whether this kernel runs the reduced CPU sizes (``COURSE_QUICK=1``: ``course lab-report --quick`` and CI)."""
    return os.environ.get("COURSE_QUICK", "") == "1"


def by_device(cpu, gpu, nprocs: int = 1, quick=None):
    """``gpu`` when `nprocs` ranks get a GPU each here, else ``cpu``. Every experiment has a CPU size (a lesson runs in
    minutes on a 2-core laptop) and a GPU size (large enough that the GPU computes instead of waiting for kernel
    launches: GPT-2 124M where memory allows); the lesson prints which ran. ``quick``: a smaller CPU size for
    ``course lab-report --quick`` (the whole course in minutes, to check that it runs); GPUs keep their size."""
    if on_gpus(nprocs):
        return gpu
    return quick if quick is not None and quick_run() else cpu


def sizes_label(nprocs: int = 1) -> str:
    """Which sizes `by_device` picks here: ``GPU sizes``, ``CPU sizes`` or ``quick CPU sizes``."""
    return "GPU sizes" if on_gpus(nprocs) else "quick CPU sizes" if quick_run() else "CPU sizes"
