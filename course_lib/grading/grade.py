"""``course grade``: run submissions with the official tests restored and score each exercise.

One submission:
1. read it (unreadable -> status ``unreadable``, the CLI exits 1);
2. find its lesson (notebook metadata ``course.lesson``, else the file name, else the exercise ids)
   and take the official test cells (hidden ones included) from an in-memory copy of ``solutions/``;
3. assemble: drop every test cell of the submission (edited, duplicated or deleted tests change
   nothing), keep all other cells, and put the official test cells of each exercise where the
   submission's first test cell of that exercise was (deleted: just before the next exercise's tests);
4. execute it in a new temp folder (the cwd) with `course_lib.grading.runner`, in a subprocess tagged
   with a unique ``COURSE_PROC_TAG``, inside the sandbox where it runs (`course_lib.grading.sandbox`: no view
   of the checkout, $HOME or other submissions, no network, a memory and a process cap); afterwards kill
   every process carrying the tag;
   While it runs, the course's own answer to each exercise (`course_lib.reference`) is refused to the
   submission's code (`guard_plan`, `course_lib.grading.kernel_guard`);
5. score: an exercise earns its points (sum of its test cells' points) only if all its test cells pass and the
   submission's code never called the course's answer to it.

Statuses: ``passed``, ``refused: X calls M, the course's answer: write your own``, ``failed: <first failing
check>``, ``not implemented``, ``timeout``, ``error: <one line>``, ``kernel died``, ``memory limit (N MB)
reached``, ``process limit (N ...) reached``.
"""

from __future__ import annotations

import ast
import copy
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from course_lib import reference
from course_lib.runtime import procs
from course_lib.grading import kernel_guard, regrade, sandbox, similarity
from course_lib import notebook as nbio
from course_lib.grading import authoring

DEFAULT_CELL_TIMEOUT = 120.0
DEFAULT_TOTAL_TIMEOUT = 900.0
DEFAULT_OUTPUT_LIMIT = 1_000_000


class GraderError(RuntimeError):
    """The grader itself failed (not the submission): the CLI exits 2."""


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------ solutions

