"""The guard of `course_lib.reference`, switched on cell by cell inside a graded submission's kernel.

The grader (`grade.guard_plan`) tells the kernel, for every cell of the assembled notebook (by the SHA-256 of its
source): whether it is an official test cell, and whose references it refuses: a test cell of exercise X refuses
X's; a learner's cell records calls to the references of every exercise whose tests are still to come. The runner
installs it in each new kernel (`install`) and reads what was refused after every cell (`report`).

Before a test cell of X runs, every name an answer of the lesson defines (``answers``: read from the solution's
answer regions) is looked at: one that *is* a reference of X (an alias, a partial, a class that inherits or copies a
marked method; `reference.is_reference`) is recorded, and for that cell bound to a `Refused` that raises
`reference.ReferenceCalled` when the test calls it.
"""

from __future__ import annotations

import hashlib
import json

from course_lib import reference


def cell_key(source: str) -> str:
    """How the grader and the kernel name a cell: the SHA-256 of its source."""
    return hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()


class Refused:
    """Stands in, for one test cell, for a learner's name that is the course's answer itself."""

    def __init__(self, exercise: str, name: str):
        self.exercise, self.name = exercise, name

    def __call__(self, *args, **kwargs):
        raise reference.ReferenceCalled(self.exercise, self.name)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise reference.ReferenceCalled(self.exercise, self.name)


_refused: list[tuple[str, str]] = []          # (exercise, name) since the last `report`


def install(plan: dict, shell=None) -> None:
    """Switch the guard on and off around every cell of ``shell`` (IPython's) as ``plan`` says:
    ``{"cells": {key: {"test": bool, "exercise": id or None, "guarded": [ids]}}, "answers": [names],
    "lesson": [every exercise id]}``. A cell the plan does not know refuses nothing and records every reference."""
    shell = shell or get_ipython()  # noqa: F821 - in a kernel
    cells, answers = plan["cells"], list(plan.get("answers", []))
    every = sorted(plan.get("lesson", []))
    test_files: set[str] = set()
    restore: dict[str, object] = {}

    def pre_run_cell(info) -> None:
        source = info.raw_cell
        cell = cells.get(cell_key(source), {"test": False, "exercise": None, "guarded": every})
        if cell["test"]:
            test_files.add(shell.compile.get_code_name(source, shell.transform_cell(source), shell.execution_count))
        guard = reference.Guard(frozenset(cell["guarded"]), frozenset(test_files), refuse=bool(cell["test"]))
        reference.activate(guard)
        if cell["test"]:
            for name in answers:
                value = shell.user_ns.get(name)
                found = reference.is_reference(value, guard.exercises) if value is not None else None
                if found:
                    guard.record(cell["exercise"], found)
                    restore[name] = value
                    shell.user_ns[name] = Refused(cell["exercise"], found)

    def post_run_cell(result) -> None:
        guard = reference.activate(None)
        if guard is not None:
            _refused.extend(guard.seen)
        for name, value in restore.items():
            if isinstance(shell.user_ns.get(name), Refused):
                shell.user_ns[name] = value
        restore.clear()

    shell.events.register("pre_run_cell", pre_run_cell)
    shell.events.register("post_run_cell", post_run_cell)


def report() -> str:
    """The refused calls since the last report, as JSON ``[[exercise, name], ...]`` (read by the runner)."""
    out = json.dumps(_refused)
    _refused.clear()
    return out
