"""Grading a class at scale (issue 35; docs/GRADING.md, "A class at scale"): ``--jobs``, ``--shard`` and ``merge``,
``--feedback``, ``--exercise``, ``--lms-csv``, bad input refused before anything runs, Ctrl-C.

Every run grades the fixture lesson (`tests/fixtures/grading/solutions/fx_basics.ipynb`: no torch, about 2-3 s a
submission) so that the whole file stays near two minutes on 2 cores. One small class (module fixture `runs`) is
graded by the CLI three ways: ``--jobs 1``, ``--jobs 2``, and 3 shards as 3 processes; the tests then compare the
outputs byte for byte (timings removed) and read the feedback files.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from course_lib.runtime import procs
from course_lib.grading import commands, grade, jobs, regrade, shards
from course_lib import notebook as nbio
from course_lib.grading import authoring

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "grading"
FX_SOLUTIONS = FIX / "solutions"
CORRECT = FIX / "wrong" / "all_correct.ipynb"
HIDDEN_EXPECTED = "[[0, 0], [0, 0]]"       # the hidden fx-chunk test's expected value, as its check prints it
MARKER = "grading-scale-test-slow"
CLI = [sys.executable, "-m", "course_lib.grading.commands", "grade"]
COMMON = ["--solutions", str(FX_SOLUTIONS), "--cell-timeout", "60", "--memory-mb", "600", "--no-progress"]


def edited(old: str, new: str, src: Path = CORRECT):
    """The correct submission with one answer cell's text replaced."""
    nb = nbio.read(src)
    cell = next(c for c in nb.cells if old in nbio.source(c) and not authoring.is_test(c))
    cell.source = nbio.source(cell).replace(old, new)
    return nb


def insert_cell(nb, exercise: str, code: str):
    """``nb`` with a learner's code cell put just before the first test cell of ``exercise``."""
    import nbformat
    nb = copy.deepcopy(nb)
    at = next(i for i, c in enumerate(nb.cells) if (authoring.test_info(c) or {}).get("exercise") == exercise)
    nb.cells.insert(at, nbformat.v4.new_code_cell(code))
    return nb


def write_class(folder: Path) -> None:
    """alice (a folder, full marks, had seen 2 hints of fx-chunk), bob (fails fx-chunk's hidden test only), carol
    (wrong quiz), dave (hostile: os._exit in fx-mean's cell, a memory hog in fx-chunk's), eve (unreadable)."""
    import nbformat
    alice = nbio.read(CORRECT)
    answer = next(c for c in alice.cells if "def chunk_bounds" in nbio.source(c))
    answer.outputs = [nbformat.v4.new_output("stream", name="stdout",
                                             text="hint 1 of 2 for fx-chunk: a\nhint 2 of 2 for fx-chunk: b\n")]
    (folder / "alice").mkdir(parents=True)
    nbio.write(alice, folder / "alice" / "lesson.ipynb")
    nbio.write(edited("def chunk_bounds(n, rank, world_size):\n",
                      "def chunk_bounds(n, rank, world_size):\n    if n == 0:\n        return 7, 7\n"),
               folder / "bob.ipynb")
    nbio.write(edited("quiz_answer = 42", "quiz_answer = 41"), folder / "carol.ipynb")
    dave = edited("def mean(xs):", "import os\nos._exit(1)\ndef mean(xs):")
    dave = insert_cell(dave, "fx-chunk", "blocks = [bytearray(64 << 20) for _ in range(10_000)]")
    nbio.write(dave, folder / "dave.ipynb")
    shutil.copyfile(FIX / "unreadable.ipynb", folder / "eve.ipynb")


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args), *COMMON], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    klass = tmp / "class"
    write_class(klass)
    out = {}
    for name, n_jobs in (("j1", 1), ("j2", 2)):
        extra = ["--feedback", tmp / "fb"] if name == "j1" else []
        t0 = time.perf_counter()
        proc = cli(klass, "--jobs", n_jobs, "--json", tmp / f"{name}.json", "--csv", tmp / f"{name}.csv",
                   "--lms-csv", tmp / f"{name}-lms.csv", *extra)
        out[name] = {"proc": proc, "wall": time.perf_counter() - t0}
    shard_procs = [subprocess.Popen([*CLI, str(klass), "--shard", f"{k}/3", "--jobs", "1", "--json",
                                     str(tmp / f"part-{k}.json"), *COMMON], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=ROOT) for k in (1, 2, 3)]
    out["shards"] = [(p, *p.communicate(timeout=600)) for p in shard_procs]
    return {"tmp": tmp, "class": klass, **out}


