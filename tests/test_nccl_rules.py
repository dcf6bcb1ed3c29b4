"""NCCL's rules checked on gloo (course_lib/runtime/nccl_rules.py), and the GPU paths of the course run on a CPU.

The test command runs every distributed test, lesson and solution with ``COURSE_NCCL_RULES=1``, so the course's own
code is checked everywhere; here the checker itself must catch what would fail or hang on GPUs: a CPU tensor in a
collective, a send and a receive to the same peer posted apart (the old ring all-reduce at 2 ranks, the old pipeline
runner that posted each receive one op ahead), and a device synchronize while a receive is pending.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.measure import speed
from course_lib.runtime import nccl_rules
from course_lib.runtime.launch import DistributedRunError, run

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value


# ------------------------------------------------------------------------------ replay (one process)

def _ring_posts(batched: bool) -> list:
    """Rank r of a 2-rank ring: 2(n-1) = 2 steps, each 'send to the right, receive from the left' (the same peer)."""
    out = []
    for r in range(2):
        peer = 1 - r
        step = [[("S", peer), ("R", peer)]] if batched else [[("S", peer)], [("R", peer)]]
        out.append(step * 2)
    return out


def test_replay_finds_the_two_rank_ring_deadlock():
    assert "ranks 0 and 1 wait for each other" in nccl_rules.replay_pairs(_ring_posts(batched=False))[0]
    assert nccl_rules.replay_pairs(_ring_posts(batched=True)) == []


def test_replay_of_pipelines():
    # GPipe as lesson 03's exercise writes it: every forward sent, then every gradient received: consistent order
    gpipe = [[[("S", 1)]] * 4 + [[("R", 1)]] * 4, [[("R", 0)]] * 4 + [[("S", 0)]] * 4]
    assert nccl_rules.replay_pairs(gpipe) == []
    # 1F1B, p = 2, as the old runner posted it (each receive one op ahead): rank 0 receives B0 before sending F1,
    # rank 1 receives F1 before sending B0's gradient
    old_1f1b = [[[("S", 1)], [("R", 1)], [("S", 1)], [("R", 1)]], [[("R", 0)], [("R", 0)], [("S", 0)], [("S", 0)]]]
    assert nccl_rules.replay_pairs(old_1f1b)
    # the runner now: the previous output and the next input travel in one batch
    new_1f1b = [[[("S", 1)], [("S", 1), ("R", 1)], [("R", 1)]], [[("R", 0)], [("S", 0), ("R", 0)], [("S", 0)]]]
    assert nccl_rules.replay_pairs(new_1f1b) == []
    # ranks that never talk to each other, and a three-rank chain
    assert nccl_rules.replay_pairs([[], [], []]) == []
    chain = [[[("S", 1)]], [[("R", 0), ("S", 2)]], [[("R", 1)]]]
    assert nccl_rules.replay_pairs(chain) == []


# ------------------------------------------------------------------------------ the rules on two gloo ranks

def _old_exchange(send, recv, peer):
    reqs = [dist.isend(send, peer), dist.irecv(recv, peer)]        # posted apart: the old ring at 2 ranks
    for req in reqs:
        req.wait()


def _new_exchange(send, recv, peer):
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]):
        req.wait()


def _case(name, fn, args=()):
    """Run fn under the rules on every rank: this rank's first error (or None), the pair replay included (which every
    rank joins, whatever happened in fn)."""
    error = None
    with nccl_rules.enforced(args) as state:
        try:
            fn(*args)
        except nccl_rules.NcclRuleError as exc:
            error = str(exc)
    try:
        nccl_rules.check_pairs(state.groups)
    except nccl_rules.NcclRuleError as exc:
        error = error or str(exc)
    return name, error


def _cases(batch):
    dev, peer = cdist.device(), 1 - dist.get_rank()

    def cpu_tensor():
        dist.all_reduce(torch.ones(3))                                   # made without a device

    def derived_cpu_tensor():
        t = torch.arange(6.0).reshape(2, 3)[0] * 2                       # computed from such a tensor alone
        dist.all_reduce(t)

    def device_tensor():
        dist.all_reduce(torch.ones(3, device=dev))
        dist.all_reduce(torch.ones(3).to(dev))

    def argument(x):
        dist.all_reduce(x)

    def moved_argument(x):
        dist.all_reduce(x.to(dev) * 1)

    def ring_posted_apart():
        _old_exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), peer)

    def ring_batched():
        _new_exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), peer)

    def synchronize_with_pending_receive():
        if dist.get_rank() == 0:
            work = dist.irecv(torch.empty(4, device=dev), 1)
            try:
                speed.synchronize(dev)                                 # what a timer does
            finally:
                work.wait()
        else:
            dist.send(torch.ones(4, device=dev), 0)

    def library_code():
        from course_lib.parallel.collectives import ring_all_reduce
        ring_all_reduce(torch.arange(10.0, device=dev))

    return dict([_case("cpu tensor", cpu_tensor), _case("derived cpu tensor", derived_cpu_tensor),
                 _case("device tensor", device_tensor), _case("argument", argument, (batch,)),
                 _case("moved argument", moved_argument, (batch,)),
                 _case("ring posted apart", ring_posted_apart), _case("ring batched", ring_batched),
                 _case("synchronize", synchronize_with_pending_receive), _case("ring_all_reduce", library_code)])


@pytest.fixture(scope="module")
def two_ranks():
    env = {nccl_rules.ENV_VAR: "0"}                  # the cases switch the rules on themselves
    return run(_cases, 2, args=(torch.ones(3),), env=env, timeout_s=120, stream=False, backend="gloo").returns


def test_cpu_tensors_in_collectives_are_caught(two_ranks):
    for out in two_ranks:
        assert "dist.all_reduce got a CPU tensor made at" in out["cpu tensor"]
        assert "test_nccl_rules.py" in out["cpu tensor"] and "device=dist.device()" in out["cpu tensor"]
        assert "test_nccl_rules.py" in out["derived cpu tensor"]
        assert "an argument of the rank function" in out["argument"]
        assert out["device tensor"] is None and out["moved argument"] is None


def test_point_to_point_order_is_replayed(two_ranks):
    for out in two_ranks:
        assert "ranks 0 and 1 wait for each other" in out["ring posted apart"]
        assert "batch_isend_irecv" in out["ring posted apart"]
        assert out["ring batched"] is None and out["ring_all_reduce"] is None


def test_synchronize_with_a_pending_receive_is_caught(two_ranks):
    assert "synchronised while a receive is pending (irecv from rank 1)" in two_ranks[0]["synchronize"]
    assert two_ranks[1]["synchronize"] is None


def _rules_active():
    return nccl_rules.active()


def test_launch_turns_the_rules_on_and_the_test_command_sets_them():
    assert run(_rules_active, 2, env={nccl_rules.ENV_VAR: "1"}, stream=False, timeout_s=60).returns == [True, True]
    assert run(_rules_active, 2, env={nccl_rules.ENV_VAR: "0"}, stream=False, timeout_s=60).returns == [False, False]
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("course_script", Path(__file__).resolve().parents[1] / "course.py")
    course = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(course)
    assert course.TEST_ENV[nccl_rules.ENV_VAR] == "1"      # every launch of `python3 course.py test` is checked


def _ring_posted_apart_on_every_rank():
    dev, peer = cdist.device(), 1 - dist.get_rank()
    _old_exchange(torch.ones(4, device=dev), torch.empty(4, device=dev), peer)
    return "done"


def test_launcher_replays_what_the_ranks_posted():
    """gloo runs the old 2-rank ring to the end; the launcher, replaying the ranks' posts, says NCCL would hang."""
    with pytest.raises(DistributedRunError, match="ranks 0 and 1 wait for each other") as info:
        run(_ring_posted_apart_on_every_rank, 2, env={nccl_rules.ENV_VAR: "1"}, stream=False, timeout_s=60)
    assert info.value.partial.returns == ["done", "done"]
