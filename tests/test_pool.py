"""Warm ranks (course_lib.runtime.pool): the same results as fresh processes, a clean state for every run, faults
reported as a fresh run reports them, and nothing left behind, even when the owner is killed."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.runtime import pool
from course_lib.config import small_config
from course_lib.data import random_batches
from course_lib.runtime.launch import DistributedRunError, RunInterrupted, RunTimeout, run
from course_lib.lessons.variants import train_variant

pytestmark = pytest.mark.usefixtures("pools_on", "no_leftovers")   # (tests/conftest.py)


def _pids():
    return dist.get_rank(), os.getpid()


def test_warm_rerun_reuses_the_ranks_and_fresh_does_not():
    first = run(_pids, 2, stream=False)
    second = run(_pids, 2, stream=False)
    fresh = run(_pids, 2, stream=False, fresh=True)
    assert first.pooled and second.pooled and not fresh.pooled
    assert first.returns == second.returns                         # the same two processes ran both
    assert {p for _, p in fresh.returns}.isdisjoint({p for _, p in first.returns})
    assert second.breakdown()["imports (torch)"] == 0.0            # a warm run imports nothing
    assert first.breakdown()["imports (torch)"] > 0.0              # the pool's first run paid for the start
    assert "warm processes" in second.summary()


def _train(cfg, batches):
    return {v: {k: train_variant(cfg, batches, v, measure_live=False)[k] for k in ("losses", "params")}
            for v in ("zero2", "fsdp2", "ds2")}


def test_pooled_and_fresh_runs_give_identical_results():
    """Own ZeRO-2, FSDP2 (a DeviceMesh, DTensors) and DeepSpeed ZeRO-2 (its groups and engine), twice on the same
    warm ranks and once on fresh ones: bit-identical losses and parameters, so no state leaks from run to run."""
    cfg = small_config()
    batches = random_batches(cfg, global_batch=4, steps=2)
    runs = [run(_train, 2, args=(cfg, batches), stream=False, timeout_s=240, fresh=fresh)
            for fresh in (False, False, True)]
    assert [r.pooled for r in runs] == [True, True, False]
    fresh = runs[2].value
    for res in runs[:2]:
        for variant, out in res.value.items():
            assert out["losses"] == fresh[variant]["losses"], variant
            for name, p in out["params"].items():
                assert torch.equal(p, fresh[variant]["params"][name]), (variant, name)


def _leave_a_mess():
    import random

    import torch.nn.functional as F

    import course_lib.model
    from course_lib.measure import speed, units

    dist.new_group([0, 1])
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (2,))
    course_lib.model.GPT.leaked = 1                        # a class attribute added ...
    units.fmt_bytes = lambda n: "patched"                  # ... a library function replaced, a global added ...
    speed.LEAKED_GLOBAL = 1
    F.gelu = lambda x, **kw: x                             # ... and a torch function
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(123)
    random.seed(5)
    os.environ["COURSE_LEAK"] = "1"
    os.chdir("/")
    return os.getpid()


def _look_around():
    import random

    import torch.nn.functional as F
    import torch.distributed.distributed_c10d as c10d

    import course_lib.model
    from course_lib.measure import speed, units

    return {"pid": os.getpid(), "groups": len(c10d._world.pg_map),
            "leaked": hasattr(course_lib.model.GPT, "leaked") or hasattr(speed, "LEAKED_GLOBAL"),
            "fmt": units.fmt_bytes(2 ** 20), "gelu": F.gelu(torch.tensor([-1.0])).item(),
            "threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "seed": torch.initial_seed(), "env": os.environ.get("COURSE_LEAK"),
            "cwd": os.getcwd(), "random": random.random()}


def test_every_run_starts_from_a_fresh_process_state():
    clean = run(_look_around, 2, stream=False).value           # on the warm ranks, before any mess
    messy_pid = run(_leave_a_mess, 2, stream=False).value
    after = run(_look_around, 2, stream=False).value
    fresh = run(_look_around, 2, stream=False, fresh=True).value
    assert after["pid"] == messy_pid == clean["pid"]             # the same process ran all three
    for key in ("groups", "leaked", "fmt", "gelu", "threads", "dtype", "grad", "env", "cwd"):
        assert after[key] == fresh[key] == clean[key], key
    assert after["random"] != clean["random"]                    # Python's random is seeded from the OS, as fresh
    assert after["seed"] != 123                                   # torch's seed is a fresh process's: torch's fixed
    if fresh["seed"] == 67280421310721:                          # default in older releases, a random one in newer
        assert after["seed"] == clean["seed"] == fresh["seed"]
    else:
        assert after["seed"] != clean["seed"]


@pytest.mark.parametrize("fault", ["exception", "hang"])
def test_faults_are_reported_as_a_fresh_run_reports_them(fault):
    """Each fault on a warm pool gives the error a fresh run gives, and the next run works: after an exception on
    one rank (the other blocked in a barrier with it) on the same ranks, which rebuilt their process group; after a
    hang on new ones. Deaths without a traceback (os._exit, SIGKILL, SIGSEGV) on a random rank, pooled and fresh:
    test_rank_death."""
    def faulty(kind):
        if dist.get_rank() == 1:
            if kind == "exception":
                raise ValueError("boom from a warm rank")
            if kind == "exit":
                os._exit(3)
            if kind == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        if kind == "exception":
            dist.barrier()            # rank 0 waits for rank 1, which never comes
        elif kind != "hang":
            time.sleep(3600)          # (in a barrier, rank 0 would fail too: "connection closed by peer")
        return "rank 0 done"

    before = run(_pids, 2, stream=False).returns
    errors = {}
    for fresh in (False, True):     # a hang waits 40 s: on a loaded 2-core CI run a fresh launch's rank 0 took over 15
        with pytest.raises(DistributedRunError) as info:
            run(faulty, 2, args=(fault,), stream=False, timeout_s=40 if fault == "hang" else 60, fresh=fresh)
        errors[fresh] = info.value
    pooled, cold = errors[False], errors[True]
    assert type(pooled) is type(cold) and pooled.rank == cold.rank == 1
    first_line = lambda e: str(e).splitlines()[0].replace("(exit code 1)", "")  # noqa: E731
    assert first_line(pooled) == first_line(cold), (str(pooled), str(cold))
    if fault == "hang":
        assert isinstance(pooled, RunTimeout) and pooled.partial.returns == ["rank 0 done", None]
    after = run(_pids, 2, stream=False)
    if fault == "exception":
        assert "(ranks [0] failed after it" in str(pooled), str(pooled)   # rank 0 was not left waiting
        assert after.pooled and after.returns == before
    else:
        assert after.pooled and {p for _, p in after.returns}.isdisjoint({p for _, p in before})


def _sleep_forever():
    time.sleep(3600)


def test_interrupt_discards_the_pool():
    before = run(_pids, 2, stream=False).returns
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in test_launch: however pytest started
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(RunInterrupted):
            run(_sleep_forever, 2, timeout_s=60, stream=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert not any(psutil.pid_exists(p) for _, p in before)
    assert run(_pids, 2, stream=False).pooled


def _start_a_thread():
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    return os.getpid()


def test_a_run_that_leaves_a_thread_retires_its_pool():
    pid = run(_start_a_thread, 2, stream=False).value
    assert not psutil.pid_exists(pid)                            # retired once the run was done
    assert run(_pids, 2, stream=False).value[1] != pid


def test_pool_off_and_concurrent_runs_start_fresh_processes(monkeypatch):
    results = {}

    def go(name):
        results[name] = run(_pids, 2, stream=False)

    threads = [threading.Thread(target=go, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.pooled for r in results.values()) == [False, True]  # one pool, used by one run at a time
    monkeypatch.setenv("COURSE_POOL", "0")
    assert not run(_pids, 2, stream=False).pooled


def test_a_killed_owner_leaves_no_rank_behind(tmp_path):
    """A kernel killed with SIGKILL runs no atexit: the ranks notice that their owner is gone and exit."""
    code = ("import os, sys\n"
            "from course_lib.runtime.launch import run\n"
            "from course_lib.runtime import pool\n"
            "def pid():\n    return os.getpid()\n"
            "run(pid, 2, stream=False)\n"
            "print(' '.join(map(str, pool.warm_pools()[0].pids())), flush=True)\n"
            "import time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, COURSE_POOL="1"))
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3                                      # torchrun and its two ranks
        owner.kill()
        owner.wait()
        deadline = time.time() + 20
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids) \
                and time.time() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"ranks outlived their killed owner: {left}"
    finally:
        owner.kill()


def test_an_idle_pool_is_shut_down_and_replaced(monkeypatch):
    monkeypatch.setattr(pool, "IDLE_S", 1.5)
    res = run(_pids, 2, stream=False)
    warm = pool.warm_pools()
    assert res.pooled and len(warm) == 1
    pids = warm[0].pids()
    deadline = time.time() + 20
    while pool.warm_pools() and time.time() < deadline:
        time.sleep(0.25)
    assert not pool.warm_pools() and not any(psutil.pid_exists(p) for p in pids)
    assert run(_pids, 2, stream=False).pooled
