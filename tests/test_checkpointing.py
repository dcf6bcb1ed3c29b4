"""Tests of lesson 07's memory savers (course_lib/parallel/checkpointing.py, lessons/l07_memory_savers,
theory/savers.py).

Checkpointed models must give the plain model's loss and gradients; the activation bytes measured after the
forward and at the peak of backward must match the formulas; the recomputed FLOPs are counted exactly; naive
attention keeps O(T^2) bytes and SDPA O(T); gradient accumulation gives the full batch's gradients; the budget
fitter picks known plans. Wrong answers to the graded exercises (a wrapper that does not checkpoint, one that
detaches its input, an estimator without the attention term, ...) must fail the same checks the test cells use.
Memory only: nothing here asserts a time.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from course_lib import theory
from course_lib.config import PRESETS, ModelConfig
from course_lib.data import random_batches
from course_lib.grading.check import CheckFailed
from course_lib.lessons.l07_memory_savers import checks as savers_checks
from course_lib.lessons.l07_memory_savers import experiments as savers_lab
from course_lib.measure.speed import count_flops
from course_lib.model import build_model
from course_lib.parallel.checkpointing import (CheckpointedBlock, apply_activation_checkpointing,
                                               checkpointed_segments, recompute_attention_core,
                                               remove_activation_checkpointing)

CFG = ModelConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=2, d_model=32, name="ckpt-test")


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ checkpointing is exact

@pytest.mark.parametrize("every,selective", [(1, False), (2, False), (3, False), (1, True)])
def test_checkpointed_model_same_loss_and_gradients(every, selective):
    x, y = random_batches(CFG, 4, 1, seed=3)[0]
    plain = build_model(CFG, 0)
    ref = savers_lab.measure_step(plain, x, y)
    model = build_model(CFG, 0)
    names = list(model.state_dict())
    apply_activation_checkpointing(model, every=every, selective=selective)
    assert list(model.state_dict()) == names, "checkpointing must not rename parameters"
    got = savers_lab.measure_step(model, x, y)
    assert got["loss"] == ref["loss"]
    assert got["grads"].keys() == ref["grads"].keys()
    for k in ref["grads"]:
        torch.testing.assert_close(got["grads"][k], ref["grads"][k], rtol=0, atol=1e-7, msg=k)
    assert got["held"] < ref["held"]
    with torch.no_grad():                              # inference: no checkpoint, the same logits
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    remove_activation_checkpointing(model)
    assert savers_lab.measure_step(model, x, y)["held"] == ref["held"]


def test_segments_and_validation():
    assert checkpointed_segments(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    model = build_model(CFG, 0)
    with pytest.raises(ValueError, match="every=0"):
        apply_activation_checkpointing(model, every=0)
    with pytest.raises(ValueError, match="selective"):
        apply_activation_checkpointing(model, every=2, selective=True)
    with pytest.raises(ValueError, match="every"):
        theory.savers.checkpointed_activation_bytes(CFG, 2, every=0)


# ------------------------------------------------------------------------------ memory: measured vs formula

def test_activation_bytes_match_estimate_for_several_k():
    """Held within 10% of the formula (it is within 2%: token ids are inputs, not created by the forward), the
    reduction vs the plain model within 10% of the formula's, the backward peak within 10%; selective in between."""
    cfg = ModelConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=2, d_model=32, name="ckpt-8")
    rows = savers_lab.checkpoint_sweep(cfg, 4, everys=(None, 1, 2, 4, 8), selective=True, cost=False)
    plain = rows[0]
    for r in rows:
        assert r["held"] == pytest.approx(r["est_held"], rel=0.10), r["label"]
        assert r["held"] == pytest.approx(r["est_held"], rel=0.02), r["label"]
        assert r["peak"] == pytest.approx(r["est_peak"], rel=0.10), r["label"]
        reduction, est_reduction = plain["held"] / r["held"], plain["est_held"] / r["est_held"]
        assert reduction == pytest.approx(est_reduction, rel=0.10), r["label"]
        assert r["dgrad"] < 1e-6 and r["dloss"] == 0
    by = {r["label"]: r for r in rows}
    assert by["every 1"]["held"] < by["selective"]["held"] < plain["held"]
    assert by["every 1"]["peak"] < by["every 8"]["peak"]           # big segments: the peak comes back
    assert by["every 8"]["held"] < by["every 1"]["held"]


