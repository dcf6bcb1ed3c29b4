"""Rank helpers used inside a function started by `course_lib.launch.run` (lesson 00).

Inside such a function the default process group is already initialised, so these are thin, readable
wrappers over `torch.distributed`. Outside a distributed run they answer as a single process
(rank 0 of world size 1), so the same code runs in a notebook cell and on many ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """Number of ranks (1 outside a distributed run)."""
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    """Rank within this node, as set by torchrun (0 outside a distributed run)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def backend() -> str:
    """'gloo', 'nccl' or 'none'."""
    return dist.get_backend() if is_initialized() else "none"


def is_cuda() -> bool:
    """True when this rank computes on a GPU (NCCL runs, or a single process with CUDA)."""
    if is_initialized():
        return dist.get_backend() == "nccl"
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    return torch.device("cuda", local_rank()) if is_cuda() else torch.device("cpu")


def device_name() -> str:
    """A human-readable name of this rank's device, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
    dev = device()
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


_ANNOUNCED: set = set()


def pick_backend(nprocs: int, announce: bool = True) -> str:
    """The course's one backend policy: 'nccl' (one GPU per rank) when this machine has at least `nprocs`
    GPUs, else 'gloo' (ranks on the CPU). So a lesson runs unchanged on a laptop, on a one-GPU machine and on
    a GPU node. On a GPU machine with too few GPUs the fallback is said once per process (``announce``)."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu >= nprocs:
        return "nccl"
    if n_gpu and announce and nprocs not in _ANNOUNCED:
        _ANNOUNCED.add(nprocs)
        print(f"note: {nprocs} ranks need {nprocs} GPUs (one per rank) and this machine has {n_gpu}: "
              f"these ranks run on the CPU with gloo", flush=True)
    return "gloo"


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (flushes, so that output streams live into the notebook)."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def barrier() -> None:
    if is_initialized():
        dist.barrier()
