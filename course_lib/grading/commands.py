"""The ``course build`` and ``course grade`` subcommands (registered by `course_lib.instructor.cli`)."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from course_lib.grading.sandbox import DEFAULT_MAX_PROCS, DEFAULT_MEMORY_MB
from course_lib.grading.similarity import DEFAULT_THRESHOLD

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


def _outputs(results: list[dict], args: argparse.Namespace, document=None) -> None:
    """Write what the options ask for: --json (``document`` for a shard: `shards.document`), --csv, --lms-csv,
    --feedback."""
    import json

    from course_lib.grading import feedback, grade, lms

    if args.json:
        if document is not None:
            Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
        else:
            grade.write_json(results, args.json)
    if args.csv:
        grade.write_csv(results, args.csv)
    if args.lms_csv:
        lms.write(results, args.lms_csv)
    if getattr(args, "feedback", None):
        feedback.write(results, args.feedback)


def _exit_code(results: list[dict]) -> int:
    if any(r["status"] == "grader error" for r in results):
        return 2
    return 1 if any(r["status"] != "graded" for r in results) else 0


def _threshold_problem(args: argparse.Namespace) -> str | None:
    t = args.similarity_threshold
    if not 0 < t <= 1:
        return (f"--similarity-threshold {t:g}: give a share between 0 and 1 (the part of an answer's code found in "
                f"another source; default {DEFAULT_THRESHOLD:g})")
    return None


def _similarity(results: list[dict], args: argparse.Namespace, solutions, shard=None) -> None:
    """Compare the class's answers (docs/GRADING.md, "Copied answers"): by default when two or more submissions
    were graded; never in a shard (it sees part of the class: `merge` compares)."""
    from course_lib.grading import grade, similarity

    graded = [r for r in results if r.get("status") == "graded"]
    if args.no_similarity or shard or not graded or (len(graded) < 2 and not args.similarity):
        why = ("a shard sees part of the class: `course grade merge` compares the answers" if shard else
               "--no-similarity" if args.no_similarity else "fewer than two graded submissions (--similarity "
               "compares one with the course's answers)")
        if shard or args.similarity_report:
            print(f"course grade: the answers are not compared here ({why})"
                  + (f"; no report in {args.similarity_report}" if args.similarity_report else ""), file=sys.stderr)
        return
    if not isinstance(solutions, grade.Solutions):
        solutions = grade.Solutions(solutions)
    report = similarity.class_report(results, solutions, args.similarity_threshold)
    print(similarity.table(report))
    if args.similarity_report:
        written = similarity.write(report, args.similarity_report)
        print(f"course grade: similarity report: {', '.join(map(str, written))}", file=sys.stderr)


def cmd_merge(args: argparse.Namespace, files: list[str]) -> int:
    """``course grade merge RESULTS... [--csv OUT] [--json OUT] [--lms-csv OUT]``: the shards' JSON as one class."""
    from course_lib.grading import grade, shards, similarity

    try:
        results = shards.merge(files)
    except shards.ShardError as exc:
        print(f"course grade {exc}", file=sys.stderr)
        return 2
    print(grade.table(results))
    try:
        _similarity(results, args, args.solutions or _default("solutions"))
    except (grade.GraderError, similarity.SimilarityError) as exc:
        print(f"course grade merge: WARNING: the answers were not compared: {exc} (give --solutions DIR, or "
              f"--no-similarity); the grades are written", file=sys.stderr)
    _outputs(results, args)
    print(f"merged {len(files)} shard file(s): {len(results)} submissions", file=sys.stderr)
    return _exit_code(results)


