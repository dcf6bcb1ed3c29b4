"""Lesson 09's learning-rate schedules: ours (closed form and LambdaLR) == torch's LinearLR + CosineAnnealingLR ==
DeepSpeed's WarmupLR / WarmupCosineLR objects, step by step, to 1e-12 relative; broken schedules fail the same
comparison; layer-wise decay gives each GPT layer its rate. One process, a few seconds."""

from __future__ import annotations

import math

import pytest
import torch

from course_lib.config import ModelConfig
from course_lib.model import build_model
from course_lib.parallel import schedules

PEAK = 3e-4
SETTINGS = [  # (warmup_steps, total_steps, min_lr)
    (0, 10, 0.0), (1, 12, 3e-5), (2, 10, 0.0), (3, 3, 0.0), (5, 40, 0.0), (5, 40, 3e-5), (10, 1000, 0.0),
    (100, 1000, 3e-5),
]
DS_SETTINGS = [s for s in SETTINGS if s[0] >= 3]
RTOL = 1e-12


def _opt(lr: float = PEAK) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _ours(w, t, m, n):
    return [schedules.warmup_cosine(s, peak_lr=PEAK, warmup_steps=w, total_steps=t, min_lr=m) for s in range(n)]


def _torch_lrs(optimizer, scheduler, n):
    """The rate each of n optimizer updates uses when the loop steps the optimizer, then the scheduler."""
    lrs = []
    for _ in range(n):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def _ds_lrs(scheduler, n):
    """DeepSpeed's rate at last_batch_iteration s = 0..n-1 (constructed at -1, one step() per iteration)."""
    lrs = []
    for _ in range(n):
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def _max_rel(actual, expected) -> float:
    """max |a - e| / |e| (an exact 0 expected must be an exact 0)."""
    return max((abs(a - e) / abs(e)) if e else (math.inf if a else 0.0) for a, e in zip(actual, expected, strict=True))


@pytest.fixture(scope="module")
def ds_lr_schedules():
    from course_lib.lessons.common import import_deepspeed

    import_deepspeed()                                  # DS_ACCELERATOR=cpu here, set before the import
    from deepspeed.runtime import lr_schedules
    return lr_schedules