class Solutions:
    """An in-memory snapshot of ``solutions/`` taken before any submission runs."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise GraderError(f"no solutions folder at {self.folder}")
        self.hashes = authoring.tree_hash(self.folder)
        self.notebooks = {p.stem: nbio.read(p) for p in sorted(self.folder.glob("*.ipynb"))}
        if not self.notebooks:
            raise GraderError(f"no solution notebooks in {self.folder}")

    def changed(self) -> list[str]:
        """Official notebooks whose bytes changed since the snapshot (a submission wrote there?)."""
        now = authoring.tree_hash(self.folder)
        return sorted(k for k in set(now) | set(self.hashes) if now.get(k) != self.hashes.get(k))

    def match(self, nb, path: Path) -> str | None:
        lesson = nb.get("metadata", {}).get("course", {}).get("lesson")
        if lesson in self.notebooks:
            return lesson
        stems = sorted(self.notebooks, key=len, reverse=True)
        for stem in stems:
            if stem == path.stem or stem in path.name:
                return stem
        ids = {info["exercise"] for info in map(authoring.test_info, nb["cells"]) if info}
        best = max(stems, key=lambda s: len(ids & {e["exercise"] for e in authoring.exercises(self.notebooks[s])}))
        if ids & {e["exercise"] for e in authoring.exercises(self.notebooks[best])}:
            return best
        return None


def assemble(submission, official) -> dict:
    """The submission's own cells with the official test cells put back (see module docstring)."""
    nb = copy.deepcopy(submission)
    groups: dict[str, list] = {}
    for cell in official["cells"]:
        info = authoring.test_info(cell)
        if info:
            groups.setdefault(info["exercise"], []).append(copy.deepcopy(cell))
    order = list(groups)
    kept, anchor = [], {}
    for cell in nb["cells"]:
        info = authoring.test_info(cell)
        if info is None:
            if cell.get("cell_type") == "code":
                cell["outputs"], cell["execution_count"] = [], None
            kept.append(cell)
        elif info["exercise"] in groups:
            anchor[info["exercise"]] = len(kept)  # the last copy wins (a duplicate moved up is ignored)
    # Exercises whose tests were deleted go just before the next exercise's tests (or at the end).
    position, next_pos = {}, len(kept)
    for ex in reversed(order):
        position[ex] = anchor.get(ex, next_pos)
        next_pos = position[ex]
    cells = []
    for i in range(len(kept) + 1):
        for ex in order:
            if position[ex] == i:
                for c in groups[ex]:
                    c["outputs"], c["execution_count"] = [], None
                    cells.append(c)
        if i < len(kept):
            cells.append(kept[i])
    for n, c in enumerate(cells):  # unique ids (students duplicate cells)
        c["id"] = authoring.cell_id("graded", n)
    nb["cells"] = cells
    nb.setdefault("metadata", {})["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                                   "language": "python"}
    return nb


def answer_names(official) -> list[str]:
    """The names the answer regions of a solution notebook define at the top of their cells (functions, classes,
    variables): what a test cell calls, so what must not be the course's own answer (`kernel_guard`)."""
    names: set[str] = set()
    for cell in official["cells"]:
        if not authoring.has_solution(cell):
            continue
        try:
            tree = ast.parse(nbio.source(cell))
        except SyntaxError:              # a cell magic: nothing to look at
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return sorted(names)


def guard_plan(assembled, official) -> dict:
    """For `kernel_guard.install`: each code cell of ``assembled`` by the hash of its source, with the exercises
    whose references it refuses (a test cell of X: X's; a learner's cell: those of every exercise tested after it,
    recorded only), the answer names of the lesson, and its exercise ids."""
    cells: dict[str, dict] = {}
    later: set[str] = set()
    for cell in reversed(assembled["cells"]):
        if cell.get("cell_type") != "code":
            continue
        info = authoring.test_info(cell)
        key = kernel_guard.cell_key(nbio.source(cell))
        if info:
            later.add(info["exercise"])
            cells[key] = {"test": True, "exercise": info["exercise"], "guarded": [info["exercise"]]}
        elif not cells.get(key, {}).get("test"):     # a learner's copy of a test cell's source stays a test
            guarded = set(later) | set(cells.get(key, {}).get("guarded", []))
            cells[key] = {"test": False, "exercise": None, "guarded": sorted(guarded)}
    return {"cells": cells, "answers": answer_names(official), "lesson": sorted(later)}


# ----------------------------------------------------------------------------------------- scoring

def score(nb, record: dict) -> list[dict]:
    """Per exercise: {exercise, points, max, status} from the runner's record of every cell, and ``hidden_test``:
    True where the first test cell that did not pass is a hidden one (`feedback` then keeps its message back)."""
    by_index = {c["index"]: c for c in record.get("cells", [])}
    rows: dict[str, dict] = {}
    since_last_test: list[dict] = []  # student cells between the previous test cell and this one
    span: dict[str, list[dict]] = {}
    for i, cell in enumerate(nb["cells"]):
        info = authoring.test_info(cell)
        entry = by_index.get(i)
        if info is None:
            if entry:
                since_last_test.append(entry)
            continue
        ex = info["exercise"]
        row = rows.setdefault(ex, {"exercise": ex, "points": 0.0, "max": 0.0, "status": None, "tests": []})
        row["max"] += info["points"]
        row["tests"].append({**(entry or {"index": i, "status": "not-run", "ename": "", "evalue": ""}),
                             "hidden": info["hidden"]})
        span.setdefault(ex, []).extend(since_last_test)
        since_last_test = []
    refused = _refused(record)
    for ex, row in rows.items():
        tests = row.pop("tests")
        row["status"] = refused.get(ex) or _status(tests, span.get(ex, []), record)
        row["points"] = row["max"] if row["status"] == "passed" else 0.0
        first_bad = next((t for t in tests if t["status"] not in ("ok", "skipped")), None)
        if row["status"] != "passed" and first_bad is not None and first_bad["hidden"]:
            row["hidden_test"] = True   # the status may hold a hidden test's expected value: not for students
    return list(rows.values())


def _refused(record: dict) -> dict[str, str]:
    """exercise -> 'refused: X calls M, the course's answer: write your own', for every exercise whose references
    the learner's code called (recorded by the kernel's guard, or in an error's text, e.g. a rank's)."""
    out: dict[str, str] = {}
    for cell in record.get("cells", []):
        found = [tuple(r) for r in cell.get("refused", [])]
        found += reference.MESSAGE_RE.findall(cell.get("evalue", ""))
        for exercise, name in found:
            out.setdefault(exercise, f"refused: {reference.message(exercise, name)}")
    return out


def _limit_hit(cell: dict, caps: dict | None) -> str | None:
    """The sandbox's cap a cell ran into: counted by its cgroup, or (rlimits) told by the failed allocation."""
    if not caps:
        return None
    cap = cell.get("limit")
    if caps["via"] == "rlimit" and (cell["ename"] == "MemoryError" or "can't allocate memory" in cell["evalue"]):
        cap = "memory"
    if cap == "memory":
        return f"memory limit ({caps['memory_mb']} MB) reached"
    if cap == "processes":
        return f"process limit ({caps['max_procs']} processes and threads) reached"
    return None


def _status(tests: list[dict], student_cells: list[dict], record: dict) -> str:
    caps = record.get("caps")
    for cell in student_cells:  # the student's own cells for this exercise
        if hit := _limit_hit(cell, caps):
            return hit
        if cell["status"] == "timeout":
            return "timeout: your code cell ran longer than the per-cell limit"
        if cell["status"] == "died":
            return "kernel died (in your code cell: sys.exit/os._exit/crash?)"
    for t in tests:
        st = t["status"]
        if hit := _limit_hit(t, caps):
            return hit
        if st in ("ok", "skipped"):      # skipped: an earlier test cell of the exercise failed (returned below)
            continue
        if st == "timeout":
            return "timeout: a test cell ran longer than the per-cell limit"
        if st == "died":
            return "kernel died (exit, os._exit, crash or out of memory while testing)"
        if st == "not-run" and not record.get("done"):
            return "error: the grading runner was stopped before this test ran (killed by the submission?)"
        if st == "not-run":
            return "timeout: total time limit reached before this test ran"
        ename, evalue = t.get("ename", ""), t.get("evalue", "")
        if ename == "NotImplementedError" or "NotImplementedError" in evalue:
            return "not implemented"
        stub = next((c for c in student_cells if c["status"] == "error"), None)
        if stub and ename == "NameError":  # the code cell that defines the name failed first
            if stub["ename"] == "NotImplementedError":
                return "not implemented"
            first = stub["evalue"].strip().splitlines()[0] if stub["evalue"].strip() else ""
            return f"error: your code cell failed: {stub['ename']}: {_one_line(first)}"
        if ename == "SystemExit":
            return "error: SystemExit (the code called sys.exit or exit)"
        if ename == "KeyboardInterrupt":
            return "error: KeyboardInterrupt raised by the code"
        if ename == "CheckFailed":
            return f"failed: {_one_line(evalue)}"
        if ename == "AssertionError":
            return f"failed: {_one_line(evalue) or 'assertion failed'}"
        first = evalue.strip().splitlines()[0] if evalue.strip() else ""
        return f"error: {ename}: {_one_line(first)}" if first else f"error: {ename}"
    return "passed"


# ----------------------------------------------------------------------------------------- running

def _sandboxing(sandboxed: bool | None, limits: sandbox.Limits | None) -> tuple[dict | None, str]:
    """(the caps the runner is given, None when not sandboxed; the line for the results)."""
    why = "turned off (--no-sandbox)" if sandboxed is False else sandbox.unavailable()
    if why and sandboxed:
        raise GraderError(f"the sandbox was asked for but cannot run here: {why}")
    if why:
        return None, f"off: {why}"
    limits = limits or sandbox.Limits()
    via = sandbox.caps_via()
    caps = {**limits.as_dict(), "via": via}
    return caps, f"bubblewrap, {sandbox.describe(limits, via)}"


def _run(assembled, workdir: Path, cell_timeout: float, total_timeout: float, output_limit: int,
         caps: dict | None = None, hidden: tuple[Path, ...] = (), warm_ranks: bool = False,
         guard: dict | None = None) -> dict:
    """Run the runner on ``assembled`` in ``workdir``: in the sandbox with ``caps`` (see `_sandboxing`), where
    the folders ``hidden`` must not be visible, or plainly when ``caps`` is None; ``guard``: `guard_plan`'s."""
    nbio.write(assembled, workdir / "graded.ipynb")
    tag = procs.new_tag("grade")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    # COURSE_POOL=0: every run of a graded notebook starts fresh ranks. Warm ranks would carry what a student's
    # own run did to them (a patched torch function) into the runs of the official test cells. Only notebooks
    # the course wrote itself may share warm ranks (`warm_ranks`), at most 4 kept (the sandbox's memory cap).
    pool_env = {"COURSE_POOL": "1", "COURSE_POOL_MAX_RANKS": "4"} if warm_ranks else {"COURSE_POOL": "0"}
    env.update({procs.TAG_VAR: tag, "MPLBACKEND": "Agg", "COURSE_RUNS_DIR": str(workdir / "runs"), **pool_env,
                "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p),
                "PYDEVD_DISABLE_FILE_VALIDATION": "1", "JUPYTER_PLATFORM_DIRS": "1"})
    cmd = [sys.executable, "-m", "course_lib.grading.runner", str(workdir / "plan.json")]
    cgroup, cpu_s = None, None
    if caps is not None:
        try:
            cmd = sandbox.command(cmd, workdir, hidden=list(hidden))
            if caps["via"] != "rlimit":
                cgroup = sandbox.Cgroup(workdir.name, sandbox.Limits.from_dict(caps), caps["via"])
                cmd = cgroup.enter + cmd
        except (sandbox.SandboxError, OSError) as exc:
            raise GraderError(f"cannot set up the sandbox: {exc}") from None
        env = sandbox.environment(env)
    log = workdir / "runner.log"
    # The runner writes its record through an inherited descriptor of a file no path leads to: a file in the
    # (writable) temp folder could be forged by the submission.
    try:
        with tempfile.TemporaryFile() as record_file, open(log, "wb") as out:
            plan = {"notebook": str(workdir / "graded.ipynb"), "workdir": str(workdir),
                    "record_fd": record_file.fileno(), "cell_timeout": cell_timeout, "total_timeout": total_timeout,
                    "output_limit": output_limit, "caps": caps, "guard": guard}
            (workdir / "plan.json").write_text(json.dumps(plan))
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(record_file.fileno(),))
            hard_limit = total_timeout + cell_timeout + 60  # the runner enforces total_timeout itself
            try:
                proc.wait(timeout=hard_limit)
            except subprocess.TimeoutExpired:
                pass
            finally:
                procs.kill_tree(proc.pid, tag=tag, grace_s=0.5)
                proc.wait()
            record_file.seek(0)
            text = record_file.read().decode(errors="replace")
    finally:
        if cgroup is not None:
            cpu_s = cgroup.cpu_seconds()
            cgroup.close()
    left = procs.alive(tag)
    try:  # the last record written, maybe followed by the tail of a longer one before it (see runner.save)
        record = json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        record = None
    if record is None:
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        raise GraderError(f"the grading runner produced no record (exit code {proc.returncode}):\n{tail}")
    record["runner_exit"] = proc.returncode
    record["left_behind"] = len(left)
    record["cpu_seconds"] = round(cpu_s, 2) if cpu_s is not None else None   # counted by the cgroup
    return record


