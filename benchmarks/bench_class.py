"""A class graded unattended (issue 16): 30 lesson-02 submissions, correct, wrong and hostile mixed, in one call of
`course grade`'s grade_many, twice; the two CSVs must be identical, and nothing may be left running.

    .venv/bin/python benchmarks/bench_class.py [--out runs/bench_class]

The class: 12 correct (the solution), 4 untouched student copies, 2 that sum the gradients instead of averaging,
2 with wrong quiz answers, and 10 hostile ones whose first exercise cell also tries to read the official solutions
and a classmate, write outside its folder, reach the network, take all the memory, fork without end, patch
course_lib on disk, plant a .pth file in the venv, or leave a process running. Prints each kind's scores, the wall
time of each pass and the hardware; exits 1 when the CSVs differ or a process is left. Not a test: it takes about
half an hour on a 2-core CPU.

Found with it (2026-11-24, 2-core AMD EPYC, cgroup v1): at the default cap of 1024 processes the fork bomb keeps
~800 busy processes alive until its cell times out, the load average reaches ~780 and the machine, the grader
included, crawls for many minutes: the process cap bounds the count, not the CPU. A CPU quota per submission
(cgroup cpu.max / cpu.cfs_quota_us) or a much lower process cap is needed before this benchmark can pass.
Since then the cap is 256 processes, the submission's processes share a CPU quota (all cores by default) as one
group, the runner kills every other process of the sandbox's pid namespace after a cap is hit (survivors of the
bomb had held the cap, so that the next kernel could not start and the whole submission scored 0), and the
sandbox's root is read-only (a write into the checkout's folder, which exists in the sandbox as a mount point's
parent, had succeeded unseen and scored full marks). Run again (2026-11-24, same machine): the CSVs of the two passes
are identical, every hostile submission loses only its first exercise (14/17; leave-process keeps 17/17: its
answer is right and its process is killed), nothing escapes or is left; the second, undisturbed pass took 18.2 min
(36.4 s per submission; the fork bomb's 172 s, the correct ones 32-83 s).
"""

from __future__ import annotations

import argparse
import copy
import filecmp
import site
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_lib import procs  # noqa: E402
from course_lib.grading import grade, sandbox  # noqa: E402
from course_lib.grading import notebook as nbio  # noqa: E402

LESSON = "02_data_parallel"
FIRST_ANSWER = "def average_gradients("           # the cell of exercise 02-average-gradients


def attacks(folder: Path) -> dict[str, str]:
    """name -> code put before the first exercise's answer (its error, if any, fails that exercise only)."""
    read = "from pathlib import Path\nprint(len(Path({!r}).read_text()))"
    venv_site = site.getsitepackages()[0]
    return {
        "read-solutions": read.format(str(ROOT / "solutions" / f"{LESSON}.ipynb")),
        "read-classmate": read.format(str(folder / "correct-01.ipynb")),
        "write-outside": f"from pathlib import Path\nPath({str(ROOT / 'escaped.txt')!r}).write_text('escaped')",
        "network": "import socket\nsocket.create_connection(('8.8.8.8', 53), timeout=5)",
        "memory": "blocks = [bytearray(64 << 20) for _ in range(10_000)]",
        "fork-bomb": "import os\nwhile True:\n    os.fork()",
        "patch-course-lib": f"open({str(ROOT / 'course_lib' / 'procs.py')!r}, 'a').write('\\nHACKED = 1\\n')",
        "plant-pth": f"open({str(Path(venv_site) / 'zz_hack.pth')!r}, 'w').write('import os')",
        "leave-process": ("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; "
                          "time.sleep(3600)', 'bench-class-left'], env={}, start_new_session=True)"),
        "read-home": read.format(str(Path.home() / ".bashrc")),
    }