def load(path: Path) -> list[dict]:
    return jobs.without_timings(json.loads(path.read_text()))


def by_student(results: list[dict]) -> dict[str, dict]:
    return {r["student"]: r for r in results}


def statuses(res: dict) -> dict[str, str]:
    return {r["exercise"]: r["status"] for r in res["exercises"]}


# ---------------------------------------------------------------------------------------- --jobs

def test_a_class_is_graded_and_one_broken_submission_does_not_stop_it(runs):
    proc = runs["j1"]["proc"]
    assert proc.returncode == 1, proc.stderr      # 1: eve's notebook cannot be read; every other one is graded
    assert "eve.ipynb cannot be graded" in proc.stderr
    res = by_student(load(runs["tmp"] / "j1.json"))
    assert list(res) == ["alice", "bob", "carol", "dave", "eve"]          # the sorted class, alice from her folder
    assert res["alice"]["points"] == res["alice"]["max"] == 12
    assert res["bob"]["points"] == 9 and statuses(res["bob"])["fx-chunk"].startswith("failed: check 'chunks of n=0")
    assert res["carol"]["points"] == 11 and statuses(res["carol"])["fx-quiz"].startswith("failed")
    assert res["eve"]["status"] == "unreadable"


def test_hostile_submission_graded_side_by_side_loses_only_its_exercises(runs):
    """dave's os._exit and memory hog ran next to the others (--jobs 2): they cost fx-mean and fx-chunk only."""
    res = by_student(load(runs["tmp"] / "j2.json"))
    st = statuses(res["dave"])
    assert st["fx-mean"].startswith("kernel died"), st
    assert st["fx-chunk"] in ("memory limit (600 MB) reached", "kernel died (in your code cell: sys.exit/os._exit/"
                              "crash?)") or st["fx-chunk"].startswith("error: MemoryError"), st
    assert all(v == "passed" for k, v in st.items() if k not in ("fx-mean", "fx-chunk")), st
    assert res["dave"]["points"] == 12 - 1 - 3
    assert res["alice"]["points"] == 12 and res["carol"]["points"] == 11


def test_jobs_2_gives_the_results_of_jobs_1_byte_for_byte(runs):
    tmp = runs["tmp"]
    assert runs["j2"]["proc"].returncode == 1, runs["j2"]["proc"].stderr
    assert "2 at a time (--jobs 2)" in runs["j2"]["proc"].stderr
    one, two = load(tmp / "j1.json"), load(tmp / "j2.json")
    assert json.dumps(one, indent=1) == json.dumps(two, indent=1)
    assert (tmp / "j1.csv").read_bytes() == (tmp / "j2.csv").read_bytes()
    assert (tmp / "j1-lms.csv").read_bytes() == (tmp / "j2-lms.csv").read_bytes()
    table = lambda out: [ln for ln in out.splitlines() if not ln.startswith("==")]  # noqa: E731 - the header has times
    assert table(runs["j1"]["proc"].stdout) == table(runs["j2"]["proc"].stdout)
    # what the comparison would catch: results in the order they finished, or with their timings
    raw = json.loads((tmp / "j1.json").read_text())
    assert json.dumps(jobs.without_timings(raw[::-1])) != json.dumps(one) and raw != one


def test_default_jobs_follows_cores_and_memory(monkeypatch):
    from course_lib.grading import sandbox

    class Mem:
        available = 64 << 30
    monkeypatch.setattr(procs, "usable_cores", lambda: 32)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    assert jobs.default_jobs(sandbox.Limits())[0] == 16                       # memory: 64 GB // 4 GB
    assert jobs.default_jobs(sandbox.Limits(memory_mb=1024))[0] == 32         # cores: 32 // 1
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert jobs.default_jobs(sandbox.Limits(memory_mb=1024, cpus=4))[0] == 8  # 32 cores // 4 CPUs each
    Mem.available = 1 << 30
    n, rule = jobs.default_jobs(sandbox.Limits())
    assert n == 1 and "1024 MB available // 4096 MB per submission" in rule


