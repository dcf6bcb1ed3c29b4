"""Pipeline schedules as pure functions: who does what, in which order (lesson 03).

A pipeline of p stages runs a batch split into m micro-batches. On each rank a schedule is a list of
operations ``("F", i)`` (forward of micro-batch i) and ``("B", i)`` (backward of micro-batch i); one runner
(`course_lib.parallel.pipeline.run_schedule`) executes any such list with send/recv. Keeping the order
a pure function makes it easy to test, to simulate and to draw.

Ops name a model chunk as a third item when a rank holds several: ``("F", i, c)`` is the forward of micro-batch i
through this rank's chunk c (a 2-tuple means chunk 0). Zero-bubble schedules split the backward: ``("B", i, c)``
then computes only the gradient of the chunk's input and ``("W", i, c)`` its weight gradients, later. Where chunk c of
rank r sits in the model is its **placement** (`position`): "loop" puts it at ring position ``c p + r`` (a micro-batch
goes rank 0, 1, ..., p - 1, then back to rank 0 for chunk 1: interleaved 1F1B); "v" (two chunks per rank) puts chunk 0
at position r and chunk 1 at ``2 p - 1 - r`` (down the ranks, then back up: rank 0 holds the first and the last chunk,
and rank p - 1 hands chunk 0's output to its own chunk 1 in memory: ZB-V and DualPipeV, `pipeline_v`).

* `split_stages(n_layers, p)`: contiguous, balanced layer ranges, one per stage.
* `gpipe_order(p, m, rank)`: all m forwards, then all m backwards (Huang et al. 2019, "GPipe").
* `one_f_one_b_order(p, m, rank)`: warm-up forwards, then one forward / one backward in steady state, then
  cool-down backwards (PipeDream-Flush; Narayanan et al. 2019 "PipeDream", 2021 "Megatron-LM").
* `interleaved_order(p, v, m, rank)`: interleaved 1F1B with v chunks per rank (Narayanan et al. 2021, section 2.2).
* `zb_h1_order(p, m, rank)`: ZB-H1, the backward split into B and W, W moved into the bubble (Qi et al. 2023).
* ZB-V and DualPipeV, the V-shaped schedules, are in `course_lib.parallel.pipeline_v`; `schedule_orders` names all.
* `simulate(orders, t_f, t_b, t_w=...)`: an ideal timeline (no communication cost) that respects the data
  dependencies: F(i) at ring position s needs F(i) at s-1; B(i) at s needs B(i) at s+1; W needs only its B.
* `bubble_of(timeline)`: the idle fraction of a timeline, measured or simulated.
* `peak_in_flight(order)`: the most micro-batches whose activations a rank holds at once.
"""

from __future__ import annotations

from course_lib.parallel.pipeline_ops import Op, check_schedule_args as _validate, op_parts
from course_lib.parallel.pipeline_v import dualpipev_order, zbv_order
from course_lib.reference import reference_for

__all__ = ["split_stages", "gpipe_order", "one_f_one_b_order", "naive_order", "interleaved_order", "zb_h1_order",
           "schedule_orders", "simulate", "bubble_of", "peak_in_flight", "validate_order", "validate_interleaving",
           "op_parts", "neighbours", "chunk_count", "position", "placement_of", "PLACEMENTS", "V_SHAPED"]

PLACEMENTS = ("loop", "v")
V_SHAPED = ("zb-v", "dualpipev")        # the schedules in the "v" placement, two chunks per rank (`pipeline_v`)


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


