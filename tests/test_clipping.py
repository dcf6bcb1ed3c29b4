"""Tests of lesson 09's global gradient-norm clipping across shards (course_lib/parallel/clipping.py).

Every parallel norm is compared with `torch.nn.utils.clip_grad_norm_` of ONE process on the global batch (same model,
same seed, mean loss over the global batch, as data parallelism averages it): DP 2 x TP 2 with the course's
tensor-parallel GPT on 4 ranks; the course's ZeRO-2 and PyTorch's FSDP2 (DTensor gradients) on 2 ranks, FSDP2 also
against torch's own clipping of its DTensor gradients. The double-counting variants (replicated parameters counted on
every TP rank, replicas summed over dp, shards never summed) must miss the reference by far more than the tolerance.
One launch per world size (each costs seconds of start-up).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.config import small_config
from course_lib.data import random_batches, shard_batch
from course_lib.dist import ProcessGrid
from course_lib.runtime.launch import run
from course_lib.lessons.errors import relative_error
from course_lib.lessons.l09_training.experiments import dp_tp_gradients
from course_lib.model import build_model
from course_lib.one_process import grads_of
from course_lib.parallel.clipping import (clip_grad_norm_, clip_grads_with_norm_, global_grad_norm,
                                          param_grad_parts, tensor_parallel_grad_parts, zero_grad_parts)
from course_lib.parallel.ddp import average_gradients
from course_lib.parallel.tensor_model import apply_tensor_parallel, shard_like
from course_lib.parallel.three_d import parallelize_3d, train_step_3d
from course_lib.parallel.zero import ZeroOptimizer

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

CFG = small_config()                     # vocab 64, T 16, 2 layers, 2 heads, d_model 32: tp = 2 divides it
CFG_PP = small_config(tie_embeddings=False)   # pipelining needs untied embeddings: one block per stage
BATCH = 4                                # global batch: 2 rows per data-parallel rank
MAX_NORM = 0.05                          # well below the gradient norm (~1): clipping happens
RTOL = 1e-6                              # fp32 rounding of a 2-norm (or inf-norm) over ~30k numbers
RTOL_L1 = 1e-5                           # a 1-norm adds ~30k |g| in another order: measured ~9e-7, kept wider
GRAD_RTOL = 2e-6                         # gradients of TP / sharded runs vs one process, as tests/test_tensor.py
INF = float("inf")


def _reference(x: torch.Tensor, y: torch.Tensor, cfg=CFG) -> dict:
    """One process on the global batch: gradients, their norms, torch's clipping of them."""
    model = build_model(cfg, seed=0)
    model.loss(x, y).backward()
    grads = grads_of(model)
    norms = {p: torch.nn.utils.get_total_norm(list(grads.values()), p).item() for p in (1.0, INF)}
    norms[2.0] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
    return {"grads": grads, "norms": norms, "clipped": grads_of(model)}


@pytest.fixture(scope="module")
def data() -> dict:
    x, y = random_batches(CFG, BATCH, steps=1, seed=0)[0]
    return {"x": x, "y": y, "ref": _reference(x, y), "ref_pp": _reference(x, y, CFG_PP)}


def _rel(a: float, e: float) -> float:
    return abs(a - e) / abs(e)


# ------------------------------------------------------------------------------ rank functions

class _ClipInsteadOfStep:
    """The optimizer handed to `train_step_3d`: its step() takes the norm and clips, where a loop would step."""

    def __init__(self, fn):
        self.step, self.zero_grad = fn, lambda: None


def _rank_pp_tp(x, y, ref) -> dict:
    """PP 2 x TP 2 (a 3D stage, dp = 1): every part is also sharded over pp (the stages hold disjoint layers)."""
    grid = ProcessGrid(pp=2, tp=2)
    tp, pp = grid.group("tp"), grid.group("pp")
    model = build_model(CFG_PP, seed=0).to(cdist.device())
    stage, out = parallelize_3d(model, grid), {}

    def clip():
        parts = tensor_parallel_grad_parts(stage, tp, pp_group=pp)
        out["pp_norm"] = global_grad_norm(parts).item()
        out["pp_forgotten"] = global_grad_norm(tensor_parallel_grad_parts(stage, tp)).item()   # broken
        clip_grad_norm_(parts, MAX_NORM)
        names = {id(p): k for k, p in model.named_parameters()}
        mine = {names[id(p)]: p.grad.cpu() for p in stage.parameters()}
        out["pp_clip_err"] = relative_error(mine, shard_like(model, {k: ref["clipped"][k] for k in mine}, tp))

    train_step_3d(stage, grid, x.to(cdist.device()), y.to(cdist.device()), m=2, optimizer=_ClipInsteadOfStep(clip))
    return out