# ------------------------------------------------------------------------------------- shards

def test_three_shards_merged_equal_one_run(runs, tmp_path, capsys):
    tmp = runs["tmp"]
    for p, _, err in runs["shards"]:
        assert p.returncode in (0, 1), err
    parts = [json.loads((tmp / f"part-{k}.json").read_text()) for k in (1, 2, 3)]
    assert [[r["student"] for r in p["results"]] for p in parts] == [["alice", "dave"], ["bob", "eve"], ["carol"]]
    assert {p["shard"] for p in parts} == {"1/3", "2/3", "3/3"} and len({p["class_digest"] for p in parts}) == 1
    out = {k: tmp_path / f"merged.{k}" for k in ("json", "csv", "lms")}
    rc = commands.main(["grade", "merge", *(str(tmp / f"part-{k}.json") for k in (3, 1, 2)), "--json",
                        str(out["json"]), "--csv", str(out["csv"]), "--lms-csv", str(out["lms"]),
                        "--solutions", str(FX_SOLUTIONS)])
    assert rc == 1                                             # as the whole class: eve is unreadable
    assert not any("similarity" in r for p in parts for r in p["results"])   # a shard sees part of the class
    assert "similarity" in by_student(load(out["json"]))["alice"]            # merge compares the whole class
    assert json.dumps(load(out["json"])) == json.dumps(load(tmp / "j1.json"))
    assert out["csv"].read_bytes() == (tmp / "j1.csv").read_bytes()
    assert out["lms"].read_bytes() == (tmp / "j1-lms.csv").read_bytes()


def test_merge_refuses_a_missing_or_duplicated_submission_naming_the_student(runs, capsys):
    tmp = runs["tmp"]
    part = {k: str(tmp / f"part-{k}.json") for k in (1, 2, 3)}
    assert commands.main(["grade", "merge", part[1], part[2]]) == 2
    err = capsys.readouterr().err
    assert "not graded in any file given: carol" in err and "shard 3/3" in err
    assert commands.main(["grade", "merge", part[1], part[2], part[3], part[1]]) == 2
    err = capsys.readouterr().err
    assert "graded twice: alice" in err and "dave" in err
    assert commands.main(["grade", "merge", str(tmp / "j1.json")]) == 2       # a whole class's JSON is no shard
    assert "is not a shard's results" in capsys.readouterr().err
    assert commands.main(["grade", "merge", part[1], part[2], part[3]]) == 1    # the repo's solutions: no fx lesson
    err = capsys.readouterr().err                              # (1: eve is unreadable, as in the whole class)
    assert "the answers were not compared: no solution of lesson fx_basics" in err and "grades are written" in err


def test_shard_specs_are_validated_and_slices_are_balanced():
    assert shards.Shard.parse("2/3") == shards.Shard(2, 3)
    for bad, said in (("3/2", "K must be between 1 and N=2"), ("0/2", "K must be between 1"),
                      ("1/0", "N must be at least 1"), ("x", "give K/N")):
        with pytest.raises(shards.ShardError, match=said):
            shards.Shard.parse(bad)
    items = list(range(10))
    slices = [shards.Shard(k, 3).pick(items) for k in (1, 2, 3)]
    assert [len(s) for s in slices] == [4, 3, 3] and sorted(sum(slices, [])) == items


# ------------------------------------------------------------------------------------ feedback