def validate_interleaving(p: int, v: int, m: int, n_layers: int | None = None) -> None:
    """Refuse what interleaved 1F1B cannot run, naming the field and the fix (before anything launches).

    The course's interleaved schedule takes micro-batches in groups of p per chunk, so m must be a multiple of p (as
    Megatron-LM required before November 2024, and Megatron-core today with its default group size);
    every one of the v p chunks gets the same number of blocks, so n_layers must be a multiple of p v."""
    if p < 1 or v < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages, v >= 1 chunks per rank and m >= 1 micro-batches; got p={p}, v={v}, "
                         f"m={m}")
    if m % p:
        raise ValueError(f"m={m} micro-batches cannot be interleaved over p={p} stages: interleaved 1F1B runs "
                         f"micro-batches in groups of p per chunk (as Megatron-core does with its default group size), so use m a multiple "
                         f"of {p}, e.g. m={p * -(-m // p)}")
    if n_layers is not None:
        if p > n_layers:
            raise ValueError(f"p={p} stages is more than the model's n_layers={n_layers}: every stage needs a "
                             f"block; use p <= {n_layers}")
        if n_layers % (p * v):
            raise ValueError(f"v={v} chunks per rank does not divide the {n_layers / p:g} layers per rank: "
                             f"n_layers={n_layers} must be a multiple of p*v={p * v}; pick v among "
                             f"{[d for d in range(1, n_layers // p + 1) if n_layers % (p * d) == 0]}")


@reference_for("03-interleaved-order")
def interleaved_order(p: int, v: int, m: int, rank: int) -> list[Op]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): rank `rank` holds v chunks (ring positions
    rank, rank + p, ...) and runs v m chunk-forwards and v m chunk-backwards, ops ``("F"|"B", i, c)``.

    Chunk-forward number k (0 <= k < v m) takes micro-batches in groups of p per chunk:
    chunk ``(k mod p v) // p``, micro-batch ``(k // (p v)) p + k mod p``; chunk-backward number k the same with the
    chunks reversed (v - 1 - chunk). As in Megatron-LM's ``forward_backward_pipelining_with_interleaving``:
    warm-up:   w = min(2 (p - rank - 1) + (v - 1) p, v m) chunk-forwards (all v m when m = p)
    steady:    v m - w pairs (forward number w + k, backward number k)
    cool-down: the w backwards still owed.
    m must be a multiple of p (`validate_interleaving`). With v = 1 it is not 1F1B's order: Megatron-LM's warm-up
    2 (p - rank - 1) is twice 1F1B's. With m = p every forward comes first, as Megatron-LM did until November 2024.
    """
    _validate(p, m, rank)
    validate_interleaving(p, v, m)

    def op(kind: str, k: int) -> Op:
        c = (k % (p * v)) // p
        return (kind, (k // (p * v)) * p + k % p, c if kind == "F" else v - 1 - c)

    total = v * m
    w = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    ops = [op("F", k) for k in range(w)]
    for k in range(total - w):
        ops += [op("F", w + k), op("B", k)]
    ops += [op("B", k) for k in range(total - w, total)]
    return ops


def zb_h1_order(p: int, m: int, rank: int) -> list[Op]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B's forwards and input-gradient
    backwards B, with each weight-gradient pass W moved later, into time the rank would otherwise wait.

    Rank r warms up with w = min(p - r - 1, m) forwards and runs F, B pairs as in 1F1B, but W(j) comes only after
    B(j + r): rank r keeps r weight gradients pending, and runs them in its cool-down, where it would wait for the
    next B. At most p - r micro-batches are between their F and their B (1F1B's activation memory; a W keeps only
    the inputs of the weight matmuls, the paper's M_W), at most p between F and W. With t_F = t_B = t_W the idle time
    per rank is (p - 1)(t_F + t_B - t_W), a third of 1F1B's.
    """
    _validate(p, m, rank)
    w = min(p - rank - 1, m)
    ops: list[Op] = [("F", i) for i in range(w)]
    pending: list[int] = []                    # micro-batches whose B ran and whose W is deferred

    def backward(j: int) -> None:
        ops.append(("B", j))
        pending.append(j)
        if len(pending) > rank:
            ops.append(("W", pending.pop(0)))

    for j in range(m - w):
        ops.append(("F", w + j))
        backward(j)
    for j in range(m - w, m):
        backward(j)
    return ops + [("W", j) for j in pending]


