"""`course book` (course_lib/instructor/book.py, book_leaks.py): the site is built from a run's executed lessons,
shows a lesson's outputs only from a clean run of the current lesson, says where its numbers came from, writes
widgets out as their saved state, loads no script or style sheet from the network, and stops when a line of an
answer or hidden test is in it.

tests/test_browser.py's last test builds the book of every lesson that file ran and opens the index, three lessons
and the search page in Chromium with the network refused; here a one-lesson run made by hand is enough, no browser.
"""

from __future__ import annotations

import copy
import html
import json
import re
import shutil

import nbformat
import pytest

from course_lib import notebook as nbio
from course_lib.instructor import book, book_leaks, catalog, cli

LESSONS = catalog.lessons("notebooks")
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def _widget_state():
    """A saved VBox of a dropdown, a float slider and an Output holding a line of text and a figure."""
    def model(name, **state):
        return {"model_name": name, "model_module": "@jupyter-widgets/controls", "model_module_version": "2.0.0",
                "state": state}
    return {"box": model("VBoxModel", children=["IPY_MODEL_pick", "IPY_MODEL_mfu", "IPY_MODEL_out"]),
            "pick": model("DropdownModel", description="GPU", _options_labels=["A100", "H100"], index=1),
            "mfu": model("FloatSliderModel", description="MFU", value=0.39999999999999997),
            "out": model("OutputModel", outputs=[
                {"output_type": "stream", "name": "stdout", "text": "step 18.8 ms\n"},
                {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG, "text/plain": "<Figure>"}}])}


def _executed_lesson(run_dir, key="00", widget_state=True):
    """A copy of lesson ``key`` as a run would leave it: its first code cell shows a figure and a widget."""
    nb = nbformat.read(LESSONS[key], as_version=4)
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1                                  # Run All from a fresh kernel
    first = next(c for c in nb.cells if c.cell_type == "code")
    first.outputs = [nbformat.from_dict(o) for o in [
        {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG, "text/plain": "<Figure>"}},
        {"output_type": "display_data", "metadata": {}, "data": {
            book.WIDGET_VIEW: {"model_id": "box", "version_major": 2, "version_minor": 0},
            "text/plain": "VBox(children=(Dropdown(...), FloatSlider(...), Output()))"}}]]
    second = [c for c in nb.cells if c.cell_type == "code"][1]
    second.outputs = [nbformat.from_dict({"output_type": "stream", "name": "stdout", "text": _held_back() + "\n"})]
    if widget_state:
        nb.metadata["widgets"] = {book.WIDGET_STATE: {"version_major": 2, "version_minor": 0,
                                                      "state": _widget_state()}}
    nbformat.write(nb, run_dir / f"{LESSONS[key].stem}.executed.ipynb")
    return nb


def _held_back():
    """What a lesson prints where it holds a reading back until the prediction is written (the learner's first run)."""
    import contextlib
    import io

    from course_lib.lessons.display import after_prediction

    import os
    from unittest import mock

    out = io.StringIO()
    with contextlib.redirect_stdout(out), mock.patch.dict(os.environ):
        os.environ.pop("COURSE_READINGS", None)          # the learner's first run: predictions empty, readings held
        assert after_prediction(None, lambda: None) is False
    return out.getvalue().strip()


def _run_dir(tmp_path, **kw):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / book.RUN_INFO).write_text(json.dumps({
        "hardware": "CPU: Test Machine, 2 cores, torch 9.9, gloo", "created": "2026-12-02T10:00:00",
        "sizes": "quick CPU sizes", "inventory": [["torch", "9.9"], ["python", "3.11.7"]]}))
    _executed_lesson(run_dir, **kw)
    return run_dir


