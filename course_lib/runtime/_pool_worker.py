"""The program torchrun starts in every rank of a warm pool (`course_lib.runtime.pool`).

    python -m torch.distributed.run ... -m course_lib.runtime._pool_worker POOL_DIR

Like `course_lib.runtime._worker`, but it stays: it imports torch and joins the default process group once, then
connects to the launcher's socket and runs one job after another. For each job the launcher sends a line
``job RUN_DIR``; the rank writes its log, result or error to RUN_DIR exactly as a fresh rank would, puts the
process back in the state a fresh one starts in (`Baseline.restore`) and answers ``ready`` (or
``ready retire`` when something could not be put back: the launcher then retires the pool after this run).

A job that raises a Python exception writes its error as a fresh rank would. Under gloo the rank then stays: it
answers ``failed``, destroys every process group it is in (its connections close, so a peer blocked on it fails at
once, as it would if the rank had exited), and joins a new default group with the other ranks (a store prefix of
its own per run, so no stale address is read): the launcher reports the error and keeps the pool, and a learner's
next run does not pay a start-up. A rank that cannot rejoin (a peer still blocked) is killed with the pool after a
grace period (`course_lib.runtime.launch`). Under NCCL, and on KeyboardInterrupt or SystemExit, the rank exits: torchrun
then stops the other ranks and the launcher discards the pool. When the launcher goes away (the kernel exits or
is killed), the socket closes or the launcher's pid disappears, and every rank exits at once.
"""

from __future__ import annotations

import os
import sys
import time
import types

from course_lib.runtime._worker import (T_START, die_with_parent, init_process_group, redirect_output, report_failure,
                                wait_for_every_rank)

#: Packages whose module-level globals may keep a process group or a DeviceMesh that a job created (DeepSpeed's
#: ``groups._WORLD_GROUP``, ``mesh_device``, ...): after a job, references to destroyed ones are cleared.
GROUP_HOLDERS = ("deepspeed", "course_lib", "torch.distributed")
#: Modules whose attributes a job may patch (``torch.nn.functional.scaled_dot_product_attention = ...``):
#: restored after every job, with every class defined in a ``course_lib`` module.
PATCHABLE = ("torch", "torch.nn.functional", "torch.distributed", "torch.nn.modules.module")
TORCH_DEFAULT_SEED = 67280421310721   # torch's default_rng_seed_val


