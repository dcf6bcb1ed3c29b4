"""Warm ranks (issue 20), measured and printed; not a test. Every ratio compares two measurements of this run.

- a trivial 2-rank job: fresh processes vs a warm re-run on the pool (target: warm median of 20 at most 0.3 s);
- ``--lessons``: lessons 00-07 executed top to bottom with COURSE_POOL=0 (every run fresh) and with the pool
  (target: pooled at most half of the fresh total);
- ``--tests``: the test command's pytest with COURSE_POOL=0 and with the pool (target: at most half; the same
  tests pass). The grader runs its kernels fresh in both (see course_lib/grading/grade.py), so the graded
  solution notebooks cost the same in both columns.

    .venv/bin/python benchmarks/bench_pool.py [--lessons] [--tests]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("0[0-7]_*.ipynb"))


def _job():
    import torch
    import torch.distributed as dist

    from course_lib import dist as cdist

    t = torch.ones(1, device=cdist.device())              # on the rank's GPU under NCCL
    dist.all_reduce(t)
    return t.item()


def trivial_job(fresh_repeats: int = 5, warm_repeats: int = 20) -> None:
    from course_lib.runtime import run

    def wall(**kw):
        t0 = time.perf_counter()
        res = run(_job, 2, stream=False, **kw)
        assert res.returns == [2.0, 2.0]
        return time.perf_counter() - t0, res.pooled

    fresh = [wall(fresh=True)[0] for _ in range(fresh_repeats)]
    first, _ = wall()                                            # starts the pool
    warm = [wall() for _ in range(warm_repeats)]
    assert all(pooled for _, pooled in warm)
    warm_s = [s for s, _ in warm]
    f, w = statistics.median(fresh), statistics.median(warm_s)
    print(f"trivial 2-rank job (all_reduce of one number), call to result:\n"
          f"  fresh processes   median {f:.2f} s of {len(fresh)} (runs {', '.join(f'{x:.2f}' for x in fresh)})\n"
          f"  pool's first run  {first:.2f} s (starts the pool)\n"
          f"  warm re-run       median {w * 1e3:.1f} ms of {len(warm_s)} (max {max(warm_s) * 1e3:.1f} ms); "
          f"target <= 300 ms: {'met' if w <= 0.3 else 'NOT met'}\n"
          f"  fresh / warm      {f / w:.0f}x")


def _timed(cmd: list[str], pool_on: bool, cwd: Path = ROOT) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, COURSE_POOL="1" if pool_on else "0", MPLBACKEND="Agg")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, proc


def lessons() -> None:
    print("lessons top to bottom (jupyter nbconvert --execute), seconds:")
    print(f"  {'notebook':<32} {'fresh':>8} {'pooled':>8} {'ratio':>6}")
    totals = [0.0, 0.0]
    with tempfile.TemporaryDirectory() as out:
        for nb in LESSONS:
            row = []
            for pool_on in (False, True):
                cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                       "--ExecutePreprocessor.timeout=900", str(nb), "--output-dir", out,
                       "--output", f"{nb.stem}-{int(pool_on)}.ipynb"]
                seconds, proc = _timed(cmd, pool_on)
                if proc.returncode != 0:
                    raise SystemExit(f"{nb.name} failed (pool {'on' if pool_on else 'off'}):\n{proc.stderr[-2000:]}")
                row.append(seconds)
            totals = [totals[0] + row[0], totals[1] + row[1]]
            print(f"  {nb.name:<32} {row[0]:8.1f} {row[1]:8.1f} {row[1] / row[0]:6.2f}")
    ratio = totals[1] / totals[0]
    print(f"  {'total':<32} {totals[0]:8.1f} {totals[1]:8.1f} {ratio:6.2f}  "
          f"(target <= 0.50: {'met' if ratio <= 0.5 else 'NOT met'})")


def tests() -> None:
    sys.path.insert(0, str(ROOT))
    from course import NBVAL_ARGS, TEST_ENV, TEST_PATHS

    cmd = [sys.executable, "-m", "pytest", *NBVAL_ARGS, *TEST_PATHS, "-q"]
    print("the test command's pytest (tests + lesson notebooks under nbval), seconds:")
    outcome = {}
    times = {}
    for pool_on in (False, True):
        os.environ.update(TEST_ENV)
        seconds, proc = _timed(cmd, pool_on)
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
        outcome[pool_on] = re.sub(r" in [\d.]+s.*", "", summary)
        times[pool_on] = seconds
        print(f"  pool {'on ' if pool_on else 'off'}: {seconds:7.1f} s   {summary}")
    ratio = times[True] / times[False]
    print(f"  pooled / fresh {ratio:.2f} (target <= 0.50: {'met' if ratio <= 0.5 else 'NOT met'}); "
          f"same outcome: {outcome[True] == outcome[False]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lessons", action="store_true", help="also time lessons 00-07 (about 10 minutes)")
    parser.add_argument("--tests", action="store_true", help="also time the test command (about 25 minutes)")
    args = parser.parse_args()
    from course_lib.measure.hardware import hardware_label
    from course_lib.runtime.launch import resolve_backend

    print(f"hardware: {hardware_label(resolve_backend('auto', 2))}, {os.cpu_count()} logical CPUs")
    trivial_job()
    if args.lessons:
        lessons()
    if args.tests:
        tests()


if __name__ == "__main__":
    main()
