"""Tests of lesson 05's ZeRO (course_lib/parallel/zero.py, lessons/variants.py, theory/memory.py).

Own ZeRO-1/2/3, PyTorch FSDP2 and DeepSpeed run on gloo ranks and are compared with PyTorch DDP on the same
data (losses every step, parameters after 10 steps); the model state each rank holds is compared with the
formula for N = 1, 2, 4; collective bytes are compared with the formula exactly. Broken variants (a wrong
shard index, a missing all-gather, a summed instead of averaged gradient) must fail the same comparisons.
All distributed checks of one world size run in one launch (each launch costs seconds of start-up).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from course_lib.config import small_config
from course_lib.data import random_batches, shard_batch
from course_lib.measure.hardware import cpu_features
from course_lib.runtime.launch import run
from course_lib.lessons.variants import VARIANTS, train_variant
from course_lib.model import build_model
from course_lib.parallel.deepspeed_config import deepspeed_config
from course_lib.parallel.zero import ZeroOptimizer, chunk_numel
from course_lib.theory.memory import (padded_numel, usable_offload, zero_bytes_per_param, zero_comm_bytes,
                                      zero_model_state_bytes, zero_saving)

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

STEPS = 10
CFG = small_config()                       # 2 layers, d_model 32: milliseconds per step
P = CFG.num_params()


def _assert_same_run(res: dict, ref: dict, what: str, rtol=1e-6, atol=1e-7):
    assert res["losses"] == pytest.approx(ref["losses"], rel=rtol, abs=atol), f"{what}: losses differ"
    assert res["params"].keys() == ref["params"].keys(), f"{what}: different parameter names"
    for k in ref["params"]:
        torch.testing.assert_close(res["params"][k], ref["params"][k], rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}, {k} after {STEPS} steps: {m}")


def _differs(res: dict, ref: dict) -> bool:
    try:
        _assert_same_run(res, ref, "broken")
    except AssertionError:
        return True
    return False


def _formula(n: int, stage: int) -> float:
    """fp32 AdamW model state of the course's GPT per rank, torch's step counters included."""
    n_tensors = len(list(build_model(CFG).parameters()))
    return zero_model_state_bytes(P, n, stage, mixed=False, step_counters=n_tensors)["total"]


# ------------------------------------------------------------------------------ formulas (one process)

def test_zero_formula_mixed_precision_matches_paper():
    Pb, N = 7_500_000_000, 64                     # the ZeRO paper's figure 1: 7.5B parameters, 64 GPUs
    gb = {s: zero_model_state_bytes(Pb, N, s)["total"] / 1e9 for s in range(4)}
    assert gb[0] == pytest.approx(120) and gb[1] == pytest.approx(31.4, abs=0.05)
    assert gb[2] == pytest.approx(16.6, abs=0.05) and gb[3] == pytest.approx(1.9, abs=0.05)
    for n in (1, 2, 4, 8, 1024):
        assert zero_bytes_per_param(0, n) == 16
        assert zero_bytes_per_param(1, n) == pytest.approx(4 + 12 / n)
        assert zero_bytes_per_param(2, n) == pytest.approx(2 + 14 / n)
        assert zero_bytes_per_param(3, n) == pytest.approx(16 / n)
        assert zero_bytes_per_param(1, n, mixed=False) == pytest.approx(8 + 8 / n)
        assert zero_bytes_per_param(2, n, mixed=False) == pytest.approx(4 + 12 / n)
        assert zero_bytes_per_param(3, n, mixed=False) == pytest.approx(16 / n)
    for s in range(4):                            # one rank: nothing to shard
        assert zero_model_state_bytes(100, 1, s)["total"] == 1600


def test_zero_offload_and_savings():
    # ZeRO-Offload (Ren et al. 2021, 4.1): gradients and optimizer state go to the CPU, the bf16 parameters stay
    s2 = zero_model_state_bytes(1000, 4, 2, offload="optimizer")
    assert (s2["grads"], s2["optimizer"], s2["params"], s2["total"]) == (0, 0, 2000, 2000)
    assert s2["cpu"] == (2 + 12) * 1000 / 4                       # 14P of the 16P leave the device (sharded)
    s1 = zero_model_state_bytes(1000, 4, 1, offload="optimizer")
    assert s1["total"] == 2000 and s1["cpu"] == 2000 + 12 * 1000 / 4
    s3o = zero_model_state_bytes(1000, 4, 3, offload="optimizer")
    assert s3o["total"] == 2000 / 4 and s3o["cpu"] == 14 * 1000 / 4
    s3 = zero_model_state_bytes(1000, 4, 3, offload="param")
    assert s3["params"] == 0 and s3["total"] == 0 and s3["cpu"] == 16 * 1000 / 4
    f32 = zero_model_state_bytes(1000, 1, 2, mixed=False, offload="optimizer")
    assert (f32["total"], f32["cpu"]) == (4000, 12000)
    with pytest.raises(ValueError, match="stage 3"):
        zero_model_state_bytes(1000, 4, 2, offload="param")
    with pytest.raises(ValueError, match="stage 1-3"):
        zero_model_state_bytes(1000, 4, 0, offload="optimizer")
    assert usable_offload(2, "param") == (None, "parameter offload needs stage 3: ignored")
    assert usable_offload(0, "optimizer")[0] is None and usable_offload(1, "optimizer") == ("optimizer", "")
    with pytest.raises(ValueError, match="stage"):
        zero_model_state_bytes(1000, 4, 4)
    # the syllabus's claims at N = 8: ZeRO-2 saves 50-75%? ZeRO-3 75-90%?
    assert 0.5 <= zero_saving(2, 4) <= 0.75 and zero_saving(2, 8) == pytest.approx(1 - (2 + 14 / 8) / 16)
    assert 0.75 <= zero_saving(3, 4) <= 0.90 and zero_saving(3, 16) > 0.9


def test_comm_formula_and_padding():
    for n in (2, 4, 8):
        assert zero_comm_bytes(1000, n, 1)["total"] == pytest.approx(zero_comm_bytes(1000, n, 0)["total"])
        assert zero_comm_bytes(1000, n, 3)["vs_ddp"] == pytest.approx(1.5)
    assert chunk_numel(10, 4) == 3 and chunk_numel(8, 4) == 2 and chunk_numel(1, 4) == 1
    assert padded_numel([10, 8, 1], 4) == 12 + 8 + 4


def test_formula_against_deepspeed_estimators():
    """DeepSpeed's estimators count mixed precision plus an fp32 gradient copy (4 bytes more per parameter
    on the sharded side) and, for stage 3, the largest layer gathered in fp32."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    Pb, largest = 1_000_000_000, 50_000_000
    for n in (1, 2, 4, 8):
        _, gpu2 = estimate_zero2_model_states_mem_needs(Pb, n, 1, cpu_offload=False)
        assert gpu2 == pytest.approx(zero_model_state_bytes(Pb, n, 2)["total"] + 4 * Pb / n, abs=1)
        _, gpu3, largest_bytes = estimate_zero3_model_states_mem_needs(Pb, largest, n, 1, cpu_offload=False)
        assert gpu3 == pytest.approx(zero_model_state_bytes(Pb, n, 3)["total"] + 2 * Pb / n + largest_bytes, abs=1)
        # ZeRO-Offload: only the 16-bit parameters stay on the GPU (2P; stage 3: 2P/N + the gathered layer)
        _, gpu2_off = estimate_zero2_model_states_mem_needs(Pb, n, 1, cpu_offload=True)
        assert gpu2_off == zero_model_state_bytes(Pb, n, 2, offload="optimizer")["total"] == 2 * Pb
        _, gpu3_off, _ = estimate_zero3_model_states_mem_needs(Pb, largest, n, 1, cpu_offload=True,
                                                               cpu_offload_params=False)
        assert gpu3_off == pytest.approx(zero_model_state_bytes(Pb, n, 3, offload="optimizer")["total"] + largest_bytes,
                                         abs=1)
        _, gpu3_par, _ = estimate_zero3_model_states_mem_needs(Pb, largest, n, 1, cpu_offload=True,
                                                               cpu_offload_params=True)
        assert gpu3_par == zero_model_state_bytes(Pb, n, 3, offload="param")["total"] + largest_bytes