def submissions(folder: Path) -> dict[str, str]:
    """Write the class into ``folder``; returns {student: kind}."""
    solution = nbio.read(ROOT / "solutions" / f"{LESSON}.ipynb")
    stub = nbio.read(ROOT / "exercises" / f"{LESSON}.ipynb")
    kinds = {}

    def save(name: str, kind: str, nb) -> None:
        nbio.write(nb, folder / f"{name}.ipynb")
        kinds[name] = kind

    def edited(old: str, new: str):
        nb = copy.deepcopy(solution)
        cell = next(c for c in nb.cells if old in nbio.source(c))
        cell.source = nbio.source(cell).replace(old, new)
        return nb

    for i in range(12):
        save(f"correct-{i + 1:02d}", "correct", copy.deepcopy(solution))
    for i in range(4):
        save(f"untouched-{i + 1:02d}", "untouched", copy.deepcopy(stub))
    for i in range(2):
        save(f"sum-not-mean-{i + 1:02d}", "sums the gradients", edited("p.grad.div_(n)", "pass"))
        save(f"wrong-quiz-{i + 1:02d}", "wrong quiz", edited("quiz_mb_per_rank = 150.0", "quiz_mb_per_rank = 200.0"))
    for name, code in attacks(folder).items():
        nb = copy.deepcopy(solution)
        cell = next(c for c in nb.cells if FIRST_ANSWER in nbio.source(c))
        cell.source = code + "\n\n" + nbio.source(cell)
        save(f"hostile-{name}", f"hostile: {name}", nb)
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_class"))
    args = parser.parse_args()
    if sandbox.unavailable():                     # the hostile submissions would write into this checkout
        print(f"bench_class needs the grading sandbox: {sandbox.unavailable()}", file=sys.stderr)
        return 2
    out = Path(args.out)
    folder = out / "class"
    folder.mkdir(parents=True, exist_ok=True)
    kinds = submissions(folder)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{len(kinds)} submissions of lesson {LESSON}; {procs.usable_cores()} cores, {cpu}; sandbox: "
          f"{sandbox.unavailable() or 'bubblewrap'}", flush=True)
    csvs, results = [], []
    for run in (1, 2):
        t0 = time.perf_counter()
        res = grade.grade_many([folder], ROOT / "solutions")
        wall = time.perf_counter() - t0
        path = out / f"grades-{run}.csv"
        grade.write_csv(res, path)
        csvs.append(path)
        results.append(res)
        print(f"pass {run}: {wall / 60:.1f} min for {len(res)} submissions ({wall / len(res):.1f} s each) -> {path}",
              flush=True)
    by_kind = {}
    for res in results[0]:
        kind = kinds[res["student"]]
        by_kind.setdefault(kind, Counter())[f"{res['points']:g}/{res['max']:g}"] += 1
        if kind.startswith("hostile"):
            first = next(r for r in res["exercises"] if r["exercise"] == "02-average-gradients")
            print(f"  {kind:32s} {res['points']:g}/{res['max']:g} in {res.get('run_seconds') or 0:5.0f} s, "
                  f"02-average-gradients: {first['status'][:80]}")
    for kind, scores in sorted(by_kind.items()):
        print(f"  {kind:32s} " + ", ".join(f"{n} x {s}" for s, n in sorted(scores.items())))
    # "Not slow the next submission": the correct ones run before and after the hostile ones (sorted by name).
    correct = [r.get("run_seconds") or 0 for r in results[0] if kinds[r["student"]] == "correct"]
    print(f"  correct submissions' run time: {min(correct):.0f}-{max(correct):.0f} s")
    same = filecmp.cmp(csvs[0], csvs[1], shallow=False)
    escaped = (ROOT / "escaped.txt").exists() or "HACKED" in (ROOT / "course_lib" / "procs.py").read_text()
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "bench-class-left" in (p.info["cmdline"] or [])]
    print(f"CSVs identical: {same}; a write escaped: {escaped}; processes left: {left or 'none'}")
    return 0 if same and not escaped and not left else 1


if __name__ == "__main__":
    sys.exit(main())