def grade_submission(path: str | Path, solutions: Solutions | str | Path = "solutions", *,
                     cell_timeout: float = DEFAULT_CELL_TIMEOUT, total_timeout: float = DEFAULT_TOTAL_TIMEOUT,
                     output_limit: int = DEFAULT_OUTPUT_LIMIT, keep: bool = False, sandboxed: bool | None = None,
                     limits: sandbox.Limits | None = None, warm_ranks: bool = False,
                     only: list[str] | None = None) -> dict:
    """Grade one notebook. Returns {submission, lesson, status, points, max, exercises: [...], sandbox, ...}.

    ``status`` is ``graded`` or ``unreadable`` (with ``error``). ``sandboxed``: None runs the submission in
    the sandbox where it can run (``sandbox`` in the result says ``off: <why>`` where not), True requires it,
    False turns it off. ``limits``: its caps (default `sandbox.Limits()`). ``warm_ranks=True`` lets the
    notebook's runs share warm ranks (`course_lib.runtime.pool`), as in a learner's own kernel: only for notebooks the
    course wrote (tests/test_grading.py grades the solutions and their generated student copies so); a
    submission's own runs could leave state in warm ranks for the official tests' runs, so `course grade` never
    sets it. ``only``: grade just these exercises (a regrade, `course_lib.grading.regrade`); the result then
    lists them only and says so in ``only``. Raises `GraderError` when the grader itself fails.
    """
    path = Path(path)
    if not isinstance(solutions, Solutions):
        solutions = Solutions(solutions)
    caps, sandbox_line = _sandboxing(sandboxed, limits)
    result = {"submission": str(path), "lesson": None, "status": "graded", "points": 0.0, "max": 0.0,
              "exercises": [], "warnings": [], "sandbox": sandbox_line}
    try:
        sub = nbio.read(path)
    except nbio.NotebookError as exc:
        return {**result, "status": "unreadable", "error": str(exc)}
    lesson = solutions.match(sub, path)
    if lesson is None:
        return {**result, "status": "unreadable",
                "error": f"{path}: cannot tell which lesson this is (no matching notebook in {solutions.folder})"}
    official = solutions.notebooks[lesson]
    assembled = assemble(sub, official)
    try:                                                    # what it wrote, for the similarity report
        result["answers"] = similarity.learner_code(assembled, official, lesson)
    except Exception as exc:  # noqa: BLE001 - the grade does not depend on it
        result["warnings"].append(f"its code could not be read for the similarity report: {exc}")
    if only:
        try:
            assembled = regrade.select(assembled, list(only))
        except regrade.SelectionError as exc:
            raise GraderError(f"{path}: {exc}") from None
        result["only"] = list(only)
    workdir = Path(tempfile.mkdtemp(prefix=f"course-grade-{os.getpid()}-"))     # the pid: whose cgroup it is
    t0 = time.perf_counter()
    try:
        shutil.copyfile(path, workdir / "submission.ipynb")
        hidden = (solutions.folder, path.parent, Path.home())
        record = _run(assembled, workdir, cell_timeout, total_timeout, output_limit, caps, hidden, warm_ranks,
                      guard_plan(assembled, official))
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    rows = score(assembled, record)
    changed = solutions.changed()
    if changed:
        result["warnings"].append(f"official notebooks changed while grading this submission: {changed} "
                                  f"(this grade used the snapshot taken before; check {solutions.folder})")
    if record.get("left_behind"):
        result["warnings"].append(f"{record['left_behind']} process(es) survived the clean-up")
    result.update(lesson=lesson, exercises=rows, points=sum(r["points"] for r in rows),
                  max=sum(r["max"] for r in rows), seconds=round(time.perf_counter() - t0, 2),
                  run_seconds=record.get("seconds"), cpu_seconds=record.get("cpu_seconds"),
                  kernel_start_s=record.get("kernel_start_s"),
                  restarts=record.get("restarts", 0), runner_max_rss_mb=record.get("max_rss_mb"),
                  memory_peak_mb=record.get("memory_peak_mb"), workdir=str(workdir) if keep else None)
    if record.get("replay_error"):
        result["warnings"].append(f"after a kernel restart the set-up could not be replayed: {record['replay_error']}")
    return result


