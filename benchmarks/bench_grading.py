"""Grading overhead: `course grade` of a solution notebook, in the sandbox and without, vs running it plainly.

    .venv/bin/python benchmarks/bench_grading.py [solutions/00_getting_started.ipynb]
    .venv/bin/python benchmarks/bench_grading.py --peaks      # every solution's peak memory and processes

Target (issues 4 and 16): grading one submission, sandbox included, costs at most the notebook's own run time
+ 15 s. Prints the wall times, the differences and the hardware (CPU model, cores, load). ``--peaks`` grades
every solution in the sandbox and prints the peak memory of its cgroup and the most processes + threads seen
in it (sampled every 0.1 s): the defaults of ``course grade --memory-mb/--max-procs`` must hold them.
Not a test: no time is asserted.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_lib.grading import grade, sandbox  # noqa: E402
from course_lib.runtime.procs import usable_cores  # noqa: E402

SLOW = dict(cell_timeout=600, total_timeout=1800)


def hardware() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    return f"{usable_cores()} cores, {cpu}, load average {os.getloadavg()[0]:.1f}"


def overhead(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    plain = time.perf_counter() - t0
    print(f"hardware: {hardware()}")
    print(f"notebook: {path.name}")
    print(f"plain nbclient run      : {plain:6.1f} s")
    for sandboxed in (False, True):
        if sandboxed and sandbox.unavailable():
            print(f"course grade, sandbox   : skipped ({sandbox.unavailable()})")
            continue
        t0 = time.perf_counter()
        res = grade.grade_submission(path, ROOT / "solutions", sandboxed=sandboxed, **SLOW)
        graded = time.perf_counter() - t0
        label = "course grade, sandbox   " if sandboxed else "course grade, no sandbox"
        print(f"{label}: {graded:6.1f} s, overhead {graded - plain:+5.1f} s (target at most +15 s); "
              f"score {res['points']:g}/{res['max']:g}, runner {res['run_seconds']} s, kernel start "
              f"{res['kernel_start_s']:.1f} s; {res['sandbox']}")


def peaks() -> None:
    """Every solution graded in the sandbox: peak memory (cgroup) and most processes + threads (sampled)."""
    why = sandbox.unavailable()
    if why:
        sys.exit(f"no sandbox here: {why}")
    pids_root = sandbox.cgroup_dirs().get("pids") or sandbox.cgroup_dirs().get("v2")
    print(f"hardware: {hardware()}; caps {sandbox.describe(sandbox.Limits(), sandbox.caps_via())}")
    def sample(most: list[int], done: threading.Event) -> None:
        while not done.wait(0.1):
            for f in pids_root.glob("course-grade-*/pids.current"):
                try:
                    most[0] = max(most[0], int(f.read_text()))
                except (OSError, ValueError):
                    pass

    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        most, done = [0], threading.Event()
        thread = threading.Thread(target=sample, args=(most, done), daemon=True)
        thread.start()
        res = grade.grade_submission(path, ROOT / "solutions", sandboxed=True, **SLOW)
        done.set()
        thread.join()
        print(f"{path.stem:28s} {res['points']:g}/{res['max']:g}  {res['seconds']:6.1f} s  peak memory "
              f"{res['memory_peak_mb']} MB  processes + threads {most[0]}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--peaks"]:
        peaks()
    else:
        overhead(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "solutions" / "00_getting_started.ipynb"))
