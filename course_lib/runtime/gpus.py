"""Which GPUs a course server or report sees: ``--gpus 2,3`` of `course lab` and `course lab-report` (issue 36).

A class on one shared node gives each learner a slice of its GPUs: ``course lab --gpus 2,3 --port 8891`` starts a
JupyterLab whose environment holds ``CUDA_VISIBLE_DEVICES=2,3``; its kernels inherit it, and so does every rank they
start with `course_lib.runtime.launch.run`. Inside, CUDA numbers the slice 0, 1, so `dist.pick_backend` counts 2 GPUs: NCCL
for runs of up to 2 ranks, gloo on the CPU for larger ones (said once), and learners never share a GPU.

    ids = parse_gpus("2,3", available=machine_gpus())     # [2, 3], or GpuSelectionError naming the flag and the fix
    env = visible_devices_env(ids)                         # {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": ...}

Ids are those of ``nvidia-smi`` (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set unless the shell chose an order). Where the
shell already restricts the GPUs (``CUDA_VISIBLE_DEVICES=4,5,6,7``), ids count among those: ``--gpus 0,1`` is 4,5.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["GpuSelectionError", "machine_gpus", "parse_gpus", "visible_devices_env", "describe"]


class GpuSelectionError(ValueError):
    """A ``--gpus`` value this machine cannot honour; the message is one line: what, which flag, how to fix."""


def machine_gpus() -> int:
    """How many GPUs this process can see (0 without CUDA). `torch.cuda.device_count` counts through NVML and
    leaves CUDA uninitialised (``torch.cuda.is_available`` would not): a ``CUDA_VISIBLE_DEVICES`` set afterwards in
    this process still takes effect (`course lab-report --gpus` runs its self-test in this process)."""
    import torch

    return torch.cuda.device_count()


def _ids_text(n: int) -> str:
    return "0" if n == 1 else f"0-{n - 1}"


def parse_gpus(spec: str, available: int, flag: str = "--gpus") -> list[int]:
    """``"2,3"`` -> [2, 3]; ``"0-3"`` -> [0, 1, 2, 3]; ``"4-5,0"`` -> [4, 5, 0] (the order CUDA will number them).

    Raises `GpuSelectionError` for a malformed value, a repeated id, an id the machine does not have
    (``available`` GPUs: ids 0 to available-1), or any id on a machine without GPUs."""
    text = spec.strip()
    ids: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise GpuSelectionError(f"{flag} {spec!r}: {part!r} is not a GPU id or a range of ids "
                                    f"(write e.g. {flag} 2,3 or {flag} 0-3)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi:
            raise GpuSelectionError(f"{flag} {spec!r}: the range {part!r} goes backwards (write {hi}-{lo})")
        for i in range(lo, hi + 1):
            if i in ids:
                raise GpuSelectionError(f"{flag} {spec!r}: GPU {i} is named twice (name each GPU once)")
            ids.append(i)
    if available <= 0:
        raise GpuSelectionError(f"{flag} {spec}: this machine has no GPU that torch can see (torch.cuda."
                                f"device_count() is 0): leave {flag} out, the lessons run on the CPU")
    missing = [i for i in ids if i >= available]
    if missing:
        raise GpuSelectionError(f"{flag} {spec}: this machine has {available} GPU{'s' * (available != 1)} (ids "
                                f"{_ids_text(available)}), no GPU {missing[0]}: choose ids among "
                                f"{_ids_text(available)} (nvidia-smi lists them)")
    return ids


def visible_devices_env(ids: list[int], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that make a process and its children see only GPUs ``ids`` (from `parse_gpus`).

    Without a ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default: this process's), the ids are the machine's, in
    nvidia-smi's order (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless ``environ`` sets an order). With one, the ids count
    among its entries (indices or UUIDs), which are kept as they are."""
    environ = os.environ if environ is None else environ
    parent = environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids),
                "CUDA_DEVICE_ORDER": environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    return {"CUDA_VISIBLE_DEVICES": ",".join(entries[i] for i in ids)}


def describe(ids: list[int], env: Mapping[str, str]) -> str:
    """One line on what the slice means for a run: ``GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3): runs of up to 2 ranks
    use NCCL (a GPU per rank), larger runs gloo on the CPU``."""
    n = len(ids)
    return (f"GPU{'s' * (n != 1)} {','.join(map(str, ids))} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}): "
            f"runs of up to {n} rank{'s' * (n != 1)} use NCCL (a GPU per rank), larger runs gloo on the CPU")
