"""The point-to-point messages of a pipeline schedule: which, to whom, and posted in which order (lesson 03).

A rank sends each op's output right after the op and receives an op's input right before it. Each post is one
``dist.batch_isend_irecv`` batch of ``("S" | "R", peer, message)`` items, a message being ``(kind, micro-batch, ring
position that produced it)``. NCCL runs the messages between two ranks in the order both post them
(`course_lib.runtime.nccl_rules`): the plan must be an order both ends agree on, or the ranks wait on each other forever.

* `adjacent_plan(order, rank, p)`: one chunk per rank (GPipe, 1F1B, ZB-H1): the previous op's output with the next op's
  input, from this rank's order alone.
* `p2p_plan(orders, rank, placement)`: any schedule, chunks included (either placement), from every rank's order:
  the order of the ideal timeline.
"""

from __future__ import annotations

from course_lib.parallel.pipeline_schedules import Op, chunk_count, neighbours, op_parts, position, simulate

__all__ = ["adjacent_plan", "p2p_plan"]


def adjacent_plan(order: list, rank: int, p: int) -> list[list[tuple]]:
    """Posts for one chunk per rank when only this rank's order is known: the previous op's output with the next op's
    input (deadlock-free for any dependency-respecting order of one chunk per rank; `p2p_plan` is the general
    rule, which needs every rank's order)."""
    plan, sending = [], None
    for op in list(order) + [None]:
        batch = [("S", *sending)] if sending else []
        if op is not None:
            kind, i, _ = op_parts(op)
            if kind == "F" and rank > 0:
                batch.append(("R", rank - 1, ("F", i, rank - 1)))
            elif kind == "B" and rank < p - 1:
                batch.append(("R", rank + 1, ("B", i, rank + 1)))
            sending = (rank + 1, ("F", i, rank)) if kind == "F" and rank < p - 1 else \
                (rank - 1, ("B", i, rank)) if kind == "B" and rank > 0 else None
        plan.append(batch)
    return plan


def _message(op, rank: int, p: int, v: int, direction: str, placement: str = "loop"):
    """Id of the message op `op` of rank `rank` receives ("in") or sends ("out"), and the peer rank; None if none.
    Id: (kind, micro-batch, ring position of the producer)."""
    kind, i, c = op_parts(op)
    if kind == "W":
        return None
    pos = position(rank, c, p, placement)
    prev, nxt = neighbours(rank, p, c, v, placement)
    if direction == "in":
        src = prev if kind == "F" else nxt
        return ((kind, i, position(src[0], src[1], p, placement)), src[0]) if src else None
    dst = nxt if kind == "F" else prev
    return ((kind, i, pos), dst[0]) if dst else None


def p2p_plan(orders: list[list[Op]], rank: int, placement: str = "loop") -> list[list[tuple]]:
    """The point-to-point posts of rank `rank` when every rank runs its order of `orders`: one batch before each op
    and one after the last, each a list of ``("S" | "R", peer, message)`` posted together with
    ``dist.batch_isend_irecv`` (message: (kind, micro-batch, ring position that produced it)).

    A rank sends each output right after the op that made it and receives an op's input right before the op. NCCL
    runs the messages between two ranks in the order both post them (`course_lib.runtime.nccl_rules`), so every rank posts
    the messages it shares with a peer in one agreed order: that of the ideal timeline (`simulate`), in which every
    message exists before anyone needs it. A send or receive therefore goes out together with the receives from the
    same peer that come earlier in that order (buffered until their op runs). With one chunk per rank (1F1B, ZB-H1)
    this is just "the previous op's output with the next op's input"; interleaving needs it on p = 2, where both
    directions of the ring join the same two ranks. `placement`: where each rank's chunks sit
    (`pipeline_schedules.position`; "v" for ZB-V and DualPipeV)."""
    p = len(orders)
    v = max(chunk_count(o) for o in orders)
    timeline = simulate(orders, placement=placement)
    key = {}
    for r, ops in enumerate(timeline):
        for op, t in zip(orders[r], ops):
            out = _message(op, r, p, v, "out", placement)
            if out is not None:
                key[out[0]] = (t["end"], r, out[0])
    incoming = sorted((key[m[0]], m[0], m[1])
                      for m in (_message(op, rank, p, v, "in", placement) for op in orders[rank])
                      if m is not None and m[1] != rank)
    posted: set = set()

    def receives_before(peer, k) -> list[tuple]:
        got = [("R", frm, msg) for kk, msg, frm in incoming if frm == peer and kk <= k and msg not in posted]
        posted.update(msg for _, _, msg in got)
        return got

    plan, sending = [], None
    for op in orders[rank] + [None]:
        batch = []
        if sending is not None and sending[1] != rank:    # a chunk's output for this rank stays in memory
            batch += receives_before(sending[1], key[sending[0]]) + [("S", sending[1], sending[0])]
        need = _message(op, rank, p, v, "in", placement) if op is not None else None
        if need is not None and need[1] != rank:
            batch += receives_before(need[1], key[need[0]])
        plan.append(batch)
        sending = _message(op, rank, p, v, "out", placement) if op is not None else None
    return plan
