"""The layout of course_lib (README, "Architecture"): techniques in parallel/, one folder per lesson in lessons/.

Read from the source with `ast`, nothing imported: parallel/ never imports lessons/ or grading/; a lesson's folder
imports another lesson's code only through lessons/common.py; notebooks and solutions import modules under words.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "course_lib"


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; `from a import b` counts as a.b as well as a)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_parallel_holds_techniques_only():
    for path in sorted((PKG / "parallel").glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith(("course_lib.lessons", "course_lib.grading"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: techniques must not depend on lessons"


def test_lessons_share_code_only_through_common():
    lessons = sorted(p for p in (PKG / "lessons").iterdir() if p.is_dir() and re.fullmatch(r"l\d\d_\w+", p.name))
    assert [p.name[:3] for p in lessons] == sorted(p.name[:3] for p in lessons) and len(lessons) >= 7
    for folder in lessons:
        for path in folder.glob("*.py"):
            for module in _imports(path):
                other = re.match(r"course_lib\.lessons\.(l\d\d_\w+)", module)
                assert other is None or other.group(1) == folder.name, \
                    f"{path.relative_to(ROOT)} imports {module}: share it through course_lib/lessons/common.py"
    for path in (PKG / "lessons" / "common.py", *(PKG / "parallel").glob("*.py")):
        assert not any(re.match(r"course_lib\.lessons\.l\d\d", m) for m in _imports(path)), path


def test_notebooks_import_modules_under_words():
    alias = re.compile(r"^\s*(?:from\s+course_lib\S*\s+import|import\s+course_lib\S*).*\bas\s+([A-Za-z_]\w*)", re.M)
    for path in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb")]):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for name in alias.findall("".join(cell["source"])):
                assert len(name) > 3, f"{path.relative_to(ROOT)}: `as {name}`: name a course module with a word"


def test_show_prints_the_course_code_a_lesson_names():
    """`lessons.common.show`: the lines between two markers of a (decorated) function, its file and line named."""
    from course_lib.lessons.common import show, source_lines
    from course_lib.parallel.zero import ZeroOptimizer

    code = show(ZeroOptimizer._reduce_scatter_unit, "send = ", "out.div_(N)")     # under @torch.no_grad()
    first, *body = code.data.splitlines()
    assert first.startswith("# course_lib/parallel/zero.py, line ") and "_reduce_scatter_unit" in first
    assert body[0].startswith("send = ") and body[-1] == "out.div_(N)"
    assert source_lines(ZeroOptimizer._make_grad_hook).startswith("def _make_grad_hook(")
    assert '"""' not in source_lines(ZeroOptimizer._reduce_scatter_unit)                 # docstring left out
    assert '"""' in source_lines(ZeroOptimizer._reduce_scatter_unit, docstring=True)
    with pytest.raises(ValueError, match="not in the source"):
        source_lines(ZeroOptimizer._make_grad_hook, "no such line")