def test_deepspeed_config_fp16_follows_the_machine():
    """fp16 is refused exactly where DeepSpeed refuses it: a CPU without native fp16 instructions (AMD EPYC, most
    laptops); accepted on a GPU and on a CPU with AVX512-FP16 / AMX-FP16 (Intel Xeon Sapphire Rapids and newer)."""
    if torch.cuda.is_available() or cpu_features()["fp16"]:
        assert deepspeed_config(2, 4, precision="fp16")["fp16"]["enabled"]
    else:
        with pytest.raises(ValueError, match="fp16"):
            deepspeed_config(2, 4, precision="fp16")
    c = deepspeed_config(3, 4, offload=True, precision="bf16")
    assert c["zero_optimization"]["offload_param"] == {"device": "cpu"} and c["bf16"]["enabled"]


# ------------------------------------------------------------------------------ broken variants

class WrongShard(ZeroOptimizer):
    """Updates the chunk of the next rank: the shard index is off by one."""

    @property
    def rank(self):
        return (self._rank + 1) % self.world

    @rank.setter
    def rank(self, value):
        self._rank = value


class NoAllGather(ZeroOptimizer):
    """Stage 1-2 without the all-gather after the step: other ranks' chunks stay stale."""

    def _all_gather_unit(self, k):
        if self.stage == 3:
            super()._all_gather_unit(k)


