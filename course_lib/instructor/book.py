"""``course book``: the course as a static website, every lesson with the outputs of a real run (issue 47).

    course book                          run every lesson here at the learner's sizes, then build the site
    course book --from reports/lab       build it from a `course lab-report` (an instructor's GPU run, say)
    course book --from runs/browser/X    ... or from the lessons the browser test ran (tests/test_browser.py)

The site (``OUT/site/index.html``, default ``runs/book/site``) is built by Sphinx with myst-nb and
sphinx-book-theme from the executed notebooks, without executing them again. It holds the course index, every
lesson (plots, tables, each widget as it was left: its controls' values and its output), each lesson's exercises as
`course build` writes them from ``solutions/`` (no reference answer, no hidden test), and the glossary as one page.
Each lesson page says which machine, versions, sizes and date its numbers came from, and links to the lesson's
notebook to run it. MathJax comes from the sphinx-mathjax-offline package and lands in the site: the site renders
with no network. Served by any static web server (docs/INSTRUCTORS.md says how to publish it).

A lesson's outputs are published only when its executed copy has the lesson's cells unchanged (no answered quiz or
filled prediction), ran each code cell once, in order, with no error, and belongs to the run (a lab report lists it);
otherwise its page is its text, saying why. After the build the site is searched for every line of the solutions'
answers and hidden tests (`book_leaks`): one found removes the site and names the line and the file.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import json
import re
import shutil
import sys
import time
from pathlib import Path

from course_lib import notebook as nbio
from course_lib.instructor import book_leaks
from course_lib.instructor.catalog import ROOT, lessons

RUN_INFO = "run.json"          # what a run of the lessons was: written by the browser test's lab; report.json alike
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
TITLE = "Training LLMs at scale, hands-on"
TOOLS = ("sphinx", "myst_nb", "sphinx_book_theme", "sphinx-mathjax-offline")   # the `book` extra, as imported
HELD_BACK = "-> write your prediction in the cell above"     # what lessons.display.after_prediction prints
MARKER = ".course-book"        # in OUT: what `course book` wrote there, it may replace
BUILT = ("source", "site", "doctrees", "jupyter_execute")

CONF = '''# Written by `course book` (course_lib/instructor/book.py): Sphinx's configuration of the course's book.
project = {title!r}
author = "the course's authors"
extensions = ["myst_nb", "sphinx-mathjax-offline", "sphinx.ext.githubpages"]   # MathJax 3 in the site; .nojekyll
html_theme = "sphinx_book_theme"
html_title = {title!r}
html_theme_options = {{"show_toc_level": 2, "use_download_button": False, "home_page_in_toc": True}}
html_last_updated_fmt = None
nb_execution_mode = "off"             # the outputs are the run's: nothing executes again
nb_ipywidgets_js = {{}}               # no widget JavaScript from a CDN: widgets are written out as their state
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
exclude_patterns = ["_run", "_build"]
html_copy_source = False              # no _sources/ copies: the pages are what is published
suppress_warnings = ["myst.header", "misc.highlighting_failure"]
'''


class BookError(RuntimeError):
    """The run cannot make a book (what, which file, how to fix)."""


# ------------------------------------------------------------------------------------------ the run's facts

def describe_run(sizes: str) -> dict:
    """What a run of the lessons on this machine is (``run.json``): hardware, versions, sizes, date."""
    import torch

    from course_lib.instructor.gpu_check import inventory
    from course_lib.measure import hardware

    return {"hardware": hardware.hardware_label("nccl" if torch.cuda.is_available() else "gloo"),
            "created": datetime.datetime.now().isoformat(timespec="seconds"), "sizes": sizes,
            "inventory": [list(row) for row in inventory()]}


def run_facts(run_dir: Path) -> dict:
    """The facts of the run in ``run_dir``: its ``report.json`` (`course lab-report`: only the lessons it lists
    belong to it, the folder may hold older copies) or ``run.json`` (a folder of one run: the browser test's)."""
    for name in ("report.json", RUN_INFO):
        if (run_dir / name).exists():
            facts = json.loads((run_dir / name).read_text())
            listed = facts.get("lessons")
            versions = {k: v for k, v in facts.get("inventory", []) if k in ("python", "CUDA", "NCCL")}
            return {"hardware": facts.get("hardware", "unknown hardware"), "created": facts.get("created", ""),
                    "sizes": {r["key"]: r.get("sizes", "") for r in listed or []},
                    "default_sizes": facts.get("sizes", ""), "versions": versions,
                    "ran": None if listed is None else {r["key"] for r in listed},
                    "failed": {r["key"]: f"it failed in this run: {r.get('error') or r.get('status')}"
                               for r in listed or [] if r.get("status") != "ok"}}
    raise BookError(f"{run_dir} has neither report.json nor {RUN_INFO}, so its pages could not say where their "
                    "numbers came from: give --from a `course lab-report` folder (or run `course book` without --from)")


def executed_lessons(run_dir: Path, facts: dict | None = None) -> dict[str, Path]:
    """{'03': run_dir/03_pipeline_parallel.executed.ipynb or .../03_pipeline_parallel.ipynb} for every lesson of
    the run found there (with ``facts``, only the lessons its report lists)."""
    found = {}
    ran = (facts or {}).get("ran")
    for key, lesson in lessons("notebooks").items():
        for name in (f"{lesson.stem}.executed.ipynb", lesson.name):
            if (run_dir / name).exists() and (ran is None or key in ran):
                found[key] = run_dir / name
                break
    return found


def why_not_shown(executed, lesson) -> str:
    """Why the outputs of ``executed`` may not stand for ``lesson`` ('' when they may): a cell differs (an answered
    quiz, a filled prediction, an older course), the run stopped at an error, or its cells did not run once each in
    order from a fresh kernel (outputs left over from an earlier state of a cell)."""
    mine = [(c.cell_type, nbio.source(c)) for c in lesson.cells]
    theirs = [(c.cell_type, nbio.source(c)) for c in executed.cells]
    if len(mine) != len(theirs):
        return f"its {len(theirs)} cells are not the lesson's {len(mine)} (an older or changed copy)"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            first = (b[1].strip().splitlines() or [""])[0][:60]
            return f"its cell {i} (`{first}`) differs from the lesson's (an answered or changed copy)"
    code = [c for c in executed.cells if c.cell_type == "code"]
    for i, cell in enumerate(executed.cells):
        error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        if error is not None:
            return f"it stopped at cell {i} ({error.get('ename')}: {str(error.get('evalue', ''))[:80]})"
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        return "its cells did not run once each, in order, from a fresh kernel"
    return ""


# ------------------------------------------------------------------------------------------ the pages

def static_widgets(nb) -> int:
    """Replace each widget view by what it showed when saved: one line with its controls' values, then its
    Output widgets' outputs (plots, text). Without saved widget state, a note says to run the lesson. Returns the
    number of widgets written out."""
    import nbformat

    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    count = 0
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        outputs = []
        for out in cell.outputs:
            view = out.get("data", {}).get(WIDGET_VIEW)
            if view is None:
                outputs.append(out)
                continue
            count += 1
            controls, shown = _walk(state, view.get("model_id", ""))
            line = ("An interactive widget (run the lesson to use it)" + (": as it was left, " + ", ".join(controls)
                    if controls else "") + "." if state else
                    "An interactive widget: its state was not saved with this run; run the lesson to use it.")
            outputs.append(_markdown_output(line))
            outputs.extend(shown)
        cell["outputs"] = [nbformat.from_dict(o) for o in outputs]
    nb.metadata.pop("widgets", None)
    return count


def _walk(state: dict, model_id: str) -> tuple[list[str], list[dict]]:
    """(the controls' 'description = value', the Output widgets' outputs) under the widget ``model_id``."""
    model = state.get(model_id)
    if model is None:
        return [], []
    name, s = model.get("model_name", ""), model.get("state", {})
    if name == "OutputModel":
        return [], list(s.get("outputs", []))
    if "children" in s:
        controls, shown = [], []
        for child in s["children"]:
            c, o = _walk(state, str(child).removeprefix("IPY_MODEL_"))
            controls += c
            shown += o
        return controls, shown
    if "_options_labels" in s and s.get("index") is not None:
        value = s["_options_labels"][s["index"]] if isinstance(s["index"], int) else \
            ", ".join(s["_options_labels"][i] for i in s["index"])
    elif "value" in s:
        value = s["value"]
    else:
        return [], []
    label = s.get("description") or name.removesuffix("Model")
    return [f"{label} = {value:.4g}" if isinstance(value, float) else f"{label} = {value}"], []


def _markdown_output(text: str) -> dict:
    """A display output that renders as markdown."""
    return {"output_type": "display_data", "metadata": {}, "data": {"text/markdown": text, "text/plain": text}}


def _markdown_cell(text: str) -> dict:
    """A markdown cell whose id comes from its text (the same in every build)."""
    return {"cell_type": "markdown", "metadata": {}, "source": text,
            "id": "book-" + hashlib.sha1(text.encode()).hexdigest()[:8]}


def lesson_page(lesson: Path, executed: Path | None, facts: dict) -> tuple:
    """(the lesson's page, widgets written out, why it has no outputs or ''): the executed copy, its widgets written
    out, under a note on where its numbers came from and how to run it; else the lesson's text, saying why."""
    import nbformat

    clean = nbformat.read(lesson, as_version=4)
    key = lesson.name[:2]
    run_it = (f"**Run this lesson:** in a clone of the course, `python3 course.py lab` opens JupyterLab; the lesson "
              f"is `notebooks/{lesson.name}` ({{download}}`download it <../_run/{lesson.name}>`: it runs where the "
              "course's package is installed).")
    nb, widgets = (nbformat.read(executed, as_version=4), 0) if executed is not None else (None, 0)
    why = facts.get("failed", {}).get(key, "") if nb is not None else "this run did not include it"
    why = why or why_not_shown(nb, clean)
    if why:
        nb = clean
        note = f"This lesson's outputs are not in this book ({why}): its text only. {run_it}"
    else:
        widgets = static_widgets(nb)
        held = sum(HELD_BACK in str(o.get("text", "")) for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)            # readings `lessons.display.after_prediction` kept for a prediction
        versions = ", ".join(f"{k} {v}" for k, v in facts["versions"].items())
        sizes = facts["sizes"].get(key) or facts["default_sizes"] or "the sizes this machine chose"
        note = (f"The outputs below come from a run on {facts['hardware']} ({versions}) at {sizes}, "
                f"{facts['created'][:10] or 'date not recorded'}; every number and figure is that run's and yours "
                f"will differ.{' Widgets are shown as they were left.' if widgets else ''}"
                + (f" {held} reading(s) that the lesson shows only once you have written your prediction are not here "
                   "(the run, like a learner's first, left the predictions empty): run the lesson to see them."
                   if held else "") +
                f" {run_it}")
    title = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and
                  nbio.source(c).lstrip().startswith("# ")), -1)
    nb.cells.insert(title + 1, nbformat.from_dict(_markdown_cell(f"```{{note}}\n{note}\n```")))
    return nb, widgets, why


