"""Talking to torchrun and its files (lesson 00): the command line, the ranks' environment, the run folder, rank 0's
log streamed live, and reading back what the ranks and torchrun's elastic agent left there.

A run folder (under ``$COURSE_RUNS_DIR``, default ``<tmp>/course_runs``) holds, for a job of ``n`` ranks:

    payload.pkl, settings.json     the job (`course_lib.runtime.payload`) and what every rank reads before it
    rank{R}.log                    everything rank R printed (rank 0's is streamed into the notebook)
    result{R}.pkl | error{R}.json  rank R's return value and timings, or its Python error and traceback
    launcher.log, launcher{N}.log  torchrun's own output, one per launcher ("node"): its report of how ranks ended

This module knows nothing of the launcher's result and errors (`course_lib.runtime.launch` builds those): it returns
plain records, a command line, a `Failure` to blame.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Sequence

from course_lib import reference
from course_lib.runtime import procs

STREAM_LIMIT_BYTES = 200_000  # rank 0 output shown in the notebook; the log keeps everything


# --------------------------------------------------------------------------------- run folders

def runs_base() -> Path:
    base = Path(os.environ.get("COURSE_RUNS_DIR", Path(tempfile.gettempdir()) / "course_runs"))
    base.mkdir(parents=True, exist_ok=True)
    return base


def new_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs_base()))


def job_dir(payload: bytes, backend: str, threads: int, timeout_s: float) -> Path:
    """A new run folder holding the pickled job and the settings every rank reads (`course_lib.runtime._worker`)."""
    run_dir = new_run_dir()
    (run_dir / "payload.pkl").write_bytes(payload)
    reference.write_job(run_dir)                         # while graded: the guard goes to the ranks too
    (run_dir / "settings.json").write_text(json.dumps({
        "backend": backend, "threads_per_rank": threads, "pg_timeout_s": max(30, int(timeout_s) + 30)}))
    return run_dir


# ------------------------------------------------------------------------ starting torchrun

def child_env(extra: dict | None, threads: int, tag: str) -> dict:
    """The environment of torchrun and its ranks: ours, ``threads`` CPU threads per rank, unbuffered output,
    faulthandler on, the process tag that `procs.kill_tree` finds them by, and ``extra`` on top."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        "TORCHELASTIC_ERROR_FILE": "",  # our worker writes its own error file
        procs.TAG_VAR: procs.nested_tag(tag),
    })
    # Make sure course_lib is importable by the workers even when it is not installed.
    root = str(Path(__file__).resolve().parents[2])      # the folder holding course_lib (this is course_lib/runtime/)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def torchrun_command(target: Sequence[str], nprocs: int, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     port: int | None = None, rdzv_id: str = "course", max_restarts: int = 0) -> list[str]:
    """The torchrun command line for ``target`` (``['-m', 'module', ...]`` or ``['script.py', ...]``).

    ``max_restarts``: how often torchrun's elastic agent restarts every rank after one fails (lesson 09).

    One node: a standalone rendezvous on a free port (``localhost:0``) or on ``port``.
    Several nodes: the same command on every node with ``--nnodes`` and a shared rendezvous endpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}"]
    if nnodes > 1:
        endpoint = rdzv_endpoint or "HEAD_NODE_ADDRESS:29500"
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    elif port is not None:
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    else:
        cmd += ["--standalone"]
    return cmd + [f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *target]


def node_commands(target: Sequence[str], nprocs: int, nnodes: int, port: int | None, env: dict,
                  run_dir: Path, max_restarts: int = 0) -> list[tuple[list[str], dict]]:
    """(command, environment) of each torchrun launcher: one, or ``nnodes`` "nodes" on this machine that meet in a
    c10d rendezvous on the loopback address, as real nodes do on the head node's (with GPUs, each node gets its
    own ``nprocs / nnodes`` of them through CUDA_VISIBLE_DEVICES)."""
    if nnodes == 1:
        return [(torchrun_command(target, nprocs, port=port, max_restarts=max_restarts), env)]
    per_node = nprocs // nnodes
    endpoint = f"127.0.0.1:{port or procs.free_port()}"
    gpus = [str(g) for g in range(_gpu_count())]
    out = []
    for node in range(nnodes):
        cmd = torchrun_command(target, per_node, nnodes=nnodes, rdzv_endpoint=endpoint, rdzv_id=run_dir.name)
        node_env = dict(env)
        if len(gpus) >= nprocs:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[node * per_node:(node + 1) * per_node])
        out.append((cmd, node_env))
    return out


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------- while it runs, and after

class Streamer:
    """Copies new bytes of rank 0's log to our stdout (the notebook), up to a limit."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled, self.pos, self.shown = path, enabled, 0, 0

    def pump(self) -> None:
        if not self.enabled or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            chunk = f.read(1 << 20)
        self.pos += len(chunk)
        if not chunk or self.shown > STREAM_LIMIT_BYTES:
            return
        room = STREAM_LIMIT_BYTES - self.shown
        text = chunk[:room].decode("utf-8", errors="replace")
        self.shown += len(chunk)
        if self.shown > STREAM_LIMIT_BYTES:
            text += f"\n[rank 0 output truncated here; the full log is {self.path}]\n"
        sys.stdout.write(text)
        sys.stdout.flush()


