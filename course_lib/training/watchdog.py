"""A watchdog for hangs: every rank reports its progress, the launching process names the one that stopped (lesson 09).

    beat = Heartbeat(folder, rank)                 # in each rank (course_lib.training.train does it)
    beat(step, "start"); ...; beat(step, "sync")   # before the step's work, before the step's all-reduce
    dog = Watchdog(folder, nprocs, timeout_s=5)    # in the launching process, polled while the job runs
    stall = dog.poll()                             # a `Stall` naming the rank, its step, the seconds, or None

A rank that dies is seen at once (its process ends). A rank that *hangs* -- stuck in a collective another rank never
calls, in a deadlocked data loader, on a broken network link -- leaves every process alive: the others wait for it
in their next collective, nothing fails, nothing restarts, and the job burns its allocation until a timeout of 30
minutes or more. Here each rank writes a heartbeat file (its step, a phase, the time, its pid) twice a step; when a
rank's newest heartbeat is older than ``timeout_s``, the watchdog blames, among the ranks that went quiet, the one
that got least far (the others are waiting for it in the step's all-reduce), prints which rank stopped, at which
step and how long ago (at most ``timeout_s`` + the poll interval after its last heartbeat), and stops it with
SIGABRT: Python's faulthandler (``PYTHONFAULTHANDLER=1``, set by `course_lib.runtime.launch`) writes its stack into its
log (where it was stuck: what a flight recorder tells), torchrun sees a failed rank, stops the others and, with
``--max-restarts``, starts every rank again from the newest checkpoint (`course_lib.training.train`).

On GPUs PyTorch does this job inside each rank, with NCCL (the settings to know):

- the process group's timeout, ``init_process_group(..., timeout=timedelta(...))``: "Timeout for operations executed
  against the process group. Default value is 10 minutes for NCCL and 30 minutes for other backends. This is the
  duration after which collectives will be aborted asynchronously and the process will crash." (its docstring,
  torch 2.x).
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: "Control how we perform Async Error Handling with NCCL when an exception is
  observed in watchdog. [...] If set to 1, aborting NCCL communicator and tearing down process upon error. [...]
  By default, it is set to 3" (tearing down the process without aborting the communicator) -- PyTorch's
  "ProcessGroupNCCL Environment Variables" page.
- the flight recorder: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` ("The maximum number of events we store in the flight
  recorder's ring buffer") and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` ("Control whether dumping debug info on watchdog
  timeout or exception is detected. This variable must be set together with TORCH_NCCL_TRACE_BUFFER_SIZE larger
  than 0"): each rank's last collectives, dumped on a timeout, show which rank never entered the one the others
  wait in -- what this module's heartbeats show on gloo.
- ``TORCH_NCCL_ENABLE_MONITORING`` / ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``: a thread that aborts the process when
  NCCL's own watchdog thread stops beating.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Heartbeat", "Watchdog", "Stall", "PHASES"]

#: The phases of a step, in order: started it (forward, backward, optimizer), entered its all-reduce, saved.
PHASES = ("start", "sync", "save")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Heartbeat:
    """A rank's progress report: ``beat(step, phase)`` writes ``FOLDER/rank{R}.json`` = {rank, pid, attempt, step,
    phase, time}. ``attempt``: torchrun's restart count (a restarted job's heartbeats are told from the last)."""

    def __init__(self, folder: str | Path, rank: int, attempt: int | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
        self.path = self.folder / f"rank{rank}.json"

    def __call__(self, step: int, phase: str = "start") -> None:
        if phase not in PHASES:
            raise ValueError(f"Heartbeat: phase={phase!r} must be one of {PHASES}")
        _write_atomic(self.path, json.dumps({"rank": self.rank, "pid": os.getpid(), "attempt": self.attempt,
                                             "step": step, "phase": phase, "time": time.time()}))


@dataclass(frozen=True)
class Stall:
    """A rank without progress: its last heartbeat said ``step``/``phase`` ``seconds`` ago; ``waiting``: the ranks
    that got further (they wait for it in a collective)."""

    rank: int
    step: int | None
    phase: str
    seconds: float
    timeout_s: float
    pid: int | None
    attempt: int
    waiting: tuple

    def __str__(self) -> str:
        where = f"at step {self.step}" if self.step is not None else "before its first step"
        doing = {"start": "computing it", "sync": "in its all-reduce", "save": "saving a checkpoint"}.get(self.phase, "")
        wait = f"; ranks {list(self.waiting)} wait for it" if self.waiting else ""
        return (f"watchdog: rank {self.rank} stopped making progress {where} ({doing}): no heartbeat for "
                f"{self.seconds:.1f} s (watchdog.timeout_s = {self.timeout_s:g}){wait}")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "step": self.step, "phase": self.phase, "seconds": round(self.seconds, 3),
                "timeout_s": self.timeout_s, "attempt": self.attempt, "waiting": list(self.waiting)}


class Watchdog:
    """Reads the ranks' heartbeats in ``folder`` (`Heartbeat`) and finds a rank silent for more than ``timeout_s``.

    Only the newest attempt's heartbeats count, and an attempt is judged once (after a `Stall`, the next is for
    the restarted job). A rank that never beat is timed from the first heartbeat of any rank of its attempt."""

    def __init__(self, folder: str | Path, nprocs: int, timeout_s: float):
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"Watchdog: timeout_s={timeout_s!r} must be a positive number of seconds")
        self.folder, self.nprocs, self.timeout_s = Path(folder), nprocs, float(timeout_s)
        self.judged: set[int] = set()            # attempts that already stalled

    def read(self) -> dict[int, dict]:
        """{rank: its newest heartbeat} (a file being replaced is read at the next poll)."""
        beats = {}
        for r in range(self.nprocs):
            try:
                beats[r] = json.loads((self.folder / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                continue
        return beats

    def poll(self, now: float | None = None) -> Stall | None:
        now = time.time() if now is None else now
        beats = self.read()
        if not beats:
            return None
        attempt = max(b["attempt"] for b in beats.values())
        if attempt in self.judged:
            return None
        current = {r: b for r, b in beats.items() if b["attempt"] == attempt}
        first = min(b["time"] for b in current.values())
        progress = {r: (current[r]["step"], PHASES.index(current[r]["phase"])) if r in current else (-1, -1)
                    for r in range(self.nprocs)}
        last = {r: current[r]["time"] if r in current else first for r in range(self.nprocs)}
        quiet = [r for r in range(self.nprocs) if now - last[r] > self.timeout_s]
        if not quiet:
            return None
        rank = min(quiet, key=lambda r: (progress[r], r))           # the one that got least far
        self.judged.add(attempt)
        beat = current.get(rank, {})
        waiting = tuple(r for r in range(self.nprocs) if progress[r] > progress[rank])
        return Stall(rank, beat.get("step"), beat.get("phase", ""), now - last[rank], self.timeout_s,
                     beat.get("pid"), attempt, waiting)


class HangError(RuntimeError):
    """The watchdog stopped a hung rank and no restart was left: ``stall`` (`Stall.to_dict`) names it; ``run_error``
    is the launcher's `launch.DistributedRunError` (the rank's log, the others stopped)."""

    def __init__(self, stall: dict, run_error: Exception):
        self.stall, self.run_error = stall, run_error
        self.rank = stall["rank"]
        where = f"at step {stall['step']}" if stall["step"] is not None else "before its first step"
        super().__init__(f"rank {stall['rank']} hung {where}: no heartbeat for {stall['seconds']:.1f} s (watchdog."
                         f"timeout_s = {stall['timeout_s']:g}); the job was stopped, no restart left "
                         f"(--max-restarts)\n{run_error}")
