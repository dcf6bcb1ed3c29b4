"""V-shaped pipeline schedules: ZB-V and DualPipeV (lesson 03, section 10).

Both give every rank two model chunks in the **V placement** (`pipeline_schedules.position`): the model is cut into
2 p chunks, chunk 0 of rank r is ring position r and chunk 1 is position 2 p - 1 - r, so a micro-batch goes down the
ranks 0, 1, ..., p - 1 and back up p - 1, ..., 0. Rank 0 holds both the first and the last chunk (it computes the
loss), and rank p - 1 hands its chunk 0's output to its own chunk 1 without a message. Both split the backward into B
(the gradient of the chunk's input, which the previous position waits for) and W (the weight gradients, which nobody
waits for) and use W to fill what would be idle time. Ops are ``("F" | "B" | "W", micro-batch, chunk)``; a backward
that is not split is written B immediately followed by its W (the same gradients as one backward).

* `zbv_order(p, m, rank)`: ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): with t_F = t_B = t_W
  every rank is busy from its own first op to its last, at the peak activation memory of 1F1B's rank 0 (2 p chunk
  activations, that is p micro-batches of a whole stage) on every rank.
* `dualpipev_order(p, m, rank)`: DualPipeV, DeepSeek's DualPipe (DeepSeek-V3 technical report, section 3.2.1) cut in
  half to the V placement (repository deepseek-ai/DualPipe, which credits the cut-in-half procedure to Sea AI Lab):
  in its steady state a rank pairs the forward of one chunk with the backward of the other. A model that provides
  an overlapped forward-backward can hide the all-to-all of one under the computation of the other (DeepSeek
  rearranges the pair's parts and splits the GPU's SMs between communication and computation); without one,
  DeepSeek's ``dualpipev.py``, PyTorch's ``ScheduleDualPipeV`` and this course's runner run the pair one after the
  other. Needs m >= 2 p.

ZB-V follows the phases of Qi et al., section 6; DualPipeV the eight steps of DeepSeek's ``dualpipev.py`` (which
PyTorch's ``ScheduleDualPipeV`` follows too). tests/test_pipeline_v.py checks each order op for op against PyTorch's
``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` (torch.distributed.pipelining, torch 2.14) and each step against one
process on gloo ranks.
"""

from __future__ import annotations

from course_lib.parallel.pipeline_ops import Op, check_schedule_args as _validate
from course_lib.reference import reference_for

__all__ = ["zbv_order", "dualpipev_order", "validate_dualpipev"]


class _Ops:
    """An op list with one counter per (kind, chunk): ``f(c)`` appends the forward of chunk c's next micro-batch,
    ``b(c)`` the next input-gradient backward B (its W queued), ``full(c)`` the next backward B + W at once,
    ``w()`` the oldest queued W, ``w_of(c)`` chunk c's oldest queued W, ``group(c)`` F, B, W of chunk c."""

    def __init__(self):
        self.ops: list[Op] = []
        self.next = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        self.queued: list[tuple[int, int]] = []           # (micro-batch, chunk) whose B ran and W did not

    def _take(self, kind: str, c: int) -> int:
        i = self.next[(kind, c)]
        self.next[(kind, c)] = i + 1
        return i

    def f(self, c: int) -> None:
        self.ops.append(("F", self._take("F", c), c))

    def b(self, c: int) -> None:
        i = self._take("B", c)
        self.ops.append(("B", i, c))
        self.queued.append((i, c))

    def full(self, c: int) -> None:
        i = self._take("B", c)
        self.ops += [("B", i, c), ("W", i, c)]

    def w(self) -> None:
        if self.queued:
            i, c = self.queued.pop(0)
            self.ops.append(("W", i, c))

    def group(self, c: int) -> None:
        """F, B and W of chunk c's next micro-batch, back to back."""
        self.f(c)
        self.b(c)
        self.w_of(c)

    def w_of(self, c: int) -> None:
        k = next(k for k, (_, cc) in enumerate(self.queued) if cc == c)
        i, _ = self.queued.pop(k)
        self.ops.append(("W", i, c))


