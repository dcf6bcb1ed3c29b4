"""Every lesson records its comparisons as data (issue 18): each calls `course_lib.measure.comparisons.compare` at least
twice, every call names its hardware and its reference, names are unique within a lesson, and the lesson prints which
sizes ran.

Read from the notebooks' source (no kernel): the runs themselves are checked by ``course run`` / ``lab-report``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from course_lib import notebook as nbio

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _code(name: str) -> str:
    nb = nbio.read(ROOT / "notebooks" / f"{name}.ipynb")
    return "\n\n".join(nbio.source(c) for c in nb.cells if c.cell_type == "code")


def _compare_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "compare"]


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_records_comparisons(name):
    src = _code(name)
    tree = ast.parse(src)
    assert "from course_lib.measure.comparisons import compare" in src, f"{name}: import compare from course_lib.measure.comparisons"
    local = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "compare"]
    assert not local, f"{name}: a local function named compare hides course_lib.measure.comparisons.compare"
    calls = _compare_calls(tree)
    assert len(calls) >= 2, f"{name}: {len(calls)} compare(...) calls, at least 2 expected"
    for call in calls:
        kw = {k.arg for k in call.keywords}
        assert "hardware" in kw and "against" in kw, \
            f"{name}, line {call.lineno}: compare(...) must say against what and on which hardware"
    literal = [c.args[0].value for c in calls if c.args and isinstance(c.args[0], ast.Constant)]
    assert len(literal) == len(set(literal)), f"{name}: two comparisons share a name"


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_prints_its_sizes(name):
    assert "sizes_label(" in _code(name), f"{name}: print which sizes ran (course_lib.lessons.sizes.sizes_label)"
