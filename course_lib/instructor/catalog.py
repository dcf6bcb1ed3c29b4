"""The course's lesson notebooks as files: ``lessons("notebooks")`` maps a lesson's number to its notebook, for `course
run`, `course lab-report` and the browser test (solutions and exercises have the same names)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]           # the repository (this is course_lib/instructor/)


def lessons(folder: str = "notebooks") -> dict[str, Path]:
    """{'00': Path('notebooks/00_getting_started.ipynb'), ...}"""
    return {p.name[:2]: p for p in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))}
