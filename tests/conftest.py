"""Fixtures shared by the test files."""

import os

import psutil
import pytest
import torch

from course_lib.runtime import pool, procs


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; on a busy 2-core machine, more threads only contend.

    Use it in a test file with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _launched_processes() -> list[psutil.Process]:
    """Processes started by a run from this test process (tagged with our pid), still alive: a fresh run's, or
    a pool's that is not one of the warm pools (those stay, by design, until the session ends)."""
    warm = {pid for p in pool.warm_pools() for pid in p.pids()}
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            tags = p.environ().get(procs.TAG_VAR, "").split(":")
            ours = any(t.startswith((f"launch-{os.getpid()}-", f"pool-{os.getpid()}-")) for t in tags)
            if ours and p.pid not in warm and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.fixture
def pools_on(monkeypatch):
    """Runs use warm pools whatever COURSE_POOL the test session has; the test starts and ends without one (for the
    tests of the pool itself: ``pytestmark = pytest.mark.usefixtures("pools_on")``)."""
    monkeypatch.setenv("COURSE_POOL", "1")
    pool.shutdown_all()
    yield
    pool.shutdown_all()


@pytest.fixture
def no_leftovers():
    """After the test, no process that a run of this test process started is alive, other than warm pools."""
    yield
    left = _launched_processes()
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"

