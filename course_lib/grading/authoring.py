"""The authoring format shared by ``course build`` and ``course grade``: answer regions, test cells, hashes.

Reading and writing a notebook is `course_lib.notebook`'s (`read`, `write`, `dumps`, `source`, `NotebookError`).

Authoring format (docs/CONVENTIONS.md, docs/GRADING.md):
- an answer region is the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION``; the student copy
  replaces it with ``raise NotImplementedError("<hint>")`` at the indentation of the BEGIN line;
- the hint is the text of a ``### HINT: ...`` line in the cell (else `GENERIC_HINT`);
- a test cell carries ``{"course": {"exercise": "NN-name", "points": P, "hidden": bool}}`` in its metadata.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from course_lib.notebook import NotebookError, source

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
HINT_RE = re.compile(r"^\s*### HINT ([12]):\s*(.*?)\s*$")    # the first points to the idea, the second to the code
GENERIC_HINT = "replace this line with your implementation"


def test_info(cell: Any) -> dict | None:
    """The ``course`` metadata of a test cell ({exercise, points, hidden}), or None for other cells."""
    if cell.get("cell_type") != "code":
        return None
    meta = cell.get("metadata", {}).get("course")
    if not isinstance(meta, dict) or "exercise" not in meta:
        return None
    return {"exercise": str(meta["exercise"]), "points": float(meta.get("points", 0)),
            "hidden": bool(meta.get("hidden", False))}


def is_test(cell: Any) -> bool:
    return test_info(cell) is not None


def has_solution(cell: Any) -> bool:
    return cell.get("cell_type") == "code" and BEGIN in source(cell)


def answer_lines(lines) -> list[str]:
    """The lines inside the answer regions of ``lines`` (a source split into lines), the markers left out."""
    out, inside = [], False
    for line in lines:
        if line.strip().startswith(BEGIN):
            inside = True
        elif line.strip().startswith(END):
            inside = False
        elif inside:
            out.append(line)
    return out


def hints_of(src: str) -> list[list[str]]:
    """The stepped hints of the answer regions of ``src``: ``[[first hints...], [second hints...]]``."""
    steps: list[list[str]] = [[], []]
    for m in filter(None, map(HINT_RE.match, src.split("\n"))):
        steps[int(m.group(1)) - 1].append(m.group(2))
    return steps


def stub_message(exercise: str | None) -> str:
    """What a student copy's stub raises: the exercise, and how to ask for a hint (never the hint itself)."""
    if not exercise:
        return GENERIC_HINT
    return (f"exercise {exercise}: not implemented yet. For a hint, run: "
            f"from course_lib.grading.hints import hint; hint({exercise!r})")


def strip_solution(src: str, where: str = "cell", exercise: str | None = None) -> str:
    """Replace every answer region of ``src`` by a stub raising NotImplementedError(:func:`stub_message`)."""
    lines = src.split("\n")
    hint = stub_message(exercise)
    out, inside, indent = [], False, ""
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise NotebookError(f"{where}, line {n}: '{BEGIN}' inside another answer region")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}raise NotImplementedError({json.dumps(hint, ensure_ascii=False)})")
        elif stripped.startswith(END):
            if not inside:
                raise NotebookError(f"{where}, line {n}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise NotebookError(f"{where}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def split_source(text: str) -> list[str]:
    """Jupyter's on-disk form of a source: list of lines, each keeping its newline."""
    return text.splitlines(keepends=True)


def cell_id(seed: str, index: int) -> str:
    return hashlib.sha1(f"{seed}:{index}".encode()).hexdigest()[:12]


def exercises(nb: Any) -> list[dict]:
    """The exercises of a notebook in order: [{exercise, points (sum over its test cells), cells}]."""
    found: dict[str, dict] = {}
    for i, cell in enumerate(nb["cells"]):
        info = test_info(cell)
        if info:
            ex = found.setdefault(info["exercise"], {"exercise": info["exercise"], "points": 0.0, "cells": []})
            ex["points"] += info["points"]
            ex["cells"].append(i)
    return list(found.values())


def file_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_hash(folder: str | Path) -> dict[str, str]:
    """sha256 of every notebook under ``folder`` (to prove the official tests were not modified)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): file_hash(p) for p in sorted(folder.rglob("*.ipynb"))}