def test_sqrt_rule_best_k_measured():
    """48 narrow blocks keep A ~ 16 s each: the formula's best k (2) is also the measured one."""
    deep = ModelConfig(vocab_size=64, seq_len=16, n_layer=48, n_head=2, d_model=32, name="deep")
    est = theory.savers.checkpointed_activation_bytes(deep, 1)
    best = theory.savers.best_checkpoint_every(deep.n_layer, est["per_layer"], est["boundary"])
    assert best["every"] == 2
    assert best["continuous"] == pytest.approx(math.sqrt(48 * est["boundary"] / est["per_layer"]))
    rows = savers_lab.checkpoint_sweep(deep, 1, everys=(1, 2, 3, 4), selective=False, cost=False)
    assert min(rows, key=lambda r: r["peak"])["every"] == best["every"]
    assert theory.savers.best_checkpoint_every(64, 16.0, 1.0)["every"] == 2        # the quiz
    assert theory.savers.best_checkpoint_every(100, 1.0, 1.0)["every"] == 10        # A = s: k = sqrt(L)


def test_recompute_flops_counted_exactly():
    x, y = random_batches(CFG, 2, 1)[0]
    model = build_model(CFG, 0)
    plain = count_flops(lambda: model.loss(x, y).backward())
    for every in (1, 2, 4):
        apply_activation_checkpointing(model, every=every)
        got = count_flops(lambda: model.loss(x, y).backward())
        assert got - plain == theory.savers.recompute_flops(CFG, 2, every)
        assert 1 < got / plain <= theory.savers.recompute_flops_ratio(1.0)
    apply_activation_checkpointing(model, selective=True)
    assert count_flops(lambda: model.loss(x, y).backward()) == plain   # selective: no matmul recomputed


# ------------------------------------------------------------------------------ attention, accumulation

def test_two_selective_checkpointings_with_naive_attention():
    """Korthikanti et al.'s recomputed attention core removes exactly the (B, H, T, T) scores of naive attention;
    the operator-level policy saves the same bytes with either attention (it keeps the bmm's scores)."""
    cfg = ModelConfig(vocab_size=64, seq_len=64, n_layer=3, n_head=2, d_model=32, name="sel")
    rows = savers_lab.selective_policies(cfg, 2)
    held = {(r["attention"], r["policy"]): r["held"] for r in rows}
    scores = cfg.n_layer * 2 * cfg.n_head * cfg.seq_len ** 2 * 4
    assert held["naive", "none"] - held["sdpa", "none"] == pytest.approx(scores, rel=0.02)
    assert held["naive", "none"] - held["naive", "attention core"] == pytest.approx(scores, rel=0.05)
    op_saving = {a: held[a, "none"] - held[a, "op policy"] for a in ("sdpa", "naive")}
    assert op_saving["sdpa"] == op_saving["naive"] > 0
    assert held["naive", "op policy"] - held["sdpa", "op policy"] == pytest.approx(scores, rel=0.02)
    assert all(r["dgrad"] == 0 for r in rows)
    core = {r["attention"]: r["flops"] for r in rows if r["policy"] == "attention core"}
    plain = {r["attention"]: r["flops"] for r in rows if r["policy"] == "none"}
    assert 1 < core["naive"] / plain["naive"] < 1.1            # recomputing q k^T and P v: a few percent
    # undone by remove_activation_checkpointing, also inside use_attention, and idempotent
    model = build_model(cfg, 0)
    x, y = random_batches(cfg, 2, 1)[0]
    ref = savers_lab.measure_step(model, x, y)
    recompute_attention_core(recompute_attention_core(model))
    assert savers_lab.measure_step(model, x, y)["held"] < ref["held"]
    remove_activation_checkpointing(model)
    assert "attend" not in model.blocks[0].attn.__dict__
    assert savers_lab.measure_step(model, x, y)["held"] == ref["held"]