class SummedGradient(ZeroOptimizer):
    """Reduce-scatter without dividing by N: every gradient counted N times."""

    def _reduce_scatter_unit(self, k):
        super()._reduce_scatter_unit(k)
        for i in self.units[k]:
            self.chunks[i].grad.mul_(self.world)    # undo the division: the sum, not the mean


# ------------------------------------------------------------------------------ two ranks

def _two_rank_checks(cfg, batches):
    one = dist.new_group([0])                    # every rank creates every group
    out = {m: train_variant(cfg, batches, m) for m in ("ddp", "zero1", "zero2", "zero3", "fsdp2")}
    short = batches[:3]
    fast = dict(measure_live=False)              # runs whose memory is not checked skip the object walk
    out["sgd-ddp"] = train_variant(cfg, short, "ddp", optimizer="sgd", lr=0.5, **fast)
    out["sgd-zero2"] = train_variant(cfg, short, "zero2", optimizer="sgd", lr=0.5, **fast)
    out["wrong-shard"] = train_variant(cfg, short, "zero1", zero_cls=WrongShard, **fast)
    out["no-all-gather"] = train_variant(cfg, short, "zero2", zero_cls=NoAllGather, **fast)
    out["summed"] = train_variant(cfg, short, "zero2", zero_cls=SummedGradient, optimizer="sgd", lr=0.5, **fast)
    out["ddp3"] = train_variant(cfg, short, "ddp", **fast)
    for stage in (1, 2, 3):
        out[f"zero{stage}-bf16"] = train_variant(cfg, short, f"zero{stage}-bf16", **fast)
    for m in ("ds1", "ds3"):
        out[m] = train_variant(cfg, short, m)
    if dist.get_rank() == 0:                     # one rank: the formula's N = 1
        out["one"] = {m: train_variant(cfg, batches[:2], m, group=one, full_params=False)
                      for m in ("ddp", "zero1", "zero2", "zero3", "fsdp2")}
    model = build_model(cfg)                   # the parameter count of the blocks, for the stage-3 bytes
    out["block_numel"] = [p.numel() for b in model.blocks for p in b.parameters()]
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    batches = random_batches(CFG, 8, STEPS)
    res = run(_two_rank_checks, 2, args=(CFG, batches), timeout_s=240, stream=False, backend="gloo")
    return res.returns


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3", "fsdp2"])
def test_sharded_equals_ddp_after_10_steps(two_ranks, mode):
    for rank, out in enumerate(two_ranks):
        _assert_same_run(out[mode], out["ddp"], f"{mode} vs DDP, rank {rank}")


