"""Hints in steps for the graded exercises: ``hint("02-ring-all-reduce")`` shows the first, a second call the next.

The first hint points to the idea, the second to the code (which function, which section); neither is the
solution. They are written in the solutions' answer regions (``### HINT 1:`` / ``### HINT 2:``) and collected by
``course build`` into ``hints.json`` beside this module.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["hint"]

_shown: dict[str, int] = {}


def _hints() -> dict[str, list[str]]:
    return json.loads(Path(__file__).with_name("hints.json").read_text(encoding="utf-8"))


def hint(exercise: str) -> str:
    """Print (and return) the next hint of ``exercise``; after the last one, say that there is no more."""
    hints = _hints()
    if exercise not in hints:
        raise KeyError(f"no exercise {exercise!r}: the exercises with hints are {', '.join(sorted(hints))}")
    steps = [h for h in hints[exercise] if h]
    k = _shown.get(exercise, 0)
    if k < len(steps):
        text = f"hint {k + 1} of {len(steps)} for {exercise}: {steps[k]}"
        _shown[exercise] = k + 1
    else:
        text = (f"no more hints for {exercise}: reread the lesson section the hints name, and run the test cell "
                "for the check that fails")
    print(text)
    return text