def exercise_pages() -> dict[str, object]:
    """{file name: page} of every lesson's exercises as `course build` writes them from ``solutions/`` (answers
    stubbed, hidden tests removed; never the ``exercises/`` folder, which a learner may have filled in), with a note."""
    import nbformat

    from course_lib.grading.build import expected_files

    pages = {}
    for name, text in expected_files(ROOT / "solutions").items():
        nb = nbformat.reads(text, as_version=4)
        note = (f"The graded exercises of lesson {name[:2]}, as a learner gets them: the reference answers are not "
                f"published. Do them in JupyterLab (`exercises/{name}` in a clone of the course); `course grade` "
                "marks them.")
        nb.cells.insert(1, nbformat.from_dict(_markdown_cell(f"```{{note}}\n{note}\n```")))
        pages[name] = nb
    return pages


def glossary_page(pages: dict[str, str]) -> str:
    """The course's one glossary as a page; each lesson number links to its page."""
    from course_lib import glossary

    table = [ln for ln in glossary.document(root=ROOT).splitlines() if ln.startswith("|")]

    def link(row: str) -> str:
        cells = row.split("|")
        cells[-2] = " " + ", ".join(f"[{k}]({pages[k]})" if k in pages else k
                                    for k in cells[-2].strip().split(", ")) + " "
        return "|".join(cells)

    return "\n".join(["# Glossary (English / 中文)", "",
                      "The course's one glossary: each lesson's glossary table takes its terms from it.", "",
                      *table[:2], *(link(r) for r in table[2:])]) + "\n"