def test_sharded_sgd_equals_ddp(two_ranks):
    for rank, out in enumerate(two_ranks):
        _assert_same_run(out["sgd-zero2"], out["sgd-ddp"], f"ZeRO-2 with SGD, rank {rank}")


@pytest.mark.parametrize("broken", ["wrong-shard", "no-all-gather", "summed"])
def test_broken_variants_fail(two_ranks, broken):
    ref = two_ranks[0]["sgd-ddp" if broken == "summed" else "ddp"]
    assert any(_differs(out[broken], ref) for out in two_ranks), f"{broken} passed the comparison with DDP"


def test_deepspeed_equals_ddp(two_ranks):
    for rank, out in enumerate(two_ranks):
        for m in ("ds1", "ds3"):
            _assert_same_run(out[m], out["ddp3"], f"DeepSpeed {m} vs DDP, rank {rank}", rtol=1e-5, atol=1e-6)
            assert out[m]["live_bytes"] > 0


def test_collective_bytes_exact(two_ranks):
    out = two_ranks[0]
    Pp = out["zero1"]["padded_numel"]
    assert Pp == padded_numel([p.numel() for p in build_model(CFG).parameters()], 2)
    for stage in (1, 2):
        assert out[f"zero{stage}"]["comm"] == {"reduce_scatter": STEPS * 4 * Pp, "all_gather": STEPS * 4 * Pp}
    blocks = padded_numel(out["block_numel"], 2)  # blocks are gathered twice (forward, backward), the root once
    assert out["zero3"]["comm"] == {"reduce_scatter": STEPS * 4 * Pp, "all_gather": STEPS * 4 * (Pp + blocks)}
    ratio = (out["zero3"]["comm"]["all_gather"] + out["zero3"]["comm"]["reduce_scatter"]) / (2 * STEPS * 4 * Pp)
    assert 1.3 < ratio <= 1.5                     # the formula's 1.5x, less the root gathered once


# ------------------------------------------------------------------------------ 1, 2 and 4 ranks

def _four_rank_checks(cfg, batches):
    return {m: train_variant(cfg, batches, m) for m in ("ddp", "zero1", "zero2", "zero3", "fsdp2")}


@pytest.fixture(scope="module")
def four_ranks():
    batches = random_batches(CFG, 8, 2)
    res = run(_four_rank_checks, 4, args=(CFG, batches), timeout_s=240, stream=False, backend="gloo")
    return res.returns


MEMORY_CHECKED = ("ddp", "zero1", "zero2", "zero3", "fsdp2")


def _check_memory(res: dict, n: int, mode: str, rank: int):
    predicted = _formula(n, VARIANTS[mode].stage)
    measured = res["state"]["total"]
    assert abs(measured - predicted) <= 0.02 * predicted, \
        f"{mode} on {n} ranks, rank {rank}: measured {measured} B vs formula {predicted:.0f} B"
    assert abs(res["live_bytes"] - measured) <= 0.02 * measured, f"{mode}: live tensors beyond the model state"


def test_memory_within_2_percent_of_formula(two_ranks, four_ranks):
    for mode in MEMORY_CHECKED:
        _check_memory(two_ranks[0]["one"][mode], 1, mode, 0)
        for rank in range(2):
            _check_memory(two_ranks[rank][mode], 2, mode, rank)
        for rank in range(4):
            _check_memory(four_ranks[rank][mode], 4, mode, rank)


