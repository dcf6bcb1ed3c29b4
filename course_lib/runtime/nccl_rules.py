"""NCCL's rules, checked on gloo: a run that keeps them does not fail or hang on GPUs for these reasons, although
only gloo ran it (lesson 00; every distributed experiment of the course is checked by the test command).

gloo on a CPU forgives three things that NCCL on GPUs does not:

1. **Devices.** A process group with backend nccl rejects CPU tensors: every tensor handed to a collective or a
   point-to-point call must live on the rank's GPU, `course_lib.dist.device()`. Checked: a tensor made by a factory
   without ``device=`` (``torch.zeros(n)``, ``torch.tensor([...])``), made by ``.cpu()``, or passed in as an argument
   of the rank function, and whatever is computed from such tensors alone, must not reach a collective before
   ``.to(device)``. The error names the line that made it. Tensors made inside libraries (torch, DeepSpeed) are not
   judged.
2. **One queue per pair of ranks.** NCCL runs the messages between two ranks in the order each rank posted them,
   and a send of a large message finishes only once the peer has reached the matching receive. If rank A posts
   ``send, recv`` to B while B posts ``send, recv`` to A, both sends wait for ever; a receive posted ahead of a send
   blocks it the same way. Ops posted together in one ``dist.batch_isend_irecv`` form one group and match in any
   order. Checked: when the run ends, the point-to-point ops of every pair of ranks are replayed in posting order;
   a state where neither rank's next group can proceed is reported as the deadlock it would be.
3. **Synchronising the device waits for NCCL too.** ``torch.cuda.synchronize()`` (so `course_lib.measure.speed.synchronize`
   and its timers) waits for every stream, NCCL's included: called while a receive is posted and not yet waited for,
   it waits for a message whose sender may be waiting for this rank. Checked: a synchronize while a receive is
   pending is an error. Time GPU work with CUDA events instead (`course_lib.measure.speed.Stopwatch`).

    with enforced(args) as state:   # on every rank, around the rank function; args: its arguments
        value = fn(*args)
    check_pairs(state.groups)       # collective: every rank calls it after its function returned

`course_lib.runtime.launch.run` checks rules 1 and 3 in every rank when the environment has ``COURSE_NCCL_RULES=1`` (the
test command sets it, so every distributed test, lesson and solution notebook is checked) and replays rule 2 itself
once every rank has returned (`replay_pairs` on the posts the ranks report), so that a rank that finished is never
held up by one that did not.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ENV_VAR", "NcclRuleError", "enforced", "check_pairs", "note_synchronize", "replay_pairs", "active"]

ENV_VAR = "COURSE_NCCL_RULES"

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter")
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint,
             torch.arange, torch.linspace, torch.tensor, torch.as_tensor, torch.eye, torch.randperm}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_LIBRARIES = tuple(str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, os.path.dirname(os.__file__)})
_HERE = str(Path(__file__).resolve())
_COURSE = str(Path(__file__).resolve().parents[1]) + os.sep  # course_lib: its own code is judged wherever it is installed


class NcclRuleError(RuntimeError):
    """The run broke one of NCCL's rules (see `course_lib.runtime.nccl_rules`): on GPUs it would fail or hang."""


class _State:
    def __init__(self):
        self.unplaced = WeakIdKeyDictionary()     # tensor -> where it was made (None: inside a library)
        self.pending_recvs: dict[int, str] = {}   # id(tracked work) -> description
        self.groups: list[list[tuple[str, int]]] = []   # point-to-point posts: [(kind 'S'|'R', global peer)]
        self.in_batch = False
        self.depth = 0                            # > 0 inside torch's own function: its inner calls are not posts


_STATE: _State | None = None


def active() -> bool:
    """Whether the rules are being checked in this process."""
    return _STATE is not None


# ------------------------------------------------------------------------------------------ 1. devices