def test_feedback_never_shows_a_hidden_expected_value_or_a_quiz_answer(runs):
    fb = runs["tmp"] / "fb"
    assert sorted(p.name for p in fb.iterdir()) == ["alice.md", "bob.md", "carol.md", "dave.md", "eve.md"]
    bob_json = statuses(by_student(load(runs["tmp"] / "j1.json"))["bob"])["fx-chunk"]
    assert HIDDEN_EXPECTED in bob_json                 # the instructor's JSON has it: the feedback must drop it
    bob = (fb / "bob.md").read_text()
    assert HIDDEN_EXPECTED not in bob and "[0, 0]" not in bob and "7, 7" not in bob
    assert "| fx-chunk | 0 / 3 | failed | a hidden test (run only when grading) did not pass" in bob
    assert "Hint: empty input gives empty chunks" in bob and "**9 of 12 points**" in bob
    carol = (fb / "carol.md").read_text()
    assert "42" not in carol and "41" not in carol
    assert "| fx-quiz | 0 / 1 | failed | check 'quiz answer' failed: wrong value. Hint: re-read the question |" in carol
    alice = (fb / "alice.md").read_text()
    assert "| fx-chunk | 3 / 3 | passed |  | 2 of 2 |" in alice and "| fx-mean | 1 / 1 | passed |  | 0 |" in alice
    dave = (fb / "dave.md").read_text()
    assert "| fx-mean | 0 / 1 | kernel died" in dave and "**8 of 12 points**" in dave
    assert "could not be graded" in (fb / "eve.md").read_text()


# ---------------------------------------------------------------------------------------- LMS CSV

def test_lms_csv_has_one_row_per_student_a_column_per_exercise_and_the_total(runs):
    rows = list(csv.reader((runs["tmp"] / "j1-lms.csv").open()))
    exercises = [r["exercise"] for r in by_student(load(runs["tmp"] / "j1.json"))["alice"]["exercises"]]
    assert rows[0] == ["student", *exercises, "total"]
    table = {r[0]: r[1:] for r in rows[1:]}
    assert list(table) == ["alice", "bob", "carol", "dave", "eve"]
    assert table["alice"] == ["1", "3", "2", "1", "1", "1", "1", "1", "1", "12"]
    assert table["bob"][exercises.index("fx-chunk")] == "0" and table["bob"][-1] == "9"
    assert table["eve"] == ["0"] * (len(exercises) + 1)
    old = list(csv.reader((runs["tmp"] / "j1.csv").open()))            # --csv keeps its columns
    assert old[0][:6] == ["student", "submission", "lesson", "points", "max", "status"]
    assert old[0][-3:] == ["sandbox", "similarity", "flagged"]          # then the class's similarity, at the end
    alice = dict(zip(old[0], old[1]))
    assert alice["similarity"] == "1.00" and "fx-shape: official solution 1.00" in alice["flagged"]
    assert dict(zip(old[0], old[-1]))["similarity"] == ""               # eve: unreadable, nothing compared


# ------------------------------------------------------------------------------------ regrades

