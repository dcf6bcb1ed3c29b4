"""Tests of lesson 02's data parallelism (course_lib/parallel/{collectives,ddp}.py, lessons/l02_data_parallel).

Every data-parallel variant runs on gloo ranks and is compared with one process on the global batch
(losses every step, parameters after the last step, gradients of the last step), and with PyTorch DDP.
All distributed checks of one world size run in one launch (each launch costs seconds of start-up).
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.config import small_config
from course_lib.data import random_batches
from course_lib.runtime.launch import run
from course_lib.lessons.l02_data_parallel import experiments as ddp_lab
from course_lib.model import build_model, lm_loss
from course_lib.one_process import grads_of, params_of, train_reference
from course_lib.parallel.collectives import chunk_sizes, ring_bytes_formula, ring_bytes_sent
from course_lib.parallel.ddp import BucketedDDP, make_buckets

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


# ------------------------------------------------------------------------------ a drop-in for torch DDP

MAX_NORM = 0.05            # below the gradient norm of every step below: clipping scales every step's gradients


def _clipped_steps(net, model, batches, sync=lambda: None, mean=torch.Tensor.item) -> dict:
    """Ordinary PyTorch training through `net`: the loss of its forward, SGD with momentum over `net.parameters()`
    (linear in the gradients, so rounding is not amplified as Adam's 1/sqrt(v) does near zero gradients), gradients
    clipped with `clip_grad_norm_(net.parameters())` after `sync()`. `mean` turns a rank's loss into the global
    batch's. Returns losses, total norms before clipping, clipped gradients of the last step, parameters after it."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    losses, norms, grads = [], [], None
    for x, y in batches:
        loss = lm_loss(net(x), y)
        loss.backward()
        sync()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        grads = grads_of(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean(loss))
    return {"losses": losses, "norms": norms, "grads": grads, "params": params_of(model)}


def _drop_in_checks(cfg, batches):
    """BucketedDDP used where torch.nn.parallel.DistributedDataParallel would go, with torch DDP beside it."""
    from course_lib.data import shard_batch
    from course_lib.dist import global_mean

    r, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    shards = [(shard_batch(x, r, n).to(dev), shard_batch(y, r, n).to(dev)) for x, y in batches]
    out = {}
    model = build_model(cfg).to(dev)
    ddp = BucketedDDP(model, bucket_cap_mb=0.01)
    out["clipped"] = _clipped_steps(ddp, model, shards, sync=ddp.finish_gradient_synchronization, mean=global_mean)
    out["repr"] = repr(ddp)

    tdp = torch.nn.parallel.DistributedDataParallel(build_model(cfg).to(dev))
    out["names"] = {"own": [k for k, _ in ddp.named_parameters()], "torch": [k for k, _ in tdp.named_parameters()]}
    out["keys"] = {"own": list(ddp.state_dict()), "torch": list(tdp.state_dict())}
    loaded = {}
    for source, state in (("torch", tdp.state_dict()), ("own", ddp.state_dict())):
        fresh = BucketedDDP(build_model(cfg, seed=1).to(dev), broadcast=False)
        fresh.load_state_dict(state)                                    # strict
        loaded[source] = (fresh.state_dict(), state)
    out["loaded"] = loaded
    plain = build_model(cfg).state_dict()                               # no 'module.' prefix
    out["plain_load"] = {}
    for name, wrapper in (("own", ddp), ("torch", tdp)):
        try:
            wrapper.load_state_dict(plain)
            out["plain_load"][name] = None
        except RuntimeError as exc:
            out["plain_load"][name] = "Missing key(s)" in str(exc)

    drop = BucketedDDP(build_model(dataclasses.replace(cfg, dropout=0.5)).to(dev))
    x = shards[0][0]
    drop.eval()
    eval_modes = {m.training for m in drop.modules()}
    eval_same = torch.equal(drop(x), drop(x)) and torch.equal(drop(x), drop.module(x))
    drop.train()
    out["modes"] = {"eval": eval_modes, "train": {m.training for m in drop.modules()},
                    "eval_outputs_equal": eval_same, "train_outputs_equal": torch.equal(drop(x), drop(x))}

    wide = BucketedDDP(build_model(cfg).to(dev), bucket_cap_mb=0.01).to(torch.float64)   # moved after wrapping
    lm_loss(wide(x), shards[0][1]).backward()
    wide.finish_gradient_synchronization()
    out["float64_grads"] = grads_of(wide.module)
    return out


@pytest.fixture(scope="module")
def drop_in():
    batches = random_batches(CFG, 8, STEPS)
    res = run(_drop_in_checks, 2, args=(CFG, batches), timeout_s=240, stream=False, backend="gloo")
    return res.returns, batches


def test_clip_grad_norm_and_optimizer_through_ddp_equal_one_process(drop_in):
    returns, batches = drop_in
    model = build_model(CFG)
    ref = _clipped_steps(model, model, batches)
    assert min(ref["norms"]) > 2 * MAX_NORM, "the reference must clip on every step, or the test proves nothing"
    for rank, out in enumerate(returns):
        got = out["clipped"]
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank}: total gradient norm differs"
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), f"rank {rank}: losses differ"
        _assert_same(got["grads"], ref["grads"], f"clipped gradients, rank {rank}")
        _assert_same(got["params"], ref["params"], f"SGD over ddp.parameters(), parameters after {STEPS} steps, rank {rank}")


