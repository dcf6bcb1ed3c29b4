"""Tests of lesson 02's data parallelism (course_lib/parallel/{collectives,ddp}.py, lessons/l02_data_parallel).

Every data-parallel variant runs on gloo ranks and is compared with one process on the global batch
(losses every step, parameters after the last step, gradients of the last step), and with PyTorch DDP.
All distributed checks of one world size run in one launch (each launch costs seconds of start-up).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.data import random_batches
from course_lib.launch import run
from course_lib.lessons.common import small_config, train_reference
from course_lib.lessons.l02_data_parallel import experiments as ddp_lab
from course_lib.model import build_model
from course_lib.parallel.collectives import chunk_sizes, ring_bytes_formula, ring_bytes_sent
from course_lib.parallel.ddp import make_buckets

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

STEPS = 3
CFG = small_config()                       # 2 layers, d_model 32: milliseconds per step
RING_SIZES = [0, 1, 2, 3, 5, 7, 64, 1000, 1001, 4099]


def _assert_same(actual: dict, expected: dict, what: str, rtol=1e-5, atol=1e-6):
    assert actual.keys() == expected.keys(), f"{what}: different parameter names"
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


def _assert_matches_reference(res: dict, ref: dict, what: str, grads: bool = True):
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), f"{what}: losses differ"
    _assert_same(res["params"], ref["params"], f"{what}: parameters after {STEPS} steps")
    if grads:
        _assert_same(res["grads"], ref["grads"], f"{what}: gradients of the last step")


# ------------------------------------------------------------------------------ single process

def test_chunk_sizes_cover_the_tensor():
    for numel in RING_SIZES:
        for n in range(1, 5):
            c = chunk_sizes(numel, n)
            assert sum(c) == numel and max(c) - min(c) <= 1
            assert c == [t.numel() for t in torch.tensor_split(torch.empty(numel), n)]


def test_ring_bytes_formula_exact():
    for numel in RING_SIZES:
        for n in range(1, 5):
            per_rank = [ring_bytes_sent(numel, n, r) for r in range(n)]
            assert sum(per_rank) == 2 * (n - 1) * 4 * numel           # total traffic, any size
            if numel % n == 0:                                         # the textbook 2(n-1)/n x bytes
                assert all(b == ring_bytes_formula(4 * numel, n) for b in per_rank)


def test_make_buckets_respects_cap():
    params = [torch.nn.Parameter(torch.zeros(k)) for k in (10, 20, 30, 100, 5)]
    groups = make_buckets(params, bucket_cap_bytes=4 * 50)
    assert [[p.numel() for p in g] for g in groups] == [[10, 20], [30], [100], [5]]
    assert [p for g in groups for p in g] == params                   # order kept, nothing lost
    assert len(make_buckets(params, 1e9)) == 1
    first = make_buckets(params, bucket_cap_bytes=1e9, first_bucket_cap_bytes=4 * 30)   # PyTorch's small first bucket
    assert [[p.numel() for p in g] for g in first] == [[10, 20], [30, 100, 5]]


# ------------------------------------------------------------------------------ two ranks

def _two_rank_checks(cfg, batches):
    from course_lib.parallel.collectives import ByteCounter, ring_all_reduce

    out = {
        "naive": ddp_lab.rank_train(cfg, batches, mode="naive"),
        "bucketed_tiny": ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=1e-4),   # 1 param/bucket
        "bucketed_mid": ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=0.01),
        "bucketed_one": ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=25.0),
        "accum": ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=0.01, accum_steps=2),
        "torch": ddp_lab.rank_train(cfg, batches, mode="torch"),
    }
    ten = random_batches(cfg, 8, 10, seed=1)
    out["own10"] = ddp_lab.rank_train(cfg, ten, mode="bucketed", bucket_cap_mb=0.01)
    out["torch10"] = ddp_lab.rank_train(cfg, ten, mode="torch", bucket_cap_mb=0.01)
    ring = []
    for numel in RING_SIZES:
        t = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank() + 10 * numel)).to(cdist.device())
        expected = t.clone()
        dist.all_reduce(expected)
        counter = ByteCounter()
        ring_all_reduce(t, counter=counter)
        ring.append((numel, t, expected, counter.bytes_sent))
    out["ring"] = ring
    out["throughput"] = ddp_lab.rank_throughput(cfg, 2, variants=(("own", 25.0), ("torch", 25.0)), steps=1, warmup=0,
                                          profile=True)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    batches = random_batches(CFG, 8, STEPS)
    res = run(_two_rank_checks, 2, args=(CFG, batches), timeout_s=240, stream=False, backend="gloo")
    return res.returns, train_reference(CFG, batches)


def test_naive_dp_equals_one_process(two_ranks):
    returns, ref = two_ranks
    for rank, out in enumerate(returns):
        _assert_matches_reference(out["naive"], ref, f"naive DP, rank {rank}")


@pytest.mark.parametrize("variant", ["bucketed_tiny", "bucketed_mid", "bucketed_one"])
def test_bucketed_ddp_equals_one_process(two_ranks, variant):
    returns, ref = two_ranks
    for rank, out in enumerate(returns):
        _assert_matches_reference(out[variant], ref, f"{variant}, rank {rank}")
    n_buckets = {"bucketed_one": 1, "bucketed_tiny": sum(1 for _ in build_model(CFG).parameters())}
    if variant in n_buckets:                      # one all-reduce per bucket per step, no more
        assert returns[0][variant]["num_all_reduces"] == STEPS * n_buckets[variant]


def test_gradient_accumulation_communicates_once_per_step(two_ranks):
    returns, ref = two_ranks
    bucketed = returns[0]["bucketed_mid"]["num_all_reduces"] // STEPS
    for rank, out in enumerate(returns):
        _assert_matches_reference(out["accum"], ref, f"accumulation, rank {rank}", grads=False)
        assert out["accum"]["num_all_reduces"] == STEPS * bucketed, "communicated on a no_sync micro-step"


def test_own_ddp_equals_torch_ddp(two_ranks):
    returns, ref = two_ranks
    for rank, out in enumerate(returns):
        _assert_matches_reference(out["torch"], ref, f"torch DDP, rank {rank}")
        own, tdp = out["own10"], out["torch10"]
        assert own["losses"] == pytest.approx(tdp["losses"], rel=1e-6, abs=1e-7)
        _assert_same(own["grads"], tdp["grads"], "own vs torch DDP gradients after 10 steps", rtol=1e-6, atol=1e-8)
        _assert_same(own["params"], tdp["params"], "own vs torch DDP parameters after 10 steps",
                     rtol=1e-6, atol=1e-8)


def test_ring_all_reduce_two_ranks(two_ranks):
    returns, _ = two_ranks
    for rank, out in enumerate(returns):
        for numel, got, expected, nbytes in out["ring"]:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            assert nbytes == ring_bytes_sent(numel, 2, rank)


def test_throughput_report_shape(two_ranks):
    returns, _ = two_ranks
    stats = returns[0]["throughput"]
    assert set(stats) == {"own@25MB", "torch@25MB"}
    for s in stats.values():
        assert s["step_s"] > 0 and s["tokens_per_s"] > 0 and 0 <= s["comm_share"] <= 1


# ------------------------------------------------------------------------------ four ranks

def _four_rank_checks(cfg, batches, batches6):
    from course_lib.parallel.collectives import ByteCounter, ring_all_reduce

    r = dist.get_rank()
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 3)}   # every rank creates every group
    groups[4] = None
    ring = []
    for n, group in groups.items():
        if r >= n:
            continue
        for numel in RING_SIZES:
            shape = (numel,) if numel % 3 else (3, numel // 3)         # shapes other than 1-D too
            base = torch.arange(numel, dtype=torch.float32, device=cdist.device()).reshape(shape)
            t = base * (r + 1) + 0.5                                   # integers + 0.5: sums are exact
            counter = ByteCounter()
            ring_all_reduce(t, group=group, counter=counter)
            expected = base * (n * (n + 1) / 2) + 0.5 * n
            ring.append((n, numel, torch.equal(t, expected), counter.bytes_sent))
    avg = torch.full((5, 3), float(r), device=cdist.device())
    ring_all_reduce(avg, average=True)
    out = {"ring": ring, "average": avg,
           "ddp4": ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=0.01)}
    if r < 3:                                                          # data parallel over 3 of the 4 ranks
        out["ddp3"] = ddp_lab.rank_train(cfg, batches6, mode="bucketed", bucket_cap_mb=0.01, group=groups[3])
    return out


@pytest.fixture(scope="module")
def four_ranks():
    batches, batches6 = random_batches(CFG, 8, STEPS), random_batches(CFG, 6, STEPS, seed=2)
    res = run(_four_rank_checks, 4, args=(CFG, batches, batches6), timeout_s=240, stream=False, backend="gloo")
    return res.returns, train_reference(CFG, batches), train_reference(CFG, batches6)


def test_ring_all_reduce_world_sizes_1_to_4(four_ranks):
    returns, _, _ = four_ranks
    seen = set()
    for rank, out in enumerate(returns):
        for n, numel, ok, nbytes in out["ring"]:
            assert ok, f"ring all-reduce wrong on {n} ranks, {numel} elements (rank {rank})"
            assert nbytes == ring_bytes_sent(numel, n, rank), f"bytes counted on {n} ranks, {numel} elements"
            seen.add(n)
        torch.testing.assert_close(out["average"], torch.full((5, 3), 1.5))
    assert seen == {1, 2, 3, 4}


def test_bucketed_ddp_on_four_and_three_ranks(four_ranks):
    returns, ref8, ref6 = four_ranks
    for rank, out in enumerate(returns):
        _assert_matches_reference(out["ddp4"], ref8, f"bucketed DDP on 4 ranks, rank {rank}")
        if rank < 3:
            _assert_matches_reference(out["ddp3"], ref6, f"bucketed DDP on a 3-rank group, rank {rank}")
