"""Context parallelism composed with data parallelism on a `ProcessGrid` (lessons 08 and 10): dp 2 x cp 2 on 4 gloo
ranks equals one process.

The grid orders ranks tp, cp, dp, pp (innermost first; `course_lib.dist.GridLayout`): with dp = cp = 2, ranks
{0, 1} and {2, 3} are the cp groups (consecutive: K/V chunks every layer on the fastest links), {0, 2} and {1, 3}
the dp groups. Each dp replica takes its half of the global batch (`shard_batch`), each cp rank of a replica its
chunks of every sequence (balanced split, ring attention). Gradients: each rank's loss is the mean over its
(B/dp) x (s/cp) tokens, so the gradient of the global mean is the mean of the 4 ranks' gradients: averaged over cp
(`sync_context_parallel_grads`) then over dp (`ddp.average_gradients`), two all-reduces, the simpler one used here.
Megatron-LM does one all-reduce over the dp x cp ranks instead (its "data-parallel group with context parallel",
which here is all 4 ranks): run too, and equal to the two.

One launch (tiny GPT, s = 32, dropout 0, global batch 4, 3 SGD steps, fp32): the loss of every step and every
parameter after the steps vs one process on the whole batch (rtol 1e-5, atol 1e-6); the groups against PyTorch's
DeviceMesh ("dp", "cp"); gradients averaged over dp only (cp forgotten) must fail.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest
import torch

from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.runtime.launch import run
from course_lib.one_process import train_reference

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(get_preset("tiny"), seq_len=32, dropout=0.0)   # 2 layers, 4 heads, d_model 64, s = 32
DP, CP, BATCH, STEPS, LR = 2, 2, 4, 3, 0.3
RTOL, ATOL = 1e-5, 1e-6
SYNCS = ["cp then dp", "dp x cp at once", "dp only (wrong)"]


def _train(cfg, batches, lr, grid, dp_cp, sync: str) -> dict:
    """Train the tiny GPT on this rank's rows and chunks of `batches` with dp x cp on `grid`; gradients averaged as
    `sync` says (`dp_cp`: the group of the dp x cp ranks). Returns the global loss of each step and the parameters
    after the last."""
    from course_lib import dist as cdist
    from course_lib.data import shard_batch
    from course_lib.model import build_model, lm_loss
    from course_lib.one_process import params_of
    from course_lib.parallel import context
    from course_lib.parallel.ddp import average_gradients

    dev = cdist.device()
    model = context.apply_context_parallel(build_model(cfg, 0).to(dev), grid.group("cp"), "ring", "balanced")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        x_r, y_r = (shard_batch(t, grid.coord("dp"), DP) for t in (x, y))                  # (B, s) -> (B/dp, s)
        x_r, y_r = (context.split_sequence(t.to(dev), grid.group("cp")) for t in (x_r, y_r))  # -> (B/dp, s/cp)
        loss = lm_loss(model(x_r), y_r)                              # mean over this rank's (B/dp) x (s/cp) tokens
        loss.backward()
        if sync == "cp then dp":
            context.sync_context_parallel_grads(model, grid.group("cp"))
            average_gradients(model, grid.group("dp"))
        elif sync == "dp x cp at once":
            average_gradients(model, dp_cp)
        else:
            average_gradients(model, grid.group("dp"))
        cp_loss = context.context_parallel_loss(loss, grid.group("cp"))
        losses.append(cdist.global_mean(torch.tensor(cp_loss, device=dev), grid.group("dp")))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "params": params_of(model)}


def _rank_all(cfg, batches, lr) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib import dist as cdist

    grid = cdist.ProcessGrid(dp=DP, cp=CP)
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    dp_cp = sorted(r for d in grid.ranks("dp") for r in grid.members(d, "cp"))   # Megatron's: same pp and tp as me
    out = {"dp_cp": dp_cp, "coords": grid.coords_of(cdist.rank()), "repr": repr(grid),
           "groups": {n: grid.ranks(n) for n in ("dp", "cp")},
           "mesh": {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in ("dp", "cp")}}
    dp_cp_group = dist.new_group(dp_cp)                            # one such group here (pp = tp = 1)
    for sync in SYNCS:
        out[sync] = _train(cfg, batches, lr, grid, dp_cp_group, sync)
    return out


BATCHES = random_batches(CFG, BATCH, STEPS, seed=0)


@pytest.fixture(scope="module")
def reference():
    return train_reference(CFG, BATCHES, optimizer="sgd", lr=LR)


@pytest.fixture(scope="module")
def ranks():
    return run(_rank_all, nprocs=DP * CP, args=(CFG, BATCHES, LR), backend="gloo", timeout_s=300, stream=False,
               threads_per_rank=1).returns


def test_grid_places_cp_inside_dp(ranks):
    for r, out in enumerate(ranks):
        assert out["coords"] == {"pp": 0, "dp": r // CP, "cp": r % CP, "tp": 0}
        assert out["groups"] == out["mesh"], r                     # = init_device_mesh((dp, cp), ("dp", "cp"))
        assert out["dp_cp"] == [0, 1, 2, 3]                           # pp = tp = 1: every rank
    assert [out["groups"]["cp"] for out in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [out["groups"]["dp"] for out in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert ranks[3]["repr"] == "ProcessGrid(pp=1, dp=2, cp=2, tp=1; rank 3 at pp=0, dp=1, cp=1, tp=0)"


@pytest.mark.parametrize("sync", SYNCS[:2])
def test_dp_x_cp_equals_one_process(ranks, reference, sync):
    """Loss of each of the 3 steps and every parameter after them, on every rank, = one process (fp32)."""
    for r, out in enumerate(ranks):
        row, what = out[sync], f"{sync}, rank {r}"
        assert row["losses"] == pytest.approx(reference["losses"], rel=RTOL, abs=ATOL), what
        assert row["params"].keys() == reference["params"].keys()
        for k, p in reference["params"].items():
            torch.testing.assert_close(row["params"][k], p, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what}: {k} after {STEPS} SGD steps: {m}")


def test_one_all_reduce_over_dp_x_cp_equals_two(ranks):
    """Megatron's single all-reduce over the dp x cp ranks gives the parameters of cp-then-dp (mean of means of
    equal counts = the mean), to fp32 rounding."""
    for out in ranks:
        for k, p in out["cp then dp"]["params"].items():
            torch.testing.assert_close(out["dp x cp at once"]["params"][k], p, rtol=RTOL, atol=ATOL)


def test_forgetting_cp_fails(ranks, reference):
    """Gradients averaged over dp only: each cp rank keeps the gradient of its own chunks, so the cp ranks of a
    replica step apart and none equals one process."""
    for r, out in enumerate(ranks):
        row = out["dp only (wrong)"]
        err = max((row["params"][k] - p).abs().max().item() for k, p in reference["params"].items())
        assert err > 1e-3, f"rank {r}: parameters within {err:.2e} of one process with cp forgotten"
    a, b = ranks[0]["dp only (wrong)"]["params"], ranks[1]["dp only (wrong)"]["params"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-3      # cp ranks 0 and 1 drifted apart
