"""A class graded unattended (issues 16 and 35): lesson-02 submissions, correct, wrong and hostile mixed, graded by
`course grade`'s class grader (`course_lib.grading.jobs`) at ``--jobs 1`` and then at ``--jobs 2``; the two CSVs (and
the JSONs without their timings) must be identical, every hostile submission must lose only its first exercise, and
nothing may be left running.

    .venv/bin/python benchmarks/bench_class.py [--size 8] [--out runs/bench_class] [--students 200] [--cores 32]

The class (``--size N``, default 8, about 10-15 minutes for both passes on a 2-core CPU): the first N of an
interleaved list of 30 kinds: correct (the solution), untouched student copies, copies that sum the gradients instead
of averaging, wrong quiz answers, and hostile ones whose first exercise cell also tries to take all the memory, read
the official solutions, write outside its folder, reach the network, fork without end, patch course_lib on disk,
plant a .pth file in the venv, leave a process running, read a classmate or a file in $HOME (N=30: the class of
issue 16, 12 correct, 4 untouched, 2 + 2 wrong, 10 hostile). Prints each kind's scores, the wall time of each
pass, their ratio, the CPU seconds per submission measured in the ``--jobs 1`` pass, and from them an ESTIMATE of
the hours ``--students`` submissions of one lesson take on a ``--cores``-core grading machine, with the hardware.
Exits 1 when the results differ, a hostile submission loses more than its exercise, or a process is left.

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

Issue 35 (2026-11-27, 2-core AMD EPYC, torch 2.14.1, gloo, cgroup v1; other jobs shared the machine, load
average 2-7): the default class of 8 (1 correct, 1 untouched, 1 sum-not-mean, 1 wrong quiz, 4 hostile: memory,
read-solutions, write-outside, network): ``--jobs 1`` 6.7 min (50.4 s each, 40.5 CPU-s each counted by the
cgroups, 0.80 cores busy on average), ``--jobs 2`` 4.0 min (1.37 cores busy): 1.69x faster; CSVs identical, JSON
identical without timings; every hostile submission 14/17, losing only 02-average-gradients, next to another
submission; nothing escaped or left. ESTIMATE from these: 200 lesson-02 submissions on a 32-core machine at
--jobs 32: 0.10 h (CPU bound 0.07 h, batch bound 0.10 h).
"""

from __future__ import annotations

import argparse
import copy
import filecmp
import json
import shutil
import site
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_lib.measure import hardware  # noqa: E402
from course_lib.grading import grade, jobs, sandbox  # noqa: E402
from course_lib import notebook as nbio  # noqa: E402

LESSON = "02_data_parallel"
FIRST_ANSWER = "def average_gradients("           # the cell of exercise 02-average-gradients
FIRST_EXERCISE = "02-average-gradients"


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