def index_page(pages: list[str], exercises: list[str], facts: dict, shown: list[str]) -> str:
    """The book's first page: the course index's text (its links made the book's) and the table of contents
    (``pages``: the lessons' file stems, in order)."""
    index = nbio.read(ROOT / "notebooks" / "index.ipynb")
    text = "\n\n".join(nbio.source(c) for c in index.cells if c.cell_type == "markdown")
    text = re.sub(r"\]\((\d\d_[a-z0-9_]+\.ipynb)\)", r"](notebooks/\1)", text)
    text = text.replace("](../exercises/", "](exercises/")
    made = (f"\n\nThis book shows the outputs of a run on {facts['hardware']}, {facts['created'][:10]}, for lessons "
            f"{', '.join(shown) or 'none'}; each of their pages says so again, with its sizes. The other lessons' "
            "pages hold their text and say why." if facts else "")
    toc = ["", "```{toctree}", ":caption: Lessons", ":hidden:", "",
           *(f"notebooks/{stem}" for stem in pages), "```", "",
           "```{toctree}", ":caption: Exercises", ":hidden:", "",
           *(f"exercises/{name.removesuffix('.ipynb')}" for name in exercises), "```", "",
           "```{toctree}", ":caption: Reference", ":hidden:", "", "glossary", "```", ""]
    return text + made + "\n" + "\n".join(toc)


