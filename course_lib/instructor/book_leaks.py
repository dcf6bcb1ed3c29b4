"""What `course book` may not publish, and the search of a built site for it (`course_lib.instructor.book`).

Secret: every line of an answer region or a hidden test in ``solutions/`` that is not public anyway. Public: the lines
of the lessons (``notebooks/``), of the learners' copies as ``course build`` writes them from ``solutions/`` (not the
``exercises/`` folder, which a learner may have filled in), and of the course's package (``course_lib/``, which a
learner installs: an answer equal to a line of the library's own technique is no secret). A line counts from 6
characters on (``q = 4`` is a quiz answer); blank lines and comments do not.

A site shows a line when a page's text (tags removed, entities decoded: highlighted code joins up again), a text
file, or a cell's source or output in a notebook it serves holds it as a whole line, spaces around it aside. The
theme's and MathJax's files (``_static/``) are not the course's text and are left out.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from course_lib import notebook as nbio
from course_lib.instructor.catalog import ROOT, lessons

MIN_CHARS = 6


def public_lines(root: Path = ROOT) -> set[str]:
    """Every stripped line a learner sees without the solutions: lessons, generated exercises, the package."""
    import nbformat

    from course_lib.grading.build import expected_files

    public: set[str] = set()
    for path in lessons("notebooks").values():
        public.update(ln.strip() for c in nbio.read(path).cells for ln in nbio.source(c).splitlines())
    for text in expected_files(root / "solutions").values():
        cells = nbformat.reads(text, as_version=4).cells
        public.update(ln.strip() for c in cells for ln in nbio.source(c).splitlines())
    for path in (root / "course_lib").rglob("*.py"):
        public.update(ln.strip() for ln in path.read_text(encoding="utf-8").splitlines())
    return public


def secret_lines(root: Path = ROOT) -> dict[str, str]:
    """{line: where it comes from} for every line that must not be published (see the module docstring)."""
    from course_lib.grading import authoring

    public, secret = public_lines(root), {}
    for path in lessons("solutions").values():
        for i, cell in enumerate(nbio.read(path).cells):
            src = nbio.source(cell)
            info = authoring.test_info(cell)
            if info and info["hidden"]:
                lines, what = src.splitlines(), "a hidden test"
            elif authoring.has_solution(cell):
                lines, what = authoring.answer_lines(src.splitlines()), "an answer"
            else:
                continue
            for ln in lines:
                s = ln.strip()
                if len(s) >= MIN_CHARS and not s.startswith("#") and s not in public:
                    secret.setdefault(s, f"{what} in solutions/{path.name}, cell {i}")
    return secret


def _output_text(output: dict) -> str:
    """What a notebook output shows as text: streams, tracebacks, and every text-like mime type (HTML unmarked)."""
    if output.get("output_type") == "stream":
        return _text(output.get("text", ""))
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    parts = []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") or mime.endswith("json"):
            text = _text(value)
            parts.append(_unmark(text) if mime == "text/html" else text)
    return "\n".join(parts)


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value if isinstance(value, str) else str(value)


def _unmark(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def site_lines(site: Path) -> dict[str, str]:
    """{stripped line: a file of the site that shows it} (see the module docstring)."""
    lines: dict[str, str] = {}
    for path in sorted(site.rglob("*")):
        if not path.is_file() or "_static" in path.relative_to(site).parts:
            continue
        if path.suffix in (".html", ".htm"):
            text = _unmark(path.read_text(errors="replace"))
        elif path.suffix == ".ipynb":
            nb = nbio.read(path)
            text = "\n".join([nbio.source(c) for c in nb.cells] +
                             [_output_text(o) for c in nb.cells for o in c.get("outputs", [])])
        elif path.suffix in (".txt", ".md", ".js", ".json", ".py", ".csv"):
            text = path.read_text(errors="replace")
        else:
            continue
        for ln in text.splitlines():
            lines.setdefault(ln.strip(), str(path.relative_to(site)))
    return lines


def leaks(site: Path) -> list[str]:
    """Every secret line the built site shows, with where it comes from and where it is shown (empty: none)."""
    shown = site_lines(site)
    return [f"{where}: `{line}` is published in {shown[line]}" for line, where in secret_lines().items()
            if line in shown]
