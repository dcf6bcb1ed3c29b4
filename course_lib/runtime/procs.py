"""Process-tree hygiene: find and kill every process a run started, however it escaped.

Used by `course_lib.runtime.launch` (torchrun and its workers) and by the grader (a kernel and whatever a
submission started). Two nets catch everything:

1. the tree: `psutil.Process(pid).children(recursive=True)`, collected *before* anything is killed, so
   children are not lost when their parent dies and they are re-parented;
2. the tag: every process started by a run carries ``COURSE_PROC_TAG=<unique value>`` in its environment
   (children inherit it), so even a double-forked orphan or a worker in its own session is found.
   Tags nest (``outer:inner``): a run started inside another keeps the outer run's tag too.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid

import psutil

TAG_VAR = "COURSE_PROC_TAG"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask; all cores where the OS has no such mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def new_tag(prefix: str = "run") -> str:
    """A unique value for ``COURSE_PROC_TAG``."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def nested_tag(tag: str) -> str:
    """The value of ``COURSE_PROC_TAG`` for a child that gets ``tag`` while keeping the tags it inherited.

    Tags nest (``grader-tag:launch-tag``), so a torchrun job started inside a graded notebook is found both
    by its launcher and by the grader.
    """
    outer = os.environ.get(TAG_VAR, "")
    return f"{outer}:{tag}" if outer else tag


def tagged_processes(tag: str, prefix: bool = False) -> list[psutil.Process]:
    """Every live process (other than this one) whose ``COURSE_PROC_TAG`` contains ``tag`` (with ``prefix``: a tag
    that starts with it, e.g. every ``new_tag("grade")`` of one process)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            parts = proc.environ().get(TAG_VAR, "").split(":")
            hit = any(p.startswith(tag) for p in parts) if prefix else tag in parts
            if hit and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _terminate(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM (so that workers can flush their logs), then wait up to ``grace_s``."""
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=grace_s)


def _stop_and_kill(procs: list[psutil.Process]) -> None:
    """SIGSTOP everyone first (a stopped process cannot fork), then SIGKILL."""
    for p in procs:
        try:
            p.suspend()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=5)


def _collect(pid: int | None, tag: str | None) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    if pid is not None:
        procs.update((p.pid, p) for p in _descendants(pid))
    if tag is not None:
        procs.update((p.pid, p) for p in tagged_processes(tag))
    procs.pop(os.getpid(), None)
    return [p for p in procs.values() if p.is_running()]


def kill_tree(pid: int | None = None, tag: str | None = None, grace_s: float = 1.0,
              sweeps: int = 4) -> int:
    """Kill the process ``pid`` with all its descendants, and every process tagged ``tag``.

    The first sweep asks politely (SIGTERM, ``grace_s``); later sweeps stop and kill whatever is left,
    repeating because a fork storm can create a process between a listing and a kill.
    Returns the number of processes found by the first sweep.
    """
    procs = _collect(pid, tag)
    found = len(procs)
    if procs and grace_s > 0:
        _terminate(procs, grace_s)
    for _ in range(sweeps):
        procs = _collect(pid, tag)
        if not procs:
            break
        _stop_and_kill(procs)
    return found


def alive(tag: str) -> list[psutil.Process]:
    """Processes still alive with this tag (for tests: this must be empty after any run)."""
    return tagged_processes(tag)


def free_port() -> int:
    """A TCP port on the loopback address that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