def test_mixed_precision_memory_is_the_16_bytes_rule_sharded(two_ranks):
    """A bf16 model with fp32 master chunks: 4P + 12P/N, 2P + 14P/N, 16P/N, measured."""
    T = len(list(build_model(CFG).parameters()))
    for rank, out in enumerate(two_ranks):
        for stage in (1, 2, 3):
            res = out[f"zero{stage}-bf16"]
            predicted = zero_model_state_bytes(P, 2, stage, mixed=True, step_counters=T)["total"]
            assert abs(res["state"]["total"] - predicted) <= 0.02 * predicted, f"bf16 ZeRO-{stage}, rank {rank}"
            assert res["losses"] == pytest.approx(out["zero1-bf16"]["losses"], abs=1e-3)
            assert res["losses"] == pytest.approx(out["ddp3"]["losses"], abs=5e-3)   # bf16 rounding of the weights


def test_four_ranks_equal_ddp(four_ranks):
    for rank, out in enumerate(four_ranks):
        # 4 ranks sum in another order than DDP; Adam divides by sqrt(v) + eps, which turns last-bit differences
        # of gradients near 0 into updates of ~1e-5 (a wrong shard or a missing gather is off by ~lr = 1e-2)
        for mode in ("zero1", "zero2", "zero3", "fsdp2"):
            _assert_same_run(out[mode], out["ddp"], f"{mode} on 4 ranks, rank {rank}", rtol=1e-5, atol=2e-5)


# ------------------------------------------------------------------------------ a torch.optim.Optimizer: groups,
# schedule, zero_grad, state dicts, checkpoints that resume on 4 ranks and on 2

CK_STEPS, CK_AT, CK_LR = 4, 2, 1e-2              # train 4 steps, checkpoint after 2


def _groups(model):
    """Parameter groups as a learner writes them: matrices decay, vectors do not and step at half the lr."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": CK_LR / 2}]


def _factor(step: int) -> float:
    return 1.0 / (1 + step)                      # LambdaLR: every step another lr


def _build(cfg, stage: int, seed: int = 0):
    """ZeRO from parameter groups; stage 1 with the default units (one per parameter), stage 2 with units that
    group the parameters by block (fewer collectives)."""
    model = build_model(cfg, seed)
    units = list(model.blocks) + [model] if stage == 2 else None
    zero = ZeroOptimizer(_groups(model), torch.optim.AdamW, stage=stage, lr=CK_LR, units=units)
    return model, zero, torch.optim.lr_scheduler.LambdaLR(zero, _factor)


def _train(model, zero, sched, batches, lrs=None, micro: int = 1, set_to_none: bool = True):
    r, n = dist.get_rank(), dist.get_world_size()
    for x, y in batches:
        x, y = shard_batch(x, r, n), shard_batch(y, r, n)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):    # gradient accumulation over micro-batches
            (model.loss(xm, ym) / micro).backward()
        if lrs is not None:
            lrs.append([g["lr"] for g in zero.optimizer.param_groups])   # what the inner, sharded step uses
        zero.step()
        sched.step()
        zero.zero_grad(set_to_none=set_to_none)


def _full_state(zero, names):
    """Every parameter's optimizer state in full (numel,), gathered: what a reshard must keep bit for bit."""
    out = {"lr": [g["lr"] for g in zero.param_groups]}
    for i, chunk in enumerate(zero.chunks):
        for k, v in zero.optimizer.state[chunk].items():
            full = torch.empty(v.numel() * zero.world, dtype=v.dtype, device=v.device)
            dist.all_gather_into_tensor(full, v.reshape(-1).contiguous())
            out[f"{names[i]}.{k}"] = v.clone() if v.dim() == 0 else full[:zero.params[i].numel()]
    return out