def test_korthikanti_activation_formula():
    """Korthikanti et al. 2022, equation 1: sbh(34 + 5as/h) bytes per layer (16-bit); per token 34C + 5aT."""
    cfg = PRESETS["gpt3-175b"]
    s, b, h, a = cfg.seq_len, 1, cfg.d_model, cfg.n_head
    k = theory.savers.korthikanti_layer_bytes(cfg)
    assert k["per_token"] * s * b == s * b * h * (34 + 5 * a * s / h)
    assert k["ratio"] == pytest.approx(17 + 2.5 * a * s / h) and k["boundary"] == 2 * h
    assert theory.savers.korthikanti_layer_bytes(cfg, selective=True)["ratio"] == 17
    assert theory.savers.korthikanti_layer_bytes(cfg, seq_len=4 * s)["per_token"] > k["per_token"]


def test_attention_memory_naive_vs_sdpa():
    rows = savers_lab.attention_sweep(seq_lens=(64, 128, 256), batch=1, n_head=2, head_dim=8, repeats=1)
    for r in rows:
        assert r["naive"] == r["naive_formula"] and r["sdpa"] == r["sdpa_formula"]
        assert r["max_diff"] < 1e-5
    ratios = [r["naive"] / r["sdpa"] for r in rows]
    assert ratios[0] < ratios[1] < ratios[2]
    assert rows[2]["naive"] / rows[1]["naive"] > 3.0 and rows[2]["sdpa"] / rows[1]["sdpa"] == pytest.approx(2.0)
    # the whole model with naive attention: held bytes vs the formula
    cfg = ModelConfig(vocab_size=64, seq_len=128, n_layer=2, n_head=4, d_model=32, name="naive")
    model = build_model(cfg, 0)
    x, y = random_batches(cfg, 2, 1)[0]
    with savers_lab.use_attention(model, "naive"):
        naive = savers_lab.measure_step(model, x, y)
    sdpa = savers_lab.measure_step(model, x, y)
    assert naive["loss"] == pytest.approx(sdpa["loss"], rel=1e-5)
    for held, kind in ((naive["held"], "naive"), (sdpa["held"], "sdpa")):
        assert held == pytest.approx(theory.savers.model_activation_bytes(cfg, 2, attention=kind)["total"], rel=0.01)


def test_gradient_accumulation_same_gradients_less_memory():
    rows = savers_lab.accumulation_sweep(CFG, global_batch=8, micro_batches=(8, 2, 1), repeats=1)
    full = rows[0]
    for r in rows:
        assert r["dgrad"] < 1e-6
        assert r["held"] == pytest.approx(r["est_held"], rel=0.02)
        assert r["state"] == full["state"]
        assert r["loss"] == pytest.approx(full["loss"], rel=1e-6)
    assert rows[1]["held"] == pytest.approx(full["held"] / 4, rel=0.05)


# ------------------------------------------------------------------------------ budget fitting