def test_formula_at_its_landmarks():
    kw = dict(peak_lr=PEAK, warmup_steps=5, total_steps=24, min_lr=1e-5)
    assert schedules.warmup_cosine(0, **kw) == pytest.approx(PEAK / 5, rel=1e-15)      # first update moves
    assert schedules.warmup_cosine(3, **kw) == pytest.approx(PEAK * 4 / 5, rel=1e-15)
    assert schedules.warmup_cosine(4, **kw) == PEAK                                     # peak once, at W - 1
    assert schedules.warmup_cosine(5, **kw) < PEAK
    half = 4 + (24 - 4) // 2                                                            # e + (T - e) / 2
    assert schedules.warmup_cosine(half, **kw) == pytest.approx((PEAK + 1e-5) / 2, rel=1e-14)
    assert schedules.warmup_cosine(24, **kw) == 1e-5 == schedules.warmup_cosine(10 ** 6, **kw)
    assert schedules.warmup_cosine(0, peak_lr=PEAK, warmup_steps=0, total_steps=8) == PEAK
    assert [schedules.warmup_constant(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert schedules.warmup_constant(0, 2.0, 0) == schedules.warmup_constant(0, 2.0, 1) == 2.0
    with pytest.raises(ValueError, match="total_steps"):
        schedules.warmup_cosine(0, peak_lr=PEAK, warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match="min_lr"):
        schedules.warmup_cosine(0, peak_lr=PEAK, warmup_steps=1, total_steps=5, min_lr=1.0)


@pytest.mark.parametrize("w,t,m", SETTINGS)
def test_ours_equals_torch_composition(w, t, m):
    n = t + 15                                            # past the end: the rate stays at min_lr
    ours = _ours(w, t, m, n)
    opt = _opt()
    lambda_lrs = _torch_lrs(opt, schedules.warmup_cosine_scheduler(opt, peak_lr=PEAK, warmup_steps=w,
                                                                    total_steps=t, min_lr=m), n)
    opt = _opt(1.0)                                       # torch_warmup_cosine sets the groups' lr to the peak
    torch_lrs = _torch_lrs(opt, schedules.torch_warmup_cosine(opt, peak_lr=PEAK, warmup_steps=w,
                                                              total_steps=t, min_lr=m), n)
    assert _max_rel(lambda_lrs, ours) <= RTOL
    assert _max_rel(torch_lrs, ours) <= RTOL
    assert ours[-1] == m and max(ours) == PEAK


@pytest.mark.parametrize("w", [0, 1, 3, 5, 100])
def test_warmup_constant_equals_deepspeed_warmuplr(ds_lr_schedules, w):
    n = w + 20
    conf = schedules.deepspeed_scheduler_config("WarmupLR", peak_lr=PEAK, warmup_steps=w)
    assert conf["type"] == "WarmupLR" and conf["params"]["warmup_type"] == "linear"
    ds = _ds_lrs(ds_lr_schedules.WarmupLR(_opt(), **conf["params"]), n)
    assert _max_rel(ds, [schedules.warmup_constant(s, PEAK, w) for s in range(n)]) <= RTOL


@pytest.mark.parametrize("w,t,m", DS_SETTINGS)
def test_deepspeed_warmup_cosine_is_ours_one_step_ahead_in_the_decay(ds_lr_schedules, w, t, m):
    """DeepSpeed's WarmupCosineLR never uses the peak: its first cosine iteration has progress 1/(T - N). Equal to
    ours in the warm-up and to ours(s + 1) in the decay; off by at most one step's decrease of the cosine."""
    n, e = t + 15, w - 1
    conf = schedules.deepspeed_scheduler_config("WarmupCosineLR", peak_lr=PEAK, warmup_steps=w, total_steps=t,
                                                min_lr=m)
    assert conf["params"]["warmup_type"] == "linear"
    ds = _ds_lrs(ds_lr_schedules.WarmupCosineLR(_opt(), **conf["params"]), n)
    ours = _ours(w, t, m, n + 1)
    assert _max_rel(ds[:e], ours[:e]) <= RTOL                                 # warm-up: equal
    assert _max_rel(ds[e:], ours[e + 1:]) <= RTOL                             # decay: one step ahead
    assert max(ds) < PEAK                                                     # hence not equal to ours
    bound = (PEAK - m) * math.sin(math.pi / (2 * (t - e)))                    # the largest one-step decrease
    worst = max(abs(a - b) for a, b in zip(ds, ours))
    assert worst <= bound * (1 + 1e-12)
    assert worst >= bound * math.cos(math.pi / (2 * (t - e))) * (1 - 1e-12)   # and the bound is tight


def _off_by_one_warmup(s, w, t, m):          # Hugging Face's warm-up from 0: lr(0) = 0, peak at W
    if s < w:
        return PEAK * s / w
    return m + (PEAK - m) * (1 + math.cos(math.pi * min(s - w, t - w) / (t - w))) / 2


def _cosine_ends_early(s, w, t, m):           # reaches min_lr at T - 1
    e = w - 1
    if s < e:
        return PEAK * (s + 1) / w
    return m + (PEAK - m) * (1 + math.cos(math.pi * min(1.0, (s - e) / (t - 1 - e)))) / 2


def _cosine_to_zero(s, w, t, m):              # decays to 0, not min_lr
    return schedules.warmup_cosine(s, peak_lr=PEAK, warmup_steps=w, total_steps=t, min_lr=0.0)


def _cosine_rises_again(s, w, t, m):          # CosineAnnealingLR alone: back up after T
    e = w - 1
    if s < e:
        return PEAK * (s + 1) / w
    return m + (PEAK - m) * (1 + math.cos(math.pi * (s - e) / (t - e))) / 2


@pytest.mark.parametrize("broken", [_off_by_one_warmup, _cosine_ends_early, _cosine_to_zero, _cosine_rises_again])
def test_broken_schedules_fail_the_same_comparisons(ds_lr_schedules, broken):
    w, t, m = 5, 40, 3e-5
    n = t + 15
    bad = [broken(s, w, t, m) for s in range(n + 1)]
    opt = _opt(1.0)
    torch_lrs = _torch_lrs(opt, schedules.torch_warmup_cosine(opt, peak_lr=PEAK, warmup_steps=w, total_steps=t,
                                                              min_lr=m), n)
    assert _max_rel(torch_lrs, bad[:n]) > 1e-3
    conf = schedules.deepspeed_scheduler_config("WarmupCosineLR", peak_lr=PEAK, warmup_steps=w, total_steps=t,
                                                min_lr=m)
    ds = _ds_lrs(ds_lr_schedules.WarmupCosineLR(_opt(), **conf["params"]), n)
    assert max(_max_rel(ds[:w - 1], bad[:w - 1]), _max_rel(ds[w - 1:], bad[w:n + 1])) > 1e-3


def test_deepspeed_config_refuses_what_has_no_twin():
    with pytest.raises(ValueError, match="warmup_steps=2"):
        schedules.deepspeed_scheduler_config("WarmupLR", peak_lr=PEAK, warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_steps >= 3"):
        schedules.deepspeed_scheduler_config("WarmupCosineLR", peak_lr=PEAK, warmup_steps=1, total_steps=10)
    with pytest.raises(ValueError, match="WarmupLR"):
        schedules.deepspeed_scheduler_config("OneCycle", peak_lr=PEAK, warmup_steps=5)


def test_layerwise_groups_give_deeper_layers_higher_rates():
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32, name="small")
    model = build_model(cfg, seed=0)
    groups = schedules.layerwise_param_groups(model, base_lr=1e-3, decay=0.5)
    assert [g["layer"] for g in groups] == ["embeddings", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [g["lr"] for g in groups] == [1e-3 * 0.5 ** k for k in (4, 3, 2, 1, 0)]
    ids = {id(p): g["layer"] for g in groups for p in g["params"]}
    assert len(ids) == sum(len(g["params"]) for g in groups) == len(list(model.parameters()))   # each once
    assert ids[id(model.tok_emb.weight)] == "embeddings" and model.head.weight is model.tok_emb.weight
    assert ids[id(model.pos_emb.weight)] == "embeddings" and ids[id(model.ln_f.weight)] == "head"
    assert all(ids[id(p)] == "blocks.1" for p in model.blocks[1].parameters())
    # The groups drive an optimizer, and the schedule scales every group by the same factor.
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = schedules.warmup_cosine_scheduler(opt, peak_lr=1e-3, warmup_steps=4, total_steps=20)
    for _ in range(7):
        opt.step()
        sched.step()
    factor = schedules.warmup_cosine(7, peak_lr=1e-3, warmup_steps=4, total_steps=20) / 1e-3
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3 * 0.5 ** k * factor for k in (4, 3, 2, 1, 0)],
                                                                rel=1e-12)
    with pytest.raises(ValueError, match="decay"):
        schedules.layerwise_param_groups(model, 1e-3, 0.0)
