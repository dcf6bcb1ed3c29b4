"""Run lessons in a real JupyterLab, in headless Chromium, the way a learner would (Run > Run All Cells), by hand.

The same check as tests/test_browser.py (course_lib/instructor/browser.py does the work), for the notebooks you name:

    .venv/bin/python tools/lab_smoke.py notebooks/01_bottlenecks.ipynb [more.ipynb ...] [--out runs/lab_smoke] [--quick]

For each: no error output, no dialog, every ipywidget rendered and reacting to a changed control. The executed
copies, a screenshot per notebook and JupyterLab's log go to --out (default runs/lab_smoke/<date-time>/).
The lessons run at the sizes a learner gets (the "runs in JupyterLab in under 6 minutes" check); tests/test_browser.py
runs them at their quick CPU sizes, as ``--quick`` does (COURSE_QUICK=1).
Needs Debian's chromium and the `browser` extra (`python3 course.py test --browser` installs it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from course_lib.instructor import browser
from course_lib.instructor.cli import ROOT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "lab_smoke" / time.strftime("%Y%m%d-%H%M%S"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds for Run All of one notebook")
    parser.add_argument("--quick", action="store_true", help="the lessons' quick CPU sizes (COURSE_QUICK=1)")
    args = parser.parse_args()
    reason = browser.unavailable()
    if reason:
        print(f"lab_smoke: {reason}", file=sys.stderr)
        return 2
    failed = 0
    with browser.Lab(args.out, env={"COURSE_QUICK": "1" if args.quick else "0"}) as lab:
        for notebook in args.notebooks:
            result = lab.run_lesson(notebook, timeout_s=args.timeout)
            print(result.report(), flush=True)
            failed += not result.ok
    print(f"{len(args.notebooks) - failed}/{len(args.notebooks)} OK; everything is in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
