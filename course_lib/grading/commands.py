"""The ``course build`` and ``course grade`` subcommands (registered by `course_lib.cli`)."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from course_lib.grading.sandbox import DEFAULT_MAX_PROCS, DEFAULT_MEMORY_MB

ROOT = Path(__file__).resolve().parents[2]


def _default(folder: str) -> str:
    """``solutions``/``exercises`` of the current folder if it has one, else of the course repo."""
    return folder if Path(folder).is_dir() else str(ROOT / folder)


def cmd_build(args: argparse.Namespace) -> int:
    from course_lib.grading.build import build

    solutions = args.solutions or _default("solutions")
    exercises = args.exercises or str(Path(solutions).resolve().parent / "exercises")
    try:
        from course_lib.glossary import sync_course
        changed = sync_course(Path(solutions).resolve().parent, check=args.check)
        changed += build(solutions, exercises, check=args.check)
    except Exception as exc:  # noqa: BLE001 - report one line, exit 2
        print(f"course build: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if changed:
            print("stale exercise notebooks or glossary tables (run `course build`):")
            print("\n".join(f"  {c}" for c in changed))
            return 1
        print(f"exercises up to date ({exercises})")
        return 0
    print("\n".join(f"wrote {c}" for c in changed) or f"exercises already up to date ({exercises})")
    return 0


def cmd_grade(args: argparse.Namespace) -> int:
    from course_lib.grading import grade, sandbox

    why = "--no-sandbox" if args.no_sandbox else sandbox.unavailable()
    if why:
        print(f"course grade: WARNING: no sandbox ({why}): each submission runs as you, can read solutions/ "
              f"and your files, use the network and all the memory"
              + ("" if args.no_sandbox else "; pass --no-sandbox to accept this"), file=sys.stderr)
    try:
        limits = sandbox.Limits(args.memory_mb, args.max_procs, args.cpus)
    except sandbox.SandboxError as exc:
        print(f"course grade: {exc}", file=sys.stderr)
        return 2
    try:
        results = grade.grade_many(args.paths, args.solutions or _default("solutions"),
                                   cell_timeout=args.cell_timeout, total_timeout=args.total_timeout,
                                   output_limit=args.output_limit, keep=args.keep,
                                   sandboxed=False if args.no_sandbox else None, limits=limits)
    except Exception as exc:  # noqa: BLE001 - the grader itself failed
        traceback.print_exc()
        print(f"course grade: the grader failed: {exc}", file=sys.stderr)
        return 2
    if not results:
        print(f"course grade: no notebooks found in {args.paths}", file=sys.stderr)
        return 1
    print(grade.table(results))
    if args.json:
        grade.write_json(results, args.json)
    if args.csv:
        grade.write_csv(results, args.csv)
    return 1 if any(r["status"] != "graded" for r in results) else 0


def add_parsers(subparsers) -> None:
    """Add ``build`` and ``grade`` to the ``course`` command's subparsers."""
    b = subparsers.add_parser("build", help="write exercises/ from solutions/ (answers -> stubs)",
                              description="Generate the student notebooks in exercises/ from solutions/.")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale exercise notebooks")
    b.add_argument("--solutions", default=None, help="solutions folder (default: ./solutions or the repo's)")
    b.add_argument("--exercises", default=None, help="exercises folder (default: next to the solutions folder)")
    b.set_defaults(func=cmd_build)

    g = subparsers.add_parser("grade", help="grade submitted notebooks (files or class folders)",
                              description="Run each submission in a fresh kernel with the official tests "
                                          "restored; print a table per exercise. Exit 0 graded, 1 a "
                                          "submission could not be read, 2 the grader failed.")
    g.add_argument("paths", nargs="+", help="submission notebooks, or folders of them (one class)")
    g.add_argument("--solutions", default=None, help="folder of official notebooks (default: ./solutions)")
    g.add_argument("--json", default=None, help="write every result (per exercise) to this JSON file")
    g.add_argument("--csv", default=None, help="write a summary, one row per student, to this CSV file")
    g.add_argument("--cell-timeout", type=float, default=120.0, help="seconds per cell (default 120)")
    g.add_argument("--total-timeout", type=float, default=900.0, help="seconds per submission (default 900)")
    g.add_argument("--output-limit", type=int, default=1_000_000, help="bytes of output kept per cell")
    g.add_argument("--keep", action="store_true", help="keep each submission's temp folder (for debugging)")
    g.add_argument("--no-sandbox", action="store_true",
                   help="run submissions without the sandbox (bubblewrap), e.g. where it is not installed")
    g.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB,
                   help=f"memory cap per submission, all its processes together (default {DEFAULT_MEMORY_MB})")
    g.add_argument("--max-procs", type=int, default=DEFAULT_MAX_PROCS,
                   help=f"processes + threads cap per submission (default {DEFAULT_MAX_PROCS})")
    g.add_argument("--cpus", type=float, default=None,
                   help="CPU quota per submission in cores, all its processes together (default: all cores)")
    g.set_defaults(func=cmd_grade)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m course_lib.grading.commands build|grade ...``."""
    parser = argparse.ArgumentParser(prog="course")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