def _optimizer_checks(cfg, batches, folder):
    """4 ranks: the schedule, a checkpoint saved after CK_AT steps and resumed, zero_grad, the shard's state dict."""
    from course_lib.parallel import dist_checkpoint
    from course_lib.parallel.zero_state import param_names

    out = {}
    for stage in (1, 2):
        model, zero, sched = _build(cfg, stage)
        res = {"live": zero.param_groups is zero.optimizer.param_groups, "lrs": []}
        _train(model, zero, sched, batches[:CK_AT], res["lrs"])
        path = dist_checkpoint.step_path(f"{folder}/zero{stage}", CK_AT)
        dist_checkpoint.save(path, model=model, optimizer=zero, scheduler=sched, step=CK_AT, data_position=CK_AT)
        res["saved"] = _full_state(zero, param_names(zero, model))
        _train(model, zero, sched, batches[CK_AT:], res["lrs"])
        res["params"] = zero.full_parameters(model)
        for forget in (False, True):             # forgetting the optimizer state must show
            model2, zero2, sched2 = _build(cfg, stage, seed=1)     # other weights: the checkpoint overwrites them
            dist_checkpoint.load(path, model=model2, optimizer=zero2, scheduler=sched2)
            if forget:
                zero2.optimizer.state.clear()
            _train(model2, zero2, sched2, batches[CK_AT:])
            res["forgot" if forget else "resumed"] = zero2.full_parameters(model2)
        # the shard's own state dict: back into the same rank; another rank's is refused
        model3, zero3, _ = _build(cfg, stage, seed=1)
        zero3.load_state_dict(zero.state_dict())
        res["shard_roundtrip"] = (zero3.param_groups is zero3.optimizer.param_groups and all(
            torch.equal(zero3.state[c3][k], v) for c, c3 in zip(zero.chunks, zero3.chunks)
            for k, v in zero.state[c].items()))
        wrong = zero.state_dict()
        wrong["zero"]["rank"] = (zero.rank + 1) % zero.world
        try:
            zero3.load_state_dict(wrong)
        except ValueError as e:
            res["refused"] = str(e)
        try:
            zero3.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
        except NotImplementedError as e:
            res["add_group_refused"] = str(e)
        # zero_grad: set_to_none=False zeroes in place (stage 1: the full gradients; stage 2: the shards)
        x, y = shard_batch(batches[0][0], zero.rank, zero.world), shard_batch(batches[0][1], zero.rank, zero.world)
        model.loss(x, y).backward()
        grads = [p.grad for p in zero.params] if stage == 1 else [c.grad for c in zero.chunks]
        zero.zero_grad(set_to_none=False)
        now = [p.grad for p in zero.params] if stage == 1 else [c.grad for c in zero.chunks]
        res["zeroed_in_place"] = all(g is h and not g.any() for g, h in zip(grads, now))
        zero.zero_grad()
        res["set_to_none"] = all(t.grad is None for t in list(zero.params) + list(zero.chunks))
        for flag in (True, False):               # two micro-batches a step: the same training either way
            m, z, s = _build(cfg, stage)
            _train(m, z, s, batches[:1], micro=2, set_to_none=flag)
            res[f"accumulated_{flag}"] = z.full_parameters(m)
        out[f"zero{stage}"] = res
    return out


def _resume_on_two(cfg, batches, folder):
    """2 ranks: load the checkpoints 4 ranks wrote, gather the state, train the remaining steps."""
    from course_lib.parallel import dist_checkpoint
    from course_lib.parallel.zero_state import param_names

    out = {}
    for stage in (1, 2):
        model, zero, sched = _build(cfg, stage, seed=1)
        dist_checkpoint.load(dist_checkpoint.step_path(f"{folder}/zero{stage}", CK_AT), model=model, optimizer=zero,
                             scheduler=sched)
        out[f"zero{stage}"] = {"loaded": _full_state(zero, param_names(zero, model))}
        _train(model, zero, sched, batches[CK_AT:])
        out[f"zero{stage}"]["resumed"] = zero.full_parameters(model)
    return out


@pytest.fixture(scope="module")
def optimizer_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero_ckpt")
    batches = random_batches(CFG, 8, CK_STEPS)
    four = run(_optimizer_checks, 4, args=(CFG, batches, str(folder)), timeout_s=240, stream=False, backend="gloo")
    two = run(_resume_on_two, 2, args=(CFG, batches, str(folder)), timeout_s=240, stream=False, backend="gloo")
    return batches, four.returns, two.returns


