"""Start a distributed job from a notebook cell: the one way this course starts processes (lesson 00).

    from course_lib.runtime.launch import run
    res = run(fn, nprocs=2, args=(...,))
    res.returns          # fn's return value on every rank

`run` starts the real launcher, ``python -m torch.distributed.run`` (torchrun), exactly as on a cluster:
a standalone c10d rendezvous on a port the OS picks (so two notebooks never collide), one worker process
per rank, gloo on CPU and NCCL with one GPU per rank on CUDA. The function is pickled by value
(cloudpickle), so functions defined in a notebook cell work. Each rank writes its own log; rank 0's log is
streamed live into the notebook. On error, timeout or interrupt the whole process tree is killed, and the
results of ranks that finished are kept (``exc.partial``).

The ranks of a finished run stay warm for the next run with the same ranks, backend, threads and environment
(`course_lib.runtime.pool`): a re-run costs milliseconds instead of the seconds of a start-up, starts from a fresh
process's state, and fails exactly as a fresh run fails. ``fresh=True`` asks for new processes.

Here: the public API (`run`, `run_nodes`, `run_script`, `RunResult` and the errors), the checks of its arguments,
and the run itself, fresh (`_launch`) or warm (`_launch_pooled`), ending in one result or one error (`_outcome`).
The torchrun command line, the run folder and reading what torchrun and the ranks left in it are
`course_lib.runtime.torchrun`'s; pickling the function for the ranks is `course_lib.runtime.payload`'s.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from course_lib import reference
from course_lib.runtime import pool as pool_mod
from course_lib.runtime import procs, torchrun
from course_lib.runtime.payload import pickle_payload
from course_lib.runtime.torchrun import torchrun_command

MAX_PROCS = 64


class LaunchError(RuntimeError):
    """Bad input to `run`, found before anything starts."""


class DistributedRunError(RuntimeError):
    """A rank failed. ``rank`` names it, ``traceback`` is that rank's own traceback, ``partial`` holds
    the `RunResult` of the ranks that finished (``None`` for the others)."""

    def __init__(self, message: str, *, rank: int | None, traceback: str, partial: "RunResult"):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.partial = partial


class RunTimeout(DistributedRunError, TimeoutError):
    """The run did not finish within ``timeout_s``; every process was killed."""


class RunInterrupted(KeyboardInterrupt):
    """The kernel was interrupted during a run; every process was killed. ``partial`` as above."""

    def __init__(self, message: str, partial: "RunResult"):
        super().__init__(message)
        self.partial = partial


@dataclasses.dataclass
class RunResult:
    """What a distributed run produced. Lists are indexed by rank."""

    returns: list[Any]
    logs: list[Path]
    wall_s: float
    backend: str
    devices: list[str | None]
    nprocs: int
    run_dir: Path
    timings: list[dict | None]  # per rank: absolute times of process start, imports, rendezvous, work
    launch_time: float  # absolute time the launcher was started
    threads_per_rank: int = 1
    p2p_posts: list | None = None  # per rank, its point-to-point posts, when NCCL's rules were checked
    pooled: bool = False  # ran on warm ranks (`course_lib.runtime.pool`) rather than freshly started ones

    @property
    def value(self) -> Any:
        """Rank 0's return value."""
        return self.returns[0]

    def log(self, rank: int = 0) -> str:
        """The text of one rank's log."""
        path = self.logs[rank]
        return path.read_text(errors="replace") if path.exists() else ""

    def breakdown(self) -> dict[str, float]:
        """Where the wall time went, in seconds (latest rank at each phase)."""
        done = [t for t in self.timings if t]
        if not done:
            return {}
        phase = lambda key: max(t[key] for t in done)  # noqa: E731
        out = {
            "launcher + process start": phase("process_start") - self.launch_time,  # a warm run: sending it
            "imports (torch)": phase("imports_done") - phase("process_start"),
            "rendezvous + process group": phase("rendezvous_done") - phase("imports_done"),
            "work": phase("work_done") - phase("rendezvous_done"),
        }
        out["shutdown + collect"] = self.wall_s - sum(out.values())
        return out

    def summary(self) -> str:
        devices = sorted({d for d in self.devices if d})
        return (f"{self.nprocs} ranks, backend {self.backend}, devices {', '.join(devices) or '?'}, "
                f"{self.threads_per_rank} thread(s)/rank, {'warm' if self.pooled else 'fresh'} processes, "
                f"wall {self.wall_s:.2f} s")


