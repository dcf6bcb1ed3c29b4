"""Tests of `course build` and `course grade` (docs/GRADING.md).

The expensive part, running notebooks, happens once in the module fixture `graded`: every solution and
exercise notebook of the course, the fixture lesson's wrong and hostile submissions, and lesson-00
submissions are graded concurrently (3 at a time; most of the time is kernels and torchrun starting).
The individual tests then only read the results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import psutil
import pytest

from course_lib import reference
from course_lib.runtime import procs
from course_lib.grading import build as gbuild
from course_lib.grading import commands, grade
from course_lib import notebook as nbio
from course_lib.grading import authoring
from course_lib.grading.check import CheckFailed, check_close, check_equal, check_shape, check_true

# Grades every notebook of the course: minutes (`course.py test --fast` leaves it out). The module fixture grades the
# 12 solutions, their generated exercises and their cheating copies in one setup, which the global 900-s timeout
# (pyproject.toml) would cut on a slower 2-core machine (an Intel Xeon run of this wave needed more than 900 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
FIX = ROOT / "tests" / "fixtures" / "grading"
FX_SOLUTIONS = FIX / "solutions"
EXPECTED_WRONG = json.loads((FIX / "expected_wrong.json").read_text())
sys.path.insert(0, str(FIX))
from cheats import CHEATS  # noqa: E402 - answers that call the course's own implementation of their exercise
TAG_PREFIX = f"grade-{os.getpid()}-"  # procs.new_tag("grade") in this process
# Lessons whose solution (full marks) and generated exercise (zero) are graded here. Lesson 00 by default,
# to keep this file at a few minutes on 2 cores; CI sets COURSE_GRADE_LESSONS=all (docs/GRADING.md).
_WANTED = os.environ.get("COURSE_GRADE_LESSONS", "00_getting_started")
LESSONS = sorted(p.stem for p in SOLUTIONS.glob("*.ipynb")
                 if _WANTED == "all" or p.stem in _WANTED.split(","))


def leftovers() -> list[psutil.Process]:
    """Processes started by a grading in this test process that are still alive."""
    return procs.tagged_processes(TAG_PREFIX, prefix=True)


# -------------------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grading")
    tamper_solutions = tmp / "tamper_solutions"
    shutil.copytree(FX_SOLUTIONS, tamper_solutions)
    outside = tmp / "outside" / "escaped.txt"
    outside.parent.mkdir()
    before = {"repo": authoring.tree_hash(SOLUTIONS), "fixture": authoring.tree_hash(FX_SOLUTIONS)}
    os.environ["GRADING_FIXTURE_OUTSIDE"] = str(outside)
    os.environ["GRADING_FIXTURE_TAMPER"] = str(tamper_solutions / "fx_basics.ipynb")

    # loop_print_fork's infinite loops must time out fast; the other hostile notebooks loop nowhere, and one CI run
    # (2026-12-03) saw a trivial cell of hostile/exits.ipynb exceed a 10-s timeout right after the kernel restart
    # its os._exit forces (that notebook grades in 37 s alone): they get a timeout no honest cell of theirs reaches.
    fast = dict(cell_timeout=10, total_timeout=120)
    no_loops = dict(cell_timeout=60, total_timeout=300)
    # The course's own notebooks (no student code) share warm ranks, as in a learner's kernel: the solutions and
    # their stubs grade in about half the time. Every submission a student could write (hostile/, lesson00/, the
    # CLI's class) is graded as `course grade` does, each run on fresh ranks.
    course_notebook = dict(cell_timeout=600, total_timeout=1800, warm_ranks=True)
    jobs = {}
    for stem in LESSONS:
        jobs[f"solution:{stem}"] = (SOLUTIONS / f"{stem}.ipynb", SOLUTIONS, dict(course_notebook))
    # The student copies as `course build` generates them now (committed staleness: test_build_check_*).
    (tmp / "exercises").mkdir()
    (tmp / "cheats").mkdir()
    for name, text in gbuild.expected_files(SOLUTIONS).items():
        if Path(name).stem not in LESSONS:
            continue
        (tmp / "exercises" / name).write_text(text)
        jobs[f"exercise:{Path(name).stem}"] = (tmp / "exercises" / name, SOLUTIONS, dict(course_notebook))
        if Path(name).stem in CHEATS:     # the student copy with answers that call the course's own (cheats.py)
            nbio.write(cheating_copy(nbformat.reads(text, as_version=4), CHEATS[Path(name).stem]),
                       tmp / "cheats" / name)
            jobs[f"cheat:{Path(name).stem}"] = (tmp / "cheats" / name, SOLUTIONS, dict(course_notebook))
    for nb in sorted((FIX / "hostile").glob("*.ipynb")):
        sols = tamper_solutions if nb.stem == "tamper" else FX_SOLUTIONS
        jobs[f"hostile:{nb.stem}"] = (nb, sols, fast if nb.stem == "loop_print_fork" else no_loops)
    jobs["lesson00:missing_all_reduce"] = (FIX / "lesson00" / "missing_all_reduce.ipynb", SOLUTIONS,
                                           dict(cell_timeout=300, total_timeout=600))
    jobs["lesson00:hanging_rank"] = (FIX / "lesson00" / "hanging_rank.ipynb", SOLUTIONS,
                                     dict(cell_timeout=30, total_timeout=300))

    def cli_class():
        """The CLI, once: the whole `wrong/` folder graded as one class, with JSON and CSV. One submission at a time
        (`--jobs 1`): the 3 threads below already share 2 cores, and the hostile notebooks' 10-s cell timeouts
        must only fire on their own loops (with the CLI's default of 2 jobs, one CI run timed out a cell of
        hostile/exits.ipynb that passes in 38 s alone). tests/test_grading_scale.py tests --jobs 2."""
        out_json, out_csv = tmp / "class.json", tmp / "class.csv"
        proc = subprocess.run([sys.executable, "-m", "course_lib.grading.commands", "grade", str(FIX / "wrong"),
                               "--solutions", str(FX_SOLUTIONS), "--cell-timeout", "20", "--jobs", "1",
                               "--json", str(out_json), "--csv", str(out_csv)],
                              capture_output=True, text=True, timeout=900, cwd=ROOT)
        return proc, out_json, out_csv

    try:
        with ThreadPoolExecutor(3) as pool:
            cli = pool.submit(cli_class)
            futures = {k: pool.submit(grade.grade_submission, p, s, **kw) for k, (p, s, kw) in jobs.items()}
            results = {k: f.result() for k, f in futures.items()}
            proc, out_json, out_csv = cli.result()
    finally:
        os.environ.pop("GRADING_FIXTURE_OUTSIDE", None)
        os.environ.pop("GRADING_FIXTURE_TAMPER", None)
    after = {"repo": authoring.tree_hash(SOLUTIONS), "fixture": authoring.tree_hash(FX_SOLUTIONS)}
    for k, r in sorted(results.items()):
        print(f"{k:40s} {r['points']:g}/{r['max']:g}  {r.get('seconds', 0):.1f} s  "
              f"(runner {r.get('run_seconds')} s, {r.get('restarts')} restarts, rss {r.get('runner_max_rss_mb')} MB)")
    return {"results": results, "cli": proc, "class_json": out_json, "class_csv": out_csv,
            "before": before, "after": after, "outside": outside, "tamper_solutions": tamper_solutions,
            "leftovers": leftovers()}


def cheating_copy(nb, cheats: dict) -> dict:
    """A student copy where each exercise of ``cheats`` gets a code cell, just before its first test cell, that
    defines its answer by calling the course's own implementation."""
    cells, done = [], set()
    for cell in nb.cells:
        info = authoring.test_info(cell)
        if info and info["exercise"] in cheats and info["exercise"] not in done:
            done.add(info["exercise"])
            cells.append(nbformat.v4.new_code_cell(cheats[info["exercise"]][0]))
        cells.append(cell)
    assert done == set(cheats), f"no test cells for {sorted(set(cheats) - done)}"
    nb.cells = cells
    return nb


