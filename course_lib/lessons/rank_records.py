"""Checks made on ranks, replayed as graded checks in the notebook's kernel (lessons 04 and 10).

A graded exercise that runs on several gloo ranks cannot raise `CheckFailed` inside a rank: the launch would fail
with a traceback, not a one-line message, and one rank's error would hide the others' results. So each rank
collects records (what was checked, the value it got, the value expected, a hint), a learner's exception becomes a
failed record, and `replay_records` turns every rank's records into `check_close` / `check_equal` calls in the
kernel, where the first failure raises its one-line message.

    rec = RankRecords("10-ring-step")                      # on a rank
    try:
        rec.add("close", "output", out, ref, hint="...")
    except Exception as exc:
        rec.error(exc)
    return rec.items                                       # back to the kernel through launch.run
    replay_records(res.returns, "10-ring-step")            # in the kernel: the number of checks that passed
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from course_lib.grading.check import check_close, check_equal

__all__ = ["RankRecords", "replay_records", "one_line"]


def one_line(exc: BaseException) -> str:
    """An exception as one line of at most 300 characters: its type, and its message where it has one."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())[:300]


class RankRecords:
    """One exercise's records on this rank. ``where`` prefixes the rank in each check's name ("tp=2, "); extra
    ``fields`` travel with every record so that `replay_records` can keep some of them (e.g. tp=2).
    ``rtol`` None: the tolerance ``tol`` of each record is relative and absolute; else ``rtol`` fixed, ``tol``
    absolute."""

    def __init__(self, exercise: str, where: str = "", rtol: float | None = None, **fields):
        self.exercise, self.where, self.rtol, self.fields = exercise, where, rtol, fields
        self.rank, self.items = dist.get_rank(), []

    def add(self, kind: str, what: str, actual, expected, hint: str = "", tol: float = 1e-5) -> None:
        """kind "close" (within the tolerance) or "equal"."""
        self.items.append(dict(self.fields, exercise=self.exercise, kind=kind, actual=actual, expected=expected,
                               name=f"{self.exercise}, {self.where}rank {self.rank}: {what}", hint=hint,
                               atol=tol, rtol=tol if self.rtol is None else self.rtol))

    def error(self, exc: BaseException) -> None:
        """A learner's exception as a failed record (one line), so the other ranks' results still come back."""
        msg = one_line(exc)
        self.add("equal", f"runs without error ({msg})", False, True,
                 "the message above says where; NotImplementedError means the exercise is still a stub")


def replay_records(returns: list, exercise: str, keep: Callable[[dict], bool] | None = None) -> int:
    """Every rank's records of `exercise` (and, with ``keep``, only those it accepts) as check_* calls: the first
    failure raises `CheckFailed` with its one-line message. Returns the number of checks that passed."""
    n = 0
    for records in returns:
        for rec in records:
            if rec["exercise"] != exercise or (keep is not None and not keep(rec)):
                continue
            if rec["kind"] == "close":
                check_close(rec["name"], rec["actual"], rec["expected"], rtol=rec["rtol"], atol=rec["atol"],
                            hint=rec["hint"])
            else:
                check_equal(rec["name"], rec["actual"], rec["expected"], hint=rec["hint"])
            n += 1
    if n == 0:
        raise AssertionError(f"no results for {exercise}: did the launch run?")
    return n
