"""Counting the collectives a rank calls, with their payload bytes, per phase (lessons 02, 04, 08, 10, 11).

:class:`CollectiveCounter` patches ``torch.distributed``'s collectives for the length of a ``with`` block;
:class:`LayerCounter` is told by a layer what it sent (lessons 10 and 11: the ring's sends, EP's all-to-alls);
:data:`COUNTED_COLLECTIVES` names those it counts, :data:`COLLECTIVE_NAMES` one name per algorithm. The formulas the
counts are checked against live in `course_lib.theory.comm`.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

from course_lib.measure.memory_stats import tensor_bytes

# (the *_single forms are torch 2.14's names for the flat-tensor collectives; older releases lack them)
COUNTED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all_single")
# one name per algorithm
COLLECTIVE_NAMES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


def _payload(op: str, args: tuple, kwargs: dict) -> torch.Tensor | list:
    first = args[0] if args else kwargs.get("tensor", kwargs.get("output", kwargs.get("output_tensor")))
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):   # (output, input): the input is the full tensor
        return args[1] if len(args) > 1 else kwargs["input"]
    if op == "reduce_scatter":                         # (output, input_list)
        return args[1] if len(args) > 1 else kwargs["input_list"]
    return first                                       # all_reduce tensor; all_gather(_into_tensor) output


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return tensor_bytes(x)


def tabulate(records) -> dict:
    """{(phase, op): {"calls": n, "bytes": b}} of records that start (phase, op, payload bytes, ...) (plain types:
    a table travels back from ranks)."""
    out = collections.defaultdict(lambda: {"calls": 0, "bytes": 0})
    for phase, op, nbytes, *_ in records:
        out[(phase, op)]["calls"] += 1
        out[(phase, op)]["bytes"] += nbytes
    return {k: dict(v) for k, v in out.items()}


class LayerCounter:
    """What one rank's layer sent, recorded by the layer itself at each call (lessons 10 and 11: a ring's sends, an
    all-gather, the all-to-alls of expert parallelism): ``records`` of (phase, op, payload bytes) and ``work``, a count
    of the layer's own choosing (the attention score elements computed, in lesson 10). The payload follows
    `CollectiveCounter`'s convention: a send counts the tensor sent, an all-gather its output, a reduce-scatter its
    input, an all-to-all its input."""

    def __init__(self):
        self.records: list[tuple[str, str, int]] = []
        self.work = 0

    def record(self, phase: str, op: str, t: torch.Tensor) -> None:
        self.records.append((phase, op, t.numel() * t.element_size()))

    def add_work(self, n: int) -> None:
        self.work += n

    def table(self) -> dict:
        """{(phase, op): {"calls": n, "bytes": b}}."""
        return tabulate(self.records)

    def reset(self) -> None:
        self.records.clear()
        self.work = 0


class CollectiveCounter:
    """Count the collectives a rank calls, with their payload bytes, forward and backward apart (lesson 04).
    Records every call as (phase, op, payload bytes, group size).

        counter = CollectiveCounter()
        with counter:                                   # patches torch.distributed's collectives
            with counter.phase("forward"):
                loss = tp_model.loss(x, y)
            with counter.phase("backward"):
                loss.backward()
        counter.table()    # {(phase, op): {"calls": n, "bytes": b}}

    The payload of a call is the size of the whole tensor being reduced or gathered: the tensor of an
    all-reduce, the *output* of an all-gather, the *input* of a reduce-scatter. What one rank actually sends
    over a ring is a fraction of it: 2(t-1)/t for an all-reduce, (t-1)/t for the other two
    (`course_lib.theory.comm.bus_factor`). Code that calls ``dist.all_reduce(...)`` at call time (every layer
    in this course, and a learner's) is counted; DTensor's functional collectives are not.
    """

    def __init__(self):
        self.records: list[tuple[str, str, int, int]] = []
        self.groups: list[tuple[int, ...]] = []        # the global ranks of each record's group (lesson 08)
        self.current = "other"
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveCounter":
        for op in COUNTED_COLLECTIVES:
            real = getattr(dist, op, None)
            if real is None:
                continue
            self._saved[op] = real
            setattr(dist, op, self._wrap(op, real))
        return self

    def __exit__(self, *exc) -> None:
        for op, real in self._saved.items():
            setattr(dist, op, real)
        self._saved = {}

    def _wrap(self, op: str, real):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            self.records.append((self.current, COLLECTIVE_NAMES.get(op, op), _nbytes(_payload(op, args, kwargs)),
                                 dist.get_world_size(group)))
            self.groups.append(tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
            return real(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the calls made inside the block ("forward", "backward", ...)."""
        old, self.current = self.current, name
        try:
            yield
        finally:
            self.current = old

    def reset(self) -> None:
        self.records.clear()
        self.groups.clear()

    def bytes_by_group(self) -> dict[tuple[int, ...], int]:
        """{global ranks of a group: payload bytes of the collectives called on it} (a 3D grid's dimensions)."""
        out: dict[tuple[int, ...], int] = collections.defaultdict(int)
        for (_, _, nbytes, _), ranks in zip(self.records, self.groups):
            out[ranks] += nbytes
        return dict(out)

    def table(self) -> dict:
        """{(phase, op): {"calls": n, "bytes": payload bytes}} (plain types: it travels back from ranks)."""
        return tabulate(self.records)

    def calls(self, phase: str | None = None, op: str | None = None) -> int:
        return sum(1 for p, o, _, _ in self.records if phase in (None, p) and op in (None, o))

    def bytes(self, phase: str | None = None, op: str | None = None) -> int:
        return sum(b for p, o, b, _ in self.records if phase in (None, p) and op in (None, o))