def statuses(res: dict) -> dict[str, str]:
    return {r["exercise"]: r["status"] for r in res["exercises"]}


def points(res: dict) -> dict[str, float]:
    return {r["exercise"]: r["points"] for r in res["exercises"]}


# ---------------------------------------------------------------------------- the course notebooks

def test_every_solution_scores_full_marks(graded):
    sols = {k: v for k, v in graded["results"].items() if k.startswith("solution:")}
    assert sols, "no solution notebooks found"
    for name, res in sols.items():
        assert res["status"] == "graded", name
        assert res["max"] > 0 and res["points"] == res["max"], (name, statuses(res))
        assert not res["warnings"], (name, res["warnings"])


def test_every_exercise_scores_zero_not_implemented(graded):
    exs = {k: v for k, v in graded["results"].items() if k.startswith("exercise:")}
    assert len(exs) == len(LESSONS) >= 1
    for name, res in exs.items():
        assert res["points"] == 0 and res["max"] > 0, name
        assert set(statuses(res).values()) == {"not implemented"}, (name, statuses(res))
        assert not res["warnings"], (name, res["warnings"])


def test_an_answer_that_calls_the_course_answer_scores_zero_with_the_reason(graded):
    """Every lesson: each exercise whose answer calls the course's own implementation (alias, partial, getattr,
    subclass, wrapper, lambda, exec, a table computed ahead of the tests; in the kernel and in torchrun ranks) scores
    zero with the one-line reason; every other exercise of the copy is still graded on its own (a stub)."""
    cheats = {k.split(":", 1)[1]: v for k, v in graded["results"].items() if k.startswith("cheat:")}
    assert set(cheats) == set(LESSONS) & set(CHEATS)
    for stem, res in cheats.items():
        got = statuses(res)
        for exercise, status in got.items():
            if exercise not in CHEATS[stem]:
                assert status == "not implemented", (stem, exercise, status)
                continue
            names = CHEATS[stem][exercise][1]
            assert status in {f"refused: {reference.message(exercise, n)}" for n in names}, (stem, exercise, status)
        assert res["points"] == 0 and not res["warnings"], (stem, res["warnings"])