def placement_of(kind: str) -> str:
    """Where schedule ``kind`` puts a rank's chunks: "v" for the V-shaped schedules ("zb-v", "dualpipev"), else
    "loop" (`position`)."""
    return "v" if kind in V_SHAPED else "loop"


def schedule_orders(kind: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """The op list of every rank for ``kind`` in {"naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v",
    "dualpipev"} (naive forces m = 1; v chunks per rank for "interleaved"; the V-shaped "zb-v" and "dualpipev" always
    hold 2, placed by `placement_of`)."""
    if kind in V_SHAPED:
        order = zbv_order if kind == "zb-v" else dualpipev_order
        return [order(p, m, r) for r in range(p)]
    if kind == "naive":
        return [naive_order(p, r) for r in range(p)]
    if kind == "gpipe":
        return [gpipe_order(p, m, r) for r in range(p)]
    if kind == "1f1b":
        return [one_f_one_b_order(p, m, r) for r in range(p)]
    if kind == "interleaved":
        return [interleaved_order(p, v, m, r) for r in range(p)]
    if kind == "zb-h1":
        return [zb_h1_order(p, m, r) for r in range(p)]
    raise ValueError(f"unknown schedule {kind!r}: pick 'naive', 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v' or "
                     "'dualpipev'")


def chunk_count(ops) -> int:
    """How many model chunks an order uses: 1 + its largest chunk index (1 for 2-tuples)."""
    return max((op_parts(op)[2] for op in ops), default=0) + 1


def validate_order(ops: list[Op], m: int, v: int | None = None) -> None:
    """Raise ValueError unless `ops` runs F and B of each of the m micro-batches through each of the v chunks
    (v read from the ops unless given) exactly once, F before B; W ops (split backward) either for every
    (micro-batch, chunk), each after its B, or for none."""
    v = chunk_count(ops) if v is None else v
    seen: dict[str, set] = {"F": set(), "B": set(), "W": set()}
    need = {"B": "F", "W": "B"}
    for op in ops:
        kind, i, c = op_parts(op)
        if kind not in seen:
            raise ValueError(f"unknown op {kind!r}: use 'F', 'B' or 'W'")
        what = f"micro-batch {i}" + (f" chunk {c}" if v > 1 else "")
        if not (0 <= i < m and 0 <= c < v):
            raise ValueError(f"{kind} of {what}, which does not exist: micro-batches are 0..{m - 1}"
                             + (f", chunks 0..{v - 1}" if v > 1 else ""))
        if (i, c) in seen[kind]:
            raise ValueError(f"{kind} of {what} appears twice")
        if kind in need and (i, c) not in seen[need[kind]]:
            label = {"B": "backward", "W": "weight gradient (W)"}[kind]
            raise ValueError(f"{label} of {what} before its {need[kind]}, or twice")
        seen[kind].add((i, c))
    every = {(i, c) for i in range(m) for c in range(v)}
    for kind in ("F", "B"):
        if seen[kind] != every:
            i, c = min(every - seen[kind])
            raise ValueError(f"every micro-batch 0..{m - 1}" + (f" of every chunk 0..{v - 1}" if v > 1 else "")
                             + f" needs one F and one B: {kind} of micro-batch {i}" + (f" chunk {c}" if v > 1 else "")
                             + " is missing")
    if seen["W"] and seen["W"] != every:
        i, c = min(every - seen["W"])
        raise ValueError("a split backward needs one W after the B of every micro-batch (and chunk), or none at all: "
                         f"W of micro-batch {i}" + (f" chunk {c}" if v > 1 else "") + " is missing")


def position(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """Ring position (0 = the model's first chunk) of rank `rank`'s chunk `chunk`: ``chunk p + rank`` in the "loop"
    placement; in the "v" placement (two chunks per rank) ``rank`` for chunk 0 and ``2 p - 1 - rank`` for chunk 1."""
    if placement == "loop":
        return chunk * p + rank
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"chunk={chunk}: the V placement gives each rank two chunks, 0 and 1")
        return rank if chunk == 0 else 2 * p - 1 - rank
    raise ValueError(f"placement={placement!r}: use one of {PLACEMENTS}")


def _owner(pos: int, p: int, placement: str) -> tuple[int, int]:
    """(rank, chunk) holding ring position `pos`: the inverse of `position`."""
    if placement == "v":
        return (pos, 0) if pos < p else (2 * p - 1 - pos, 1)
    return pos % p, pos // p


def neighbours(rank: int, p: int, chunk: int = 0, v: int = 1,
               placement: str = "loop") -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(rank, chunk) before and after rank `rank`'s chunk `chunk` on the ring of v p positions (None at the ends):
    the previous position sends this chunk its forward input, the next one its backward input."""
    pos = position(rank, chunk, p, placement)
    prev = _owner(pos - 1, p, placement) if pos > 0 else None
    nxt = _owner(pos + 1, p, placement) if pos < v * p - 1 else None
    return prev, nxt


def simulate(orders: list[list[Op]], t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0,
             t_w: float = 0.0, durations: list[list[float]] | None = None,
             placement: str = "loop") -> list[list[dict]]:
    """Ideal timeline of per-rank op lists: each op starts when its rank is free and its input has arrived.

    t_f, t_b, t_w: time of one F, B, W op (of one chunk when ranks hold several); ``durations[rank][k]``, if given,
    the time of each op instead (e.g. measured ones: the bubble those op times give with free, instant messages and
    no other waiting). `placement` says where each rank's chunks sit (`position`). Returns per rank a list of dicts
    ``kind, mb, chunk, pos, start, end`` (same units as t_f, t_b; pos the chunk's ring position). Raises ValueError if
    the orders deadlock (an op waits for one that can never run).
    """
    p = len(orders)
    v = max(chunk_count(o) for o in orders)
    duration = {"F": t_f, "B": t_b, "W": t_w}
    done: dict[tuple, float] = {}   # (kind, mb, chunk, rank) -> end time
    pos, free = [0] * p, [0.0] * p
    out: list[list[dict]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, i, c = op_parts(orders[r][pos[r]])
                prev, nxt = neighbours(r, p, c, v, placement)
                src = prev if kind == "F" else nxt if kind == "B" else None
                dep = (kind, i, src[1], src[0]) if src is not None else None
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + t_comm if dep is not None else 0.0
                start = max(free[r], ready)
                end = start + (duration[kind] if durations is None else durations[r][pos[r]])
                done[(kind, i, c, r)] = free[r] = end
                out[r].append(dict(kind=kind, mb=i, chunk=c, pos=position(r, c, p, placement), start=start, end=end))
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


def peak_in_flight(order: list[Op], v: int | None = None, until: str = "B") -> float:
    """Most micro-batches (of a whole stage) whose activations a rank holds at any point of `order`: a chunk's
    count 1/v of a stage's, held from its F to its B (``until="B"``) or to its W (``until="W"``, for a split backward:
    a W still needs the inputs of the weight matmuls, Qi et al.'s M_W, 32sbh of a layer's sb(34h + 5as) by their
    table 1, and the course's runner keeps the whole graph until W). Until B: m for GPipe, min(p - rank, m) for 1F1B
    and ZB-H1, `theory.pipeline.interleaved_in_flight` for interleaved 1F1B; ZB-V and DualPipeV
    (`theory.pipeline.v_shape_in_flight`) hold as many counted either way."""
    if until not in ("B", "W"):
        raise ValueError(f"until={until!r}: count activations until the 'B' or until the 'W'")
    if until == "W" and not any(op[0] == "W" for op in order):
        until = "B"                            # an unsplit backward frees them itself
    v = chunk_count(order) if v is None else v
    live = peak = 0
    for op in order:
        live += 1 if op[0] == "F" else -1 if op[0] == until else 0
        peak = max(peak, live)
    return peak if v == 1 else peak / v
