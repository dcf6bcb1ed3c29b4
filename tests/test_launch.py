"""The launcher: return values, failures, hangs, interrupts, concurrency, bad input; nothing left behind."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.runtime import procs
from course_lib.dist import pick_backend
from course_lib.runtime.launch import DistributedRunError, LaunchError, RunInterrupted, RunTimeout, run, run_nodes, run_script


pytestmark = pytest.mark.usefixtures("no_leftovers")   # (tests/conftest.py)


def _rank_info(scale):
    t = torch.tensor([float(dist.get_rank() + 1)], device=cdist.device())   # NCCL takes tensors on the rank's GPU
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item() * scale,
            "threads": torch.get_num_threads(), "backend": dist.get_backend()}


def test_four_ranks_return_values_and_logs():
    res = run(_rank_info, 4, args=(2.0,), stream=False)
    assert [r["rank"] for r in res.returns] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["sum"] == 20.0 for r in res.returns)  # (1+2+3+4) * 2
    backend = pick_backend(4)                    # gloo here; NCCL on a machine with 4 GPUs
    assert res.backend == backend and all(r["backend"] == backend for r in res.returns)
    cores = procs.usable_cores()
    assert all(r["threads"] == max(1, cores // 4) for r in res.returns)
    assert len(res.logs) == 4 and all(p.exists() for p in res.logs)
    gpus = [torch.cuda.get_device_name(r) for r in range(4)] if backend == "nccl" else ["cpu"] * 4
    assert res.devices == gpus
    assert set(res.breakdown()) >= {"imports (torch)", "work"}


def _chatty():
    print(f"rank {dist.get_rank()} says hi", flush=True)
    return dist.get_rank()


def test_rank0_streams_and_every_rank_logs(capsys):
    res = run(_chatty, 2)
    out = capsys.readouterr().out
    assert "rank 0 says hi" in out and "rank 1 says hi" not in out  # only rank 0 streams
    assert "rank 1 says hi" in res.log(1) and "rank 0 says hi" in res.log(0)


def test_notebook_style_function_pickled_by_value():
    namespace: dict = {}
    exec("import torch\ndef double(x):\n    return torch.tensor(x) * 2\n", namespace)  # like a notebook cell
    fn = namespace["double"]
    fn.__module__ = "__main__"
    assert run(fn, 2, args=(21,), stream=False).returns == [torch.tensor(42)] * 2


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from the student code")
    dist.barrier()  # rank 0 waits for rank 1, which never comes
    return "unreachable"


def test_failing_rank_named_with_its_own_traceback():
    with pytest.raises(DistributedRunError) as info:
        run(_fail_on_rank_one, 2, stream=False, timeout_s=60)
    err = info.value
    assert err.rank == 1
    assert "rank 1 of 2 failed with ValueError: boom from the student code" in str(err)
    assert "_fail_on_rank_one" in err.traceback
    assert 'test_launch.py", line' in err.traceback      # the file, not cloudpickle 3.1.3's '<dynamic-code>'
    assert 'raise ValueError("boom from the student code")' in err.traceback       # and the line's source
    assert "torch.distributed.elastic" not in str(err).split("--- traceback")[0]


def _finish_or_hang():
    if dist.get_rank() == 0:
        return "done"
    time.sleep(3600)


def test_hang_times_out_and_keeps_finished_results():
    t0 = time.perf_counter()
    with pytest.raises(RunTimeout) as info:
        run(_finish_or_hang, 2, timeout_s=25, stream=False)
    assert time.perf_counter() - t0 < 55  # the timeout, plus killing and collecting
    assert info.value.partial.returns == ["done", None]
    assert "Ranks [1] had not finished" in str(info.value)


def _exit_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(3600)


def test_rank_dying_without_traceback():
    with pytest.raises(DistributedRunError) as info:
        run(_exit_hard, 2, timeout_s=60, stream=False)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 exited with code 3 without a Python traceback")
    assert "ranks [0] were stopped by torchrun because rank 1 left" in str(info.value)   # (tests/test_rank_death.py)


def _sleep_forever():
    time.sleep(3600)


def test_keyboard_interrupt_kills_the_tree():
    # A kernel interrupt is a SIGINT to the kernel's main thread, which a kernel handles with Python's own handler.
    # A test runner started as a background job of a non-interactive shell inherits SIGINT *ignored*, and then
    # interrupt_main() does nothing: install the kernel's handler for this test, however pytest was started.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(8.0, _thread.interrupt_main)  # what a kernel interrupt does to the main thread
    timer.start()
    try:
        with pytest.raises(RunInterrupted) as info:
            run(_sleep_forever, 2, timeout_s=120, stream=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert isinstance(info.value, KeyboardInterrupt)
    assert info.value.partial.returns == [None, None]


def _rank_and_pid():
    time.sleep(1.0)
    return dist.get_rank(), os.getpid()


def test_two_concurrent_runs_do_not_collide():
    results = {}

    def go(name):
        results[name] = run(_rank_and_pid, 2, stream=False, timeout_s=120)

    threads = [threading.Thread(target=go, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = results["a"], results["b"]
    assert a.run_dir != b.run_dir
    assert [r for r, _ in a.returns] == [0, 1] and [r for r, _ in b.returns] == [0, 1]
    assert {p for _, p in a.returns}.isdisjoint({p for _, p in b.returns})


@pytest.mark.parametrize("nprocs", [0, -2, 10_000, 2.5, "2", True])
def test_bad_nprocs_is_refused_before_launch(nprocs):
    with pytest.raises(LaunchError, match="nprocs"):
        run(_chatty, nprocs)


@pytest.mark.parametrize("call, match", [
    (dict(args=5), r"args=5 must be a tuple or list .* \(got int\); one argument x is args=\(x,\)"),
    (dict(args="ab"), r"args='ab' must be a tuple or list"),
    (dict(args={"a": 1}), r"must be a tuple or list .* \(got dict\)"),
    (dict(kwargs=[1]), r"kwargs=\[1\] must be a dict"),
    (dict(threads_per_rank=0), r"threads_per_rank=0 must be an int from 1 to \d+"),
    (dict(threads_per_rank=1.5), r"threads_per_rank=1.5 must be an int"),
    (dict(threads_per_rank=10_000), r"threads_per_rank=10000 must be an int from 1 to"),
    (dict(env={"A": 1}), r"env=.* must be a dict of strings"),
    (dict(timeout_s=0), r"timeout_s=0 must be a positive number"),
    (dict(timeout_s=True), r"timeout_s=True must be a positive number"),
])
def test_bad_arguments_are_refused_before_launch_naming_the_field(call, match, tmp_path, monkeypatch):
    """Issue 33: ``run(fn, 2, args=5)`` used to fail inside the pickler ("'int' object is not iterable") and
    ``threads_per_rank=0`` ran. Nothing starts: no run folder is created."""
    monkeypatch.setenv("COURSE_RUNS_DIR", str(tmp_path))
    with pytest.raises(LaunchError, match=match):
        run(_chatty, 2, **call)
    with pytest.raises(LaunchError, match="is not callable"):
        run(42, 2)
    assert not list(tmp_path.iterdir())


def test_bad_script_arguments_are_refused_before_launch(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    for call, match in ((dict(args="--x"), r"args='--x' must be a list of the script's command-line arguments"),
                        (dict(nnodes=0), r"nnodes=0 must be a positive int"),
                        (dict(max_restarts=-1), r"max_restarts=-1 must be an int >= 0"),
                        (dict(timeout_s=-3), r"timeout_s=-3 must be a positive number")):
        with pytest.raises(LaunchError, match=match):
            run_script(script, 2, **call)


def test_unpicklable_argument_is_refused_before_launch():
    lock = threading.Lock()
    with pytest.raises(LaunchError, match="cannot send .* picklable"):
        run(_chatty, 2, args=(lock,))


def test_missing_backend_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the check is for CPU-only machines")
    with pytest.raises(LaunchError, match="nccl.*needs CUDA"):
        run(_chatty, 2, backend="nccl")
    with pytest.raises(LaunchError, match="backend='mpi' is not supported"):
        run(_chatty, 2, backend="mpi")


def test_port_already_taken_is_refused():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port={port} is already in use"):
            run(_chatty, 2, port=port)


def test_run_script_and_multinode_command(tmp_path, capsys):
    script = tmp_path / "job.py"
    out = tmp_path / "out"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "open(os.path.join(sys.argv[1], f'r{dist.get_rank()}'), 'w').write(str(int(t.item())))\n"
        "print('script rank', dist.get_rank(), flush=True)\n"
        "dist.destroy_process_group()\n")
    out.mkdir()
    res = run_script(script, 2, [str(out)], print_command=True, timeout_s=120)
    printed = capsys.readouterr().out
    assert "--nnodes=2" in printed and "--rdzv-endpoint" in printed and "--standalone" in printed
    assert "script rank 0" in printed
    assert (out / "r0").read_text() == "3" and (out / "r1").read_text() == "3"
    assert "script rank 1" in res.log(1)


def test_run_script_failure_names_rank(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import os\nif os.environ['RANK'] == '0':\n    raise RuntimeError('script broke')\n")
    with pytest.raises(DistributedRunError, match="rank 0 of 2 failed with RuntimeError: script broke"):
        run_script(script, 2, timeout_s=60, stream=False)
    with pytest.raises(LaunchError, match="does not exist"):
        run_script(tmp_path / "nope.py", 2)


def test_run_script_polls_and_an_error_in_the_poll_stops_the_run(tmp_path):
    """``on_poll`` runs in the caller's thread while the script runs (lesson 09 follows a metrics file with it); what
    it raises stops the run, and its processes with it."""
    script = tmp_path / "slow.py"
    seen = tmp_path / "seen"
    script.write_text(f"import time\nopen({str(seen)!r}, 'w').write('started')\ntime.sleep(600)\n")
    calls = []

    def poll():
        calls.append(time.perf_counter())
        if seen.exists():
            raise KeyError("the plot broke")

    t0 = time.perf_counter()
    with pytest.raises(KeyError, match="the plot broke"):
        run_script(script, 2, timeout_s=300, stream=False, on_poll=poll)
    assert len(calls) >= 2 and time.perf_counter() - t0 < 120


def test_kill_tree_catches_escaped_orphans():
    """A double fork escapes the tree; the tag still finds it."""
    import subprocess
    import sys

    tag = procs.new_tag("test")
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(600)\n"
            "    os._exit(0)\n"
            "time.sleep(600)\n")
    env = dict(os.environ, **{procs.TAG_VAR: tag})
    parent = subprocess.Popen([sys.executable, "-c", code], env=env)
    deadline = time.time() + 10
    while len(procs.tagged_processes(tag)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert len(procs.tagged_processes(tag)) >= 2
    procs.kill_tree(parent.pid, tag=tag, grace_s=0.5)
    parent.wait()
    assert procs.tagged_processes(tag) == []


def _node_info():
    t = torch.tensor([float(dist.get_rank() + 1)], device=cdist.device())
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "node": int(os.environ["GROUP_RANK"]),
            "local": int(os.environ["LOCAL_RANK"]), "sum": t.item()}


def _fail_on_node_one():
    if int(os.environ["GROUP_RANK"]) == 1 and int(os.environ["LOCAL_RANK"]) == 1:
        raise ValueError("boom on the second node")
    dist.barrier()


def test_two_nodes_on_one_machine_meet_in_one_world():
    """Two torchrun launchers of 2 ranks each (`run_nodes`: --nnodes=2, a c10d rendezvous on the loopback address)
    form one world of 4: node = GROUP_RANK, consecutive global ranks per node; a rank failing on the second node
    is named with its own traceback, and both launchers' trees are gone (no_leftovers)."""
    res = run_nodes(_node_info, 2, 2, backend="gloo", stream=False, timeout_s=120)
    assert [(r["rank"], r["node"], r["local"]) for r in res.returns] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert all(r["world"] == 4 and r["sum"] == 10 for r in res.returns)
    with pytest.raises(DistributedRunError) as info:
        run_nodes(_fail_on_node_one, 2, 2, backend="gloo", stream=False, timeout_s=120)
    assert info.value.rank == 3 and "boom on the second node" in str(info.value)
    with pytest.raises(LaunchError, match="nproc_per_node=0 must be a positive int"):
        run_nodes(_node_info, 2, 0)
