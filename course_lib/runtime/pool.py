"""Warm ranks: keep a torchrun job alive between runs, so a re-run costs milliseconds instead of seconds.

A fresh `launch.run` starts torchrun, a Python process per rank, imports torch and meets at the rendezvous:
2.5-4.5 s on the course's 2-core CPU machines before the first line of the function, for work that often takes
milliseconds. A pool does that once per (ranks, backend, threads per rank, environment) and then sends each run
to the same ranks (`course_lib.runtime._pool_worker`), which put themselves back in a fresh process's state after every
run.

    from course_lib.runtime import pool
    pool.enabled()        # False under COURSE_POOL=0, inside a rank, or in the grader's kernels
    pool.shutdown_all()   # what happens anyway when the kernel or the test session exits

A pool is used by one run at a time (a second, concurrent run starts fresh processes). A run whose function raised
on gloo ranks keeps the pool: the ranks rebuild their process group and the next run starts at once
(`course_lib.runtime._pool_worker`); a run that dies without a Python exception, hangs, times out, is interrupted or
fails on NCCL discards it. A pool goes away with its owner: at exit, and if the owner is killed,
because every rank watches its socket to the owner and exits when it closes. ``launch.run(fresh=True)`` skips
the pool for runs that must measure a fresh process (start-up time, peak memory of a new process, faults).
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from course_lib.runtime import procs

#: Most ranks kept warm at once by one process (idle pools beyond it are shut down, least recently used first).
#: A warm rank holds about 0.5 GB (torch imported), so the default keeps at most 8 (4 GB) per kernel.
MAX_WARM_RANKS = int(os.environ.get("COURSE_POOL_MAX_RANKS", "8"))
#: A pool unused for this long is shut down (its memory returned); the next run starts a new one.
IDLE_S = float(os.environ.get("COURSE_POOL_IDLE_S", "900"))
#: Process-group timeout of a pool's ranks; a run's own ``timeout_s`` stops a hang long before it.
PG_TIMEOUT_S = 3600


class PoolStartError(RuntimeError):
    """The pool's ranks did not all start and connect (the launcher log says why)."""


def enabled() -> bool:
    """Runs use warm pools unless COURSE_POOL=0, or this process is itself a rank (a run inside a rank)."""
    return os.environ.get("COURSE_POOL", "1") != "0" and os.environ.get("COURSE_IN_RANK") != "1"