def find_submissions(paths: list[str | Path]) -> list[Path]:
    """Expand folders (a class) into their notebooks, sorted; files are taken as given."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            out.append(p)
    return out


def student_name(path: Path, roots: list[Path]) -> str:
    for root in roots:
        if root.is_dir():
            try:
                rel = path.relative_to(root)
            except ValueError:
                continue
            return rel.parts[0] if len(rel.parts) > 1 else rel.stem
    return path.stem


# ------------------------------------------------------------------------------------------ output

def table(results: list[dict]) -> str:
    lines = []
    for res in results:
        head = f"== {res['submission']}"
        if res["status"] != "graded":
            lines += [head, f"   UNREADABLE: {res.get('error', '')}", ""]
            continue
        lines.append(f"{head}  (lesson {res['lesson']}, {res['points']:g}/{res['max']:g} points, "
                     f"{res.get('seconds', 0):.1f} s)")
        width = max([len("exercise")] + [len(r["exercise"]) for r in res["exercises"]])
        lines.append(f"   {'exercise':<{width}}  {'points':>6}  {'max':>4}  status")
        for r in res["exercises"]:
            lines.append(f"   {r['exercise']:<{width}}  {r['points']:>6g}  {r['max']:>4g}  {r['status']}")
        lines += [f"   warning: {w}" for w in res.get("warnings", [])]
        lines.append("")
    return "\n".join(lines)


def write_json(results: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps(results, indent=1) + "\n")


def exercise_columns(results: list[dict]) -> list[str]:
    """The exercises of ``results`` in the order they first appear: the CSVs' columns."""
    return list(dict.fromkeys(r["exercise"] for res in results for r in res["exercises"]))


def write_csv(results: list[dict], path: str | Path) -> None:
    """One row per submission (student): total, max, status, each exercise's points and the sandbox; where the
    class's similarity was computed, its highest score and its flags (`similarity.csv_cells`: no points change)."""
    exercises = exercise_columns(results)
    sim = any("similarity" in res for res in results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "submission", "lesson", "points", "max", "status", *exercises, "sandbox",
                    *(["similarity", "flagged"] if sim else [])])
        for res in results:
            pts = {r["exercise"]: r["points"] for r in res["exercises"]}
            w.writerow([res.get("student", Path(res["submission"]).stem), res["submission"], res["lesson"] or "",
                        res["points"], res["max"], res["status"], *(pts.get(e, "") for e in exercises),
                        res.get("sandbox", ""), *(similarity.csv_cells(res) if sim else ())])