def test_build_check_passes_on_the_repo():
    assert gbuild.build(SOLUTIONS, EXERCISES, check=True) == []
    assert commands.main(["build", "--check", "--solutions", str(SOLUTIONS), "--exercises", str(EXERCISES)]) == 0


def test_build_check_fails_on_a_stale_copy(tmp_path, capsys):
    sols, exs = tmp_path / "solutions", tmp_path / "exercises"
    shutil.copytree(SOLUTIONS, sols)
    shutil.copytree(EXERCISES, exs)
    nb = next(sols.glob("*.ipynb"))
    sol = nbio.read(nb)
    sol.cells.insert(0, nbformat.v4.new_markdown_cell("a new paragraph", id="new-paragraph"))
    nbio.write(sol, nb)
    (exs / "99_orphan.ipynb").write_text(nbio.dumps(nbformat.v4.new_notebook()))
    args = ["build", "--check", "--solutions", str(sols), "--exercises", str(exs)]
    assert commands.main(args) == 1
    out = capsys.readouterr().out
    assert nb.name in out and "99_orphan.ipynb" in out
    assert commands.main(["build", "--solutions", str(sols), "--exercises", str(exs)]) == 0
    (exs / "99_orphan.ipynb").unlink()
    assert commands.main(args) == 0


def test_build_output_is_a_clean_deterministic_student_copy(tmp_path):
    for path in SOLUTIONS.glob("*.ipynb"):
        text = (EXERCISES / path.name).read_text()
        assert text == gbuild.expected_files(SOLUTIONS)[path.name]  # deterministic
        ex = nbformat.reads(text, as_version=4)
        sol = nbio.read(path)
        assert authoring.BEGIN not in text and authoring.END not in text
        assert not any(authoring.test_info(c)["hidden"] for c in ex.cells if authoring.is_test(c))
        for c in ex.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None
        n_regions = sum(nbio.source(c).count(authoring.BEGIN) for c in sol.cells)
        assert text.count("raise NotImplementedError(") == n_regions > 0
        visible = [c for c in sol.cells if not (authoring.is_test(c) and authoring.test_info(c)["hidden"])]
        assert len(ex.cells) == len(visible)
        for a, b in zip(visible, ex.cells):  # everything but the answers is kept
            if not authoring.has_solution(a):
                assert a.source == b.source and a.metadata.get("course") == b.metadata.get("course")