def _modules(prefixes, exact=()) -> list:
    """Loaded modules named in ``exact``, or inside one of the packages ``prefixes``."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name in exact or any(name == p or name.startswith(p + ".") for p in prefixes))]


class Baseline:
    """What a fresh rank looks like, captured once after the process group is up, put back after every job."""

    def __init__(self, threads: int):
        import torch
        import torch.distributed.distributed_c10d as c10d

        self.threads = threads
        # torchrun's store, where a new default group meets after a failed run (None outside a rank: a test)
        self.store = c10d._get_default_store() if c10d.is_initialized() else None
        # A fresh process starts torch's generators from torch's fixed default seed (older releases) or from a
        # random one (newer releases): a job gets the same.
        self.seed = torch.initial_seed() if torch.initial_seed() == TORCH_DEFAULT_SEED else None
        self.groups = set(c10d._world.pg_map)              # the default group (and its internal ones)
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.cwd = os.getcwd()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.threads_alive = set(__import__("threading").enumerate())
        self.warning_filters = list(__import__("warnings").filters)
        self.dicts: dict = {}                              # module or class -> its attributes as first seen
        self._remember()
        import gc

        gc.collect()
        gc.freeze()            # what the pool imported stays: the collection after each job skips it

    def _remember(self) -> None:
        """Record the attributes of modules (and course_lib classes) not seen before. A module first imported
        during a job is recorded as that job left it."""
        for m in _modules(("course_lib",), exact=PATCHABLE):
            if m in self.dicts:
                continue
            self.dicts[m] = dict(vars(m))
            if m.__name__.startswith("course_lib"):
                for value in list(vars(m).values()):
                    if isinstance(value, type) and value.__module__ == m.__name__:
                        self.dicts[value] = dict(vars(value))

    # ------------------------------------------------------------------------------------- before a job
    def prepare(self, cwd: str) -> None:
        """State every job starts from: seeds and counters as in a fresh process, the launcher's folder."""
        import random

        import torch

        os.chdir(cwd)
        if self.seed is None:
            torch.seed()                                  # CPU and every GPU, as a fresh process has them
        else:
            torch.manual_seed(self.seed)
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_num_threads(self.threads)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    # -------------------------------------------------------------------------------------- after a job
    def restore(self) -> list[str]:
        """Undo what a job changed; return what could not be undone (the pool is then retired)."""
        import gc

        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        problems = []
        destroyed = []
        for pg in list(c10d._world.pg_map):               # groups, DeviceMesh dims, DeepSpeed and FSDP groups
            if pg not in self.groups:
                try:
                    dist.destroy_process_group(pg)
                    destroyed.append(pg)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"could not destroy a process group: {exc}")
        self._forget(destroyed)
        try:
            from torch.distributed.device_mesh import _mesh_resources

            getattr(_mesh_resources, "mesh_stack", []).clear()
        except ImportError:
            pass
        for owner, saved in self.dicts.items():           # patched functions, classes and module attributes
            current = vars(owner)
            for key in [k for k in current if k not in saved and not k.startswith("__")]:
                if isinstance(current[key], types.ModuleType):    # a submodule imported by the job stays
                    continue
                if isinstance(owner, type) or owner.__name__.startswith("course_lib"):   # (torch adds its own)
                    try:
                        delattr(owner, key)
                    except (AttributeError, TypeError):
                        pass
            for key, value in saved.items():
                if current.get(key, object()) is not value and not key.startswith("__"):
                    try:
                        setattr(owner, key, value)
                    except (AttributeError, TypeError):
                        pass
        os.environ.clear()
        os.environ.update(self.environ)
        sys.path[:] = self.path
        os.chdir(self.cwd)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.set_float32_matmul_precision(self.matmul_precision)
        if torch.are_deterministic_algorithms_enabled():
            torch.use_deterministic_algorithms(False)     # (the call imports torch._inductor: only when needed)
        if torch.is_anomaly_enabled():
            torch.autograd.set_detect_anomaly(False)
        import warnings

        warnings.filters[:] = self.warning_filters
        getattr(warnings, "_filters_mutated", lambda: None)()
        self._remember()
        extra = [t for t in __import__("threading").enumerate() if t not in self.threads_alive and t.is_alive()]
        if extra:
            problems.append(f"the job left threads running: {[t.name for t in extra]}")
        try:
            import psutil

            children = psutil.Process().children()
            if children:
                problems.append(f"the job left child processes: {[c.pid for c in children]}")
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return problems

    def leave_world(self) -> None:
        """After a failed job: destroy every process group, the default one too. The rank's connections close, so a
        peer blocked on it in a collective fails now instead of waiting forever."""
        import gc

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        groups, pg = list(c10d._world.pg_map), None
        for pg in groups:
            if pg is not c10d._world.default_pg:
                try:
                    dist.destroy_process_group(pg)
                except Exception:  # noqa: BLE001, S110 - a broken group: dropping it is all that is left to do
                    pass
        if dist.is_initialized():
            dist.destroy_process_group()
        self._forget(groups)
        del groups, pg
        self.groups = set()       # the last references: a group's connections close when it is freed
        gc.collect()

    def rejoin_world(self, backend: str, key: str, timeout_s: float) -> None:
        """A new default group of every rank, met under the store prefix ``key`` (one per failed run)."""
        from datetime import timedelta

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.init_process_group(backend, store=dist.PrefixStore(f"course-pool-rejoin/{key}", self.store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=timeout_s))
        wait_for_every_rank(backend)
        self.groups = set(c10d._world.pg_map)

    @staticmethod
    def _forget(destroyed: list) -> None:
        """Clear module globals that still point to a destroyed group, or to a DeviceMesh built on one."""
        if not destroyed:
            return
        from torch.distributed.device_mesh import DeviceMesh

        dead = {id(pg) for pg in destroyed}

        def stale(value) -> bool:
            if id(value) in dead:
                return True
            if isinstance(value, DeviceMesh):
                return True
            if isinstance(value, (dict, list, tuple, set)):
                items = value.values() if isinstance(value, dict) else value
                return any(id(v) in dead or isinstance(v, DeviceMesh) for v in items)
            return False

        for module in _modules(GROUP_HOLDERS):
            for key, value in list(vars(module).items()):
                if key.startswith("__") or not stale(value):
                    continue
                if isinstance(value, (dict, list, set)):
                    value.clear()
                else:
                    setattr(module, key, None)