def test_widgets_are_written_out_as_their_saved_state(tmp_path):
    nb = nbformat.read(_run_dir(tmp_path) / f"{LESSONS['00'].stem}.executed.ipynb", as_version=4)
    assert book.static_widgets(nb) == 1 and "widgets" not in nb.metadata
    outputs = next(c for c in nb.cells if c.cell_type == "code").outputs
    assert outputs[0].data["image/png"] == PNG                        # the cell's own figure stays
    line = outputs[1].data["text/markdown"]
    assert "GPU = H100" in line and "MFU = 0.4." in line, line        # controls as left; a float as typed
    assert outputs[2].text == "step 18.8 ms\n" and outputs[3].data["image/png"] == PNG   # the Output's contents
    bare = _executed_lesson(tmp_path, widget_state=False)
    assert book.static_widgets(bare) == 1
    texts = [o.data.get("text/markdown", "") for o in next(c for c in bare.cells if c.cell_type == "code").outputs]
    assert any("state was not saved" in t for t in texts) and not any("VBox(" in t for t in texts)


def _ran(nb):
    for n, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
    return nb


def test_only_a_clean_run_of_the_unchanged_lesson_is_shown():
    lesson = nbformat.read(LESSONS["03"], as_version=4)
    assert book.why_not_shown(_ran(copy.deepcopy(lesson)), lesson) == ""     # outputs and metadata may differ
    answered = _ran(copy.deepcopy(lesson))
    quiz = next(i for i, c in enumerate(answered.cells) if "from course_lib.lessons.quizzes import quiz" in c.source)
    answered.cells[quiz].source = answered.cells[quiz].source.replace("None", "42", 1)
    assert book.why_not_shown(answered, lesson).startswith(f"its cell {quiz} (`")
    shorter = _ran(copy.deepcopy(lesson))
    shorter.cells = shorter.cells[:-1]
    assert "cells are not the lesson's" in book.why_not_shown(shorter, lesson)
    failed = _ran(copy.deepcopy(lesson))
    at = next(i for i, c in enumerate(failed.cells) if c.cell_type == "code")
    failed.cells[at].outputs = [nbformat.from_dict({"output_type": "error", "ename": "RuntimeError",
                                                    "evalue": "rank 1 timed out", "traceback": []})]
    assert book.why_not_shown(failed, lesson) == f"it stopped at cell {at} (RuntimeError: rank 1 timed out)"
    rerun = _ran(copy.deepcopy(lesson))
    rerun.cells[at].execution_count = 7                  # a cell run again, or out of order: stale outputs possible
    assert "did not run once each, in order" in book.why_not_shown(rerun, lesson)


def test_a_run_without_its_facts_is_refused_and_a_lab_report_is_read(tmp_path):
    with pytest.raises(book.BookError, match="neither report.json nor run.json.*course lab-report"):
        book.run_facts(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({
        "hardware": "GPU: NVIDIA H200, nccl", "created": "2026-12-01T09:00:00",
        "inventory": [["torch", "2.14.1"], ["python", "3.11.7"], ["CUDA", "13.0"], ["GPU 0", "H200"]],
        "lessons": [{"key": "03", "status": "ok", "sizes": "GPU sizes where the ranks get a GPU each (1 GPUs), "
                     "else CPU sizes"}]}))
    facts = book.run_facts(tmp_path)
    assert facts["versions"] == {"python": "3.11.7", "CUDA": "13.0"} and facts["sizes"]["03"].startswith("GPU")
    assert facts["ran"] == {"03"} and facts["failed"] == {}


def _site_with(tmp_path, text):
    """A one-page site whose page shows ``text`` in a code block, highlighted and escaped as Sphinx writes it."""
    site = tmp_path / "site"
    (site / "_static").mkdir(parents=True)
    spans = "".join(f'<span class="n">{html.escape(tok)}</span>' for tok in re.split(r"(\W)", text) if tok)
    (site / "page.html").write_text(f"<html><body><div class='highlight'><pre>x = 1\n{spans}\n</pre></div></body>")
    (site / "_static" / "theme.js").write_text(text)      # the theme's files are not the course's text
    return site


