"""Lessons in a real JupyterLab 4, in headless Chromium, run the way a learner runs them (Run > Run All Cells).

    from course_lib.instructor import browser
    with browser.Lab(Path("runs/browser/x")) as lab:    # one JupyterLab server and one Chromium for every lesson
        result = lab.run_lesson(Path("notebooks/01_bottlenecks.ipynb"))
        assert result.ok, result.report()

For each lesson `Lab.run_lesson` copies the notebook into the run folder (the repo's file is never touched), opens the
copy in a fresh JupyterLab workspace, clicks Run > Run All Cells and waits until no cell is running and the kernel is
idle. Then it saves the notebook (the executed copy stays in the run folder) and judges what a learner would see:

- every code cell ran, and no cell has an error output (the saved notebook says which cell and what error);
- no dialog appeared (JupyterLab's, e.g. "Kernel Restarting", or the browser's own);
- every ipywidget output is rendered (its ``.jupyter-widgets`` DOM is there) and reacts: one control changed
  (a dropdown, else a slider) changes the widget's output area, with no error in it.

A screenshot per lesson (NN_name.png) is kept next to the executed copy; the lesson's kernel is shut down before the
next lesson opens, and whatever it started must be gone by then. The executed copies keep their widgets' state
(JupyterLab's widget setting ``saveState``, for this server only), and ``run.json`` says what machine, versions and
sizes ran them: `course book --from` the run folder makes the course's website from them.

Used by tests/test_browser.py (every lesson; `python3 course.py test --browser`) and tools/lab_smoke.py (chosen
notebooks, by hand). Needs Debian's ``chromium`` (``COURSE_CHROMIUM`` names another binary) and the ``browser``
extra (playwright); `unavailable` says which one is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.runtime import procs

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1400, "height": 1000}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# The top-level widget views of a cell: an output whose child is a widget, not an output inside an Output widget.
WIDGET_VIEWS = ".jp-OutputArea-output:not(.widget-output .jp-OutputArea-output):has(> .jupyter-widgets)"
# What the page reports on every poll: cell prompts, the kernel's status and name, and any dialog's text. The status
# reads "idle" before a kernel is there, with the name "No Kernel".
STATE_JS = """() => ({
    prompts: [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')].map(e => e.innerText.trim()),
    kernel: document.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status ?? null,
    kernelName: document.querySelector('.jp-Toolbar-kernelName')?.innerText.trim() ?? null,
    dialogs: [...document.querySelectorAll('.jp-Dialog')].map(e => e.innerText.trim()),
})"""

# Wait until every image under an element (the whole page for null) is decoded, then for two frames; the number of
# images that cannot be decoded. (On a CPU busy with other work, headless Chromium still sometimes paints a figure
# blank or in part for a while: a screenshot can show that although the image's data is right.)
DECODE_IMAGES_JS = """async (root) => {
    const images = [...(root ?? document).querySelectorAll('img')];
    const ok = await Promise.all(images.map(i => i.decode().then(() => true, () => false)));
    await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
    return ok.filter(x => !x).length;
}"""


def chromium() -> Path:
    """The Chromium binary the lessons run in: Debian's, unless ``COURSE_CHROMIUM`` names another."""
    return Path(os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium"))


def unavailable() -> str | None:
    """Why lessons cannot run in the browser on this machine, or None when they can."""
    if not chromium().is_file():
        return (f"Chromium not found at {chromium()}: install Debian's chromium (sudo apt-get install chromium "
                f"fonts-noto-cjk), or set COURSE_CHROMIUM to a Chromium binary")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return ("the playwright package is missing: `python3 course.py test --browser` installs it "
                "(or pip install -e .[browser])")
    return None


def sigterm_when_parent_dies():
    """A ``preexec_fn`` asking Linux to send SIGTERM to the child when this process dies (PR_SET_PDEATHSIG);
    None elsewhere. The function is looked up before the fork: a child forked from a process with threads (pytest,
    a warm pool's reaper) must not import or load a library."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)


@dataclass
class LessonResult:
    """What one lesson did in the browser. ``problems`` is empty when the lesson passed."""

    lesson: str                                           # the notebook's file name
    seconds: float                                        # from opening the notebook to its kernel shut down
    code_cells: int
    ran: int                                              # code cells with an execution count after Run All
    problems: list[str] = field(default_factory=list)     # each names the cell ("cell 12 (`code`)") and what is wrong
    widgets: list[str] = field(default_factory=list)      # each widget checked: the control changed
    notes: list[str] = field(default_factory=list)        # not failures: stderr output, page console errors
    screenshot: Path | None = None
    executed: Path | None = None                          # the saved notebook, with its outputs

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        head = (f"{self.lesson}: {'OK' if self.ok else 'FAILED'} in {self.seconds:.0f} s, "
                f"{self.ran}/{self.code_cells} code cells ran, {len(self.widgets)} widget(s) reacted")
        lines = [head, *(f"  PROBLEM {p}" for p in self.problems), *(f"  widget {w}" for w in self.widgets),
                 *(f"  note {n}" for n in self.notes)]
        lines += [f"  screenshot: {self.screenshot}", f"  executed copy: {self.executed}"]
        return "\n".join(lines)


def cell_name(nb, i: int) -> str:
    """'cell 12 (`zero_report.zero_calculator()`)': its index in the notebook (from 0, as `course run` says) and its
    first line of code."""
    lines = [line for line in nb.cells[i].source.splitlines() if line.strip() and not line.startswith("#")]
    first = lines[0].strip() if lines else ""
    return f"cell {i} (`{first[:70]}{'...' if len(first) > 70 else ''}`)"


class Lab:
    """One JupyterLab server and one headless Chromium, serving every lesson run in ``run_dir``.

    The server runs from ``run_dir`` (notebooks are copied there) with the course's lab settings, in this process's
    environment without MPLBACKEND (a learner's kernel shows figures inline) and COURSE_READINGS (readings wait for a
    prediction, as on a learner's first run), plus ``env`` (e.g. ``COURSE_QUICK=1``:
    every lesson at its quick CPU sizes). Everything it starts (kernels, their torchrun ranks) carries one process
    tag, and so does Chromium; `close` kills both trees. If this process dies, Linux sends the server SIGTERM (it
    shuts its kernels down) and playwright's driver closes Chromium.
    """

    def __init__(self, run_dir: Path, start_timeout_s: float = 120, env: dict[str, str] | None = None):
        self.run_dir = Path(run_dir).resolve()
        self.start_timeout_s = start_timeout_s
        self.env = dict(env or {})
        self.token = secrets.token_hex(16)
        self.port = procs.free_port()
        self.server_tag = procs.new_tag("lab")          # the server, its kernels, and what they start
        self.browser_tag = procs.new_tag("chromium")
        self.server: subprocess.Popen | None = None
        self._playwright = None
        self.browser = None

    # ------------------------------------------------------------------------------------ start and stop

    def __enter__(self) -> Lab:  # noqa: PYI034 - Python 3.10 has no typing.Self
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        from playwright.sync_api import sync_playwright

        from course_lib.instructor import book, lab_report
        from course_lib.instructor.lab_settings import lab_flags, write_lab_settings

        write_lab_settings()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        quick = self.env.get("COURSE_QUICK", os.environ.get("COURSE_QUICK", "")) == "1"
        (self.run_dir / book.RUN_INFO).write_text(json.dumps(book.describe_run(lab_report.sizes_of(quick))))
        # This server's user settings: the saved notebooks keep their widgets' state (an Output's plots too).
        widgets = self.run_dir / "lab-user-settings" / "@jupyter-widgets" / "jupyterlab-manager"
        widgets.mkdir(parents=True, exist_ok=True)
        (widgets / "plugin.jupyterlab-settings").write_text(json.dumps({"saveState": True}))
        # COURSE_READINGS (lessons.display.READINGS_VAR) left out: readings wait for a prediction, as a learner's do
        env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "COURSE_READINGS")} | self.env
        env[procs.TAG_VAR] = procs.nested_tag(self.server_tag)
        with open(self.run_dir / "jupyter.log", "wb") as log:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                 f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                 f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.run_dir}",
                 f"--LabApp.user_settings_dir={self.run_dir / 'lab-user-settings'}", *lab_flags()],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=sigterm_when_parent_dies())  # noqa: PLW1509 - it only makes a system call
        deadline = time.time() + self.start_timeout_s
        while True:
            try:
                self.api("GET", "/api/status")
                break
            except (OSError, urllib.error.URLError):
                if self.server.poll() is not None or time.time() > deadline:
                    tail = (self.run_dir / "jupyter.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"JupyterLab did not start (exit code {self.server.poll()}); "
                                       f"the end of {self.run_dir / 'jupyter.log'}:\n{tail}") from None
                time.sleep(0.5)
        self._playwright = sync_playwright().start()
        self.browser = self._playwright.chromium.launch(
            executable_path=str(chromium()), args=CHROMIUM_ARGS,
            env={**os.environ, procs.TAG_VAR: procs.nested_tag(self.browser_tag)})

    def close(self) -> None:
        """Close Chromium and stop the server; then kill whatever either left (kernels, ranks, renderers)."""
        try:
            if self.browser is not None:
                self.browser.close()
            if self._playwright is not None:
                self._playwright.stop()
        except Exception:  # noqa: BLE001, S110 - a dead browser or driver: the kills below still run
            pass
        finally:
            self.browser = self._playwright = None
            if self.server is not None:
                procs.kill_tree(self.server.pid, tag=self.server_tag, grace_s=5)
            procs.kill_tree(tag=self.browser_tag, grace_s=1)

    def api(self, method: str, path: str):
        """Call the Jupyter server's REST API; the decoded JSON answer (None when empty)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def leftovers(self) -> list:
        """Processes the server started that are still alive (kernels and what they started)."""
        return [p for p in procs.alive(self.server_tag) if self.server is None or p.pid != self.server.pid]

    # ---------------------------------------------------------------------------------------- a lesson

    def run_lesson(self, notebook: Path, timeout_s: float = 900, widget_timeout_s: float = 60) -> LessonResult:
        """Open a copy of ``notebook``, Run All Cells, check errors, dialogs and widgets; see the module docstring."""
        import nbformat

        notebook = Path(notebook)
        copy = self.run_dir / notebook.name
        shutil.copyfile(notebook, copy)
        source = nbformat.read(copy, as_version=4)
        code = [i for i, c in enumerate(source.cells) if c.cell_type == "code"]
        result = LessonResult(lesson=notebook.name, seconds=0.0, code_cells=len(code), ran=0, executed=copy,
                              screenshot=self.run_dir / f"{notebook.stem}.png")
        t0 = time.time()
        page = self.browser.new_page(viewport=VIEWPORT)
        page.on("dialog", lambda d: (result.problems.append(f"browser dialog: {d.type} {d.message!r}"), d.dismiss()))
        page.on("pageerror", lambda e: result.notes.append(f"page error: {e}"))
        focus = None  # the cell the screenshot shows: the first failing one, else the last widget changed
        try:
            page.goto(f"http://127.0.0.1:{self.port}/lab/workspaces/{notebook.stem}/tree/{copy.name}"
                      f"?reset&token={self.token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            names = [cell_name(source, i) for i in code]
            started = self._wait(page, result, lambda s: s["kernel"] == "idle" and s["kernelName"] not in
                                 (None, "", "No Kernel"), 120, "the kernel did not start", names, settle=2)
            if started:
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.locator("li[data-command='runmenu:run-all']").click()
            if started and self._wait(page, result, lambda s: s["kernel"] == "idle" and "[*]:" not in s["prompts"],
                                      timeout_s, f"Run All did not finish in {timeout_s:.0f} s", names, settle=2):
                self._save(page)
                executed = self._read_saved(copy)
                focus = self._judge_outputs(executed, code, result)
                if not result.problems:  # widgets are tried once the run is clean
                    focus = self._check_widgets(page, executed, result, widget_timeout_s) or focus
            cells = page.locator(".jp-Notebook .jp-Cell")
            if focus is not None and focus < cells.count():
                cells.nth(focus).scroll_into_view_if_needed()
            page.evaluate(DECODE_IMAGES_JS, None)
            page.screenshot(path=str(result.screenshot))
        finally:
            self._shut_down(copy, page, result)
            result.seconds = time.time() - t0
        return result

    def _wait(self, page, result: LessonResult, done, timeout_s: float, what: str, names: list[str],
              settle: int = 1) -> bool:
        """Poll the page once a second until ``done(state)`` holds ``settle`` times in a row; a dialog, or
        ``timeout_s``, fails (a problem naming the cells still running: ``names`` are the code cells' names)."""
        deadline, streak = time.time() + timeout_s, 0
        while time.time() < deadline:
            state = page.evaluate(STATE_JS)
            if state["dialogs"]:
                result.problems += [f"dialog: {' | '.join(d.splitlines())}" for d in state["dialogs"]]
                return False
            streak = streak + 1 if done(state) else 0
            if streak >= settle:
                return True
            time.sleep(1)
        running = [names[k] for k, p in enumerate(state["prompts"]) if p == "[*]:" and k < len(names)]
        result.problems.append(f"{what} (kernel {state['kernel']}; still running or queued: "
                               f"{', '.join(running[:3]) or 'none'})")
        return False

    def _save(self, page) -> None:
        """File > Save Notebook, then wait until the tab is no longer marked as changed."""
        page.get_by_role("menuitem", name="File", exact=True).click()
        page.locator("li[data-command='docmanager:save']").click()
        page.wait_for_selector(".lm-TabBar-tab.jp-mod-dirty", state="detached", timeout=60_000)

    @staticmethod
    def _read_saved(path: Path, timeout_s: float = 30):
        """The saved notebook. Jupyter's "atomic" save truncates and rewrites the file in place (the copy it keeps is
        only for a failure), and an autosave can be writing it as the tab turns clean: a read then finds ``''`` or
        half a notebook (a CI run did); read again until it parses."""
        import nbformat

        deadline = time.time() + timeout_s
        while True:
            try:
                return nbformat.read(path, as_version=4)
            except (nbformat.reader.NotJSONError, ValueError):
                if time.time() > deadline:
                    raise
                time.sleep(0.5)

    def _judge_outputs(self, nb, code: list[int], result: LessonResult) -> int | None:
        """Errors and cells that did not run, from the saved notebook; the first failing cell's index."""
        first = None
        for i in code:
            cell = nb.cells[i]
            if cell.get("execution_count") is not None:
                result.ran += 1
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    result.problems.append(f"{cell_name(nb, i)}: {out.get('ename')}: {out.get('evalue')}")
                    first = i if first is None else first
                elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                    text = "".join(out.get("text", "")).strip().splitlines()
                    result.notes.append(f"{cell_name(nb, i)} wrote to stderr: {text[0][:200] if text else ''}")
        not_run = [i for i in code if nb.cells[i].get("execution_count") is None]
        if not_run and not result.problems:  # after an error, the cells below not running is expected
            result.problems.append(f"{len(not_run)} code cell(s) did not run, the first: {cell_name(nb, not_run[0])}")
            first = not_run[0]
        return first

    def _check_widgets(self, page, nb, result: LessonResult, timeout_s: float) -> int | None:
        """Every widget output of the saved notebook is rendered and reacts; the last widget cell's index."""
        cells = page.locator(".jp-Notebook .jp-Cell")
        last = None
        for i, cell in enumerate(nb.cells):
            expected = sum(WIDGET_MIME in out.get("data", {}) for out in cell.get("outputs", []))
            if not expected:
                continue
            last = i
            views = cells.nth(i).locator(WIDGET_VIEWS)
            if views.count() != expected:
                shown = cells.nth(i).locator(".jp-OutputArea").first.inner_text()[:200]
                result.problems.append(f"{cell_name(nb, i)}: {expected} widget(s) in the output, "
                                       f"{views.count()} rendered; the cell shows: {shown!r}")
                continue
            for j in range(expected):
                self._try_widget(page, views.nth(j), f"{cell_name(nb, i)} widget {j}", result, timeout_s)
        return last

    def _try_widget(self, page, view, name: str, result: LessonResult, timeout_s: float) -> None:
        """Change one control of ``view`` (a dropdown, else a slider); its output area must change, error-free."""
        view.scroll_into_view_if_needed()
        area = view.locator(".widget-output").first if view.locator(".widget-output").count() else view
        before = area.inner_html()
        select, slider = view.locator(".widget-dropdown select"), view.locator(".widget-slider .noUi-handle")
        if select.count():
            control = select.first
            label = view.locator(".widget-dropdown .widget-label").first.inner_text().strip()
            old = control.evaluate("s => s.options[s.selectedIndex].text")
            n = control.evaluate("s => s.options.length")
            control.select_option(index=(control.evaluate("s => s.selectedIndex") + 1) % n)
            new = control.evaluate("s => s.options[s.selectedIndex].text")
        elif slider.count():
            control = slider.first
            label = view.locator(".widget-slider .widget-label").first.inner_text().strip()
            old = control.get_attribute("aria-valuenow")
            control.focus()
            page.keyboard.press("ArrowRight")
            new = control.get_attribute("aria-valuenow")
        else:
            result.problems.append(f"{name}: no dropdown or slider to change")
            return
        change = f"{label or 'control'} {old} -> {new}"
        deadline, last, stable = time.time() + timeout_s, before, 0
        while time.time() < deadline:  # changed, the kernel idle, and the same for 2 polls in a row
            time.sleep(0.5)
            html, state = area.inner_html(), page.evaluate(STATE_JS)
            stable = stable + 1 if html == last and html != before and state["kernel"] == "idle" else 0
            last = html
            if stable >= 2 or state["dialogs"]:
                break
        if last == before:
            result.problems.append(f"{name}: changing {change} did not change its output in {timeout_s:.0f} s")
        elif area.evaluate(DECODE_IMAGES_JS):
            result.problems.append(f"{name}: after {change} its output shows an image the browser cannot decode")
        elif area.locator("[data-mime-type='application/vnd.jupyter.stderr']").count():
            error = area.locator("[data-mime-type='application/vnd.jupyter.stderr']").first.inner_text()
            last_paragraph = error.strip().split("\n\n")[-1]  # a traceback ends with "ValueError: ..."
            result.problems.append(f"{name}: after {change} its output shows an error: {last_paragraph[-300:]}")
        else:
            result.widgets.append(f"{name}: {change}, output changed")

    def _shut_down(self, copy: Path, page, result: LessonResult, timeout_s: float = 30) -> None:
        """Shut the lesson's kernel down (its session deleted), close the page; nothing it started may stay."""
        try:
            for session in self.api("GET", "/api/sessions"):
                if session.get("path") == copy.name:
                    self.api("DELETE", f"/api/sessions/{session['id']}")
        finally:
            page.close()
        deadline = time.time() + timeout_s
        while self.leftovers() and time.time() < deadline:
            time.sleep(0.5)
        left = self.leftovers()
        if left:
            result.problems.append(f"{len(left)} process(es) still alive {timeout_s:.0f} s after the kernel shut down: "
                                   f"{[' '.join(p.cmdline())[:120] for p in left]}")
            for p in left:
                procs.kill_tree(p.pid, grace_s=1)
