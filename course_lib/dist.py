"""Rank helpers used inside a function started by `course_lib.runtime.launch.run` (lesson 00).

Inside such a function the default process group is already initialised, so these are thin, readable
wrappers over `torch.distributed`. Outside a distributed run they answer as a single process
(rank 0 of world size 1), so the same code runs in a notebook cell and on many ranks.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from course_lib.reference import reference_for


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


# ------------------------------------------------------------------------------------- the process grid

GRID_ORDER = ("pp", "dp", "cp", "tp")  # outermost to innermost, as torchtitan's mesh ["pp", "dp", "cp", "tp"]


@reference_for("08-grid")
class GridLayout:
    """Where each rank sits in a dp x cp x pp x tp grid, and which ranks each dimension groups (no process groups:
    any process can ask, e.g. to draw a grid of 1,024 ranks). `ProcessGrid` adds the groups.

    Rank r sits at ``(pp, dp, cp, tp)`` with ``r = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp``: the
    dimension that talks most often sits innermost, on the fastest links (torchrun numbers a node's ranks
    consecutively). TP innermost: two all-reduces of activations in every layer, forward and backward, on the
    critical path. CP next (lesson 10): every layer's attention exchanges K/V chunks (ring, all-gather) or
    activations (Ulysses), once per layer, partly hidden behind attention. DP next: one gradient all-reduce per
    step, overlapped with the backward pass, so it may cross nodes. PP outermost: its point-to-point messages are
    the smallest, so its stages may sit on different nodes. Megatron-LM's default order is "tp-cp-ep-dp-pp"
    (innermost first) and torchtitan's mesh is ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]`` (outermost
    first): the same order; picotron puts DP outermost.

    cp defaults to 1, and a grid with cp = 1 has no cp dimension (``coords_of`` gives pp, dp, tp; ``lines("cp")``
    refuses): the grids of lessons 08-09 are unchanged, ranks, groups and the order their groups are created in.
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1):
        sizes = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        for name, n in sizes.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{type(self).__name__}: {name}={n!r} must be a positive integer")
        if cp == 1:
            del sizes["cp"]
        self.sizes = sizes                                           # the grid's dimensions: cp only when cp > 1
        self.dims = tuple(d for d in GRID_ORDER if d in sizes)       # outermost to innermost
        self.world_size = dp * pp * tp * cp

    def _size(self, name: str) -> int:
        return self.sizes.get(name, 1)

    def coords_of(self, r: int) -> dict[str, int]:
        """Grid coordinates of global rank ``r``: ``{"pp": ..., "dp": ..., "tp": ...}`` (and ``"cp"`` if cp > 1)."""
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank {r} is not in a grid of {self.world_size} ranks")
        coords = {}
        for name in reversed(self.dims):                             # peel the innermost dimension off first
            r, coords[name] = divmod(r, self.sizes[name])
        return {name: coords[name] for name in self.dims}

    def rank_at(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at these coordinates."""
        coords = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        r = 0
        for name in GRID_ORDER:
            r = r * self._size(name) + coords[name]
        return r

    def lines(self, name: str) -> list[list[int]]:
        """Every group of dimension ``name``: the ranks that differ only in that coordinate, ordered by it."""
        if name not in self.sizes:
            fix = ": build the grid with cp=2 or more" if name == "cp" else ""
            raise ValueError(f"{type(self).__name__}: no dimension {name!r} (there are {', '.join(self.dims)}){fix}")
        others = [d for d in self.dims if d != name]
        return [[self.rank_at(**dict(zip(others, fixed)), **{name: i}) for i in range(self.sizes[name])]
                for fixed in itertools.product(*(range(self.sizes[d]) for d in others))]

    def members(self, r: int, name: str) -> list[int]:
        """The ranks of ``r``'s group along ``name``."""
        return next(line for line in self.lines(name) if r in line)


class ProcessGrid(GridLayout):
    """A `GridLayout` of this job's ranks, with one process group per line of each dimension (lesson 08; cp:
    lesson 10).

    Every rank must build the grid (``dist.new_group`` is collective: every rank creates every group, in the same
    order). ``grid.group("tp")`` is this rank's TP group, ``grid.ranks("tp")`` its members (global ranks),
    ``grid.coord("tp")`` this rank's index in it. One grid is passed explicitly to the code that needs it: no
    module-level groups.
    """

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, backend: str | None = None, cp: int = 1):
        super().__init__(dp, pp, tp, cp)
        world = world_size()
        if self.world_size != world:
            names = ["dp", "cp", "pp", "tp"] if cp > 1 else ["dp", "pp", "tp"]
            raise ValueError(f"ProcessGrid: {' x '.join(names)} = {' x '.join(str(self._size(n)) for n in names)} = "
                             f"{self.world_size}, but the world has {world} ranks: choose sizes whose product is "
                             f"{world}")
        self.rank = rank()
        self._coords = self.coords_of(self.rank)
        self._groups: dict[str, object] = {}
        self._ranks: dict[str, list[int]] = {}
        for name in self.dims:
            for members in self.lines(name):  # every rank creates every group, in the same order
                group = dist.new_group(members, backend=backend) if is_initialized() and world > 1 else None
                if self.rank in members:
                    self._groups[name], self._ranks[name] = group, members

    def group(self, name: str):
        """This rank's process group along ``name`` (None in a single process)."""
        self.lines(name)  # validates the name
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group along ``name``."""
        self.lines(name)
        return self._ranks[name]

    def coord(self, name: str) -> int:
        """This rank's index along ``name`` (its rank inside ``group(name)``)."""
        self.lines(name)
        return self._coords[name]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}={self.sizes[d]}" for d in self.dims)
        at = ", ".join(f"{d}={self._coords[d]}" for d in self.dims)
        return f"ProcessGrid({sizes}; rank {self.rank} at {at})"


def global_mean(value: torch.Tensor, group=None) -> float:
    """The mean over the ranks of `group` of a scalar (a rank's loss on its rows): the loss of the global batch
    when every rank has as many rows."""
    t = value.detach().float().clone()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