class Pool:
    """One warm torchrun job of ``nprocs`` ranks, started by `start` with the given command and environment."""

    def __init__(self, key: tuple, nprocs: int, cmd_for, env: dict, settings: dict, runs_dir: Path):
        self.key, self.nprocs, self.env, self.settings = key, nprocs, env, settings
        self.cmd_for = cmd_for              # pool folder -> torchrun command line
        self.runs_dir = runs_dir
        self.lock = threading.Lock()        # held by the run using the pool
        self.proc: subprocess.Popen | None = None
        self.conns: dict[int, socket.socket] = {}
        self.buffers: dict[int, bytes] = {}
        self.ready: set[int] = set()
        self.failed: set[int] = set()         # ranks whose function raised in the current run
        self.first_failure: float | None = None
        self.retire = False
        self.last_used = time.monotonic()
        self.tag = procs.new_tag("pool")
        self.dir: Path | None = None
        self._sock_dir: str | None = None
        self._server: socket.socket | None = None
        self._selector = selectors.DefaultSelector()

    # ------------------------------------------------------------------------------------------ state
    @property
    def started(self) -> bool:
        return self.proc is not None

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    @property
    def launcher_log(self) -> Path:
        return self.dir / "launcher.log"

    def pids(self) -> list[int]:
        """Process ids of the launcher and its ranks (for tests: nothing else may be left behind)."""
        return [p.pid for p in procs.tagged_processes(self.tag)]

    # ------------------------------------------------------------------------------------------ start
    def start(self, deadline: float) -> None:
        """Start torchrun and wait until every rank has joined the process group and connected (or raise)."""
        self.dir = Path(tempfile.mkdtemp(prefix="pool-", dir=self.runs_dir))
        self._sock_dir = tempfile.mkdtemp(prefix="cpool-")   # short path: a socket's name has ~100 bytes
        path = os.path.join(self._sock_dir, "s")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(self.nprocs)
        self._server.settimeout(0.05)
        settings = dict(self.settings, socket=path, launcher_pid=os.getpid(), pg_timeout_s=PG_TIMEOUT_S)
        (self.dir / "settings.json").write_text(json.dumps(settings))
        env = dict(self.env, **{procs.TAG_VAR: procs.nested_tag(self.tag)})
        with open(self.launcher_log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd_for(self.dir), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        pending: list[socket.socket] = []
        while len(self.conns) < self.nprocs:
            if self.proc.poll() is not None:
                raise PoolStartError(self._why("torchrun exited while the ranks were starting"))
            if time.perf_counter() > deadline:
                raise TimeoutError("the ranks did not start in time")
            try:
                conn, _ = self._server.accept()
                conn.settimeout(5)
                pending.append(conn)
            except socket.timeout:
                pass
            for conn in list(pending):
                hello = conn.recv(64).decode().split()
                pending.remove(conn)
                rank = int(hello[1])
                conn.setblocking(False)
                self.conns[rank] = conn
                self.buffers[rank] = b""
                self._selector.register(conn, selectors.EVENT_READ, rank)

    def _why(self, what: str) -> str:
        tail = self.launcher_log.read_text(errors="replace")[-3000:] if self.launcher_log.exists() else ""
        ranks = "".join(f"\n--- rank {r} ---\n{(self.dir / f'rank{r}.log').read_text(errors='replace')[-1500:]}"
                        for r in range(self.nprocs) if (self.dir / f"rank{r}.log").exists())
        return f"{what}.\n--- launcher (torchrun) ---\n{tail}{ranks}\nfolder: {self.dir}"

    # ------------------------------------------------------------------------------------------ a run
    def submit(self, run_dir: Path, cwd: str) -> None:
        """Send one run to every rank."""
        self.ready.clear()
        self.failed.clear()
        self.first_failure = None
        line = ("job " + json.dumps({"run_dir": str(run_dir), "cwd": cwd}) + "\n").encode()
        for conn in self.conns.values():
            conn.setblocking(True)
            conn.sendall(line)
            conn.setblocking(False)

    def wait(self, timeout: float) -> str:
        """'ready' when every rank has finished the run and cleaned up (those in ``failed`` after rejoining a new
        process group), 'dead' when torchrun has exited, 'running' otherwise (after waiting at most ``timeout`` s)."""
        for key, _ in self._selector.select(timeout):
            rank = key.data
            try:
                chunk = self.conns[rank].recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self._selector.unregister(self.conns[rank])
                continue
            self.buffers[rank] += chunk
            while b"\n" in self.buffers[rank]:
                line, self.buffers[rank] = self.buffers[rank].split(b"\n", 1)
                words = line.decode().split()
                if words and words[0] == "ready":
                    self.ready.add(rank)
                    self.retire = self.retire or "retire" in words
                elif words and words[0] == "failed":
                    self.failed.add(rank)
                    self.first_failure = self.first_failure or time.perf_counter()
        if len(self.ready) == self.nprocs:
            return "ready"
        return "dead" if self.proc.poll() is not None else "running"

    def release(self) -> None:
        """The run using the pool is over (the idle clock starts now)."""
        self.last_used = time.monotonic()
        self.lock.release()

    # --------------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop every process of the pool (nothing is left behind) and remove its socket."""
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        self.conns.clear()
        if self._server is not None:
            self._server.close()
        if self.proc is not None:
            procs.kill_tree(self.proc.pid, tag=self.tag, grace_s=0.5)
            self.proc.wait()
        if self._sock_dir:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        self._selector.close()
        with _REGISTRY_LOCK:
            if _POOLS.get(self.key) is self:
                del _POOLS[self.key]


# ------------------------------------------------------------------------------------------- registry

_POOLS: dict[tuple, Pool] = {}
_REGISTRY_LOCK = threading.Lock()


def acquire(key: tuple, make) -> Pool | None:
    """The pool for ``key``, created by ``make()`` if there is none; None when it is busy with another run.
    The caller calls ``pool.release()`` when its run ends."""
    retired = []
    with _REGISTRY_LOCK:
        pool = _POOLS.get(key)
        if pool is not None and not pool.alive():
            retired.append(_POOLS.pop(key))
            pool = None
        if pool is None:
            pool = make()
            idle = sorted((p for p in _POOLS.values() if not p.lock.locked()), key=lambda p: p.last_used)
            while idle and sum(p.nprocs for p in _POOLS.values()) + pool.nprocs > MAX_WARM_RANKS:
                retired.append(_POOLS.pop(idle.pop(0).key))
            _POOLS[key] = pool
        busy = not pool.lock.acquire(blocking=False)
    for old in retired:
        old.shutdown()
    if busy:
        return None
    pool.last_used = time.monotonic()
    _start_reaper()
    return pool


def _reap_idle() -> None:
    """Shut down pools nobody has used for `IDLE_S` seconds (a daemon thread that looks once a second)."""
    while True:
        time.sleep(1.0)
        for p in warm_pools():
            if time.monotonic() - p.last_used > IDLE_S and p.lock.acquire(blocking=False):
                try:
                    if time.monotonic() - p.last_used > IDLE_S:
                        p.shutdown()
                finally:
                    p.lock.release()


_REAPER: threading.Thread | None = None


def _start_reaper() -> None:
    global _REAPER
    if _REAPER is None or not _REAPER.is_alive():
        _REAPER = threading.Thread(target=_reap_idle, name="course-pool-reaper", daemon=True)
        _REAPER.start()


def warm_pools() -> list[Pool]:
    """The pools of this process (started or not)."""
    with _REGISTRY_LOCK:
        return list(_POOLS.values())


def shutdown_all() -> None:
    """Stop every pool of this process (at exit, and for tests)."""
    for pool in warm_pools():
        pool.shutdown()


def _forget_after_fork() -> None:
    """A forked child does not own its parent's pools (nor the reaper thread, which a fork does not copy)."""
    global _REAPER
    _POOLS.clear()
    _REAPER = None


atexit.register(shutdown_all)
os.register_at_fork(after_in_child=_forget_after_fork)
