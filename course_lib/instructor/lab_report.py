"""``course lab-report``: the instructor's lab in one command (issue 18).

    course lab-report [--lessons 00,02-05] [--quick] [--out DIR]    run the course here, write DIR/index.html
    course lab-report --gpus 2,3                                     the same on GPUs 2,3 only (CUDA_VISIBLE_DEVICES)
    course lab-report --compare A B [--out DIR]                      two reports side by side

It runs `course gpu-check` first (the node's self-test), then each selected lesson top to bottom in a fresh
kernel with one progress bar (lesson, cell, elapsed, remaining estimated from the cells left), and writes:

- ``DIR/index.html``: the hardware inventory, the self-test's table, one row per lesson (status, wall time, sizes,
  comparisons passed), every recorded comparison (`course_lib.measure.comparisons`) with pass / out of tolerance / not
  run, the first plot of each lesson, and links to each executed lesson rendered by nbconvert (``NN_name.html``,
  plots embedded). Self-contained: images are data URIs, it opens from the file system;
- ``DIR/report.json`` (the same, for scripts; ``--compare`` reads it), ``DIR/NN_name.executed.ipynb`` and
  ``DIR/NN_name.comparisons.jsonl`` (the records of each lesson's run, beside its executed notebook).

``--quick`` sets ``COURSE_QUICK=1`` in the kernels: every lesson runs its reduced CPU sizes
(`lessons.sizes.by_device`), to check that the course runs (CI, a laptop); GPUs keep their sizes. The exit code
is 1 when a lesson failed, a comparison was out of tolerance or a self-test check failed, else 0.
"""

from __future__ import annotations

import datetime
import html
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.measure import comparisons

__all__ = ["LessonRun", "parse_lessons", "count_code_cells", "execute_notebook", "run_report", "write_report",
           "compare_reports", "main"]

ROOT = Path(__file__).resolve().parents[2]           # the repository (this is course_lib/instructor/)
VERSION = 1


@dataclass
class LessonRun:
    """One lesson's run in the report."""

    key: str                                   # "02"
    notebook: str                              # "02_data_parallel"
    status: str = "not run"                    # "ok", "failed", "not run"
    error: str = ""                            # "cell 12: ValueError: ..." when failed
    wall_s: float = 0.0
    sizes: str = ""
    cells_run: int = 0
    code_cells: int = 0
    comparisons: list[comparisons.Comparison] = field(default_factory=list)
    html: str = ""                             # file name of the rendered lesson, beside index.html
    first_plot: str = ""                       # a data URI

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "comparisons"}
        d["comparisons"] = [c.to_dict() for c in self.comparisons]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LessonRun":
        run = cls(**{k: v for k, v in d.items() if k != "comparisons"})
        run.comparisons = [comparisons.Comparison.from_dict(c) for c in d.get("comparisons", [])]
        return run


# ------------------------------------------------------------------------------------------ selection