@reference_for("03-v-order")
def zbv_order(p: int, m: int, rank: int) -> list[Op]:
    """ZB-V for rank `rank` of p (Qi et al. 2023, section 6): two chunks per rank in the V placement.

    With every F, B and W of a chunk taking one unit, rank r
    1. fills: 2 (p - r) - 1 forwards of chunk 0 (the deeper the rank, the later its first input arrives), then r
       pairs (forward of chunk 1, forward of chunk 0), then p - r triples (F, B, W of chunk 1): chunk 1's first
       backwards start as soon as its forwards come back up the V;
    2. steady state: (F0, B0, W0, F1, B1, W1) until every chunk-1 forward has run (F0 only while micro-batches are
       left);
    3. drains: r pairs (B0, B1) whose W waits, then p - r pairs (B0, the oldest chunk-0 W), then every W still owed
       (chunk 1's first).
    The schedule is written for at least 2 p - 1 micro-batches; with fewer, the ops of micro-batches >= m are left out
    (as PyTorch does). Rank 0 holds at most 2 p chunk activations (p micro-batches of a whole stage: 1F1B's peak).
    """
    _validate(p, m, rank)
    n = max(m, 2 * p - 1)
    o = _Ops()
    for _ in range(2 * (p - rank) - 1):
        o.f(0)
    for _ in range(rank):
        o.f(1)
        o.f(0)
    for _ in range(p - rank):
        o.group(1)
    while o.next[("F", 1)] < o.next[("F", 0)] or o.next[("F", 0)] < n:
        if o.next[("F", 0)] < n:
            o.f(0)
        o.b(0)
        o.w_of(0)
        o.group(1)
    for _ in range(rank):
        o.b(0)
        o.b(1)
    for _ in range(p - rank):
        o.b(0)
        o.w_of(0)
    while any(c == 1 for _, c in o.queued):
        o.w_of(1)
    while o.queued:
        o.w_of(0)
    return [op for op in o.ops if op[1] < m]


def validate_dualpipev(p: int, m: int) -> None:
    """DualPipeV needs m >= 2 p micro-batches (one per chunk of the V): refuse fewer, naming the fix."""
    if p < 1 or m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2 p = {2 * p} micro-batches (one per model chunk) on p={p} ranks; "
                         f"got m={m}: use m >= {2 * p}, or ZB-V")


def dualpipev_order(p: int, m: int, rank: int) -> list[Op]:
    """DualPipeV for rank `rank` of p (DeepSeek's DualPipe cut in half: the V placement on p ranks, m >= 2 p).

    Rank r
    1. fills: 2 (p - r - 1) forwards of chunk 0, then r + 1 pairs (F0, F1), then p - r - 1 triples (B1, its W, F1);
    2. steady state, m - 2 p + r + 1 times: F0 with the full backward of chunk 1, then F1 with the full backward of
       chunk 0: the forward-backward pairs DualPipe overlaps (one's all-to-all under the other's compute);
    3. drains: p - r - 1 times (full B1, then F1 with the full B0); then r + 1 pairs (B1, B0) whose backwards are
       split into B and a queued W from the middle pair on (for an odd rank from that pair's B1, for an even rank
       from its B0); then p - r - 1 times (the oldest queued W, then the next B0, split); then every W still queued.
    A full backward is written B then W.
    """
    _validate(p, m, rank)
    validate_dualpipev(p, m)
    o = _Ops()
    for _ in range(2 * (p - rank - 1)):
        o.f(0)
    for _ in range(rank + 1):
        o.f(0)
        o.f(1)
    for _ in range(p - rank - 1):
        o.b(1)
        o.w()
        o.f(1)
    for _ in range(m - 2 * p + rank + 1):
        o.f(0)
        o.full(1)
        o.f(1)
        o.full(0)
    for _ in range(p - rank - 1):
        o.full(1)
        o.f(1)
        o.full(0)
    split = False
    for k in range(rank + 1):
        middle = k == (rank + 1) // 2
        split = split or (middle and rank % 2 == 1)
        (o.b if split else o.full)(1)
        split = split or (middle and rank % 2 == 0)
        (o.b if split else o.full)(0)
    for _ in range(p - rank - 1):
        o.w()
        (o.b if split else o.full)(0)
    while o.queued:
        o.w()
    return o.ops