# ----------------------------------------------------------------------------------------- checks

def _validate_nprocs(nprocs: Any) -> int:
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise LaunchError(f"nprocs={nprocs!r} must be an int: the number of ranks, e.g. nprocs=2")
    if nprocs < 1:
        raise LaunchError(f"nprocs={nprocs} must be at least 1: the number of ranks, e.g. nprocs=2")
    if nprocs > MAX_PROCS:
        raise LaunchError(f"nprocs={nprocs} is more than this launcher allows on one node ({MAX_PROCS}); "
                          f"use a smaller number (this machine has {procs.usable_cores()} cores)")
    return nprocs


def resolve_backend(backend: str, nprocs: int) -> str:
    """'auto' -> `course_lib.dist.pick_backend` (NCCL with one GPU per rank when there are enough GPUs, else
    gloo on the CPU); 'gloo' or 'nccl' are checked against what the machine has."""
    import torch

    if backend == "auto":
        from course_lib.dist import pick_backend

        return pick_backend(nprocs)
    if backend not in ("gloo", "nccl"):
        raise LaunchError(f"backend={backend!r} is not supported: use 'auto', 'gloo' or 'nccl'")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LaunchError("backend='nccl' needs CUDA GPUs and this machine has none: "
                              "use backend='auto' or 'gloo' to run on the CPU")
        n_gpu = torch.cuda.device_count()
        if nprocs > n_gpu:
            raise LaunchError(f"nprocs={nprocs} ranks need {nprocs} GPUs (one per rank) but this machine has "
                              f"{n_gpu}: use nprocs<={n_gpu}, or backend='auto' or 'gloo' to run on the CPU")
    return backend


def _validate_call(fn: Any, args: Any, kwargs: Any, where: str = "run") -> None:
    """``fn`` callable, ``args`` a tuple or list (not a single value, a string or a dict), ``kwargs`` a dict with
    string keys or None: checked before anything starts, so that a bad call is not a rank's traceback."""
    if not callable(fn):
        raise LaunchError(f"{where}: fn={fn!r} is not callable: pass the function every rank runs")
    if isinstance(args, (str, bytes, dict)) or not isinstance(args, (tuple, list)):
        raise LaunchError(f"{where}: args={args!r} must be a tuple or list of fn's positional arguments "
                          f"(got {type(args).__name__}); one argument x is args=(x,)")
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise LaunchError(f"{where}: kwargs={kwargs!r} must be a dict of fn's keyword arguments by name, or None")