def stays_after_failure(exc: BaseException, backend: str) -> bool:
    """Whether a rank whose job raised ``exc`` stays in the pool (and rejoins): only after a Python exception
    (`Exception`) under gloo. Under NCCL the rank exits, so torchrun stops the others and the launcher discards the
    pool: a communicator whose peer raised mid-collective may hang or abort later, and a new one would need every
    GPU's memory back first. KeyboardInterrupt and SystemExit mean stop, under any backend."""
    return isinstance(exc, Exception) and backend == "gloo"


def main() -> int:
    die_with_parent()
    os.environ["COURSE_IN_RANK"] = "1"  # a run started inside a rank starts its own processes (no pool)
    pool_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    pool_log = os.path.join(pool_dir, f"rank{rank}.log")
    redirect_output(pool_log)
    startup = {"process_start": T_START}

    import json
    import queue
    import socket
    import threading

    import cloudpickle  # noqa: F401 - imported once, for every job
    import torch

    startup["imports_done"] = time.time()
    settings = json.loads(open(os.path.join(pool_dir, "settings.json")).read())
    torch.set_num_threads(settings["threads_per_rank"])
    init_process_group(settings["backend"], settings["pg_timeout_s"])
    startup["rendezvous_done"] = time.time()
    baseline = Baseline(settings["threads_per_rank"])

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(settings["socket"])
    sock.sendall(f"hello {rank} {os.getpid()}\n".encode())
    jobs: queue.Queue = queue.Queue()
    launcher_pid = settings["launcher_pid"]

    def listen() -> None:
        """Read jobs from the launcher; exit the process the moment the launcher is gone."""
        sock.settimeout(1.0)
        buffer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                try:
                    os.kill(launcher_pid, 0)
                    continue
                except ProcessLookupError:
                    chunk = b""
            except OSError:
                chunk = b""
            if not chunk:
                os._exit(0)
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                jobs.put(line.decode())

    threading.Thread(target=listen, name="course-pool-listener", daemon=True).start()
    baseline.threads_alive = set(threading.enumerate())
    first = True
    while True:
        command, _, arg = jobs.get().partition(" ")
        if command != "job":
            continue
        spec = json.loads(arg)
        run_dir = spec["run_dir"]
        redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
        now = time.time()
        # The first job of a pool paid for the process start, imports and rendezvous; later ones did not.
        timings = dict(startup) if first else {"process_start": now, "imports_done": now, "rendezvous_done": now}
        first = False
        failed = stays = False
        try:
            baseline.prepare(spec["cwd"])
            from course_lib.runtime._worker import run_job

            run_job(run_dir, rank, timings)
            # Every rank is done before any destroys the run's groups: a slower rank may still be connecting to
            # this one in a group the function made (gloo's connectFullMesh), as in `_worker.main`.
            wait_for_every_rank(settings["backend"])
        except BaseException as exc:  # noqa: BLE001 - reported as a fresh rank reports it
            report_failure(run_dir, rank, exc)
            failed, stays = True, stays_after_failure(exc, settings["backend"])
        if failed and not stays:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if failed:                           # (outside the except block: the traceback's frames are gone)
            sock.sendall(b"failed\n")
            try:
                baseline.leave_world()
                baseline.rejoin_world(settings["backend"], os.path.basename(run_dir), settings["pg_timeout_s"])
            except BaseException as exc:  # noqa: BLE001 - the pool cannot go on: the launcher discards it
                print(f"pool: could not rejoin after a failed run: {exc!r}", flush=True)
                os._exit(1)
        problems = baseline.restore()
        if problems:
            print("pool: retiring after this run:", "; ".join(problems), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        redirect_output(pool_log)
        sock.sendall(b"ready retire\n" if problems else b"ready\n")


if __name__ == "__main__":
    sys.exit(main())