def _site() -> str | None:
    """'file:line' of the innermost caller outside torch and this module, or None when that is a library."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _HERE and not path.startswith("<frozen"):
            real = os.path.realpath(path) if os.path.isabs(path) else path
            if real.startswith(_COURSE):
                return f"{path}:{frame.f_lineno}"
            if "/torch/" in real and real.startswith(_LIBRARIES):
                frame = frame.f_back
                continue
            if real.startswith(_LIBRARIES):
                return None                       # made inside a library (DeepSpeed, transformers, ...)
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                yield x


class _Placement(TorchFunctionMode):
    """Follows which tensors were made without a device (see rule 1)."""

    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        unplaced = self.state.unplaced
        if func in FACTORIES:
            if kwargs.get("device") is None and isinstance(out, torch.Tensor):
                unplaced[out] = _site()
        elif func in _MOVES:
            moved = func is torch.Tensor.cuda or kwargs.get("device") is not None or any(
                isinstance(a, (str, torch.device, torch.Tensor)) for a in args[1:])
            if moved and isinstance(out, torch.Tensor):
                unplaced.pop(out, None)
            elif isinstance(out, torch.Tensor) and args and args[0] in unplaced and out is not args[0]:
                unplaced[out] = unplaced[args[0]]
        elif func is torch.Tensor.cpu:
            if isinstance(out, torch.Tensor) and out is not args[0]:   # a copy from the GPU (on a CPU: itself)
                unplaced[out] = _site()
        elif len(unplaced):
            inputs = [t for a in (*args, *kwargs.values()) for t in _tensors(a)]
            if inputs and all(t in unplaced for t in inputs):
                site = unplaced[inputs[0]]
                for t in _tensors(out):
                    if t not in unplaced:
                        unplaced[t] = site
        return out


def _check_devices(op: str, args, kwargs) -> None:
    state = _STATE
    if state is None:
        return
    for a in (*args, *kwargs.values()):
        for t in _tensors(a):
            if t in state.unplaced and state.unplaced[t] is not None:
                raise NcclRuleError(
                    f"dist.{op} got a CPU tensor made at {state.unplaced[t]} without a device: under NCCL every "
                    f"tensor of a collective must live on the rank's GPU. Create it with device=dist.device() (from "
                    f"course_lib import dist) or move it with .to(dist.device()) first")


# ------------------------------------------------------------------------------------------ 2. point-to-point

class _TrackedWork:
    """A `Work` whose wait is noticed (a receive stops being pending)."""

    def __init__(self, work, key: int | None):
        self._work, self._key = work, key

    def wait(self, *a, **k):
        out = self._work.wait(*a, **k)
        if _STATE is not None and self._key is not None:
            _STATE.pending_recvs.pop(self._key, None)
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _global_peer(group, peer=None, group_peer=None) -> int:
    if peer is not None:
        return peer
    return group_peer if group is None else dist.get_global_rank(group, group_peer)


def _peer_of(op: str, args, kwargs) -> int:
    direct, via_group = ("dst", "group_dst") if op in ("send", "isend") else ("src", "group_src")
    peer = args[1] if len(args) > 1 else kwargs.get(direct)
    return _global_peer(kwargs.get("group"), peer, kwargs.get(via_group))


def _track(kind: str, peer: int, work, what: str):
    if work is None or kind != "R":
        return work
    tracked = _TrackedWork(work, None)
    tracked._key = id(tracked)
    _STATE.pending_recvs[tracked._key] = what
    return tracked


def _call(real, *args, **kwargs):
    """Call torch's own function with ``__torch_function__`` off (c10d's functions dispatch to the active mode,
    `_Placement`, under their *public* name, which is a wrapper while the rules are on: it would run twice), and with
    the calls it makes itself unrecorded (``dist.recv`` is an ``irecv`` and a wait: one receive, not two)."""
    state = _STATE
    state.depth += 1
    try:
        with torch._C.DisableTorchFunction():
            return real(*args, **kwargs)
    finally:
        state.depth -= 1


def _p2p(op: str, real):
    kind = "S" if "send" in op else "R"

    def wrapped(*args, **kwargs):
        state = _STATE
        if state is None or (state.depth and not state.in_batch):
            return real(*args, **kwargs)
        _check_devices(op, args, kwargs)
        peer = _peer_of(op, args, kwargs)
        if state.in_batch:
            state.groups[-1].append((kind, peer))
            state.in_batch = False                    # what this op calls in turn is part of it
            try:
                return _call(real, *args, **kwargs)
            finally:
                state.in_batch = True
        state.groups.append([(kind, peer)])
        work = _call(real, *args, **kwargs)
        if op in ("isend", "irecv"):
            return _track(kind, peer, work, f"irecv from rank {peer}")
        return work
    wrapped.__name__ = op
    return wrapped


def _batch(real):
    def wrapped(p2p_op_list):
        state = _STATE
        if state is None:
            return real(p2p_op_list)
        state.groups.append([])
        state.in_batch = True
        try:
            works = _call(real, p2p_op_list)
        finally:
            state.in_batch = False
        posted = state.groups[-1]                     # (kind, peer) of each op, in the list's order
        if len(works) != len(p2p_op_list) or len(posted) != len(works):   # NCCL-style: one work for the batch
            return works
        return [_track(kind, peer, w, f"irecv from rank {peer} (in a batch)") for (kind, peer), w in zip(posted, works)]
    wrapped.__name__ = "batch_isend_irecv"
    return wrapped


def _collective(op: str, real):
    def wrapped(*args, **kwargs):
        if _STATE is None or _STATE.depth:
            return real(*args, **kwargs)
        _check_devices(op, args, kwargs)
        return _call(real, *args, **kwargs)
    wrapped.__name__ = op
    return wrapped


def replay_pairs(groups_by_rank: list[list[list[tuple[str, int]]]]) -> list[str]:
    """Replay the point-to-point posts of every rank as NCCL would run them (rule 2) and return the deadlocks found.

    ``groups_by_rank[r]``: rank r's posts in order, each a group [(kind 'S' or 'R', peer)] (one op, or a batch).
    Between two ranks a and b, a's k-th send to b matches b's k-th receive from a. A group of a's ops with b runs
    when it is the first unfinished one; an op of it finishes when its match is in b's first unfinished group."""
    found = []
    n = len(groups_by_rank)
    for a in range(n):
        for b in range(a + 1, n):
            seqs = {}
            for x, y in ((a, b), (b, a)):
                ops, count = [], {"S": 0, "R": 0}
                for g, group in enumerate(groups_by_rank[x]):
                    for kind, peer in group:
                        if peer == y:
                            ops.append((g, kind, count[kind]))
                            count[kind] += 1
                seqs[x] = ops
            if not seqs[a] and not seqs[b]:
                continue
            done = {a: [False] * len(seqs[a]), b: [False] * len(seqs[b])}
            index = {x: {(kind, k): i for i, (_, kind, k) in enumerate(seqs[x])} for x in (a, b)}

            def head(x):
                left = [seqs[x][i][0] for i, d in enumerate(done[x]) if not d]
                return min(left) if left else None

            progress = True
            while progress:
                progress = False
                for x, y in ((a, b), (b, a)):
                    gx, gy = head(x), head(y)
                    if gx is None or gy is None:
                        continue
                    for i, (g, kind, k) in enumerate(seqs[x]):
                        if g != gx or done[x][i]:
                            continue
                        j = index[y].get(("R" if kind == "S" else "S", k))
                        if j is not None and seqs[y][j][0] == gy and not done[y][j]:
                            done[x][i] = done[y][j] = True
                            progress = True
            ha, hb = head(a), head(b)
            if ha is not None and hb is not None:
                what = lambda x, g: ", ".join(  # noqa: E731
                    f"{'send to' if kind == 'S' else 'recv from'} rank {b if x == a else a} (#{k})"
                    for (gg, kind, k), d in zip(seqs[x], done[x]) if gg == g and not d)
                found.append(f"ranks {a} and {b} wait for each other: rank {a} is stuck at [{what(a, ha)}] while "
                             f"rank {b} is stuck at [{what(b, hb)}]. Post a send and a receive between the same two "
                             f"ranks together, with dist.batch_isend_irecv, and never post a receive ahead of a send "
                             f"that the peer needs first")
    return found