def let_the_others_report(launchers: list, grace_s: float = 2.0) -> None:
    """After one node's launcher failed, give the other nodes' launchers a moment to end on their own: each prints
    torchrun's report of its own ranks, and the rank that died (`blame`) may be on a node other than the one
    whose launcher ended first. A launcher whose ranks still wait is killed after ``grace_s``."""
    deadline = time.perf_counter() + grace_s
    while len(launchers) > 1 and any(p.poll() is None for p in launchers) and time.perf_counter() < deadline:
        time.sleep(0.05)


def rank_records(run_dir: Path, nprocs: int) -> list[dict | None]:
    """What each rank wrote to ``result{R}.pkl`` (its return value, device, timings and, when NCCL's rules were
    checked, its point-to-point posts), or None for a rank that wrote no result (a torn file counts as none)."""
    records = []
    for r in range(nprocs):
        path = run_dir / f"result{r}.pkl"
        record = None
        if path.exists():
            try:
                with open(path, "rb") as f:
                    record = pickle.load(f)
            except Exception:  # noqa: BLE001 - a torn file counts as no result
                record = None
        records.append(record)
    return records


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").rstrip().splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


# ----------------------------------------------------------------------- how a job ended

def _torchrun_report(launcher_logs: Sequence[Path]) -> dict[int, int]:
    """rank -> exit code of every rank that ended on its own, as torchrun's elastic agent reports it.

    The agent prints a "Failures" / "Root Cause" report with ``rank : R (local_rank: L)`` and ``exitcode : C (pid:
    P)`` per failed worker (a negative code is a signal). Its "Root Cause" is not the rank that died: all failures
    seen in one poll share a timestamp, so a survivor that already failed in a collective can win the tie. Newer
    releases also list the workers the agent stopped itself (SIGTERM, SIGKILL after a grace period, logged as
    "Sending process P closing signal ..."): those are left out, as the rank that died is never among them."""
    found: dict[int, int] = {}
    for log in launcher_logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        stopped = {int(p) for p in re.findall(r"(?:Sending|Unable to shutdown) process (\d+)", text)}
        entries = re.finditer(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?",
                              text, re.MULTILINE)
        for m in entries:
            rank, code, pid = int(m.group(1)), int(m.group(2)), m.group(3)
            if code == 0 or (int(pid) in stopped if pid and stopped else code == -signal.SIGTERM):
                continue
            found[rank] = code
    return found


#: What a signal that ends a rank most often means.
_SIGNAL_CAUSES = {
    "SIGKILL": "often the out-of-memory killer; see dmesg",
    "SIGSEGV": "a crash in C/C++ code or a CUDA error",
    "SIGABRT": "an abort in C/C++ code (a failed check, an uncaught C++ exception)",
    "SIGBUS": "a bad memory access in C/C++ code (or /dev/shm is full)",
    "SIGTERM": "stopped from outside (a scheduler's time limit, kill)",
}