def rank_dp_tp(x, y, ref, ref_pp) -> dict:
    """DP 2 x TP 2: this rank's rows, gradients averaged over dp, norms of the TP parts; then clipped. The same with
    sequence parallelism, and PP 2 x TP 2."""
    model, grid, parts = dp_tp_gradients(CFG, x, y)           # (lesson 09's: its exercise checks the same way)
    tp, dp, dev = grid.group("tp"), grid.group("dp"), cdist.device()
    xs, ys = (shard_batch(t, grid.coord("dp"), 2).to(dev) for t in (x, y))    # for the SP model below
    out = {"grad_err": relative_error(grads_of(model), shard_like(model, ref["grads"], tp)),
           "norms": {p: global_grad_norm(parts, p).item() for p in (1.0, 2.0, INF)},
           "n_replicated": sum(spec is None for _, spec in parts),
           # broken: replicated parameters counted on every tp rank; replicas summed over dp
           "every_tp_rank": global_grad_norm([(g, tp) for g, _ in parts]).item(),
           "summed_over_dp": global_grad_norm([(g, (s or ()) + (dp,)) for g, s in parts]).item()}
    out["total"] = clip_grad_norm_(parts, MAX_NORM).item()
    out["clip_err"] = relative_error(grads_of(model), shard_like(model, ref["clipped"], tp))
    sp = apply_tensor_parallel(build_model(CFG, seed=0).to(dev), tp, sequence_parallel=True)
    sp.loss(xs, ys).backward()
    average_gradients(sp, group=dp)
    sp.sync_sequence_parallel_grads()            # LayerNorms etc. saw T/2 tokens: summed, then replicated
    out["sp_norm"] = global_grad_norm(tensor_parallel_grad_parts(sp, tp)).item()
    return {**out, **_rank_pp_tp(x, y, ref_pp)}


def rank_sharded(x, y, ref) -> dict:
    """Own ZeRO-2, then FSDP2, on 2 ranks: norms of the owned gradient shards; clipped shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    xs, ys = (shard_batch(t, r, n).to(dev) for t in (x, y))
    out = {}
    # ZeRO-2: after backward each rank holds chunk r of every (padded, flattened) mean gradient
    model = build_model(CFG, seed=0).to(dev)
    zero = ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1)
    model.loss(xs, ys).backward()
    parts = zero_grad_parts(zero)
    out["zero"] = global_grad_norm(parts).item()
    out["zero_unsummed"] = global_grad_norm([(g, None) for g, _ in parts]).item()     # broken: shards never summed
    out["zero_total"] = clip_grad_norm_(parts, MAX_NORM).item()
    names = {id(p): k for k, p in model.named_parameters()}
    ref_chunks = []
    for p, c in zip(zero.params, zero.sizes):
        flat = torch.zeros(n * c)
        flat[:p.numel()] = ref["clipped"][names[id(p)]].reshape(-1)
        ref_chunks.append(flat[r * c:(r + 1) * c])                                    # (c,) the same chunk
    out["zero_clip_err"] = relative_error(torch.cat([g.cpu() for g, _ in parts]), torch.cat(ref_chunks))
    zero.remove()
    try:
        zero_grad_parts(ZeroOptimizer(build_model(CFG, seed=0).to(dev), torch.optim.SGD, stage=1, lr=0.1))
        out["zero1_refused"] = False
    except ValueError as e:
        out["zero1_refused"] = "step()" in str(e)
    # FSDP2: gradients are DTensors sharded along dim 0 over the mesh
    model = build_model(CFG, seed=0).to(dev)
    mesh = init_device_mesh(dev.type, (n,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.loss(xs, ys).backward()
    parts = param_grad_parts(model.parameters())
    out["fsdp_all_sharded"] = all(spec is not None for _, spec in parts)
    out["fsdp"] = global_grad_norm(parts).item()
    out["fsdp_unsummed"] = global_grad_norm([(g, None) for g, _ in parts]).item()
    before = [g.clone() for g, _ in parts]
    out["fsdp_total"] = clip_grad_norm_(parts, MAX_NORM).item()
    full = lambda: {k: p.grad.full_tensor().cpu() for k, p in model.named_parameters()}   # noqa: E731
    own_clipped = full()
    for (g, _), b in zip(parts, before):
        g.copy_(b)                                                   # back to the unclipped gradients
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)    # torch's distributed clipping
    out["torch_total"] = (total.full_tensor() if hasattr(total, "full_tensor") else total).item()
    torch_clipped = full()
    out["fsdp_clip_err"] = relative_error(own_clipped, ref["clipped"])
    out["fsdp_vs_torch_clip_err"] = relative_error(own_clipped, torch_clipped)
    out["torch_clip_err"] = relative_error(torch_clipped, ref["clipped"])
    return out


@pytest.fixture(scope="module")
def four_ranks(data) -> list[dict]:
    args = (data["x"], data["y"], data["ref"], data["ref_pp"])
    return run(rank_dp_tp, 4, args=args, timeout_s=120, backend="gloo").returns


@pytest.fixture(scope="module")
def two_ranks(data) -> list[dict]:
    return run(rank_sharded, 2, args=(data["x"], data["y"], data["ref"]), timeout_s=120, backend="gloo").returns


# ------------------------------------------------------------------------------ one process

def test_one_process_equals_torch_bit_for_bit(data):
    """Every part replicated (None): the norms and the clipped gradients are torch's, exactly."""
    ref = data["ref"]
    grads = [g.clone() for g in ref["grads"].values()]
    for p in (1.0, 2.0, INF):
        assert global_grad_norm([(g, None) for g in grads], p).item() == ref["norms"][p]
    assert ref["norms"][2.0] > MAX_NORM                               # the reference itself clips
    total = clip_grad_norm_([(g, None) for g in grads], MAX_NORM)
    assert total.item() == ref["norms"][2.0]
    assert all(torch.equal(g, c) for g, c in zip(grads, ref["clipped"].values()))
    coef = clip_grads_with_norm_(grads, MAX_NORM, torch.tensor(MAX_NORM / 2))
    assert coef.item() == 1.0                                         # never amplifies
    assert global_grad_norm([]).item() == 0.0
    with pytest.raises(ValueError, match="norm_type"):
        global_grad_norm([(grads[0], None)], 0.0)