def _validate_env(env: Any) -> None:
    if env is not None and (not isinstance(env, dict)
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise LaunchError(f"env={env!r} must be a dict of strings (variable name -> value), or None")


def _validate_timeout(timeout_s: Any) -> None:
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise LaunchError(f"timeout_s={timeout_s!r} must be a positive number of seconds")


def _validate_threads(threads_per_rank: Any) -> None:
    most = os.cpu_count() or 1
    if threads_per_rank is None:
        return
    if isinstance(threads_per_rank, bool) or not isinstance(threads_per_rank, int) \
            or not 1 <= threads_per_rank <= most:
        raise LaunchError(f"threads_per_rank={threads_per_rank!r} must be an int from 1 to {most} (this machine's "
                          f"logical CPUs), or None to share the cores among the ranks")


def _validate_port(port: int | None) -> None:
    if port is None:
        return
    if not isinstance(port, int) or not 0 < port < 65536:
        raise LaunchError(f"port={port!r} must be an int in 1..65535, or None to let the OS pick a free one")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise LaunchError(f"port={port} is already in use: pass port=None (the default) to let the OS "
                              f"pick a free one, or choose another port") from None


# --------------------------------------------------------------------------------------- the run

def _job_dir(fn: Callable, args: Sequence, kwargs: dict | None, backend: str, threads: int, timeout_s: float) -> Path:
    """A new run folder holding the job, pickled by value (`course_lib.runtime.payload`), and its settings."""
    try:
        payload = pickle_payload(fn, args, kwargs or {})
    except Exception as exc:  # noqa: BLE001 - pickling fails in many ways
        raise LaunchError(
            f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: {type(exc).__name__}: "
            f"{exc}. Everything a rank needs must be picklable: create locks, files, sockets and "
            f"process groups inside the function, not outside it") from None
    return torchrun.job_dir(payload, backend, threads, timeout_s)


def _collect(run_dir: Path, nprocs: int, backend: str, wall_s: float, launch_time: float,
             threads: int) -> RunResult:
    """The `RunResult` of what the ranks left in ``run_dir`` (None for a rank that wrote no result)."""
    records = torchrun.rank_records(run_dir, nprocs)
    returns = [rec["value"] if rec else None for rec in records]
    devices = [rec["device"] if rec else None for rec in records]
    timings = [rec["timings"] if rec else None for rec in records]
    posts = [rec.get("p2p") if rec else None for rec in records]
    logs = [run_dir / f"rank{r}.log" for r in range(nprocs)]
    reference.collect_from(run_dir)                      # the course's answers a learner's code called in a rank
    return RunResult(returns, logs, wall_s, backend, devices, nprocs, run_dir, timings, launch_time, threads,
                     posts if any(p is not None for p in posts) else None)


def _failure(result: RunResult, launcher_log: Path, returncode: int | None) -> DistributedRunError:
    """One error that names the rank that failed first and shows its own traceback, or its log (`torchrun.blame`)."""
    finished = [r for r in range(result.nprocs) if result.timings[r] is not None]
    found = torchrun.blame(result.run_dir, result.nprocs, finished, launcher_log, returncode)
    return DistributedRunError(found.message, rank=found.rank, traceback=found.traceback, partial=result)


def _launch(target: Sequence[str], nprocs: int, backend: str, timeout_s: float, env: dict | None,
            stream: bool, run_dir: Path, port: int | None, threads: int, nnodes: int = 1,
            max_restarts: int = 0, on_poll: Callable[[], None] | None = None) -> RunResult:
    tag = procs.new_tag("launch")
    launcher_log = run_dir / "launcher.log"
    launch_time = time.time()
    t0 = time.perf_counter()
    streamer = torchrun.Streamer(run_dir / "rank0.log", stream)
    child_env = torchrun.child_env(env, threads, tag)
    launchers = []
    for node, (cmd, node_env) in enumerate(torchrun.node_commands(target, nprocs, nnodes, port, child_env, run_dir,
                                                                  max_restarts)):
        log = launcher_log if node == 0 else run_dir / f"launcher{node}.log"
        with open(log, "wb") as out:
            launchers.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=node_env, cwd=os.getcwd(), start_new_session=True))
    state = "running"
    results = [run_dir / f"result{r}.pkl" for r in range(nprocs)]
    all_done_at = None
    try:
        while True:
            codes = [p.poll() for p in launchers]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                torchrun.let_the_others_report(launchers)
                break                          # all launchers done, or one failed (its ranks are gone)
            time.sleep(0.05)
            streamer.pump()
            if on_poll is not None:
                on_poll()
            now = time.perf_counter()
            if now - t0 > timeout_s:
                state = "timeout"
                break
            # Every rank has written its result: torchrun's own shutdown adds nothing, so don't wait for it.
            if all_done_at is None and all(p.exists() for p in results):
                all_done_at = now
            if all_done_at is not None and now - all_done_at > 0.2:
                state = "done"
                break
    except KeyboardInterrupt:
        state = "interrupted"
    finally:
        exited = [p.poll() for p in launchers]        # before the clean-up kills what is left
        for launcher in launchers:
            procs.kill_tree(launcher.pid, tag=tag, grace_s=1.0)
            launcher.wait()
        streamer.pump()
    wall = time.perf_counter() - t0
    result = _collect(run_dir, nprocs, backend, wall, launch_time, threads)
    failed = next((i for i, code in enumerate(exited) if code), 0)   # the launcher that failed first, if one did
    log = launcher_log if failed == 0 else run_dir / f"launcher{failed}.log"
    return _outcome(state, result, log, launchers[failed].returncode, timeout_s)


