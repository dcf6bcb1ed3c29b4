"""Pipeline schedules as pure functions: who does what, in which order (lesson 03).

A pipeline of p stages runs a batch split into m micro-batches. On each rank a schedule is a list of
operations ``("F", i)`` (forward of micro-batch i) and ``("B", i)`` (backward of micro-batch i); one runner
(`course_lib.parallel.pipeline.run_schedule`) executes any such list with send/recv. Keeping the order
a pure function makes it easy to test, to simulate and to draw.

* `split_stages(n_layers, p)`: contiguous, balanced layer ranges, one per stage.
* `gpipe_order(p, m, rank)`: all m forwards, then all m backwards (Huang et al. 2019, "GPipe").
* `one_f_one_b_order(p, m, rank)`: warm-up forwards, then one forward / one backward in steady state, then
  cool-down backwards (PipeDream-Flush; Narayanan et al. 2019 "PipeDream", 2021 "Megatron-LM").
* `simulate(orders, t_f, t_b)`: an ideal timeline (no communication cost) that respects the data
  dependencies: F(i) on stage s needs F(i) on stage s-1; B(i) on stage s needs B(i) on stage s+1.
* `bubble_of(timeline)`: the idle fraction of a timeline, measured or simulated.
* `peak_in_flight(order)`: the most micro-batches whose activations a rank holds at once.
"""

from __future__ import annotations
from course_lib.reference import reference_for

__all__ = ["split_stages", "gpipe_order", "one_f_one_b_order", "naive_order", "schedule_orders",
           "simulate", "bubble_of", "peak_in_flight", "validate_order"]

Op = tuple[str, int]


@reference_for("00-partial-sum", "03-split-stages")
def split_stages(n_layers: int, p: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [start, end) for p stages, sizes differing by at most one.

    The first ``n_layers % p`` stages get one extra layer: stage s holds
    ``n_layers // p + [s < n_layers % p]`` layers. Example: 10 layers, 4 stages -> (0,3),(3,6),(6,8),(8,10).
    """
    if p < 1 or n_layers < p:
        raise ValueError(f"cannot split {n_layers} layers into p={p} stages: need 1 <= p <= n_layers")
    base, extra = divmod(n_layers, p)
    ranges, start = [], 0
    for s in range(p):
        size = base + (1 if s < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def gpipe_order(p: int, m: int, rank: int) -> list[Op]:
    """GPipe: forward every micro-batch, then backward every micro-batch (in the same order, as torch's
    ``ScheduleGPipe`` does). Every rank holds the activations of all m micro-batches at the peak."""
    _validate(p, m, rank)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def naive_order(p: int, rank: int) -> list[Op]:
    """Naive model parallelism: one batch, no micro-batches (GPipe with m = 1)."""
    return gpipe_order(p, 1, rank)


@reference_for("03-1f1b-order")
def one_f_one_b_order(p: int, m: int, rank: int) -> list[Op]:
    """1F1B (PipeDream-Flush): the same work as GPipe, reordered so that at most p - rank micro-batches are
    in flight on rank `rank`.

    warm-up:   w = min(p - rank - 1, m) forwards
    steady:    m - w pairs (forward of the next micro-batch, backward of the oldest one)
    cool-down: the w backwards still owed.
    """
    _validate(p, m, rank)
    w = min(p - rank - 1, m)
    ops: list[Op] = [("F", i) for i in range(w)]
    for i in range(m - w):
        ops += [("F", w + i), ("B", i)]
    ops += [("B", i) for i in range(m - w, m)]
    return ops


def schedule_orders(kind: str, p: int, m: int) -> list[list[Op]]:
    """The op list of every rank for ``kind`` in {"naive", "gpipe", "1f1b"} (naive forces m = 1)."""
    if kind == "naive":
        return [naive_order(p, r) for r in range(p)]
    if kind == "gpipe":
        return [gpipe_order(p, m, r) for r in range(p)]
    if kind == "1f1b":
        return [one_f_one_b_order(p, m, r) for r in range(p)]
    raise ValueError(f"unknown schedule {kind!r}: pick 'naive', 'gpipe' or '1f1b'")


def _validate(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1 and 0 <= rank < p; got p={p}, m={m}, rank={rank}")


def validate_order(ops: list[Op], m: int) -> None:
    """Raise ValueError unless `ops` runs F and B of each of the m micro-batches exactly once, F before B."""
    seen_f, seen_b = set(), set()
    for kind, i in ops:
        if kind == "F":
            if i in seen_f:
                raise ValueError(f"forward of micro-batch {i} appears twice")
            seen_f.add(i)
        elif kind == "B":
            if i not in seen_f or i in seen_b:
                raise ValueError(f"backward of micro-batch {i} before its forward, or twice")
            seen_b.add(i)
        else:
            raise ValueError(f"unknown op {kind!r}: use 'F' or 'B'")
    if seen_f != set(range(m)) or seen_b != set(range(m)):
        raise ValueError(f"every micro-batch 0..{m - 1} needs one F and one B")


def simulate(orders: list[list[Op]], t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0) -> list[list[dict]]:
    """Ideal timeline of per-rank op lists: each op starts when its rank is free and its input has arrived.

    Returns per rank a list of dicts ``kind, mb, start, end`` (same units as t_f, t_b). Raises
    ValueError if the orders deadlock (an op waits for one that can never run).
    """
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}   # (kind, mb, rank) -> end time
    pos, free = [0] * p, [0.0] * p
    out: list[list[dict]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, i = orders[r][pos[r]]
                dep = ("F", i, r - 1) if kind == "F" and r > 0 else ("B", i, r + 1) if kind == "B" and r < p - 1 \
                    else None
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + t_comm if dep is not None else 0.0
                start = max(free[r], ready)
                end = start + (t_f if kind == "F" else t_b)
                done[(kind, i, r)] = free[r] = end
                out[r].append(dict(kind=kind, mb=i, start=start, end=end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedules deadlock: some rank waits for an op that never runs")
    return out


@reference_for("03-bubble")
def bubble_of(timeline: list[list[dict]]) -> float:
    """Idle fraction of a pipeline step: 1 - (busy time summed over ranks) / (p x step span).

    The span runs from the first op's start to the last op's end over all ranks; busy time is the sum
    of op durations (time waiting for a message, or sending one, counts as idle).
    """
    ops = [op for rank in timeline for op in rank]
    span = max(op["end"] for op in ops) - min(op["start"] for op in ops)
    busy = sum(op["end"] - op["start"] for op in ops)
    return 1.0 - busy / (len(timeline) * span)


def peak_in_flight(order: list[Op]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of `order` (their activations are
    held): m for GPipe, min(p - rank, m) for 1F1B."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