# ------------------------------------------------------------------------------ DP 2 x TP 2 on 4 ranks

def test_dp_tp_norm_equals_one_process(four_ranks, data):
    ref = data["ref"]["norms"]
    for r, out in enumerate(four_ranks):
        assert out["grad_err"] < GRAD_RTOL, f"rank {r}: the TP gradients differ from one process"
        assert out["n_replicated"] > 0
        for p in (1.0, 2.0, INF):
            tol = RTOL_L1 if p == 1.0 else RTOL
            assert _rel(out["norms"][p], ref[p]) < tol, f"rank {r}, p={p}: {out['norms'][p]} vs {ref[p]}"
        assert out["total"] == out["norms"][2.0]
        assert MAX_NORM / (out["total"] + 1e-6) < 1                   # clipping happened


def test_dp_tp_clipped_gradients_equal_one_process(four_ranks):
    for r, out in enumerate(four_ranks):
        assert out["clip_err"] < GRAD_RTOL, f"rank {r}: clipped gradients differ by {out['clip_err']:.2e}"


def test_dp_tp_double_counting_is_caught(four_ranks, data):
    ref = data["ref"]["norms"][2.0]
    for out in four_ranks:
        assert _rel(out["every_tp_rank"], ref) > 100 * RTOL           # replicated params counted tp times
        assert _rel(out["summed_over_dp"], ref) == pytest.approx(2 ** 0.5 - 1, rel=1e-5)   # sqrt(dp) too large


def test_sequence_parallel_and_pipeline_stages_count_each_part_once(four_ranks, data):
    ref, ref_pp = data["ref"]["norms"][2.0], data["ref_pp"]["norms"][2.0]
    for r, out in enumerate(four_ranks):
        assert _rel(out["sp_norm"], ref) < RTOL, f"rank {r}: sequence parallel {out['sp_norm']} vs {ref}"
        assert _rel(out["pp_norm"], ref_pp) < RTOL, f"rank {r}: pp x tp {out['pp_norm']} vs {ref_pp}"
        assert out["pp_clip_err"] < GRAD_RTOL and ref_pp > MAX_NORM
        assert _rel(out["pp_forgotten"], ref_pp) > 100 * RTOL          # one stage's norm is not the model's


# ------------------------------------------------------------------------------ ZeRO-2 and FSDP2 on 2 ranks

def test_zero2_norm_and_clipping_equal_one_process(two_ranks, data):
    ref = data["ref"]["norms"][2.0]
    for r, out in enumerate(two_ranks):
        assert _rel(out["zero"], ref) < RTOL, f"rank {r}: ZeRO-2 norm {out['zero']} vs {ref}"
        assert out["zero_total"] == out["zero"] and MAX_NORM / (out["zero"] + 1e-6) < 1
        assert out["zero_clip_err"] < GRAD_RTOL
        assert _rel(out["zero_unsummed"], ref) > 100 * RTOL           # a shard's norm is not the model's
        assert out["zero1_refused"], "stage 1 has no reduced gradients before step(): it must refuse"


def test_fsdp2_norm_equals_one_process_and_torch(two_ranks, data):
    ref = data["ref"]["norms"][2.0]
    for r, out in enumerate(two_ranks):
        assert out["fsdp_all_sharded"]
        assert _rel(out["fsdp"], ref) < RTOL, f"rank {r}: FSDP2 norm {out['fsdp']} vs {ref}"
        assert _rel(out["torch_total"], ref) < RTOL and _rel(out["fsdp"], out["torch_total"]) < RTOL
        assert out["fsdp_total"] == out["fsdp"]
        assert _rel(out["fsdp_unsummed"], ref) > 100 * RTOL


def test_fsdp2_clipped_gradients_equal_one_process_and_torch(two_ranks):
    for out in two_ranks:
        assert out["fsdp_clip_err"] < GRAD_RTOL and out["torch_clip_err"] < GRAD_RTOL
        assert out["fsdp_vs_torch_clip_err"] < GRAD_RTOL