def test_regrade_of_chosen_exercises_equals_the_full_grade_and_skips_the_slow_cell(tmp_path):
    """erin's fx-ring answer calls a helper defined in another exercise's cell, next to a 6 s cell; fx-mean is wrong.
    Grading fx-mean and fx-ring alone keeps the helper, skips the slow cell, and scores both as the full grade."""
    nb = edited("return 2 * (world_size - 1) / world_size", "return 2 * ring_helper(world_size) / world_size",
                src=FIX / "wrong" / "mean_sum.ipynb")
    nb = insert_cell(nb, "fx-chunk", "import time\ntime.sleep(6)")
    nb = insert_cell(nb, "fx-chunk", "def ring_helper(w):\n    return w - 1")
    path = tmp_path / "erin.ipynb"
    nbio.write(nb, path)
    full = grade.grade_submission(path, FX_SOLUTIONS, cell_timeout=60)
    proc = subprocess.run([*CLI, str(path), "--exercise", "fx-mean", "--exercise", "fx-ring", "--json",
                           str(tmp_path / "r.json"), *COMMON[:4], "--no-progress"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    [part] = json.loads((tmp_path / "r.json").read_text())
    want = {r["exercise"]: r for r in full["exercises"] if r["exercise"] in ("fx-mean", "fx-ring")}
    assert want["fx-mean"]["status"].startswith("failed") and want["fx-ring"]["status"] == "passed"
    assert {r["exercise"]: r for r in part["exercises"]} == want
    assert part["only"] == ["fx-mean", "fx-ring"] and (part["points"], part["max"]) == (1, 2)
    # the rule itself: the helper's cell is kept, the slow cell and the other exercises' cells are not
    assembled = grade.assemble(nb, nbio.read(FX_SOLUTIONS / "fx_basics.ipynb"))
    kept = [nbio.source(c) for c in regrade.select(assembled, ["fx-ring"])["cells"]]
    assert any("def ring_helper" in s for s in kept) and not any("time.sleep" in s for s in kept)
    assert not any("def chunk_bounds" in s or "chunks of n=10" in s for s in kept)
    assert any("def ring_factor" in s for s in kept) and any("ring all-reduce factor" in s for s in kept)


# ------------------------------------------------------------------------------------ bad input

def test_bad_input_is_refused_before_anything_runs(tmp_path, capsys):
    two = tmp_path / "two"
    (two / "frank").mkdir(parents=True)
    for name in ("a.ipynb", "b.ipynb"):
        shutil.copyfile(CORRECT, two / "frank" / name)
    sols = tmp_path / "solutions"
    sols.mkdir()
    shutil.copyfile(FX_SOLUTIONS / "fx_basics.ipynb", sols / "fx_basics.ipynb")
    other = nbio.read(FX_SOLUTIONS / "fx_basics.ipynb")
    other.metadata["course"] = {"lesson": "fx_other"}
    nbio.write(other, sols / "fx_other.ipynb")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copyfile(CORRECT, mixed / "gina.ipynb")
    nbio.write(other, mixed / "hugo.ipynb")
    cases = [
        ([str(CORRECT), "--jobs", "0"], "--jobs 0: give at least 1"),
        ([str(CORRECT), "--shard", "3/2"], "--shard 3/2: K must be between 1 and N=2"),
        ([str(two), "--solutions", str(FX_SOLUTIONS)], "two or more submissions for one student"),
        ([str(mixed), "--solutions", str(sols)], "notebooks of more than one lesson"),
        ([str(mixed), "--solutions", str(sols), "--lesson", "fx_basics"], "another lesson than --lesson fx_basics"),
        ([str(CORRECT), "--solutions", str(FX_SOLUTIONS), "--exercise", "fx-nope"], "--exercise fx-nope: not an"),
        ([str(tmp_path / "nowhere")], "no such file or folder"),
        ([str(CORRECT), "--similarity-threshold", "1.5"], "--similarity-threshold 1.5: give a share between 0 and 1"),
    ]
    before = set(Path(tempfile.gettempdir()).glob(f"course-grade-{os.getpid()}-*"))
    for args, said in cases:
        t0 = time.perf_counter()
        assert commands.main(["grade", *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err, (args, err)
        assert time.perf_counter() - t0 < 10, args
    assert set(Path(tempfile.gettempdir()).glob(f"course-grade-{os.getpid()}-*")) == before    # no submission ran
    err = (commands.main(["grade", str(two), "--solutions", str(FX_SOLUTIONS)]), capsys.readouterr().err)[1]
    assert "frank:" in err and "a.ipynb" in err and "b.ipynb" in err
    commands.main(["grade", str(mixed), "--solutions", str(sols)])
    err = capsys.readouterr().err
    assert "fx_basics: 1" in err and "fx_other: 1" in err and "hugo.ipynb" in err


# ------------------------------------------------------------------------------------- Ctrl-C

def marked() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if MARKER in (p.info["cmdline"] or [])]


def test_sigterm_stops_every_sandbox_and_writes_the_results_already_graded(tmp_path):
    klass = tmp_path / "class"
    klass.mkdir()
    for name in ("a_ok", "b_ok"):
        shutil.copyfile(CORRECT, klass / f"{name}.ipynb")
    slow = insert_cell(nbio.read(CORRECT), "fx-mean", "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
                       f"'import time; time.sleep(300)', {MARKER!r}])")
    for name in ("c_slow", "d_slow"):
        nbio.write(slow, klass / f"{name}.ipynb")
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    proc = subprocess.Popen([*CLI, str(klass), "--jobs", "2", "--json", str(out_json), "--csv", str(out_csv),
                             *COMMON[:2], "--cell-timeout", "200", "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while len(marked()) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert len(marked()) == 2, "the two slow submissions did not start"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "the 2 of 4 submissions graded before are written" in err
    results = json.loads(out_json.read_text())
    assert [(r["student"], r["points"]) for r in results] == [("a_ok", 12), ("b_ok", 12)]
    assert len(list(csv.reader(out_csv.open()))) == 3
    time.sleep(1)
    assert marked() == []
    assert procs.tagged_processes(f"grade-{proc.pid}-", prefix=True) == []
