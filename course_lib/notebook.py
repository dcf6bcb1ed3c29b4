"""Reading and writing Jupyter notebooks: the one place the course opens a ``.ipynb`` file.

The glossary (`course_lib.glossary`) and grading (`course_lib.grading`) both read and write notebooks through it;
what an authored notebook means (answer regions, test cells) is `course_lib.grading.authoring`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat


class NotebookError(ValueError):
    """A notebook cannot be read, or an authored notebook breaks the format (names the cell)."""


def read(path: str | Path) -> nbformat.NotebookNode:
    """Read a notebook (any nbformat 4.x); raises `NotebookError` with the reason."""
    path = Path(path)
    try:
        nb = nbformat.read(str(path), as_version=4)
    except FileNotFoundError:
        raise NotebookError(f"{path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - bad JSON, bad schema, binary junk...
        raise NotebookError(f"{path}: not a readable notebook ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(nb.get("cells"), list):
        raise NotebookError(f"{path}: not a notebook (no list of cells)")
    return nb


def dumps(nb: Any) -> str:
    """Deterministic JSON text as Jupyter writes it (sorted keys, indent 1, sources as lists of lines,
    trailing newline): equal notebooks give equal bytes."""
    text = nbformat.writes(nbformat.from_dict(nb), version=4)
    return text if text.endswith("\n") else text + "\n"


def write(nb: Any, path: str | Path) -> None:
    Path(path).write_text(dumps(nb), encoding="utf-8")


def source(cell: Any) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)
