"""The course's one glossary (course_lib/glossary.py): every lesson's table is generated from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from course_lib import glossary

ROOT = Path(__file__).resolve().parents[1]


def test_every_lesson_has_one_generated_glossary():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        tables = [c for c in cells if c["cell_type"] == "markdown" and glossary.HEADING in "".join(c["source"])]
        assert len(tables) == 1, f"{path.name}: {len(tables)} cells with {glossary.HEADING!r}"
        rows = glossary.glossary_rows("".join(tables[0]["source"]))
        assert len(rows) >= 5, path.name
        twice = sorted({r for r in rows if rows.count(r) > 1})
        assert not twice, f"{path.name}: glossary terms listed twice: {twice}"
    stale = glossary.sync_course(ROOT, check=True)
    assert stale == [], f"glossary tables differ from course_lib/glossary.py (run `course build`): {stale}"


def test_one_chinese_term_per_concept():
    text = "".join(p.read_text(encoding="utf-8") for folder in ("notebooks", "solutions", "exercises")
                   for p in (ROOT / folder).glob("*.ipynb"))
    for variant in ("全规约", "归约分散", "汇合点"):          # the renderings the course does not use
        assert variant not in text, variant
    assert glossary.chinese("reduce-scatter / all-gather") == "归约散射 / 全收集"
    assert glossary.chinese("conjugate operators f / g") == "共轭算子 f / g"      # a whole term first
    with pytest.raises(KeyError, match="not in course_lib/glossary.py"):
        glossary.chinese("all-reduce / warp drive")


def test_sync_fills_the_chinese_column_and_refuses_unknown_terms():
    cell = f"Summary.\n\n{glossary.HEADING}\n| English | 中文 |\n|---|---|\n| all-reduce | 全规约 |\n| rank | ? |"
    out = glossary.sync_cell(cell)
    assert out.startswith("Summary.") and "| all-reduce | 全归约 |" in out and "| rank | 进程编号（秩） |" in out
    assert glossary.sync_cell(out) == out and glossary.glossary_rows(out) == ["all-reduce", "rank"]
    with pytest.raises(KeyError, match="'hyperdrive'"):
        glossary.sync_cell(cell + "\n| hyperdrive | 超光速 |")