def parse_lessons(spec: str, found: dict[str, Path]) -> list[str]:
    """``"00,02-05"`` -> ["00", "02", "03", "04", "05"] among the lessons ``found``; "all" -> every one.
    Raises ValueError naming the part that is wrong."""
    if spec.strip().lower() == "all":
        return sorted(found)
    keys: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\d{1,2})(?:-(\d{1,2}))?", part)
        if not m:
            raise ValueError(f"--lessons: {part!r} is not a lesson number or a range (write e.g. 00,02-05)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo > hi:
            raise ValueError(f"--lessons: the range {part!r} goes backwards (write {hi:02d}-{lo:02d})")
        for n in range(lo, hi + 1):
            key = f"{n:02d}"
            if key not in found:
                raise ValueError(f"--lessons: there is no lesson {key} (there are {', '.join(sorted(found))})")
            if key not in keys:
                keys.append(key)
    if not keys:
        raise ValueError("--lessons: no lesson selected (write e.g. 00,02-05, or all)")
    return keys


# ------------------------------------------------------------------------------------------ running

def execute_notebook(path: Path, out_path: Path, cell_timeout: float = 600, env: dict[str, str] | None = None,
                     on_cell=None) -> tuple[str, int, float]:
    """Run ``path`` cell by cell in a fresh kernel (the environment plus ``env``) and save the executed copy at
    ``out_path``; ``on_cell(index)`` is called after each code cell. Stops at the first failing cell, as
    JupyterLab's "run all" does. Whatever the notebook started (torchrun jobs included) is killed at the end.

    Returns (error, cells run, wall seconds): error is '' or ``cell 12: ValueError: first line``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from course_lib.runtime import procs

    nb = nbformat.read(path, as_version=4)
    tag = procs.new_tag("courserun")
    saved = {k: os.environ.get(k) for k in [procs.TAG_VAR, *(env or {})]}
    os.environ.update(env or {})
    os.environ[procs.TAG_VAR] = procs.nested_tag(tag)  # the kernel inherits it, and everything it starts
    client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    error, ran = "", 0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        with client.setup_kernel():
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                try:
                    client.execute_cell(cell, i)
                except CellExecutionError as exc:
                    first = (str(exc.evalue).strip().splitlines() or [""])[0]
                    error = f"cell {i}: {exc.ename}: {first}"
                    break
                finally:
                    ran += 1
                    if on_cell:
                        on_cell(i)
    finally:
        procs.kill_tree(tag=tag, grace_s=0.5)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        client.set_widgets_metadata()     # the widgets' last state (an Output's plots too): `course book` shows it
        nbformat.write(nb, out_path)
    return error, ran, time.perf_counter() - t0


def count_code_cells(path: Path) -> int:
    import nbformat

    return sum(c.cell_type == "code" for c in nbformat.read(path, as_version=4).cells)


def sizes_of(quick: bool) -> str:
    """The sizes the lessons run at here: GPU sizes where there are GPUs, else quick or learner CPU sizes."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        return f"GPU sizes where the ranks get a GPU each ({torch.cuda.device_count()} GPUs), else CPU sizes"
    return "quick CPU sizes" if quick else "CPU sizes"


def run_report(keys: list[str], found: dict[str, Path], out: Path, quick: bool = False, gpu_check: bool = True,
               cell_timeout: float = 600, progress: bool = True) -> dict:
    """Run the self-test and the lessons ``keys``; write everything into ``out``; return the report (a dict)."""
    import torch
    from tqdm.auto import tqdm

    from course_lib.instructor import gpu_check as node_check
    from course_lib.measure import hardware

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"version": VERSION, "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "quick": quick, "command": " ".join(["course", "lab-report", *sys.argv[2:]]) if sys.argv else "",
              "inventory": [list(row) for row in node_check.inventory()], "gpu_check": [], "lessons": []}
    report["hardware"] = hardware.hardware_label("nccl" if torch.cuda.is_available() else "gloo")
    if gpu_check:
        print("course gpu-check (the node's self-test; about a minute) ...", flush=True)
        t0 = time.perf_counter()
        checks = node_check.run_checks()
        report["gpu_check"] = [c.__dict__ for c in checks]
        report["gpu_check_s"] = round(time.perf_counter() - t0, 1)
        print(node_check.format_report(checks, report["hardware"]), flush=True)
    runs = [LessonRun(k, found[k].stem, code_cells=count_code_cells(found[k])) for k in keys]
    bar = tqdm(total=sum(r.code_cells for r in runs), unit="cell", disable=not progress, desc="lessons",
               bar_format="{desc} |{bar}| {n_fmt}/{total_fmt} cells, {elapsed} elapsed, ~{remaining} remaining")
    for run in runs:
        path = found[run.key]
        records = out / f"{run.notebook}.comparisons.jsonl"
        records.unlink(missing_ok=True)
        env = {comparisons.ENV: str(records), "COURSE_LESSON": run.key, "COURSE_QUICK": "1" if quick else "0",
               "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        done = 0

        def on_cell(i: int, run=run) -> None:
            nonlocal done
            done += 1
            bar.set_description(f"lesson {run.key} cell {i}")
            bar.update(1)

        error, run.cells_run, run.wall_s = execute_notebook(path, out / f"{run.notebook}.executed.ipynb",
                                                            cell_timeout, env, on_cell)
        bar.update(run.code_cells - done)                 # the cells a failure skipped
        run.wall_s = round(run.wall_s, 1)
        run.status, run.error, run.sizes = ("failed" if error else "ok"), error, sizes_of(quick)
        run.comparisons = comparisons.load(records)
        run.html, run.first_plot = _render(out / f"{run.notebook}.executed.ipynb", out)
        report["lessons"].append(run.to_dict())
        tqdm.write(f"lesson {run.key}: {run.status} in {run.wall_s:.0f} s, "
                   f"{sum(c.ok is True for c in run.comparisons)}/{len(run.comparisons)} comparisons pass"
                   + (f" ({error})" if error else ""))
    bar.close()
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["exit_code"] = exit_code(report)
    write_report(report, out)
    return report


def _render(executed: Path, out: Path) -> tuple[str, str]:
    """Render an executed notebook as HTML beside the index (images embedded); (file name, first plot URI)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(executed, as_version=4)
    body, _ = HTMLExporter(template_name="lab", embed_images=True).from_notebook_node(nb)
    name = executed.name.replace(".executed.ipynb", ".html")
    (out / name).write_text(body, encoding="utf-8")
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                return name, "data:image/png;base64," + "".join(png).replace("\n", "")
    return name, ""


def exit_code(report: dict) -> int:
    """1 when a lesson failed, a comparison was out of tolerance or a self-test check failed, else 0."""
    bad = any(run["status"] == "failed" for run in report["lessons"])
    bad |= any(c["status"] == "out of tolerance" for run in report["lessons"] for c in run["comparisons"])
    bad |= any(c["ok"] is False for c in report.get("gpu_check", []))
    return int(bad)


# ------------------------------------------------------------------------------------------- writing

CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;width:100%}th,td{border:1px solid #ccc;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass,.ok{background:#e3f6e3}.out-of-tolerance,.failed,.FAIL{background:#fbe0e0}.not-run{background:#f3f3f3}
.plots{display:flex;flex-wrap:wrap;gap:1em}.plots figure{margin:0;width:360px}.plots img{width:100%;
border:1px solid #ddd}small{color:#666}"""


def passed_text(records: list[comparisons.Comparison]) -> str:
    """``7/9 (2 not run)``: comparisons that passed of those recorded, and how many could not run here."""
    passed = sum(c.ok is True for c in records)
    not_run = sum(c.ok is None for c in records)
    return f"{passed}/{len(records)}" + (f" ({not_run} not run)" if not_run else "")


def _e(x) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list[str]], classes: list[str] | None = None, raw: bool = False) -> str:
    out = ["<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = "".join(f"<td>{c if raw else _e(c)}</td>" for c in row)
        out.append(f"<tr{cls}>{cells}</tr>")
    return "\n".join(out) + "</table>"


def _slug(status: str) -> str:
    return status.replace(" ", "-")


def _num(x) -> str:
    return "-" if x is None else f"{x:.6g}"


def index_html(report: dict) -> str:
    """The report's index page (self-contained)."""
    lessons = [LessonRun.from_dict(d) for d in report["lessons"]]
    n_cmp = sum(len(r.comparisons) for r in lessons)
    n_pass = sum(c.ok is True for r in lessons for c in r.comparisons)
    verdict = "all lessons ran, every comparison within tolerance" if report["exit_code"] == 0 else \
        "FAILED: a lesson failed, a comparison is out of tolerance or a self-test check failed (see below)"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Course lab report</title>"
             f"<style>{CSS}</style></head><body>",
             "<h1>Course lab report</h1>",
             f"<p><b>{_e(verdict)}</b><br>{_e(report['hardware'])}<br><small>created {_e(report['created'])}; "
             f"{'quick sizes (--quick)' if report['quick'] else 'full sizes'}; whole run {report['wall_s']:.0f} s; "
             f"{n_pass}/{n_cmp} comparisons pass</small></p>",
             "<h2>Hardware</h2>", _table(["", "here"], report["inventory"])]
    if report.get("gpu_check"):
        rows = [[c["name"], c["expected"], c["measured"], {True: "pass", False: "FAIL", None: "-"}[c["ok"]]]
                for c in report["gpu_check"]]
        classes = [{True: "pass", False: "FAIL", None: "not-run"}[c["ok"]] for c in report["gpu_check"]]
        parts += [f"<h2>Self-test (course gpu-check, {report.get('gpu_check_s', 0):.0f} s)</h2>",
                  _table(["check", "expected", "measured", "result"], rows, classes)]
    rows, classes = [], []
    for r in lessons:
        link = f"<a href='{_e(r.html)}'>{_e(r.notebook)}</a>" if r.html else _e(r.notebook)
        rows.append([link, _e(r.status + (f": {r.error}" if r.error else "")), f"{r.wall_s:.0f} s",
                     f"{r.cells_run}/{r.code_cells}", _e(r.sizes), passed_text(r.comparisons)])
        bad = any(c.ok is False for c in r.comparisons)
        classes.append(r.status if r.status != "ok" else "out-of-tolerance" if bad else "pass")
    parts += ["<h2>Lessons</h2>", _table(["lesson", "status", "wall time", "cells run", "sizes",
                                          "comparisons passed"], rows, classes, raw=True)]
    rows, classes = [], []
    for r in lessons:
        for c in r.comparisons:
            rows.append([r.key, c.name, _num(None if c.ok is None else c.measured), c.expected_text(), c.unit,
                         c.tolerance(), c.against, c.status, c.hardware])
            classes.append(_slug(c.status))
    parts += ["<h2>Comparisons</h2>", "<p><small>a measurement beside its formula or its library twin, as each "
              "lesson printed it (course_lib.measure.comparisons)</small></p>",
              _table(["lesson", "comparison", "measured", "expected", "unit", "tolerance", "against", "result",
                      "hardware"], rows, classes)]
    figures = [f"<figure><img alt='first plot of lesson {_e(r.key)}' src='{r.first_plot}'><figcaption>"
               f"<a href='{_e(r.html)}'>{_e(r.notebook)}</a></figcaption></figure>" for r in lessons if r.first_plot]
    if figures:
        parts += ["<h2>Plots</h2><p><small>the first plot of each lesson; every plot is in the lesson's page"
                  "</small></p>", "<div class='plots'>", *figures, "</div>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "index.html").write_text(index_html(report), encoding="utf-8")


def summary(report: dict) -> str:
    """The text summary printed at the end: per lesson, comparisons passed / total and wall time."""
    lines = [f"lab report: {report['hardware']}; {'quick' if report['quick'] else 'full'} sizes"]
    lines.append(f"  {'lesson':<28} {'status':<7} {'wall':>7}  comparisons passed")
    for d in report["lessons"]:
        records = [comparisons.Comparison.from_dict(c) for c in d["comparisons"]]
        lines.append(f"  {d['notebook']:<28} {d['status']:<7} {d['wall_s']:>5.0f} s  {passed_text(records)}")
    if report.get("gpu_check"):
        ok = sum(c["ok"] is True for c in report["gpu_check"])
        lines.append(f"  {'self-test (gpu-check)':<28} {'':<7} {report.get('gpu_check_s', 0):>5.0f} s  "
                     f"{ok}/{sum(c['ok'] is not None for c in report['gpu_check'])}")
    lines.append(f"  whole run {report['wall_s']:.0f} s; exit code {report['exit_code']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- compare

def load_report(path: str | Path) -> dict:
    """A report.json, or the folder that holds one."""
    path = Path(path)
    path = path / "report.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--compare: no report at {path} (give a lab-report folder or its report.json)")
    report = json.loads(path.read_text(encoding="utf-8"))
    if report.get("version") != VERSION:
        raise ValueError(f"--compare: {path} is not a course lab report (version {report.get('version')!r})")
    return report


def compare_reports(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> tuple[list[str], list[list[str]]]:
    """The comparison table of two reports: one row per (lesson, comparison) in either, both columns."""
    def by_key(report):
        return {(d["notebook"], c["name"]): c for d in report["lessons"] for c in d["comparisons"]}

    ca, cb = by_key(a), by_key(b)
    keys = list(ca) + [k for k in cb if k not in ca]
    head = ["lesson", "comparison", "expected", "unit", f"measured {names[0]}", f"result {names[0]}",
            f"measured {names[1]}", f"result {names[1]}"]
    rows = []
    for key in keys:
        x, y = ca.get(key), cb.get(key)
        ref = comparisons.Comparison.from_dict(x or y)
        rows.append([key[0], key[1], ref.expected_text(), ref.unit,
                     _num(x["measured"]) if x else "-", x["status"] if x else "absent",
                     _num(y["measured"]) if y else "-", y["status"] if y else "absent"])
    for report, name in ((a, names[0]), (b, names[1])):
        for d in report["lessons"]:
            rows.append([d["notebook"], "wall time", "", "s", "", "", "", ""])
            rows[-1][4 if name == names[0] else 6] = f"{d['wall_s']:.0f}"
    return head, rows


def compare_html(a: dict, b: dict, names: tuple[str, str]) -> str:
    head, rows = compare_reports(a, b, names)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Lab reports compared</title><style>{CSS}"
            f"</style></head><body><h1>Lab reports compared</h1><p>{_e(names[0])}: {_e(a['hardware'])}, "
            f"{_e(a['created'])}<br>{_e(names[1])}: {_e(b['hardware'])}, {_e(b['created'])}</p>"
            + _table(head, rows) + "</body></html>")


# ---------------------------------------------------------------------------------------------- main

def main(args) -> int:
    """``course lab-report`` (arguments from `course_lib.instructor.cli`)."""
    from course_lib.instructor.catalog import lessons

    out = Path(args.out)
    if args.compare:
        try:
            a, b = (load_report(p) for p in args.compare)
        except ValueError as exc:
            print(f"course lab-report: {exc}", file=sys.stderr)
            return 2
        names = tuple(str(p) for p in args.compare)
        head, rows = compare_reports(a, b, names)
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        for row in [head, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.html").write_text(compare_html(a, b, names), encoding="utf-8")
        print(f"written: {out / 'compare.html'}")
        return 0
    found = lessons(args.folder)
    try:
        keys = parse_lessons(args.lessons, found)
    except ValueError as exc:
        print(f"course lab-report: {exc}", file=sys.stderr)
        return 2
    if args.gpus is not None:
        env = _restrict_gpus(args.gpus)
        if env is None:
            return 2
        os.environ.update(env)        # before CUDA starts here: the self-test, the kernels and their ranks see them
    report = run_report(keys, found, out, quick=args.quick, gpu_check=not args.no_gpu_check,
                        cell_timeout=args.cell_timeout)
    print(summary(report))
    print(f"written: {out / 'index.html'} (open it in a browser) and {out / 'report.json'}")
    return report["exit_code"]


def _restrict_gpus(spec: str) -> dict[str, str] | None:
    """``--gpus 2,3``: the environment that shows this report only those GPUs (`course_lib.runtime.gpus`), said in one
    line; None, after a one-line error, when the machine has no such GPU."""
    from course_lib.runtime import gpus

    try:
        ids = gpus.parse_gpus(spec, gpus.machine_gpus())
    except gpus.GpuSelectionError as exc:
        print(f"course lab-report: {exc}", file=sys.stderr)
        return None
    env = gpus.visible_devices_env(ids)
    print(f"course lab-report: {gpus.describe(ids, env)}", flush=True)
    return env


def add_parser(sub) -> None:
    p = sub.add_parser("lab-report", help="run the course here (self-test + lessons) and write one HTML report")
    p.add_argument("--lessons", default="all", help="which lessons, e.g. 00,02-05 (default: all)")
    p.add_argument("--quick", action="store_true", help="reduced CPU sizes: the whole course in minutes (CI)")
    p.add_argument("--out", default=str(ROOT / "reports" / "lab"), help="output folder (default: reports/lab)")
    p.add_argument("--folder", default="notebooks", help="where the lessons are (default: notebooks)")
    p.add_argument("--cell-timeout", type=float, default=600, help="seconds per cell (default 600)")
    p.add_argument("--no-gpu-check", action="store_true", help="skip the node's self-test (course gpu-check)")
    p.add_argument("--gpus", default=None, help="check only these GPUs, e.g. 2,3 or 0-3 (CUDA_VISIBLE_DEVICES), "
                   "while learners use the others")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two reports (folders or report.json)")
    p.set_defaults(func=main)