def test_leaks_finds_an_answer_line_however_the_page_writes_it(tmp_path):
    secret = book_leaks.secret_lines()
    solved = {s: w for s, w in secret.items() if "an answer in" in w}
    hidden = {s: w for s, w in secret.items() if "a hidden test" in w}
    assert len(solved) > 100 and hidden, "every lesson's solutions have answer lines; some have hidden tests"
    assert "q_peak = 4" in solved, "a short quiz answer is searched for too"
    line, where = next((s, w) for s, w in solved.items() if "<" in s or "'" in s or '"' in s)
    found = book_leaks.leaks(_site_with(tmp_path, line))
    assert len(found) == 1 and found[0].startswith(where) and "published in page.html" in found[0], found
    shutil.rmtree(tmp_path / "site")
    assert book_leaks.leaks(_site_with(tmp_path, "x = 1")) == []
    # in a notebook the site serves for download: an output (a printed answer) counts as well as a source
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(answer)", outputs=[nbformat.from_dict(
        {"output_type": "stream", "name": "stdout", "text": f"before\n{line}\nafter\n"})])])
    nbformat.write(nb, tmp_path / "site" / "copy.ipynb")
    assert [f for f in book_leaks.leaks(tmp_path / "site") if "copy.ipynb" in f], "a leak in an output"


def test_exercise_pages_come_from_solutions_not_from_the_exercises_folder():
    """A learner's clone may hold exercises/ filled in: the pages are what `course build` makes of solutions/, each
    with one note cell added."""
    from course_lib.grading.build import expected_files

    pages = book.exercise_pages()
    built = expected_files(cli.ROOT / "solutions")
    assert sorted(pages) == sorted(built)
    for name, page in pages.items():
        cells = nbformat.reads(built[name], as_version=4).cells
        assert [c.source for c in page.cells[:1] + page.cells[2:]] == [c.source for c in cells], name
        assert "the reference answers are not published" in page.cells[1].source


def test_a_lab_report_folder_shows_only_its_lessons_that_passed(tmp_path):
    """A reused folder holds older copies (a lab report of other lessons, or an earlier run): only the lessons its
    report lists count, and one it lists as failed is shown as text with the error."""
    run_dir = tmp_path / "lab"
    run_dir.mkdir()
    for key in ("00", "02"):
        _executed_lesson(run_dir, key)
    (run_dir / "report.json").write_text(json.dumps({
        "hardware": "CPU: Today", "created": "2026-12-02T10:00:00", "inventory": [["python", "3.11.7"]],
        "lessons": [{"key": "02", "status": "failed", "error": "cell 12: RuntimeError: rank 1 timed out",
                     "sizes": "CPU sizes"}]}))
    facts = book.run_facts(run_dir)
    assert list(book.executed_lessons(run_dir, facts)) == ["02"]          # 00's copy is not this report's
    src = tmp_path / "src"
    made = book.write_source(src, run_dir)
    assert made["with_outputs"] == [] and made["without"]["00"] == "this run did not include it"
    assert made["without"]["02"] == "it failed in this run: cell 12: RuntimeError: rank 1 timed out"


def test_every_course_notebook_is_valid():
    """The book, nbformat and JupyterLab read these files: each must pass nbformat's schema (cell ids, which nbformat
    4.5 requires; no outputs on a markdown cell), not only load."""
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((cli.ROOT / folder).glob("*.ipynb")):
            nb = json.loads(path.read_text())
            assert all("id" in c for c in nb["cells"]), (path.name, [i for i, c in enumerate(nb["cells"])
                                                                     if "id" not in c])
            nbformat.validate(nb, version=4)             # (it would add a missing id, with a warning)


