"""``course grade --feedback DIR``: per submission a short Markdown file a student can read.

``DIR/<student>.md`` holds the total, and per exercise its points, its status, the failing check's one-line
message, and the hint steps the student had seen (read from the outputs saved in the submitted notebook:
``hint k of n for ID``, printed by `course_lib.grading.hints.hint`). It never holds what a student must not see:

- a hidden test's message (its check prints the expected value, e.g. ``expected [[0, 0], [0, 0]]``): for an
  exercise whose first failing test cell is hidden (`grade.score`'s ``hidden_test``) only "a hidden test did not
  pass" and the check's hint are written;
- a quiz's answer: quiz checks never print it (``reveal=False``, ``check_answer``: "wrong value");
- timings, paths of the grading machine, the official tests' code.
"""

from __future__ import annotations

import re
from pathlib import Path

from course_lib.grading import hints
from course_lib import notebook as nbio

SEEN_RE = re.compile(r"hint (\d+) of (\d+) for (\S+?):")
NO_MORE_RE = re.compile(r"no more hints for (\S+?):")
HINT_RE = re.compile(r"\. Hint: (.*)$")


def hints_seen(path: str | Path) -> dict[str, tuple[int, int]]:
    """exercise -> (the last hint step the submission's saved outputs show, the steps there are)."""
    try:
        nb = nbio.read(path)
    except nbio.NotebookError:
        return {}
    seen: dict[str, tuple[int, int]] = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else str(text)
            for k, n, ex in SEEN_RE.findall(text):
                seen[ex] = max(seen.get(ex, (0, 0)), (int(k), int(n)))
            for ex in NO_MORE_RE.findall(text):
                n = seen.get(ex, (0, 0))[1] or len(hints._hints().get(ex, []))
                seen[ex] = (n, n)
    return seen


def _message(row: dict) -> tuple[str, str]:
    """(status word, what to look at) of one exercise's row, a hidden test's expected value kept back."""
    status = row["status"]
    word, _, rest = status.partition(": ")
    if status == "passed":
        return "passed", ""
    if row.get("hidden_test") and word in ("failed", "error"):
        hint = HINT_RE.search(rest)
        return word, "a hidden test (run only when grading) did not pass" + (f". Hint: {hint.group(1)}" if hint else "")
    return word, rest


def markdown(result: dict, seen: dict[str, tuple[int, int]] | None = None) -> str:
    """The feedback file of one result of `grade.grade_submission` (see the module docstring)."""
    seen = seen or {}
    student = result.get("student") or Path(result["submission"]).stem
    lines = [f"# Feedback for {student}", ""]
    if result["status"] != "graded":
        lines += [f"Your notebook `{Path(result['submission']).name}` could not be graded: "
                  f"{result.get('error', result['status'])}. Ask your instructor.", ""]
        return "\n".join(lines)
    lines += [f"Lesson {result['lesson']}: **{result['points']:g} of {result['max']:g} points**.", ""]
    if result.get("only"):
        lines += [f"Regraded: {', '.join(result['only'])} only.", ""]
    lines += ["| exercise | points | status | what to look at | hints seen |", "|---|---|---|---|---|"]
    known = hints._hints()
    for row in result["exercises"]:
        word, detail = _message(row)
        k, n = seen.get(row["exercise"], (0, len([h for h in known.get(row["exercise"], []) if h])))
        steps = f"{k} of {n}" if n else str(k)
        cell = detail.replace("|", "\\|")
        lines.append(f"| {row['exercise']} | {row['points']:g} / {row['max']:g} | {word} | {cell} | {steps} |")
    lines += ["", "An exercise earns its points only when all its tests pass. For a hint: "
              "`from course_lib.grading.hints import hint; hint(\"EXERCISE\")`.", ""]
    return "\n".join(lines)


def write(results: list[dict], folder: str | Path) -> list[Path]:
    """``folder/<student>.md`` for each result; returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        student = res.get("student") or Path(res["submission"]).stem
        path = folder / f"{student}.md"
        path.write_text(markdown(res, hints_seen(res["submission"])))
        written.append(path)
    return written
