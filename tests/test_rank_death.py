"""A rank that dies without a Python traceback is the one blamed (issue 19, section 3).

A rank killed by the out-of-memory killer (SIGKILL), crashing in C/C++ or CUDA code (SIGSEGV) or calling os._exit
writes nothing, while the ranks waiting for it in a collective raise ("Connection reset by peer") or are stopped by
torchrun. The error must name the rank that died, with its exit code or signal and its log, list the others as
consequences, and leave nothing running: on fresh ranks and on warm ones alike.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.runtime import pool
from course_lib.runtime.launch import DistributedRunError, RunResult, RunTimeout, _failure, run

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value


SEED = int(os.environ.get("COURSE_TEST_SEED", random.SystemRandom().randrange(2 ** 32)))   # printed by each test

#: The first line of the error for each way of dying (``{v}`` the rank that died, ``{n}`` the world size).
FIRST_LINE = {
    "exit": "rank {v} of {n} exited with code 3 without a Python traceback (os._exit or a C/C++ abort)",
    "sigkill": "rank {v} of {n} was killed by SIGKILL: often the out-of-memory killer; see dmesg",
    "sigsegv": "rank {v} of {n} was killed by SIGSEGV: a crash in C/C++ code or a CUDA error",
}


pytestmark = pytest.mark.usefixtures("pools_on", "no_leftovers")   # (tests/conftest.py)


def _ping():
    return dist.get_rank()


def _die_after_a_collective(victim: int, kind: str):
    t = torch.ones(1, device=cdist.device())
    dist.all_reduce(t)                                # every rank is connected and has run one collective
    if dist.get_rank() == victim:
        print(f"rank {victim} is about to die ({kind})", flush=True)
        if kind == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL if kind == "sigkill" else signal.SIGSEGV)
        time.sleep(60)
    dist.all_reduce(t)                                # the survivors wait for the rank that died
    dist.barrier()
    return "unreachable"


@pytest.mark.parametrize("path", ["fresh", "pooled"])
@pytest.mark.parametrize("kind", ["exit", "sigkill", "sigsegv"])
def test_the_rank_that_died_is_blamed(kind, path):
    draw = random.Random(f"{SEED}-{kind}-{path}")
    n = draw.randint(2, 4)
    victim = draw.randrange(n)
    where = f"seed {SEED}: {kind} on rank {victim} of {n}, {path}"
    print(where)                                      # (pytest shows it when the test fails)
    if path == "pooled":
        assert run(_ping, n, stream=False, timeout_s=60).pooled, where     # the fault hits a warm, reused rank
    with pytest.raises(DistributedRunError) as info:
        run(_die_after_a_collective, n, args=(victim, kind), stream=False, timeout_s=60, fresh=path == "fresh")
    err = info.value
    text = str(err)
    assert not isinstance(err, RunTimeout), f"{where}\n{text}"
    assert err.rank == victim, f"{where}\n{text}"
    assert text.splitlines()[0] == FIRST_LINE[kind].format(v=victim, n=n), f"{where}\n{text}"
    assert f"rank {victim} is about to die" in text, f"{where}: the dead rank's log is shown\n{text}"
    consequence = next(line for line in text.splitlines() if f"because rank {victim} left" in line)
    listed = sorted(int(r) for group in re.findall(r"ranks \[([\d, ]+)\]", consequence) for r in group.split(","))
    assert listed == [r for r in range(n) if r != victim], f"{where}: survivors as consequences\n{text}"
    assert err.partial.pooled == (path == "pooled") and err.partial.returns == [None] * n
    assert not pool.warm_pools()                      # a pool whose rank died is discarded (no_leftovers: gone)


# ------------------------------------------------------------------- torchrun's report, without starting anything

def _report(entries: list[tuple[int, int, int]], stopped: list[int]) -> str:
    """A launcher log as torchrun 2.x writes it: 'Sending process P closing signal' for each worker it stops, then
    its report; the last entry is the "Root Cause" (not always the rank that died: timestamps tie)."""
    lines = [f"W1124 17:22:30.413000 1 api.py:1028] Sending process {p} closing signal SIGTERM" for p in stopped]
    lines += ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "=" * 40,
              "course_lib.runtime._worker FAILED", "-" * 40, "Failures:"]
    for i, (rank, code, pid) in enumerate(entries):
        if i == len(entries) - 1:
            lines += ["-" * 40, "Root Cause (first observed failure):"]
        lines += [f"[{i}]:", "  time      : 2026-11-24_17:22:30", "  host      : localhost",
                  f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: {pid})",
                  "  error_file: <N/A>"]
    return "\n".join(lines + ["=" * 40, ""])


@pytest.mark.parametrize("case", ["survivor is root cause", "survivors stopped", "python error, others stopped"])
def test_report_parsing_blames_only_a_rank_that_ended_on_its_own(tmp_path, case):
    """Rank 1 of 3 ends; pids are 100 + rank. Whatever torchrun calls the root cause, and whether it lists the
    ranks it stopped itself (SIGTERM), the rank with neither result nor error that ended on its own is blamed."""
    errors = {"survivor is root cause": [0, 2], "survivors stopped": [], "python error, others stopped": [1]}[case]
    code = 1 if case == "python error, others stopped" else -9
    entries = {"survivor is root cause": [(1, code, 101), (2, 1, 102), (0, 1, 100)],
               "survivors stopped": [(0, -15, 100), (2, -15, 102), (1, code, 101)],
               "python error, others stopped": [(0, -15, 100), (2, -15, 102), (1, code, 101)]}[case]
    stopped = [] if case == "survivor is root cause" else [100, 102]
    (tmp_path / "launcher.log").write_text(_report(entries, stopped))
    for r in errors:
        (tmp_path / f"error{r}.json").write_text(
            f'{{"rank": {r}, "type": "RuntimeError", "message": "Connection reset by peer", "time": {r}, '
            f'"traceback": "Traceback ..."}}')
    (tmp_path / "rank1.log").write_text("last words of rank 1\n")
    result = RunResult([None] * 3, [tmp_path / f"rank{r}.log" for r in range(3)], 1.0, "gloo", [None] * 3, 3,
                       tmp_path, [None] * 3, 0.0)
    err = _failure(result, tmp_path / "launcher.log", returncode=1)
    text = str(err)
    assert err.rank == 1, text
    if case == "python error, others stopped":
        assert text.startswith("rank 1 of 3 failed with RuntimeError"), text
    else:
        assert text.startswith("rank 1 of 3 was killed by SIGKILL"), text
        assert "last words of rank 1" in text
        expected = {"survivor is root cause": "ranks [0, 2] then failed in collectives because rank 1 left",
                    "survivors stopped": "ranks [0, 2] were stopped by torchrun because rank 1 left"}[case]
        assert expected in text, text