def test_fit_budget_known_cases():
    cands = savers_checks.budget_candidates(seq_len=256)
    assert theory.savers.fit_budget(1e5, cands, 16) is None
    assert all(theory.savers.plan_bytes(c, 16)["total"] > 35e6 for c in cands)   # no saver: nothing fits (the lesson)
    plan = theory.savers.fit_budget(35e6, cands, 16, everys=(None,))              # accumulation only
    assert (plan["name"], plan["micro_batch"], plan["every"]) == ("d192-L2", 2, None)
    plan = theory.savers.fit_budget(35e6, cands, 16)                              # + checkpointing: a bigger model
    assert (plan["name"], plan["micro_batch"], plan["accum_steps"], plan["every"]) == ("d256-L2", 1, 16, 1)
    plan = theory.savers.fit_budget(35e6, cands, 16, offloads=(None, "optimizer"))
    assert (plan["name"], plan["offload"]) == ("d256-L8", "optimizer")             # only the 4P of weights stay
    huge = theory.savers.fit_budget(1e12, cands, 16)                              # everything fits: biggest, no saver
    assert (huge["name"], huge["micro_batch"], huge["every"]) == ("d384-L12", 16, None)
    cfg = next(c for c in cands if c.name == "d256-L2")
    state = theory.memory.training_memory_bytes(cfg, "adamw", step_counters=theory.memory.num_param_tensors(cfg))
    b = theory.savers.plan_bytes(cfg, 1, 1)
    assert b["state"] == state["total"] == 16 * cfg.num_params() + 4 * theory.memory.num_param_tensors(cfg)
    off = theory.savers.plan_bytes(cfg, 1, 1, offload="optimizer")
    assert off["cpu"] == state["optimizer"] + state["grads"] and off["state"] == state["params"]


def test_planner_extends_lesson05_calculator():
    cfg = PRESETS["gpt2-1.5b"]
    base = theory.memory.per_rank_bytes(cfg, 8, 2, None, True, 4)
    none = theory.savers.planner_bytes(cfg, 8, 2, None, True, 4, every=None, global_batch=512)
    every1 = theory.savers.planner_bytes(cfg, 8, 2, None, True, 4, every=1, global_batch=512)
    assert none["params"] == base["params"] and none["accum_steps"] == 16
    assert every1["activations"] < none["activations"] and every1["device_total"] < none["device_total"]


# ------------------------------------------------------------------------------ the graded checks

def _estimator(cfg, B, T, every, attention):
    return theory.savers.checkpointed_activation_bytes(cfg, B, T, every, attention=attention)["held"]


def test_checks_accept_the_reference_answers():
    out = savers_checks.check_checkpointed_block(CheckpointedBlock)
    assert out["held"] < out["plain_held"] / 3 and out["flops"] > out["plain_flops"]
    savers_checks.check_activation_estimator(_estimator)
    savers_checks.check_budget_fitter(lambda b, c, g, **kw: theory.savers.fit_budget(b, c, g, **kw))


class _NoCheckpoint(CheckpointedBlock):
    def forward(self, x):
        return self.block(x)


class _DetachedInput(CheckpointedBlock):
    def forward(self, x):
        return checkpoint(self.block, x.detach(), use_reentrant=False)


class _NoGrad(CheckpointedBlock):
    def forward(self, x):
        with torch.no_grad():
            return self.block(x)


class _Identity(nn.Module):            # "saves" everything by doing nothing
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x


@pytest.mark.parametrize("wrapper", [_NoCheckpoint, _DetachedInput, _NoGrad, _Identity])
def test_block_check_rejects_wrong_wrappers(wrapper):
    with pytest.raises(CheckFailed):
        savers_checks.check_checkpointed_block(wrapper)


def _no_attention_term(cfg, B, T, every, attention):
    return _estimator(cfg, B, T, every, "sdpa")


def _ignores_checkpointing(cfg, B, T, every, attention):
    return _estimator(cfg, B, T, None, attention)