def test_strip_solution_keeps_indentation_and_names_the_hint_call():
    src = ("def f(x):\n    ### BEGIN SOLUTION\n    ### HINT 1: x, twice\n    ### HINT 2: the + operator\n"
           "    return x + x\n    ### END SOLUTION\n\ny = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\nprint(y)")
    out = authoring.strip_solution(src, exercise="09-double")
    stub = authoring.stub_message("09-double")
    assert out == (f'def f(x):\n    raise NotImplementedError({json.dumps(stub)})\n\ny = 1\n'
                   f'raise NotImplementedError({json.dumps(stub)})\nprint(y)')
    assert "hint('09-double')" in stub and "twice" not in out and "operator" not in out
    assert authoring.hints_of(src) == [["x, twice"], ["the + operator"]]
    assert "GENERIC" not in authoring.strip_solution("### BEGIN SOLUTION\nx=1\n### END SOLUTION")
    for bad in ("### BEGIN SOLUTION\nx", "### END SOLUTION", "### BEGIN SOLUTION\n### BEGIN SOLUTION\n"):
        with pytest.raises(nbio.NotebookError):
            authoring.strip_solution(bad)


def test_hints_come_in_two_steps_and_never_hold_the_solution(capsys):
    """Every exercise with an answer region has a first and a second hint; no line of its answer is in them; hint()
    shows one step per call."""
    from course_lib.grading.hints import hint
    hints = json.loads(gbuild.expected_hints(SOLUTIONS))
    assert hints == json.loads(gbuild.HINTS_FILE.read_text())
    for path in SOLUTIONS.glob("*.ipynb"):
        nb = nbio.read(path)
        for i, ex in gbuild.answer_exercises(nb).items():
            assert all(hints[ex]), f"{path.name}: {ex} needs a ### HINT 1 and a ### HINT 2"
            src = nbio.source(nb.cells[i])
            body = src[src.index(authoring.BEGIN):src.rindex(authoring.END)]
            for line in body.splitlines():
                code = line.strip()
                if len(code) > 12 and not code.startswith("#"):
                    assert code not in " ".join(hints[ex]), f"{ex}: the hint holds the answer line {code!r}"
    first, second, third = (hint("02-ring-all-reduce") for _ in range(3))
    assert first.startswith("hint 1 of 2") and second.startswith("hint 2 of 2") and "no more hints" in third
    with pytest.raises(KeyError, match="no exercise"):
        hint("99-nothing")


# ------------------------------------------------------------------------------------------ checks