# ------------------------------------------------------------------------------------------ 3. synchronize

def note_synchronize() -> None:
    """Called by `course_lib.measure.speed.synchronize` (and ``torch.cuda.synchronize`` while checking): rule 3."""
    if _STATE is not None and _STATE.pending_recvs:
        pending = ", ".join(sorted(set(_STATE.pending_recvs.values())))
        raise NcclRuleError(
            f"the device is synchronised while a receive is pending ({pending}): on a GPU, torch.cuda.synchronize "
            f"waits for that NCCL receive, whose sender may be waiting for this rank. Wait for the receive first, "
            f"or time the work with CUDA events (course_lib.measure.speed.Stopwatch)")


# ------------------------------------------------------------------------------------------ switching it on

def _patches() -> list[tuple[object, str, object]]:
    """(module, name, replacement): the same replacement in torch.distributed and in distributed_c10d, because
    ``batch_isend_irecv`` checks that a ``P2POp``'s op *is* c10d's ``isend`` or ``irecv``."""
    wrappers = {op: _p2p(op, getattr(c10d, op)) for op in ("send", "recv", "isend", "irecv")}
    wrappers["batch_isend_irecv"] = _batch(c10d.batch_isend_irecv)
    wrappers.update({op: _collective(op, getattr(c10d, op)) for op in COLLECTIVES if hasattr(c10d, op)})
    out = [(module, name, fn) for module in (dist, c10d) for name, fn in wrappers.items()]
    real_sync = torch.cuda.synchronize

    def synchronize(*a, **k):
        note_synchronize()
        return real_sync(*a, **k)
    out.append((torch.cuda, "synchronize", synchronize))
    return out


@contextlib.contextmanager
def enforced(args=()):
    """Check the rules inside the block; tensors in ``args`` (a rank function's arguments) count as CPU tensors
    made without a device (rule 1). Yields the state (its ``groups`` are the point-to-point posts)."""
    global _STATE
    if _STATE is not None:
        yield _STATE
        return
    state = _State()
    for t in torch.utils._pytree.tree_leaves(args):
        if isinstance(t, torch.Tensor):
            state.unplaced[t] = "an argument of the rank function"
    patches = _patches()
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, fn in patches:
        setattr(m, name, fn)
    _STATE = state
    try:
        with _Placement(state):
            yield state
    finally:
        _STATE = None
        for m, name, fn in saved:
            setattr(m, name, fn)


def check_pairs(groups: list[list[tuple[str, int]]]) -> None:
    """Collective: gather every rank's point-to-point posts and raise `NcclRuleError` on a deadlock (rule 2)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, groups)
    found = replay_pairs(every)
    if found:
        raise NcclRuleError("; ".join(found))