def _floor_segments(cfg, B, T, every, attention):
    if every is None:
        return _estimator(cfg, B, T, None, attention)
    return (cfg.n_layer // every) * B * T * cfg.d_model * 4 + theory.memory.activation_bytes(cfg, B, T)["other"]


def _no_loss_part(cfg, B, T, every, attention):
    return _estimator(cfg, B, T, every, attention) - theory.memory.activation_bytes(cfg, B, T)["other"]


@pytest.mark.parametrize("fn", [_no_attention_term, _ignores_checkpointing, _floor_segments, _no_loss_part])
def test_estimator_check_rejects_wrong_estimators(fn):
    with pytest.raises(CheckFailed):
        savers_checks.check_activation_estimator(fn)


def _smallest_first(budget, cands, gb):
    for cfg in sorted(cands, key=lambda c: c.num_params()):
        plan = theory.savers.fit_budget(budget, [cfg], gb)
        if plan:
            return plan
    return None


def _no_accumulation(budget, cands, gb):
    for cfg in sorted(cands, key=lambda c: c.num_params(), reverse=True):
        for every in (None, 1, 2, 4):
            b = theory.savers.plan_bytes(cfg, gb, every)["total"]
            if b <= budget:
                return dict(name=cfg.name, micro_batch=gb, accum_steps=1, every=every, bytes=b)
    return None


def _least_memory_plan(budget, cands, gb):
    for cfg in sorted(cands, key=lambda c: c.num_params(), reverse=True):
        plans = [(theory.savers.plan_bytes(cfg, mb, k)["total"], mb, k) for mb in range(1, gb + 1) if gb % mb == 0
                 for k in (None, 1, 2, 4)]
        fits = [p for p in plans if p[0] <= budget]
        if fits:
            b, mb, k = min(fits, key=lambda p: p[0])
            return dict(name=cfg.name, micro_batch=mb, accum_steps=gb // mb, every=k, bytes=b)
    return None


@pytest.mark.parametrize("fn", [_smallest_first, _no_accumulation, _least_memory_plan])
def test_budget_check_rejects_wrong_fitters(fn):
    with pytest.raises(CheckFailed):
        savers_checks.check_budget_fitter(fn)


def test_model_activation_bytes_counts_swiglu_as_the_planner_does():
    """llama-7b (SwiGLU, F = 11,008) at 4,096 tokens, bf16, batch 1: a hand count per token, the course's GPT block
    (ln1 in/out, qkv 3C, attention output C, ln2 in/out: 8C) + SwiGLU's four (T, F) tensors (gate output, SiLU
    output, up output, their product: 4F; Korthikanti et al. 2022's GELU MLP keeps two, its input and output) in 2
    bytes, + fp32 LayerNorm statistics (4) and log-sum-exp (H): 153,744 bytes per token, 629,735,424 per layer
    (449,380,352 with a GELU MLP of the same width, the count before the fix)."""
    cfg = PRESETS["llama-7b"]
    C, F, H, T = cfg.d_model, cfg.d_ff, cfg.n_head, 4096
    hand = T * ((8 * C + 4 * F) * 2 + (4 + H) * 4)
    got = theory.savers.model_activation_bytes(cfg, 1, T, dtype=torch.bfloat16)
    assert got["per_layer"] == hand == 629_735_424
    gelu = theory.savers.model_activation_bytes(cfg.replace(mlp="gelu"), 1, T, dtype=torch.bfloat16)
    assert gelu["per_layer"] == T * ((8 * C + 2 * F) * 2 + (4 + H) * 4) == 449_380_352
    # the MLP's share equals the planner's (lesson 08), which counts 16-bit bytes: 8 s b F for SwiGLU, 4 s b F GELU
    from course_lib.theory.planner import layer_activation_bytes as planner
    assert got["per_layer"] - gelu["per_layer"] == planner(cfg, 1, T)["mlp"] - planner(cfg.replace(mlp="gelu"), 1, T)["mlp"]
    assert got["total"] == got["layers"] + got["other"] and got["layers"] == cfg.n_layer * got["per_layer"]
    naive = theory.savers.model_activation_bytes(cfg, 1, T, dtype=torch.bfloat16, attention="naive")
    assert naive["per_layer"] - got["per_layer"] == H * T * (T * 2 - 4)