def test_check_messages_are_one_line_and_reveal_only_the_expected_value():
    check_close("close", [1.0, 2.0], (1.0, 2.0 + 1e-9))
    check_equal("equal", 3, 3)
    check_true("true", 1 < 2)
    check_shape("shape", [[1, 2, 3], [4, 5, 6]], (2, 3))
    with pytest.raises(CheckFailed) as e:
        check_close("loss after 3 steps", 2.5, 2.0, rtol=1e-6, hint="average, not sum")
    msg = str(e.value)
    assert isinstance(e.value, AssertionError) and "\n" not in msg
    assert "loss after 3 steps" in msg and "expected 2.0" in msg and "got 2.5" in msg and "average, not sum" in msg
    with pytest.raises(CheckFailed) as e:
        check_equal("quiz", 41, 42, reveal=False, hint="re-read")
    assert "42" not in str(e.value) and "41" not in str(e.value) and "wrong value" in str(e.value)
    with pytest.raises(CheckFailed, match=r"expected shape \(2, 4\), got shape \(4, 2\)"):
        check_shape("split", [[0, 0]] * 4, (2, 4))
    with pytest.raises(CheckFailed, match="condition does not hold"):
        check_true("property", False)
    with pytest.raises(CheckFailed, match="expected shape"):
        check_close("shape mismatch", [1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(CheckFailed):
        check_close("nan", float("nan"), 1.0)
    torch = pytest.importorskip("torch")
    check_close("tensor", torch.tensor([1.0, 2.0]), [1.0, 2.0])
    with pytest.raises(CheckFailed, match="got 12"):
        check_equal("tensor scalar", torch.tensor(12), 10)
    long = list(range(10_000))
    with pytest.raises(CheckFailed) as e:
        check_equal("long", long, long[::-1])
    assert len(str(e.value)) < 700


# ----------------------------------------------------------------------------------- assembling

def test_assemble_restores_official_tests_and_keeps_student_cells():
    official = nbio.read(FX_SOLUTIONS / "fx_basics.ipynb")
    sub = nbio.read(FIX / "hostile" / "edited_tests.ipynb")
    nb = grade.assemble(sub, official)
    official_tests = [c.source for c in official.cells if authoring.is_test(c)]
    got_tests = [c.source for c in nb.cells if authoring.is_test(c)]
    assert sorted(got_tests) == sorted(official_tests)  # hidden included, edits and duplicates gone
    assert any("tests? what tests" in c.source for c in nb.cells)  # student cells kept
    assert len({c.id for c in nb.cells}) == len(nb.cells)


# --------------------------------------------------------------------------------- wrong answers

@pytest.mark.parametrize("name", sorted(EXPECTED_WRONG))
def test_wrong_implementation_loses_exactly_its_exercise(graded, name):
    results = {Path(r["submission"]).stem: r for r in json.loads(graded["class_json"].read_text())}
    full = points(results["all_correct"])
    assert sum(full.values()) == results["all_correct"]["max"] > 0
    res, broken = results[name], EXPECTED_WRONG[name]
    assert res["points"] == res["max"] - full[broken], statuses(res)
    st = statuses(res)
    assert points(res)[broken] == 0
    assert st[broken].startswith(("failed: ", "error: ")), st[broken]
    assert all(v == "passed" for k, v in st.items() if k != broken), st
    if name == "quiz_wrong":
        assert "41" not in st[broken] and "42" not in st[broken] and "wrong value" in st[broken]


def test_cli_grades_a_class_with_table_json_and_csv(graded):
    proc = graded["cli"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exercise" in proc.stdout and "fx-mean" in proc.stdout and "failed: check 'mean" in proc.stdout
    rows = graded["class_csv"].read_text().strip().splitlines()
    n = len(list((FIX / "wrong").glob("*.ipynb")))
    assert len(rows) == n + 1 and rows[0].startswith("student,submission,lesson,points,max,status,fx-mean")
    assert any(r.startswith("all_correct,") and ",12.0,12.0,graded," in r for r in rows)


def test_lesson00_missing_all_reduce_fails_with_a_clear_message(graded):
    res = graded["results"]["lesson00:missing_all_reduce"]
    st = statuses(res)
    assert points(res) == {"00-partial-sum": 3, "00-distributed-sum": 0, "00-quiz": 1}, st
    assert st["00-distributed-sum"].startswith("failed: check 'sum of 1..10 on rank 0 of 2'")
    assert "all_reduce" in st["00-distributed-sum"]


def test_unreadable_submission_and_unknown_lesson(tmp_path, capsys):
    res = grade.grade_submission(FIX / "unreadable.ipynb", FX_SOLUTIONS)
    assert res["status"] == "unreadable" and "not a readable notebook" in res["error"]
    other = tmp_path / "zz_unknown.ipynb"
    nbio.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), other)
    assert grade.grade_submission(other, FX_SOLUTIONS)["status"] == "unreadable"
    assert commands.main(["grade", str(FIX / "unreadable.ipynb"), "--solutions", str(FX_SOLUTIONS)]) == 1
    assert commands.main(["grade", str(other), "--solutions", str(tmp_path / "nowhere")]) == 2


# -------------------------------------------------------------------------------------- hostile

def test_exits_and_interrupts_cost_only_their_exercise(graded):
    res = graded["results"]["hostile:exits"]
    st = statuses(res)
    assert st["fx-mean"].startswith("error: SystemExit")                # sys.exit()
    assert st["fx-chunk"].startswith("kernel died")                     # os._exit(1)
    assert st["fx-grad-avg"].startswith("error: KeyboardInterrupt")     # raise KeyboardInterrupt
    assert st["fx-bytes"].startswith("failed")                          # exit(): the kernel stops after the cell
    broken = {"fx-mean", "fx-chunk", "fx-grad-avg", "fx-bytes"}
    assert all(v == "passed" for k, v in st.items() if k not in broken), st
    assert res["points"] == res["max"] - 6 and res["restarts"] >= 2


def test_loop_print_fork_cost_only_their_exercise(graded):
    res = graded["results"]["hostile:loop_print_fork"]
    st = statuses(res)
    assert st["fx-mean"].startswith("timeout")      # infinite loop called by the test
    assert st["fx-ring"].startswith("timeout")      # infinite loop at the top level of a code cell
    assert st["fx-allreduce"].startswith("failed")  # printed 50 MB and returned the wrong thing
    assert st["fx-grad-avg"] == "passed"            # forked 20 sleeping children: killed afterwards
    assert all(v == "passed" for k, v in st.items() if k not in {"fx-mean", "fx-ring", "fx-allreduce"}), st
    assert res["runner_max_rss_mb"] < 150, "a 50 MB print must not reach the grader (about 70 MB without it)"
    assert len(json.dumps(res)) < 20_000


def test_edited_deleted_and_stripped_tests_change_nothing(graded):
    res = graded["results"]["hostile:edited_tests"]
    st = statuses(res)
    assert st["fx-mean"].startswith("failed: check 'mean")       # test cell deleted
    assert st["fx-chunk"].startswith("failed: check 'chunks")    # test cell replaced by `pass`
    assert st["fx-bytes"].startswith("failed: check 'Adam")      # test cell stripped of its metadata
    assert st["fx-quiz"] == "passed"                             # test cell duplicated at the top
    assert res["points"] == res["max"] - 5


def test_hanging_torchrun_rank_times_out_and_is_killed(graded):
    res = graded["results"]["lesson00:hanging_rank"]
    st = statuses(res)
    assert st["00-distributed-sum"].startswith("timeout"), st
    assert st["00-partial-sum"] == "passed" and st["00-quiz"] == "passed"


def sandboxed(res: dict) -> bool:
    return res["sandbox"].startswith("bubblewrap")  # else "off: <why>" (tests/test_sandbox.py covers the sandbox)


def test_writing_outside_fails_in_the_sandbox_and_official_tests_are_unchanged(graded):
    res = graded["results"]["hostile:outside"]
    if sandboxed(res):  # the path is not there (and not even in the sandbox's environment)
        assert points(res)["fx-mean"] == 0 and res["points"] == res["max"] - 1, statuses(res)
        assert not graded["outside"].exists()
    else:
        assert res["points"] == res["max"], statuses(res)
        assert graded["outside"].read_text() == "written by a submission"  # the documented limit: no sandbox
    assert graded["before"] == graded["after"]


def test_tampering_with_official_tests_is_detected_and_does_not_change_grades(graded):
    res = graded["results"]["hostile:tamper"]
    assert res["points"] == res["max"], statuses(res)
    if sandboxed(res):  # the official notebooks are out of its sight
        assert not res["warnings"] and (graded["tamper_solutions"] / "fx_basics.ipynb").read_text() != "{}"
    else:
        assert any("official notebooks changed" in w for w in res["warnings"])
        assert (graded["tamper_solutions"] / "fx_basics.ipynb").read_text() == "{}"


def test_no_process_is_left_behind(graded):
    assert graded["leftovers"] == []
    assert leftovers() == []
    for name, res in graded["results"].items():
        assert not any("survived" in w for w in res["warnings"]), name
