#!/usr/bin/env python3
"""Set up and run the course with nothing but Python 3.10+ installed.

    python3 course.py lab     create .venv the first time, install, open JupyterLab on the course index
    python3 course.py test    create .venv the first time, install, run every test (pytest + nbval, and the
                              browser test where Chromium is installed: see below)
    python3 course.py test --browser   only the browser test: every lesson in JupyterLab in headless Chromium
    python3 course.py test --fast      the maintainer's loop: every unit and multi-rank test, without the tests
                              marked slow (lessons under nbval or in the browser, grading every notebook, real lab
                              reports): a few minutes; CI runs the whole command
    python3 course.py book    the course as a static website with the outputs of a real run (`course book --help`)
    python3 course.py ARGS    anything else goes to the `course` command inside .venv (doctor, run, build, grade)

The environment is re-installed when pyproject.toml changes, or when a command needs an extra that is not installed
yet (`browser`: playwright; `book`: Sphinx and its theme). Only the standard library is used here.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".course-installed"

# The test command (README and .ci/run call `python3 course.py test`, which runs these):
#  1. exercises/ must be in sync with solutions/;
#  2. pytest over the unit tests and, through nbval, every lesson notebook. Every solution notebook runs in
#     tests/test_grading.py instead (COURSE_GRADE_LESSONS=all): `course grade` executes it top to bottom in a
#     fresh kernel and requires full marks, which checks more than nbval would, and its student copy must
#     score zero. Running solutions under nbval as well would only repeat that work.
NBVAL_ARGS = ["--nbval-lax", "--nbval-cell-timeout=600", "--nbval-kernel-name=python3",
              "--sanitize-with", "tests/nbval_sanitize.cfg", "-p", "no:cacheprovider", "--durations=40"]
TEST_PATHS = ["tests", "notebooks"]
#  3. tests/test_browser.py runs every lesson in JupyterLab 4 in headless Chromium (Run All; no error, no dialog, every
#     widget reacts). Where Debian's chromium is installed (CI installs it in .ci/run), the test command installs the
#     `browser` extra (playwright) and runs it beside nbval: the course's design asks for both (nbval in a plain
#     kernel, the browser test in the JupyterLab a learner uses). The browser test runs the lessons at their quick CPU
#     sizes (COURSE_QUICK=1), nbval at the learner's: 14 and 10 minutes of a worker's time on a 2-core CPU.
#     COURSE_BROWSER=required makes it fail, not skip, if it cannot run. Without Chromium, the browser test skips,
#     saying why.
BROWSER_TEST = "tests/test_browser.py"
#  4. The tests run in parallel, one pytest-xdist worker per core (at most 4; COURSE_TEST_WORKERS overrides, 1 runs
#     them in one process): a serial run waits (torchrun start-up, rendezvous, time-outs of the hang tests,
#     JupyterLab), so two workers on 2 cores take less time. Three workers on 2 cores were slower than two (the CPU
#     was idle 0-3 % of the time) and made a hang test's timeout miss: more workers help only with more cores.
#     ``--dist loadscope`` keeps each test file (with its module fixtures) and each notebook (whose cells share one
#     kernel under nbval, in order) in one worker; files go out in collection order, so the longest (test_browser.py,
#     test_grading.py) start early instead of last.
#     (``--dist loadgroup`` with a group per browser lesson was tried: it ran nbval's cells out of order, and a second
#     playwright in one worker refused to start.)
CHROMIUM = Path(os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium"))  # as course_lib.instructor.browser.chromium()
# COURSE_NCCL_RULES=1: every rank started by the tests, lessons and solutions checks NCCL's rules on gloo
# (course_lib/runtime/nccl_rules.py), so that what passes on a CPU does not fail or hang on GPUs.
# COURSE_READINGS=1: nbval runs every reading a lesson holds back until a prediction is written (the browser test's
# JupyterLab does not: it runs the lessons as a learner first does, predictions empty).
TEST_ENV = {"PYTHONHASHSEED": "0", "MPLBACKEND": "Agg", "COURSE_GRADE_LESSONS": "all", "COURSE_NCCL_RULES": "1",
            "COURSE_READINGS": "1"}


def fail(message: str) -> None:
    print(f"course.py: {message}", file=sys.stderr)
    sys.exit(1)


def requirements_hash() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_env(extras: list[str]) -> None:
    """Create .venv and install the course with ``extras`` into it, unless it is already up to date.

    The stamp holds the hash of pyproject.toml and the extras installed; extras installed before are kept.
    """
    if sys.version_info < (3, 10):
        fail(f"Python 3.10 or newer is needed, this is {sys.version.split()[0]}: install a newer Python "
             f"and run this command with it (e.g. python3.11 course.py ...)")
    stamp = STAMP.read_text().split() if STAMP.exists() else []
    if stamp[:1] == [requirements_hash()] and set(extras) <= set(stamp[1:]):
        return
    extras = sorted(set(extras) | set(stamp[1:]))
    python = BIN / "python"
    if not python.exists():
        print(f"creating the environment in {VENV} ...", flush=True)
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
        except (subprocess.CalledProcessError, OSError) as exc:
            fail(f"could not create a virtual environment ({exc}). On Debian/Ubuntu install the venv module "
                 f"first: sudo apt install python3-venv")
    print("installing the course and its dependencies (torch, deepspeed, jupyterlab, ...): a few minutes "
          "the first time ...", flush=True)
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e",
           f"{ROOT}[{','.join(extras)}]"]
    if subprocess.call(cmd, cwd=ROOT) != 0:
        fail("pip install failed (see above). Check your network access to PyPI, then run the command again.")
    STAMP.write_text(" ".join([requirements_hash(), *extras]))


def test_workers(extra: list[str]) -> list[str]:
    """pytest-xdist's arguments: ``-n N --dist loadscope`` with N = the cores (at most 4), or what
    COURSE_TEST_WORKERS says; none when the caller passed its own ``-n`` or N is 1."""
    if any(a == "-n" or a.startswith(("-n=", "--numprocesses")) for a in extra):
        return []
    wanted = os.environ.get("COURSE_TEST_WORKERS", "")
    if wanted and not wanted.isdigit():
        fail(f"COURSE_TEST_WORKERS={wanted!r}: give a number of test processes, e.g. 2 (1: no parallel workers)")
    n = int(wanted) if wanted else min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                       else (os.cpu_count() or 1), 4)
    return ["-n", str(n), "--dist", "loadscope", "--no-loadscope-reorder"] if n > 1 else []


def names_a_test(arg: str) -> bool:
    """Whether a pytest argument names tests to run (a file, a folder or a node id such as tests/x.py::test_y)."""
    return not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()


def run_tests(extra: list[str], browser: str, fast: bool = False) -> int:
    """Run the tests; ``browser`` is "only" (just the browser test), "lessons" (it runs too) or "" (it skips);
    ``fast``: only tests/, without the tests marked slow (pyproject.toml's ``markers``)."""
    env = dict(os.environ, **TEST_ENV)
    if browser:
        env["COURSE_BROWSER"] = "required"
    if browser == "only":
        paths = [BROWSER_TEST]
    else:
        course = [str(BIN / "python"), "-m", "course_lib.instructor.cli"]
        status = subprocess.call([*course, "build", "--check"], cwd=ROOT, env=env)
        if status != 0:
            print("exercises/ is out of date: run `python3 course.py build` and commit the result", file=sys.stderr)
            return status
        paths = [p for p in TEST_PATHS if (ROOT / p).exists()]
    if fast:
        paths, extra = ["tests"], ["-m", "not slow", *extra]
    if any(names_a_test(a) for a in extra):     # `course.py test tests/test_launch.py`: that file, not everything
        paths = []
    cmd = [str(BIN / "python"), "-m", "pytest", *NBVAL_ARGS, *test_workers(extra), *paths, *extra]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    browser = ""
    fast = command == "test" and "--fast" in rest
    if command == "test":
        browser = "only" if "--browser" in rest else "" if fast or not CHROMIUM.is_file() else "lessons"
        rest = [a for a in rest if a not in ("--browser", "--fast")]
        if fast and browser:
            fail("--fast leaves the browser test out and --browser runs only it: pick one")
        if browser == "only" and not CHROMIUM.is_file():
            fail(f"the browser test needs Chromium at {CHROMIUM}: sudo apt-get install chromium fonts-noto-cjk "
                 f"(or set COURSE_CHROMIUM to a Chromium binary)")
    extras = ["test", "book"] if command in ("test", "book") else ["test"]
    ensure_env(extras + (["browser"] if browser else []))
    if command == "test":
        return run_tests(rest, browser, fast)
    if command == "install":
        return 0
    if command == "lab" and os.name == "posix":
        # Become `course lab`: Ctrl-C and SIGTERM reach it (and the JupyterLab it runs) as they would directly,
        # instead of this process killing it with the server's kernels still running.
        os.chdir(ROOT)
        os.execv(BIN / "course", [str(BIN / "course"), command, *rest])
    return subprocess.call([str(BIN / "course"), command, *rest], cwd=ROOT)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