# ------------------------------------------------------------------------------------------ building

def write_source(src: Path, run_dir: Path | None) -> dict:
    """Write the book's Sphinx project into ``src``; returns what went in (lessons with outputs and why the others
    have none, widgets, the run's facts)."""
    import nbformat

    for sub in ("notebooks", "exercises", "_run"):
        (src / sub).mkdir(parents=True)
    facts = run_facts(run_dir) if run_dir is not None else {}
    executed = executed_lessons(run_dir, facts) if run_dir is not None else {}
    found = lessons("notebooks")
    widgets, without = 0, {}
    for key, lesson in found.items():
        nb, n, why = lesson_page(lesson, executed.get(key), facts)
        widgets += n
        if why:
            without[key] = why
        nbformat.write(nb, src / "notebooks" / lesson.name)
        shutil.copyfile(lesson, src / "_run" / lesson.name)
    exercises = exercise_pages()
    for name, nb in exercises.items():
        nbformat.write(nb, src / "exercises" / name)
    pages = {k: f"notebooks/{p.stem}" for k, p in found.items()}
    (src / "glossary.md").write_text(glossary_page(pages), encoding="utf-8")
    shown = sorted(set(found) - set(without))
    (src / "index.md").write_text(index_page([p.stem for p in found.values()], sorted(exercises), facts, shown),
                                  encoding="utf-8")
    (src / "conf.py").write_text(CONF.format(title=TITLE), encoding="utf-8")
    return {"with_outputs": shown, "without": without, "lessons": sorted(found), "widgets": widgets, "facts": facts}


def sphinx_build(src: Path, site: Path, log: Path) -> None:
    """Run Sphinx (html) from ``src`` into ``site``; its messages go to ``log``; BookError on failure."""
    import subprocess

    with open(log, "w") as f:
        status = subprocess.call([sys.executable, "-m", "sphinx", "-b", "html", "-q", str(src),
                                  str(site), "-d", str(src.parent / "doctrees")], stdout=f, stderr=subprocess.STDOUT)
    if status != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise BookError(f"Sphinx failed (exit code {status}); the end of {log}:\n{tail}")


