"""Grading overhead: `course grade` of a solution notebook vs running the same notebook plainly.

    .venv/bin/python benchmarks/bench_grading.py [solutions/00_getting_started.ipynb]

Target (issue 4): grading one submission costs at most the notebook's own run time + 15 s.
Prints both wall times, the difference and the hardware. Not a test: no time is asserted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_lib.grading import grade  # noqa: E402
from course_lib.procs import usable_cores  # noqa: E402


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "solutions" / "00_getting_started.ipynb")
    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = grade.grade_submission(path, ROOT / "solutions", cell_timeout=600, total_timeout=1800)
    graded = time.perf_counter() - t0
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"hardware: {usable_cores()} cores, {cpu}, load average {os.getloadavg()[0]:.1f}")
    print(f"notebook: {path.name}, score {res['points']:g}/{res['max']:g}")
    print(f"plain nbclient run : {plain:6.1f} s")
    print(f"course grade       : {graded:6.1f} s (runner {res['run_seconds']} s, kernel start "
          f"{res['kernel_start_s']:.1f} s)")
    print(f"overhead           : {graded - plain:+6.1f} s (target: at most +15 s)")


if __name__ == "__main__":
    main()