def submissions(folder: Path, size: int) -> dict[str, str]:
    """Write the first ``size`` submissions of the class (see the module docstring) into ``folder``; returns
    {student: kind}."""
    solution = nbio.read(ROOT / "solutions" / f"{LESSON}.ipynb")
    stub = nbio.read(ROOT / "exercises" / f"{LESSON}.ipynb")

    def edited(old: str, new: str):
        nb = copy.deepcopy(solution)
        cell = next(c for c in nb.cells if old in nbio.source(c))
        cell.source = nbio.source(cell).replace(old, new)
        return nb

    def hostile(code: str):
        nb = copy.deepcopy(solution)
        cell = next(c for c in nb.cells if FIRST_ANSWER in nbio.source(c))
        cell.source = code + "\n\n" + nbio.source(cell)
        return nb

    makers = {"correct": lambda: copy.deepcopy(solution), "untouched": lambda: copy.deepcopy(stub),
              "sum-not-mean": lambda: edited("p.grad.div_(n)", "pass"),
              "wrong-quiz": lambda: edited("quiz_mb_per_rank = 150.0", "quiz_mb_per_rank = 200.0")}
    codes = attacks(folder)
    order = ["correct", "untouched", "sum-not-mean", "wrong-quiz", "hostile-memory", "hostile-read-solutions",
             "hostile-write-outside", "hostile-network", "correct", "hostile-fork-bomb", "hostile-patch-course-lib",
             "hostile-plant-pth", "hostile-leave-process", "hostile-read-classmate", "hostile-read-home",
             "untouched", "sum-not-mean", "wrong-quiz", "untouched", "untouched"]
    order += ["correct"] * max(0, size - len(order))
    kinds, count = {}, Counter()
    for kind in order[:size]:
        count[kind] += 1
        if kind.startswith("hostile-"):
            name, nb = kind, hostile(codes[kind[len("hostile-"):]])
        else:
            name, nb = f"{kind}-{count[kind]:02d}", makers[kind]()
        nbio.write(nb, folder / f"{name}.ipynb")
        kinds[name] = "hostile: " + kind[len("hostile-"):] if kind.startswith("hostile-") else kind
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=8, help="submissions in the class (default 8; 30: issue 16's)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_class"))
    parser.add_argument("--students", type=int, default=200, help="class size of the estimate (default 200)")
    parser.add_argument("--cores", type=int, default=32, help="cores of the grading machine of the estimate")
    args = parser.parse_args()
    if args.size < 2:
        print(f"--size {args.size}: give at least 2 submissions (two at a time are compared with one)",
              file=sys.stderr)
        return 2
    if sandbox.unavailable():                     # the hostile submissions would write into this checkout
        print(f"bench_class needs the grading sandbox: {sandbox.unavailable()}", file=sys.stderr)
        return 2
    if sandbox.caps_via() not in ("cgroup v1", "cgroup v2"):
        print(f"bench_class counts CPU seconds in each submission's cgroup: none here ({sandbox.caps_via()})",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    folder = out / "class"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    kinds = submissions(folder, args.size)
    where = (f"{hardware.hardware_label('gloo')}, sandbox: bubblewrap, "
             f"{sandbox.describe(sandbox.Limits(), sandbox.caps_via())}")
    print(f"{len(kinds)} submissions of lesson {LESSON}; {where}", flush=True)
    runs = {}
    for n_jobs in (1, 2):
        t0 = time.perf_counter()
        res = jobs.grade_many([folder], ROOT / "solutions", jobs=n_jobs, progress=True)
        wall = time.perf_counter() - t0
        cpu = sum(r.get("cpu_seconds") or 0 for r in res)    # counted by each submission's cgroup
        path = out / f"grades-jobs{n_jobs}.csv"
        grade.write_csv(res, path)
        runs[n_jobs] = {"results": res, "wall": wall, "cpu": cpu, "csv": path}
        print(f"--jobs {n_jobs}: {wall / 60:.1f} min wall for {len(res)} submissions ({wall / len(res):.1f} s each), "
              f"{cpu:.0f} CPU-s ({cpu / len(res):.1f} CPU-s each, {cpu / wall:.2f} cores busy on average) -> {path}",
              flush=True)
    results = runs[1]["results"]
    by_kind, spill = {}, []
    for res in results:
        kind = kinds[res["student"]]
        by_kind.setdefault(kind, Counter())[f"{res['points']:g}/{res['max']:g}"] += 1
        if kind.startswith("hostile"):
            st = {r["exercise"]: r["status"] for r in res["exercises"]}
            spill += [f"{kind}: {ex} {s[:60]}" for ex, s in st.items() if ex != FIRST_EXERCISE and s != "passed"]
            print(f"  {kind:32s} {res['points']:g}/{res['max']:g} in {res.get('run_seconds') or 0:5.0f} s, "
                  f"{FIRST_EXERCISE}: {st[FIRST_EXERCISE][:80]}")
    for kind, scores in sorted(by_kind.items()):
        print(f"  {kind:32s} " + ", ".join(f"{n} x {s}" for s, n in sorted(scores.items())))
    same_csv = filecmp.cmp(runs[1]["csv"], runs[2]["csv"], shallow=False)
    same_json = (json.dumps(jobs.without_timings(runs[1]["results"]))
                 == json.dumps(jobs.without_timings(runs[2]["results"])))
    escaped = (ROOT / "escaped.txt").exists() or "HACKED" in (ROOT / "course_lib" / "runtime" / "procs.py").read_text()
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "bench-class-left" in (p.info["cmdline"] or [])]
    ratio = runs[1]["wall"] / runs[2]["wall"]
    print(f"--jobs 1: {runs[1]['wall'] / 60:.1f} min, --jobs 2: {runs[2]['wall'] / 60:.1f} min: --jobs 2 is "
          f"{ratio:.2f}x faster (target 1.4x) on {hardware.hardware_label('gloo')}")
    print(f"CSVs identical: {same_csv}; JSON identical without timings: {same_json}; hostile submissions that lost "
          f"more than {FIRST_EXERCISE}: {spill or 'none'}; a write escaped: {escaped}; processes left: "
          f"{left or 'none'}")
    n = len(results)
    cpu_each, wall_each = runs[1]["cpu"] / n, runs[1]["wall"] / n
    jobs_big = max(1, min(args.cores, (args.cores * 4096) // sandbox.DEFAULT_MEMORY_MB))
    est = jobs.machine_estimate(args.students, args.cores, jobs_big, cpu_each, wall_each)
    print(f"ESTIMATE (not a measurement): {args.students} submissions of {LESSON} on a {args.cores}-core grading "
          f"machine (4 GB per core, --jobs {est['jobs']}): {est['hours']:.2f} h = max(CPU bound {args.students} x "
          f"{cpu_each:.1f} CPU-s / {args.cores} cores = {est['cpu_bound_h']:.2f} h, batch bound "
          f"ceil({args.students}/{est['jobs']}) x {wall_each:.0f} s = {est['batch_bound_h']:.2f} h); from this "
          f"class's --jobs 1 pass on {hardware.hardware_label('gloo')}, assuming those cores as fast as these and a "
          f"class with this mix of hostile submissions")
    return 0 if same_csv and same_json and not spill and not escaped and not left else 1


if __name__ == "__main__":
    sys.exit(main())