def _outcome(state: str, result: RunResult, launcher_log: Path, returncode: int | None,
             timeout_s: float) -> RunResult:
    """The result of a finished run, or the one error that says what went wrong (fresh and pooled alike)."""
    nprocs, run_dir, wall = result.nprocs, result.run_dir, result.wall_s
    done = [r for r in range(nprocs) if result.timings[r] is not None]
    if state == "interrupted":
        raise RunInterrupted(f"interrupted after {wall:.1f} s; all processes were stopped. Ranks that had "
                             f"finished: {done}. Logs: {run_dir}", result)
    if state == "timeout":
        lagging = [r for r in range(nprocs) if r not in done]
        hint = "\n".join(f"--- last lines of rank {r}'s log ---\n{torchrun.tail(result.logs[r], 8)}"
                         for r in lagging[:2])
        raise RunTimeout(
            f"the run did not finish within timeout_s={timeout_s:g} s and was stopped (all processes killed). "
            f"Ranks {lagging} had not finished (a rank waiting in a collective that another rank never calls "
            f"hangs forever); ranks {done} had.\n{hint}\nlogs: {run_dir}",
            rank=lagging[0] if lagging else None, traceback="", partial=result)
    if len(done) < nprocs or (returncode != 0 and state != "done"):
        raise _failure(result, launcher_log, returncode)
    if result.p2p_posts is not None:                  # the ranks checked NCCL's rules: replay their messages
        from course_lib.runtime.nccl_rules import replay_pairs

        found = replay_pairs(result.p2p_posts)
        if found:
            raise DistributedRunError("NCCL's rules (course_lib/runtime/nccl_rules.py, rule 2), which gloo forgives: "
                                      + "; ".join(found) + f"\nlogs: {run_dir}", rank=None, traceback="",
                                      partial=result)
    return result


#: After a rank of a warm pool reports a failed run, how long the others may take to fail too (a peer blocked on it in
#: a collective fails at once, when its connections close) and to rejoin; then the pool is shut down, as torchrun
#: stops the survivors of a fresh run.
REJOIN_GRACE_S = 5.0


def _launch_pooled(warm: "pool_mod.Pool", nprocs: int, backend: str, timeout_s: float, stream: bool,
                   run_dir: Path, threads: int) -> RunResult:
    """Run the job in ``run_dir`` on a warm pool: the same files, errors and guarantees as `_launch`.
    A pool whose ranks raised and rejoined a new process group (gloo) is kept; one that dies, times out, is
    interrupted, asks to retire, or whose failed run leaves a rank unaccounted for ``REJOIN_GRACE_S`` is shut down,
    and the next run starts a new one."""
    launch_time = time.time()
    t0 = time.perf_counter()
    streamer = torchrun.Streamer(run_dir / "rank0.log", stream)
    state = "running"
    try:
        if not warm.started:
            warm.start(deadline=t0 + timeout_s)
        warm.submit(run_dir, os.getcwd())
        while state == "running":
            status = warm.wait(0.05)
            streamer.pump()
            if status == "ready":
                state = "failed" if warm.failed else "done"
            elif status == "dead":
                state = "failed"
            elif warm.failed and time.perf_counter() - warm.first_failure > REJOIN_GRACE_S:
                state = "stuck"            # a rank neither failed nor finished: blocked for good, or slow
            elif time.perf_counter() - t0 > timeout_s:
                state = "timeout"
    except KeyboardInterrupt:
        state = "interrupted"
    except TimeoutError:
        state = "timeout"
    except (pool_mod.PoolStartError, OSError) as exc:     # a rank gone before the run reached it, a socket error
        warm.shutdown()
        warm.release()
        raise DistributedRunError(f"the warm ranks did not take the run: {exc}", rank=None, traceback="",
                                  partial=_collect(run_dir, nprocs, backend, time.perf_counter() - t0,
                                                   launch_time, threads)) from None
    try:
        kept = state == "failed" and warm.alive() and len(warm.ready) == nprocs
        if (state != "done" and not kept) or warm.retire:
            warm.shutdown()
            state = "failed" if state == "stuck" else state
            if state == "failed":          # torchrun has exited: its log names the rank that died
                state = "done" if all((run_dir / f"result{r}.pkl").exists() for r in range(nprocs)) else state
        streamer.pump()
    finally:
        warm.release()
    wall = time.perf_counter() - t0
    result = _collect(run_dir, nprocs, backend, wall, launch_time, threads)
    result.pooled = True
    ended = warm.proc is not None and warm.proc.poll() is not None
    returncode = warm.proc.returncode if ended and state == "failed" else 0
    return _outcome(state, result, warm.launcher_log, returncode, timeout_s)