def test_state_dict_names_equal_torch_ddp_and_round_trip(drop_in):
    returns, _ = drop_in
    for rank, out in enumerate(returns):
        assert out["names"]["own"] == out["names"]["torch"]
        assert out["keys"]["own"] == out["keys"]["torch"]
        assert out["keys"]["own"][0].startswith("module.")
        for source, (got, saved) in out["loaded"].items():
            _assert_same(got, saved, f"state dict saved from {source} DDP, loaded into BucketedDDP", rtol=0, atol=0)
        assert out["plain_load"] == {"own": True, "torch": True}, "a plain model's state dict loads as in torch DDP"


def test_train_eval_propagate_through_ddp(drop_in):
    returns, _ = drop_in
    for out in returns:
        modes = out["modes"]
        assert modes["eval"] == {False} and modes["train"] == {True}
        assert modes["eval_outputs_equal"], "eval(): dropout must be off, outputs equal to the plain model's"
        assert not modes["train_outputs_equal"], "train(): dropout 0.5 must change the outputs between calls"


def test_ddp_to_moves_buckets_and_repr(drop_in):
    returns, batches = drop_in
    model = build_model(CFG).double()
    x, y = batches[0]
    lm_loss(model(x), y).backward()                     # one process, the whole first batch, float64
    for out in returns:
        assert all(g.dtype == torch.float64 for g in out["float64_grads"].values())
        _assert_same(out["float64_grads"], grads_of(model), "float64 gradients after ddp.to()", rtol=1e-10, atol=1e-12)
        first = out["repr"].splitlines()
        assert first[0] == "BucketedDDP(" and "buckets of [" in first[1] and "cap 0.01 MB, world size 2" in first[1]
        assert any(line.strip().startswith("(module): GPT(") for line in first)


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


def test_tracking_backward_sees_hooks_inside_backward_only():
    """Lesson 02's bucketed-DDP check tells 'inside backward' from public API only (a wrapped
    torch.autograd.backward): a gradient hook sees True, code before and after backward sees False, and both
    loss.backward() and torch.autograd.backward(loss) are seen; the wrapper goes away with the context."""
    from course_lib.lessons.l02_data_parallel import checks as ddp_checks

    real = torch.autograd.backward
    seen = []
    w = torch.nn.Parameter(torch.ones(3))
    w.register_post_accumulate_grad_hook(lambda p: seen.append(ddp_checks._in_backward()))
    with ddp_checks.tracking_backward():
        assert not ddp_checks._in_backward()
        (w * 2).sum().backward()
        torch.autograd.backward((w * 3).sum())
        assert not ddp_checks._in_backward()
    assert seen == [True, True]
    assert torch.autograd.backward is real
    (w * 2).sum().backward()
    assert seen == [True, True, False]          # outside the context nothing is tracked