def cmd_grade(args: argparse.Namespace) -> int:
    from course_lib.grading import grade, jobs, sandbox, shards

    problem = _threshold_problem(args)
    if problem:
        print(f"course grade: {problem}", file=sys.stderr)
        return 2
    if args.paths[0] == "merge" and not Path("merge").exists():
        return cmd_merge(args, args.paths[1:])
    try:
        limits = sandbox.Limits(args.memory_mb, args.max_procs, args.cpus)
        shard = shards.Shard.parse(args.shard) if args.shard else None
    except (sandbox.SandboxError, shards.ShardError) as exc:
        print(f"course grade: {exc}", file=sys.stderr)
        return 2
    n_jobs, rule = jobs.default_jobs(limits)
    if args.jobs is not None:
        if args.jobs < 1:
            print(f"course grade: --jobs {args.jobs}: give at least 1 submission at a time (the default here is "
                  f"{rule})", file=sys.stderr)
            return 2
        n_jobs, rule = args.jobs, f"--jobs {args.jobs}"
    try:
        plan = jobs.plan_class(args.paths, args.solutions or _default("solutions"), shard=shard,
                               only=args.exercise, lesson=args.lesson)
    except (jobs.ClassError, grade.GraderError) as exc:
        print(f"course grade: {exc}", file=sys.stderr)
        return 2
    if not plan.members:
        print(f"course grade: no notebooks found in {args.paths}", file=sys.stderr)
        return 1
    why = "--no-sandbox" if args.no_sandbox else sandbox.unavailable()
    if why:
        print(f"course grade: WARNING: no sandbox ({why}): each submission runs as you, can read solutions/ "
              f"and your files, use the network and all the memory"
              + ("" if args.no_sandbox else "; pass --no-sandbox to accept this"), file=sys.stderr)
    for note in plan.notes:
        print(f"course grade: {note}", file=sys.stderr)
    mine = plan.mine()
    if len(mine) > 1 and n_jobs > 1 or shard:
        print(f"course grade: {len(mine)} submissions" + (f" (shard {shard} of a class of {len(plan.members)})"
                                                          if shard else "")
              + f", {min(n_jobs, max(1, len(mine)))} at a time ({rule})", file=sys.stderr)
    try:
        results = jobs.grade_class(plan, jobs=n_jobs, progress=not args.no_progress,
                                   cell_timeout=args.cell_timeout, total_timeout=args.total_timeout,
                                   output_limit=args.output_limit, keep=args.keep,
                                   sandboxed=False if args.no_sandbox else None, limits=limits)
    except jobs.Interrupted as exc:
        _outputs(exc.results, args, shards.document(exc.results, shard, plan.roster()) if shard else None)
        print(f"course grade: {exc}: every sandbox stopped; the {len(exc.results)} of {len(mine)} submissions "
              f"graded before are written", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:  # noqa: BLE001 - the grader itself failed
        traceback.print_exc()
        print(f"course grade: the grader failed: {exc}", file=sys.stderr)
        return 2
    print(grade.table(results))
    try:
        _similarity(results, args, plan.solutions, shard)
    except Exception as exc:  # noqa: BLE001 - the grades stand without it
        print(f"course grade: WARNING: the answers were not compared ({type(exc).__name__}: {exc}); the grades "
              f"are written", file=sys.stderr)
    _outputs(results, args, shards.document(results, shard, plan.roster()) if shard else None)
    return _exit_code(results)


def add_parsers(subparsers) -> None:
    """Add ``build`` and ``grade`` to the ``course`` command's subparsers."""
    b = subparsers.add_parser("build", help="write exercises/ from solutions/ (answers -> stubs)",
                              description="Generate the student notebooks in exercises/ from solutions/.")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale exercise notebooks")
    b.add_argument("--solutions", default=None, help="solutions folder (default: ./solutions or the repo's)")
    b.add_argument("--exercises", default=None, help="exercises folder (default: next to the solutions folder)")
    b.set_defaults(func=cmd_build)

    g = subparsers.add_parser(
        "grade", help="grade submitted notebooks (files or class folders); `grade merge` joins shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run each submission in a fresh kernel, in its own sandbox, with the official tests restored; "
                    "print a table per exercise.\nExit 0 graded, 1 a submission could not be read, 2 bad input "
                    "(found before anything runs) or the grader failed, 130/143 stopped by SIGINT/SIGTERM (the "
                    "results graded before are written).\n\n"
                    "  course grade CLASS/ --jobs 4 --csv class.csv --json class.json --lms-csv lms.csv "
                    "--feedback fb/\n"
                    "  course grade CLASS/ --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT --json part-K.json\n"
                    "  course grade merge part-*.json --csv class.csv --json class.json --lms-csv lms.csv\n"
                    "  course grade CLASS/alice --exercise 02-ring-all-reduce      # a regrade request\n\n"
                    "The student of a submission is the first folder under the class folder, else the file's name "
                    "(docs/GRADING.md).")
    g.add_argument("paths", nargs="+", help="submission notebooks, or folders of them (one class, one lesson); "
                                            "or `merge` and the shards' JSON files")
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
    g.add_argument("--jobs", type=int, default=None,
                   help="submissions graded at once, each in its own sandbox (default: min(cores // CPUs per "
                        "submission (--cpus, else 1), available memory // --memory-mb), at least 1)")
    g.add_argument("--shard", default=None, metavar="K/N",
                   help="grade the K-th of N round-robin slices of the sorted class (K from 1, e.g. a SLURM "
                        "array's task id); --json then records the class for `course grade merge`")
    g.add_argument("--exercise", action="append", default=None, metavar="ID",
                   help="grade only this exercise (repeatable): its cells and the earlier cells they need "
                        "(a regrade request)")
    g.add_argument("--lesson", default=None, help="the lesson every submission must be of (default: the one "
                                                   "they all are of; a class mixing lessons is refused)")
    g.add_argument("--lms-csv", default=None, help="write a gradebook for an LMS: student, one column per "
                                                   "exercise, total")
    g.add_argument("--feedback", default=None, metavar="DIR",
                   help="write DIR/<student>.md per submission: points, status and the failing check per "
                        "exercise (never a hidden test's expected value or a quiz's answer)")
    compare = g.add_mutually_exclusive_group()
    compare.add_argument("--similarity", action="store_true",
                         help="compare answers even when one submission is graded (default: when two or more are)")
    compare.add_argument("--no-similarity", action="store_true", help="do not compare the answers")
    g.add_argument("--similarity-threshold", type=float, default=DEFAULT_THRESHOLD, metavar="SHARE",
                   help="flag an answer when at least this share of its code is in another source (default "
                        f"{DEFAULT_THRESHOLD:g})")
    g.add_argument("--similarity-report", default=None, metavar="DIR",
                   help="write DIR/similarity.html (answers side by side, shared code marked) and DIR/similarity.json")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (it only shows on a terminal)")
    g.set_defaults(func=cmd_grade)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m course_lib.grading.commands build|grade ...``."""
    parser = argparse.ArgumentParser(prog="course")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