def _how_it_ended(exitcode: int | None) -> str:
    """'was killed by SIGKILL: often the out-of-memory killer; see dmesg', 'exited with code 3 without ...'."""
    if exitcode is None:
        return "ended without a result and without a Python traceback"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}: {_SIGNAL_CAUSES.get(name, 'a signal from the system or another process')}"
    return f"exited with code {exitcode} without a Python traceback (os._exit or a C/C++ abort)"


class Failure(NamedTuple):
    """What `blame` found: the message of the one error to raise, the rank it names (None: the launcher itself
    failed) and that rank's own Python traceback ('' when it left none)."""

    message: str
    rank: int | None
    traceback: str


def blame(run_dir: Path, nprocs: int, finished: Sequence[int], launcher_log: Path, returncode: int | None) -> Failure:
    """The rank that failed first, with its own traceback (or its log), from the files of a failed run; ``finished``:
    the ranks that wrote a result.

    A rank that dies without a Python traceback (os._exit, SIGKILL from the out-of-memory killer, SIGSEGV from
    C/C++ or CUDA code) writes nothing, while the ranks blocked in a collective with it then raise ("Connection
    reset by peer") and write their errors, or are stopped by torchrun: the rank to blame is the one that ended,
    by torchrun's report, with neither a result nor an error. Only when there is none is it the earliest error."""
    n = nprocs
    errors = {}
    for r in range(n):
        path = run_dir / f"error{r}.json"
        if path.exists():
            try:
                errors[r] = json.loads(path.read_text())
            except ValueError:
                pass
    ended = _torchrun_report(sorted(launcher_log.parent.glob("launcher*.log")))
    unfinished = [r for r in range(n) if r not in finished and r not in errors]   # no result, no error
    silent = [r for r in unfinished if r in ended]     # ended on their own: they died
    if silent or not errors:
        # No Python error to blame: a rank died or the launcher itself failed.
        rank = (silent or unfinished or [None])[0]
        if rank is None:
            msg = (f"the launcher (torchrun) of {n} ranks failed (launcher exit code {returncode})\n"
                   f"--- last lines of the launcher (torchrun) ---\n{tail(launcher_log, 20)}\n")
            return Failure(msg + f"logs: {run_dir}", None, "")
        log = run_dir / f"rank{rank}.log"
        msg = (f"rank {rank} of {n} {_how_it_ended(ended.get(rank))}\n"
               f"--- last lines of rank {rank}'s log ---\n{tail(log, 25)}\n")   # (and faulthandler's)
        after = [f"ranks {sorted(errors)} then failed in collectives" if errors else "",
                 f"ranks {[r for r in silent if r != rank]} also died" if len(silent) > 1 else "",
                 f"ranks {[r for r in unfinished if r not in silent]} were stopped by torchrun"
                 if len(unfinished) > len(silent) else ""]
        if any(after):
            msg += f"\n{' and '.join(a for a in after if a)} because rank {rank} left"
            if errors:
                first = errors[min(errors, key=lambda r: errors[r]["time"])]
                text = (first["message"].splitlines() or [""])[0]
                msg += f" (rank {first['rank']}: {first['type']}: {text[:150] + '...' if len(text) > 150 else text})"
        msg += f"\nlogs: {run_dir}"
        return Failure(msg, rank, "")
    first = min(errors.values(), key=lambda e: e["time"])
    others = sorted(r for r in errors if r != first["rank"])
    msg = (f"rank {first['rank']} of {n} failed with {first['type']}: {first['message']}\n\n"
           f"--- traceback of rank {first['rank']} ---\n{first['traceback'].rstrip()}\n")
    if others:
        msg += f"\n(ranks {others} failed after it, most likely because rank {first['rank']} left)"
    msg += f"\nlogs: {run_dir}"
    return Failure(msg, first["rank"], first["traceback"])
