"""Every lesson in a real JupyterLab 4, in headless Chromium: Run All, no error output, no dialog, every ipywidget
rendered and reacting to a changed control (course_lib/instructor/browser.py says how each is judged).

The lessons run at their quick CPU sizes (COURSE_QUICK=1, as `course lab-report --quick`): this test is about
JupyterLab (Run All, outputs, dialogs, widgets), and nbval runs every lesson at the sizes a learner gets in the same
test command; `tools/lab_smoke.py` runs them in JupyterLab at those sizes, by hand.

One JupyterLab server and one Chromium serve every lesson (a module fixture: playwright's sync API runs one at a
time in a process, and test_lab_report.py starts its own); each lesson's kernel is shut down before the next opens.
The executed copies, a screenshot per lesson and the server's log stay in runs/browser/<date-time>[-worker]/
(printed as each lesson ends).

Where Chromium (/usr/bin/chromium, or COURSE_CHROMIUM) or playwright is missing, the lessons are skipped with the
reason; under COURSE_BROWSER=required (set by `python3 course.py test` when it leaves the lessons to this file, and
by `--browser`) that is a failure instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib.instructor import browser, catalog, cli

pytestmark = pytest.mark.slow     # every lesson in JupyterLab: minutes (`course.py test --fast` leaves it out)

LESSONS = catalog.lessons("notebooks")  # every notebooks/NN_*.ipynb: lessons 08 and 09 join when they land


@pytest.fixture(scope="module")
def lab():
    reason = browser.unavailable()
    if reason:
        if os.environ.get("COURSE_BROWSER") == "required":
            pytest.fail(f"COURSE_BROWSER=required, but {reason}")
        pytest.skip(reason)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    run_dir = cli.ROOT / "runs" / "browser" / (time.strftime("%Y%m%d-%H%M%S") + (f"-{worker}" if worker else ""))
    with browser.Lab(run_dir, env={"COURSE_QUICK": "1"}) as lab:
        yield lab


def test_unavailable_names_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_CHROMIUM", str(tmp_path / "no-chromium"))
    reason = browser.unavailable()
    assert reason is not None and str(tmp_path / "no-chromium") in reason and "apt-get install chromium" in reason


def test_a_notebook_read_while_jupyter_rewrites_it_is_read_again(tmp_path):
    """Jupyter's save truncates the file and writes it again: a read in between finds '' (a CI run of lesson 09 did);
    the saved notebook is read again until it parses, and a file that never does still fails."""
    import threading

    path = tmp_path / "saved.ipynb"
    path.write_text("")
    writer = threading.Timer(1.0, lambda: nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), path))
    writer.start()
    try:
        assert browser.Lab._read_saved(path, timeout_s=30).cells[0].source == "x = 1"
    finally:
        writer.join()
    path.write_text('{"cells": [')
    with pytest.raises(nbformat.reader.NotJSONError):
        browser.Lab._read_saved(path, timeout_s=1)


def _broken_notebook(path):
    """A widget that does not react, a widget whose callback raises, an error, and a cell that cannot run after it."""
    dropdown = "w.Dropdown(options=['a', 'b'], description='{}')"
    nb = new_notebook(cells=[
        new_markdown_cell("# A broken lesson"),
        new_code_cell(f"import ipywidgets as w\nw.VBox([{dropdown.format('dead')}, w.Output()])"),
        new_code_cell(f"d = {dropdown.format('boom')}\nout = w.Output()\n\n"
                      "def update(*_):\n    with out:\n        out.clear_output(wait=True)\n"
                      "        if d.value == 'b':\n            raise ValueError('the widget broke')\n"
                      "        print(d.value)\n\n"
                      "d.observe(update, names='value')\nupdate()\nw.VBox([d, out])"),
        new_code_cell("1 / 0"),
        new_code_cell("print('never reached')"),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_a_broken_lesson_fails_naming_its_cells(lab, tmp_path):
    result = lab.run_lesson(_broken_notebook(tmp_path / "99_broken.ipynb"), timeout_s=120, widget_timeout_s=8)
    assert not result.ok and result.ran == 3 and result.code_cells == 4
    assert result.problems[0] == "cell 3 (`1 / 0`): ZeroDivisionError: division by zero", result.report()
    assert result.screenshot.stat().st_size > 0
    # Widgets are tried once a run is clean: the same widgets, without the error cell.
    nb = nbformat.read(tmp_path / "99_broken.ipynb", as_version=4)
    nb.cells = nb.cells[:3]
    nbformat.write(nb, tmp_path / "98_broken_widgets.ipynb")
    result = lab.run_lesson(tmp_path / "98_broken_widgets.ipynb", timeout_s=120, widget_timeout_s=8)
    assert len(result.problems) == 2, result.report()
    assert result.problems[0].startswith("cell 1 (`import ipywidgets as w`) widget 0: changing dead a -> b did not "
                                         "change its output"), result.report()
    assert result.problems[1].startswith("cell 2 (`d = w.Dropdown(options=['a', 'b'], description='boom')`) "
                                         "widget 0: after boom a -> b its output shows an error"), result.report()
    assert result.problems[1].endswith("ValueError: the widget broke"), result.report()


@pytest.mark.parametrize("notebook", list(LESSONS.values()), ids=[p.stem for p in LESSONS.values()])
def test_lesson_runs_in_jupyterlab(lab, notebook, capsys):
    result = lab.run_lesson(notebook)
    with capsys.disabled():
        print(f"\n[browser] {result.lesson}: {'OK' if result.ok else 'FAILED'} in {result.seconds:.0f} s at quick "
              f"sizes, {len(result.widgets)} widget(s) reacted; screenshot {result.screenshot}", flush=True)
    assert result.ok, result.report()


# ------------------------------------------------------------------------------------------------ the book
# Last in this file, so that in the test command it builds from the lessons run above (one worker runs this whole
# file in order): `course book --from` their run folder, with no second execution. Run alone (-k book), it first runs
# the lessons whose pages it opens.
BOOK_PAGES = {"01": "a widget's saved state, plots, math", "03": "schedules and most of the course's math",
              "08": "the planner's tables and plots"}
PAGE_JS = """() => ({
    images: document.querySelectorAll('article img').length,
    broken: [...document.querySelectorAll('article img')].filter(i => !i.complete || i.naturalWidth === 0)
            .map(i => i.getAttribute('src')),
    math: document.querySelectorAll('article .math').length,
    typeset: document.querySelectorAll('article .math mjx-container').length,
    raw_math: [...document.querySelectorAll('article p, article li')].filter(e => /\\$[^$\\s][^$]*\\$/.test(e.innerText))
              .map(e => e.innerText.slice(0, 80)),
    lessons: [...document.querySelectorAll('nav.bd-docs-nav a')].map(a => a.innerText.trim()),
    search: !!document.querySelector('form.bd-search input[name=q]') || !!document.querySelector('button.search-button__button, .search-button-field'),
    outline: document.querySelectorAll('.bd-toc-nav a, #pst-page-toc-nav a').length,
    next: [...document.querySelectorAll('.prev-next-area a')].map(a => a.getAttribute('href')),
})"""


def _serve(site):
    """A local static web server on ``site`` (as an instructor's would be); (server, base URL)."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/"


def test_book_of_the_lessons_run_above(lab, capsys):
    """`course book --from` the executed lessons above: the site builds, publishes no answer (the build searches it,
    and a planted leak stops it: tests/test_book.py), every lesson page of the run has its figures, and the index and
    three lessons render in Chromium with every request outside the site refused: figures loaded, math typeset by
    the bundled MathJax, the side bar's lessons and exercises, the page outline, next/previous links; and the search
    page finds lesson 03 for "bubble"."""
    from course_lib.instructor import book

    for key in BOOK_PAGES:
        if key not in book.executed_lessons(lab.run_dir):
            assert lab.run_lesson(LESSONS[key]).ok
    out = cli.ROOT / "runs" / "book" / lab.run_dir.name
    made = book.build(lab.run_dir, out)
    site = Path(made["site"])
    with capsys.disabled():
        print(f"\n[book] built from {lab.run_dir} in {made['seconds']:.0f} s: {made['pages']} pages, "
              f"{made['megabytes']:.1f} MB, lessons with outputs {', '.join(made['with_outputs'])}; "
              f"screenshots in {out}", flush=True)
    assert set(BOOK_PAGES) <= set(made["with_outputs"]), made
    assert all(why == "this run did not include it" for why in made["without"].values()), made["without"]
    for key in made["with_outputs"]:             # every page with a run's outputs shows every figure the run made
        page = (site / "notebooks" / f"{LESSONS[key].stem}.html").read_text()
        written = nbformat.read(out / "source" / "notebooks" / LESSONS[key].name, as_version=4)
        figures = sum(any(m.startswith("image/") for m in o.get("data", {})) for c in written.cells
                      if c.cell_type == "code" for o in c.outputs)     # widgets' figures included, written out
        assert figures >= 1 and page.count("<img") >= figures, (key, figures, page.count("<img"))
        assert "The outputs below come from a run on" in page, key
    server, base = _serve(site)
    context = lab.browser.new_context(viewport={"width": 1400, "height": 1000})
    outside = []
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith(base) else
                  (outside.append(route.request.url), route.abort()))
    try:
        for key in ["index", *BOOK_PAGES]:
            path = "index.html" if key == "index" else f"notebooks/{LESSONS[key].stem}.html"
            page = context.new_page()
            page.goto(base + path, wait_until="networkidle")
            page.evaluate("async () => { await window.MathJax?.startup?.promise; }")   # typeset the page
            page.evaluate(browser.DECODE_IMAGES_JS, None)
            seen = page.evaluate(PAGE_JS)
            if seen["images"]:                    # the screenshot shows the page's first figure
                page.locator("article img").first.scroll_into_view_if_needed()
            page.screenshot(path=str(out / f"{key}.png"))
            page.close()
            where = f"{path}: {seen}"
            assert len([n for n in seen["lessons"] if n[:2].isdigit()]) >= 2 * len(LESSONS), where  # lessons+exercises
            assert seen["search"] and not seen["broken"], where
            if key != "index":
                assert seen["images"] >= 2 and seen["outline"] >= 3 and seen["next"], where
                assert seen["math"] > 0 and seen["typeset"] == seen["math"] and not seen["raw_math"], where
        page = context.new_page()                 # the search box's page finds the lesson on pipeline bubbles
        page.goto(base + "search.html?q=bubble", wait_until="networkidle")
        page.wait_for_selector("ul.search li a", timeout=30_000)
        hits = page.evaluate("() => [...document.querySelectorAll('ul.search li a')].map(a => a.getAttribute('href'))")
        page.screenshot(path=str(out / "search.png"))
        assert f"notebooks/{LESSONS['03'].stem}.html" in hits, hits
    finally:
        context.close()
        server.shutdown()
    assert not outside, f"the site asked the network for {outside[:5]}: it must render offline"