def _pool_for(nprocs: int, backend: str, threads: int, env: dict | None) -> "pool_mod.Pool | None":
    """The warm pool these settings share (None when it is busy with a concurrent run)."""
    child_env = torchrun.child_env(env, threads, tag="")
    key_env = {k: v for k, v in child_env.items() if k not in (procs.TAG_VAR, "PYTEST_CURRENT_TEST")}
    key = (nprocs, backend, threads, tuple(sorted(key_env.items())))
    settings = {"backend": backend, "threads_per_rank": threads}
    make = lambda: pool_mod.Pool(key, nprocs, lambda folder: torchrun_command(  # noqa: E731
        ["-m", "course_lib.runtime._pool_worker", str(folder)], nprocs), child_env, settings, torchrun.runs_base())
    return pool_mod.acquire(key, make)


def run(fn: Callable, nprocs: int, *, args: Sequence = (), kwargs: dict | None = None, backend: str = "auto",
        timeout_s: float = 300.0, env: dict | None = None, stream: bool = True, port: int | None = None,
        threads_per_rank: int | None = None, fresh: bool = False) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` ranks under torchrun and return every rank's result.

    Inside ``fn`` the default process group is initialised (gloo on CPU, NCCL with the GPU set to
    LOCAL_RANK on CUDA): call ``torch.distributed`` directly, or `course_lib.dist`.

    Args:
        fn: the function each rank runs; its return value comes back (tensors moved to the CPU).
        nprocs: number of ranks (processes) on this machine.
        backend: 'auto' (NCCL with one GPU per rank where there are enough GPUs, else gloo: `dist.pick_backend`),
            'gloo' or 'nccl'.
        timeout_s: wall-clock limit; past it every process is killed and `RunTimeout` is raised.
        env: extra environment variables for the ranks.
        stream: show rank 0's output live.
        port: rendezvous port; None lets the OS choose a free one (recommended).
        threads_per_rank: CPU threads per rank; default shares the machine's cores among the ranks.
        fresh: start new processes even where warm ones are available (`course_lib.runtime.pool`): for runs that
            measure a new process (its start-up time, its peak memory) or that kill ranks on purpose.
            Runs with a fixed ``port``, runs inside a rank and runs under COURSE_POOL=0 are always fresh.
    """
    nprocs = _validate_nprocs(nprocs)
    _validate_call(fn, args, kwargs)
    _validate_env(env)
    _validate_timeout(timeout_s)
    _validate_threads(threads_per_rank)
    backend = resolve_backend(backend, nprocs)
    _validate_port(port)
    threads = threads_per_rank or max(1, procs.usable_cores() // nprocs)
    run_dir = _job_dir(fn, args, kwargs, backend, threads, timeout_s)
    if not fresh and port is None and pool_mod.enabled():
        warm = _pool_for(nprocs, backend, threads, env)
        if warm is not None:
            return _launch_pooled(warm, nprocs, backend, timeout_s, stream, run_dir, threads)
    return _launch(["-m", "course_lib.runtime._worker", str(run_dir)], nprocs, backend, timeout_s, env, stream,
                   run_dir, port, threads)


def run_nodes(fn: Callable, nnodes: int, nproc_per_node: int, *, args: Sequence = (), kwargs: dict | None = None,
              backend: str = "auto", timeout_s: float = 300.0, env: dict | None = None,
              stream: bool = True) -> RunResult:
    """`run` with ``nnodes`` "nodes" on this machine: one torchrun launcher of ``nproc_per_node`` ranks per node,
    started as on a cluster (``--nnodes``, a c10d rendezvous, here on the loopback address; the README's multi-node
    command) and meeting there. The ranks see the same world as one launcher of ``nnodes * nproc_per_node``
    (``GROUP_RANK`` tells the node, ``LOCAL_RANK`` the rank in it), so the result must be the same (lesson 08).
    Always fresh processes; the same `RunResult` and errors as `run`."""
    for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LaunchError(f"run_nodes: {name}={value!r} must be a positive int")
    nprocs = _validate_nprocs(nnodes * nproc_per_node)
    _validate_call(fn, args, kwargs, "run_nodes")
    _validate_env(env)
    _validate_timeout(timeout_s)
    backend = resolve_backend(backend, nprocs)
    threads = max(1, procs.usable_cores() // nprocs)
    run_dir = _job_dir(fn, args, kwargs, backend, threads, timeout_s)
    return _launch(["-m", "course_lib.runtime._worker", str(run_dir)], nprocs, backend, timeout_s, env, stream, run_dir,
                   None, threads, nnodes=nnodes)


def run_script(path: str | os.PathLike, nprocs: int, args: Sequence[str] = (), *, timeout_s: float = 600.0,
               env: dict | None = None, stream: bool = True, port: int | None = None,
               print_command: bool = False, nnodes: int = 1, max_restarts: int = 0,
               on_poll: Callable[[], None] | None = None) -> RunResult:
    """Run a Python script under torchrun the same way as `run` (logs, timeout, clean-up).

    The script initialises its own process group (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...).
    Its output goes to ``rank{R}.log`` in the run folder; rank 0's is streamed.
    ``print_command=True`` prints the torchrun command to run it by hand, and the form for ``nnodes`` nodes.
    ``returns`` are None for scripts: read results from files the script writes.
    ``max_restarts``: torchrun restarts every rank up to this many times after one fails (``--max-restarts``);
    the script must resume from its own checkpoint (lesson 09's `course_lib.training.train` does).
    ``on_poll``: called in this thread every 50 ms while the script runs (e.g. to follow a file it writes and
    redraw a plot); Ctrl-C or an error it raises stops the run and kills its processes.
    """
    nprocs = _validate_nprocs(nprocs)
    script = Path(path)
    if not script.is_file():
        raise LaunchError(f"script {str(script)!r} does not exist: pass the path of a .py file")
    if isinstance(args, (str, bytes, dict)) or not isinstance(args, (tuple, list)):
        raise LaunchError(f"run_script: args={args!r} must be a list of the script's command-line arguments "
                          f"(got {type(args).__name__}), e.g. ['--config', 'configs/x.toml']")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise LaunchError(f"run_script: nnodes={nnodes!r} must be a positive int (it only shapes the printed "
                          f"command)")
    if isinstance(max_restarts, bool) or not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise LaunchError(f"run_script: max_restarts={max_restarts!r} must be an int >= 0")
    _validate_env(env)
    _validate_timeout(timeout_s)
    _validate_port(port)
    if print_command:
        print("one node:  ", shlex.join(torchrun_command([str(script), *args], nprocs)))
        print(f"{max(nnodes, 2)} nodes (run on every node):",
              shlex.join(torchrun_command([str(script), *args], nprocs, nnodes=max(nnodes, 2))))
    threads = max(1, procs.usable_cores() // nprocs)
    run_dir = torchrun.new_run_dir()
    wrapper = ["-m", "course_lib.runtime._script", str(run_dir), str(script.resolve()), *map(str, args)]
    return _launch(wrapper, nprocs, "script", timeout_s, env, stream, run_dir, port, threads,
                   max_restarts=max_restarts, on_poll=on_poll)