def test_the_book_of_a_run(tmp_path, monkeypatch):
    """The site of a run holding lesson 00 only: its page has the figure, the widget's state and the note on the
    run's machine; the other lessons their text; exercises without answers; the glossary; MathJax bundled and no
    script or style sheet from the network; then a leak stops the build and removes the site."""
    run_dir = _run_dir(tmp_path)
    made = book.build(run_dir, tmp_path / "book")
    site = tmp_path / "book" / "site"
    assert made["with_outputs"] == ["00"] and made["lessons"] == sorted(LESSONS) and made["widgets"] == 1
    page = (site / "notebooks" / f"{LESSONS['00'].stem}.html").read_text()
    assert "The outputs below come from a run on CPU: Test Machine, 2 cores, torch 9.9, gloo (python 3.11.7) at " \
           "quick CPU sizes, 2026-12-02" in page
    assert page.count("<img") >= 2 and "GPU = H100" in page and "step 18.8 ms" in page
    assert _held_back().startswith(book.HELD_BACK) and "1 reading(s) that the lesson shows only once you have " \
        "written your prediction are not here" in page
    assert re.search(r'href="../_downloads/[0-9a-f]+/00_getting_started.ipynb"', page), "the run-this-lesson link"
    other = (site / "notebooks" / f"{LESSONS['03'].stem}.html").read_text()
    assert "outputs are not in this book (this run did not include it)" in other and "The outputs below" not in other
    exercise = (site / "exercises" / f"{LESSONS['03'].stem}.html").read_text()
    assert "the reference answers are not published" in exercise and "NotImplementedError" in exercise
    glossary = (site / "glossary.html").read_text()
    assert "全归约" in glossary and f'href="notebooks/{LESSONS["03"].stem}.html"' in glossary
    index = (site / "index.html").read_text()
    assert "CPU: Test Machine, 2 cores, torch 9.9, gloo, 2026-12-02, for lessons 00;" in index
    assert all(f"notebooks/{p.stem}.html" in index for p in LESSONS.values())
    assert (site / "_static" / "mathjax" / "tex-chtml.js").exists()
    for path in site.rglob("*.html"):
        remote = re.findall(r'<(?:script|link)[^>]*(?:src|href)="(?:https?:)?//[^"]*"', path.read_text())
        assert not remote, (path, remote[:2])
    assert book_leaks.leaks(site) == [] and not [p for p in site.rglob("_sources/*") if p.is_file()]

    shown = next(ln.strip() for c in nbio.read(LESSONS["00"]).cells for ln in nbio.source(c).splitlines()
                 if c.cell_type == "code" and len(ln.strip()) > 30)
    monkeypatch.setattr(book_leaks, "secret_lines", lambda: {shown: "a planted answer"})
    with pytest.raises(book.BookError, match=f"(?s)site removed.*a planted answer: `{re.escape(shown)}` is published"):
        book.build(run_dir, tmp_path / "book")
    assert not site.exists()


def test_the_command_says_what_is_wrong(tmp_path, capsys):
    assert cli.main(["book", "--from", str(tmp_path / "nowhere")]) == 2
    assert "--from" in capsys.readouterr().err
    assert cli.main(["book", "--from", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "neither report.json nor run.json" in capsys.readouterr().err
    assert cli.main(["book", "--lessons", "77", "--out", str(tmp_path / "out")]) == 2
    assert "77" in capsys.readouterr().err
    mine = tmp_path / "mine"
    (mine / "site").mkdir(parents=True)                   # a folder `course book` did not write is not replaced
    (mine / "site" / "keep.txt").write_text("mine")
    with pytest.raises(book.BookError, match="site exists and `course book` did not write it: choose another --out"):
        book.build(_run_dir(tmp_path), mine)
    assert (mine / "site" / "keep.txt").read_text() == "mine"


def test_missing_tools_are_named_with_the_fix(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "sphinx-mathjax-offline"
                        else real(name))
    assert cli.main(["book", "--from", "."]) == 2
    err = capsys.readouterr().err
    assert "sphinx-mathjax-offline missing" in err and "pip install -e '.[book]'" in err