def _one_process(cfg, batches):
    model = build_model(cfg, 0)
    opt = torch.optim.AdamW(_groups(model), lr=CK_LR)
    sched, lrs = torch.optim.lr_scheduler.LambdaLR(opt, _factor), []
    for x, y in batches:
        model.loss(x, y).backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
        opt.zero_grad()
    return lrs, {k: v.detach().clone() for k, v in model.named_parameters()}


def _close(a: dict, b: dict, what: str, rtol=0.0, atol=0.0):
    assert a.keys() == b.keys(), f"{what}: different names"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what}, {k}: {m}")


@pytest.mark.parametrize("stage", [1, 2])
def test_lambda_lr_drives_the_sharded_step(optimizer_runs, stage):
    batches, four, _ = optimizer_runs
    lrs, params = _one_process(CFG, batches)
    assert lrs[1] == [CK_LR / 2, CK_LR / 4]      # the schedule moved both groups' lr
    for rank, out in enumerate(four):
        res = out[f"zero{stage}"]
        assert res["live"] and res["lrs"] == lrs, f"ZeRO-{stage}, rank {rank}: the inner lr is not the schedule's"
        # 4 ranks sum gradients in another order than one process; Adam turns last-bit differences of gradients
        # near 0 into updates of ~1e-5 (a wrong lr or weight decay is off by ~lr = 1e-2)
        _close(res["params"], params, f"ZeRO-{stage} on 4 ranks vs one process", rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_set_to_none_and_accumulation(optimizer_runs, stage):
    for rank, out in enumerate(optimizer_runs[1]):
        res = out[f"zero{stage}"]
        assert res["zeroed_in_place"] and res["set_to_none"], f"ZeRO-{stage}, rank {rank}"
        _close(res["accumulated_False"], res["accumulated_True"], f"ZeRO-{stage} set_to_none=False vs True")


@pytest.mark.parametrize("stage", [1, 2])
def test_shard_state_dict_and_refusals(optimizer_runs, stage):
    for out in optimizer_runs[1]:
        res = out[f"zero{stage}"]
        assert res["shard_roundtrip"]
        assert "dist_checkpoint" in res["refused"] and "constructor" in res["add_group_refused"]
    with pytest.raises(ValueError, match="apply_zero"):
        ZeroOptimizer(build_model(CFG).parameters(), torch.optim.AdamW, stage=3)


@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoint_resumes_bit_exactly_and_reshards(optimizer_runs, stage):
    """Saved on 4 ranks after 2 of 4 steps. Resumed on 4: the very same arithmetic, bit for bit. Resumed on 2:
    the loaded state (parameters' optimizer state, step, lr) is the saved one bit for bit; the remaining steps
    sum the gradients of 2 ranks instead of 4 (another order), hence the tolerance of the 4-rank comparison."""
    _, four, two = optimizer_runs
    for rank, out in enumerate(four):
        res = out[f"zero{stage}"]
        _close(res["resumed"], res["params"], f"ZeRO-{stage} resumed on 4 ranks, rank {rank}")
        assert _differs({"losses": [], "params": res["forgot"]}, {"losses": [], "params": res["params"]}), \
            "a resume without the optimizer state passed"
    saved, params = four[0][f"zero{stage}"]["saved"], four[0][f"zero{stage}"]["params"]
    for rank, out in enumerate(two):
        res = out[f"zero{stage}"]
        assert res["loaded"].pop("lr") == saved["lr"]
        _close(res["loaded"], {k: v for k, v in saved.items() if k != "lr"}, f"ZeRO-{stage} state loaded on 2 ranks")
        _close(res["resumed"], params, f"ZeRO-{stage} resumed on 2 ranks, rank {rank}", rtol=1e-5, atol=2e-5)
