"""Grading a class: check it before anything runs, then grade ``--jobs N`` submissions at a time.

`plan_class` reads every notebook of the class first and refuses, before any kernel starts (`ClassError`, the
CLI exits 2): two submissions of one student, a notebook of another lesson than the class's (one lesson per call:
the CSV's columns, the LMS's gradebook column and `course grade merge` are per lesson), an exercise asked for
(``--exercise``) that the lesson lacks. A notebook that cannot be read, or of no lesson at all, is named before
anything runs and then graded as ``unreadable`` (0 points): one broken submission never stops the class.

`grade_class` grades the plan's submissions (all, or the slice of ``--shard K/N``, `course_lib.grading.shards`) in
a pool of ``jobs`` threads, each grading one submission at a time in its own sandbox (`grade.grade_submission`:
its own temp folder, cgroup with the ``--memory-mb``/``--max-procs``/``--cpus`` caps, pid namespace and
``COURSE_PROC_TAG``). Results come back in the class's sorted order whatever order they finish in, so the JSON,
CSV and table of ``--jobs N`` are those of ``--jobs 1`` but for the timings. One progress bar (tqdm, with an ETA)
counts the class. On SIGINT (Ctrl-C) or SIGTERM every running sandbox's processes are killed (each carries a
``COURSE_PROC_TAG`` starting with ``grade-<this pid>-``: `course_lib.runtime.procs`), their threads clean up their
cgroups and temp folders, and `Interrupted` carries the results already computed (the CLI writes them, then exits
130).

The default ``jobs`` (`default_jobs`): min(cores // CPUs per submission, available memory // ``--memory-mb``), at
least 1, where CPUs per submission is ``--cpus``, or 1 when ``--cpus`` is not given (each submission may then use
every core, and they share them).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from course_lib.runtime import procs
from course_lib.grading import grade, sandbox
from course_lib import notebook as nbio
from course_lib.grading import authoring
from course_lib.grading.shards import Shard


class ClassError(ValueError):
    """The class cannot be graded as given (found before anything runs): the message names the files and the fix."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the class: ``results`` holds the submissions graded before, in the class's order."""

    def __init__(self, results: list[dict], signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.results, self.signum = results, signum


@dataclass(frozen=True)
class Member:
    """One submission of a class: its file, its student (`grade.student_name`), its lesson (None: unknown) and why
    it cannot be read (None: it can)."""

    path: Path
    student: str
    lesson: str | None
    problem: str | None = None


@dataclass
class ClassPlan:
    """A class checked before anything runs (`plan_class`)."""

    members: list[Member]                    # the whole class, in the order of `grade.find_submissions`
    solutions: grade.Solutions
    lesson: str | None
    shard: Shard | None = None
    only: list[str] | None = None
    notes: list[str] = field(default_factory=list)   # what the CLI says before grading (unreadable ones)

    def mine(self) -> list[Member]:
        """The submissions this call grades: the whole class, or the shard's slice."""
        return self.shard.pick(self.members) if self.shard else list(self.members)

    def roster(self) -> list[tuple[str, str]]:
        """(student, submission) of the whole class, in order: what a shard's JSON records."""
        return [(m.student, str(m.path)) for m in self.members]


def _listing(paths: list[Path], limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def plan_class(paths: list[str | Path], solutions: grade.Solutions | str | Path, *, shard: Shard | None = None,
               only: list[str] | None = None, lesson: str | None = None) -> ClassPlan:
    """Read and check a class (see the module docstring); raises `ClassError` for what must be fixed first."""
    if not isinstance(solutions, grade.Solutions):
        solutions = grade.Solutions(solutions)
    roots = [Path(p) for p in paths]
    missing = [p for p in roots if not p.exists()]
    if missing:
        raise ClassError(f"no such file or folder: {_listing(missing)}")
    members, notes = [], []
    for path in grade.find_submissions(paths):
        student = grade.student_name(path, roots)
        try:
            nb = nbio.read(path)
        except nbio.NotebookError as exc:
            members.append(Member(path, student, None, str(exc)))
            continue
        found = solutions.match(nb, path)
        problem = None if found else f"no lesson of {solutions.folder} matches it"
        members.append(Member(path, student, found, problem))
    by_student: dict[str, list[Path]] = {}
    for m in members:
        by_student.setdefault(m.student, []).append(m.path)
    twice = {s: ps for s, ps in by_student.items() if len(ps) > 1}
    if twice:
        listed = "; ".join(f"{s}: {_listing(ps)}" for s, ps in twice.items())
        raise ClassError(f"two or more submissions for one student (the student is the first folder under the class "
                         f"folder, else the file's name): {listed}. Keep one notebook per student")
    lessons: dict[str, list[Path]] = {}
    for m in members:
        if m.lesson:
            lessons.setdefault(m.lesson, []).append(m.path)
    if lesson is not None and lesson not in solutions.notebooks:
        raise ClassError(f"--lesson {lesson}: no such lesson in {solutions.folder} (there: "
                         f"{', '.join(solutions.notebooks)})")
    expected = lesson or (next(iter(lessons)) if len(lessons) == 1 else None)
    if lessons and (expected is None or set(lessons) != {expected}):
        parts = "; ".join(f"{k}: {len(v)} ({_listing(v, 3)})" for k, v in sorted(lessons.items()))
        raise ClassError(f"notebooks of more than one lesson in one class ({parts}): grade each lesson in its own "
                         f"call (its CSV columns and gradebook column are that lesson's)" if lesson is None else
                         f"notebooks of another lesson than --lesson {lesson}: {parts}; grade them in their own call")
    if only:
        official = [e["exercise"] for e in authoring.exercises(solutions.notebooks[expected])] if expected else []
        unknown = [e for e in only if e not in official]
        if unknown:
            raise ClassError(f"--exercise {', '.join(unknown)}: not an exercise of lesson {expected}; its exercises: "
                             f"{', '.join(official) or 'none (no readable submission)'}")
    for m in members:
        if m.problem:
            notes.append(f"{m.path} cannot be graded ({m.problem}): recorded as unreadable, 0 points")
    return ClassPlan(members, solutions, expected, shard, list(only) if only else None, notes)


TIMING_KEYS = ("seconds", "run_seconds", "cpu_seconds", "kernel_start_s", "runner_max_rss_mb", "memory_peak_mb")


def without_timings(results: list[dict]) -> list[dict]:
    """``results`` without what differs from run to run (times, memory peaks): what ``--jobs N``, a merge of
    shards and ``--jobs 1`` must agree on byte for byte."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in results]


def default_jobs(limits: sandbox.Limits | None = None) -> tuple[int, str]:
    """(submissions graded at once, the rule with this machine's numbers): min(cores // CPUs per submission,
    available memory // memory cap per submission), at least 1; CPUs per submission is ``limits.cpus``, 1 when
    unset."""
    limits = limits or sandbox.Limits()
    cores = procs.usable_cores()
    per_job = limits.cpus or 1.0
    available_mb = psutil.virtual_memory().available >> 20
    jobs = max(1, min(int(cores // per_job), available_mb // limits.memory_mb))
    return jobs, (f"min({cores} cores // {per_job:g} CPU per submission, {available_mb} MB available // "
                  f"{limits.memory_mb} MB per submission) = {jobs}")


def _kill_class(grace_s: float = 0.0) -> int:
    """Kill every process a grading of this process started (tags ``grade-<pid>-...``), repeatedly, until none
    is left; returns how many the first sweep found."""
    prefix = f"grade-{os.getpid()}-"
    found = None
    for _ in range(20):
        left = procs.tagged_processes(prefix, prefix=True)
        found = len(left) if found is None else found
        if not left:
            break
        for p in left:
            procs.kill_tree(p.pid, grace_s=grace_s, sweeps=2)
        time.sleep(0.1)
    return found or 0


class _Stop:
    """SIGINT/SIGTERM handlers for the time of a class (main thread only): the first signal is recorded and raises
    KeyboardInterrupt in the main thread, later ones are ignored until the class is stopped; SIGINT stays ignored
    where it was (a job started with nohup)."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    def _handler(self, signum, frame):
        if self.signum is not None:     # a second Ctrl-C while the sandboxes are being stopped: let them stop
            return
        self.signum = signum
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                current = signal.getsignal(sig)
                if sig == signal.SIGINT and current is signal.SIG_IGN:
                    continue
                self.previous[sig] = current
                signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        return False


def grade_class(plan: ClassPlan, *, jobs: int = 1, progress: bool = False, **kw) -> list[dict]:
    """Grade ``plan.mine()`` ``jobs`` at a time (see the module docstring); ``kw``: `grade.grade_submission`'s.
    Returns the results in the class's order; raises `Interrupted` (with those already computed) on SIGINT or
    SIGTERM, after every sandbox's processes are gone."""
    if jobs < 1:
        raise ClassError(f"jobs={jobs}: give at least 1 submission at a time")
    members = plan.mine()
    results: list[dict | None] = [None] * len(members)
    bar = None
    if progress and members:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(members), unit="submission", desc=f"grading {plan.lesson or ''}".strip(),
                   file=sys.stderr, disable=None, mininterval=1.0)

    def one(i: int) -> dict:
        m = members[i]
        try:
            res = grade.grade_submission(m.path, plan.solutions, only=plan.only, **kw)
        except grade.GraderError as exc:   # the grader failed on this one: say so, grade the others
            res = {"submission": str(m.path), "lesson": m.lesson, "status": "grader error", "points": 0.0,
                   "max": 0.0, "exercises": [], "warnings": [], "error": str(exc)}
        res["student"] = m.student
        return res

    stop = _Stop()
    pool = ThreadPoolExecutor(max_workers=min(jobs, max(1, len(members))), thread_name_prefix="grade")
    try:
        with stop:
            pending = {pool.submit(one, i): i for i in range(len(members))}
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in done:
                    results[pending.pop(f)] = f.result()
                    if bar is not None:
                        bar.update(1)
    except KeyboardInterrupt:
        signum = stop.signum or signal.SIGINT
        for f in list(pending):                      # finished before the signal: kept
            if f.done() and not f.cancelled() and f.exception() is None:
                results[pending.pop(f)] = f.result()
        for f in pending:
            f.cancel()
        _kill_class()
        pool.shutdown(wait=True, cancel_futures=True)   # the running gradings return (their runner was killed)
        _kill_class()
        raise Interrupted([r for r in results if r is not None], signum) from None
    finally:
        if bar is not None:
            bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
    return results  # type: ignore[return-value]


def grade_many(paths: list[str | Path], solutions: grade.Solutions | str | Path = "solutions", *, jobs: int = 1,
               progress: bool = False, only: list[str] | None = None, **kw) -> list[dict]:
    """Grade a class (files or folders of them) ``jobs`` submissions at a time: `plan_class` then `grade_class`.
    ``kw``: `grade.grade_submission`'s."""
    return grade_class(plan_class(paths, solutions, only=only), jobs=jobs, progress=progress, **kw)


def machine_estimate(students: int, cores: int, jobs: int, cpu_s_per_submission: float,
                     wall_s_per_submission: float) -> dict:
    """An ESTIMATE of the hours ``students`` submissions take on a ``cores``-core machine grading ``jobs`` at once:
    the larger of the CPU bound (all CPU seconds spread over every core) and the batch bound (rounds of ``jobs``
    submissions, each as long as one graded alone)."""
    cpu_bound = students * cpu_s_per_submission / cores
    batch_bound = math.ceil(students / jobs) * wall_s_per_submission
    return {"jobs": jobs, "cpu_bound_h": cpu_bound / 3600, "batch_bound_h": batch_bound / 3600,
            "hours": max(cpu_bound, batch_bound) / 3600}
