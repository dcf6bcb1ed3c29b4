"""What every pipeline order is made of (lesson 03): an op and the check of a schedule's arguments.

An op is ``("F" | "B" | "W", micro-batch)`` or ``("F" | "B" | "W", micro-batch, chunk)``; the orders themselves are in
`pipeline_schedules` (GPipe, 1F1B, interleaved 1F1B, ZB-H1) and `pipeline_v` (ZB-V, DualPipeV), which both build on
this module.
"""

from __future__ import annotations

__all__ = ["Op", "op_parts", "check_schedule_args"]

Op = tuple  # ("F" | "B" | "W", micro-batch) or ("F" | "B" | "W", micro-batch, chunk)


def op_parts(op) -> tuple[str, int, int]:
    """``("F", i)`` -> ("F", i, 0); ``("B", i, c)`` -> ("B", i, c)."""
    return (op[0], op[1], op[2] if len(op) > 2 else 0)


def check_schedule_args(p: int, m: int, rank: int) -> None:
    """Refuse a schedule's (p, m, rank) outside p >= 1, m >= 1, 0 <= rank < p, naming the values."""
    if p < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1 and 0 <= rank < p; got p={p}, m={m}, rank={rank}")