def build(run_dir: Path | None, out: Path) -> dict:
    """Write the Sphinx project into ``out/source`` and build the site into ``out/site``; check it for leaks.
    Returns what was built (pages, sizes, seconds). What an earlier `course book` wrote in ``out`` is replaced;
    a folder it did not write is refused."""
    t0 = time.perf_counter()
    made_here = [out / name for name in BUILT if (out / name).exists()]
    if made_here and not (out / MARKER).exists():
        raise BookError(f"{made_here[0]} exists and `course book` did not write it: choose another --out")
    for path in made_here:
        shutil.rmtree(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `course book`: it replaces source/, site/, doctrees/, jupyter_execute/\n")
    made = write_source(out / "source", run_dir)
    site = out / "site"
    sphinx_build(out / "source", site, out / "sphinx.log")
    found = book_leaks.leaks(site)
    if found:
        shutil.rmtree(site)
        raise BookError("the site would publish what learners must not see (site removed):\n  " +
                        "\n  ".join(found[:10]) + ("\n  ..." if len(found) > 10 else ""))
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
    made.update(site=str(site), seconds=round(time.perf_counter() - t0, 1), megabytes=round(size / 1e6, 1),
                pages=len(list(site.rglob("*.html"))))
    return made


def main(args) -> int:
    """``course book`` (arguments from `course_lib.instructor.cli`)."""
    from course_lib.instructor import lab_report

    out = Path(args.out)
    missing = [name for name in TOOLS if importlib.util.find_spec(name) is None]
    if missing:
        print(f"course book: {', '.join(missing)} missing: install the book's tools with `pip install -e '.[book]'` "
              "(or run `python3 course.py book`, which does it)", file=sys.stderr)
        return 2
    run_dir = Path(args.from_dir) if args.from_dir else None
    if run_dir is not None and not run_dir.is_dir():
        print(f"course book: --from {run_dir}: no such folder (give a `course lab-report` folder)", file=sys.stderr)
        return 2
    if run_dir is None:
        found = lessons("notebooks")
        try:
            keys = lab_report.parse_lessons(args.lessons, found)
        except ValueError as exc:
            print(f"course book: {exc}", file=sys.stderr)
            return 2
        run_dir = out / "run"
        print(f"course book: running {len(keys)} lesson(s) here first ({'quick' if args.quick else 'learner'} "
              f"sizes), into {run_dir}", flush=True)
        report = lab_report.run_report(keys, found, run_dir, quick=args.quick, gpu_check=False)
        print(lab_report.summary(report), flush=True)
    try:
        made = build(run_dir, out)
    except BookError as exc:
        print(f"course book: {exc}", file=sys.stderr)
        return 1
    print(f"course book: built in {made['seconds']:.0f} s: {made['pages']} pages, {made['megabytes']:.1f} MB, "
          f"{len(made['with_outputs'])} lesson(s) with the outputs of the run on "
          f"{made['facts'].get('hardware', 'no run')}")
    if made["without"]:
        print("  without outputs, their text only:\n"
              + "".join(f"    {k}: {why}\n" for k, why in made["without"].items())
              + "  (a run of the current lessons that includes them: `course lab-report --lessons 00-12 --out DIR`, "
              "then `course book --from DIR`)")
    print(f"open {Path(made['site']) / 'index.html'}, or serve the folder: python3 -m http.server -d {made['site']}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("book", help="the course as a static website with the outputs of a real run")
    p.add_argument("--from", dest="from_dir", default=None, help="a folder of executed lessons: a `course "
                   "lab-report` folder (e.g. reports/lab, an instructor's GPU run); default: run them here first")
    p.add_argument("--out", default=str(ROOT / "runs" / "book"), help="where the site goes: OUT/site "
                   "(default: runs/book)")
    p.add_argument("--lessons", default="all", help="without --from: which lessons to run, e.g. 00,02-05")
    p.add_argument("--quick", action="store_true", help="without --from: run the lessons at their quick CPU sizes")
    p.set_defaults(func=main)
