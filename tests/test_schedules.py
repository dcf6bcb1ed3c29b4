"""Lesson 09's learning-rate schedules: ours (closed form and LambdaLR) == torch's LinearLR + CosineAnnealingLR ==
DeepSpeed's WarmupLR / WarmupCosineLR objects, step by step, to 1e-12 relative; broken schedules fail the same
comparison; layer-wise decay gives each GPT layer its rate. DeepSpeed's first updates under a real engine (linear and
log warm-up) and the DeepSpeed lines the lesson quotes. One process and one one-rank launch, a few seconds."""

from __future__ import annotations

import math
import sys

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
    from course_lib.parallel.deepspeed_config import import_deepspeed

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
    """DeepSpeed's WarmupCosineLR with warmup_type='linear' never uses the peak: its first cosine iteration has
    progress 1/(T - N). Equal to ours in the warm-up and to ours(s + 1) in the decay; off by at most one step's
    decrease of the cosine."""
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


@pytest.mark.parametrize("w,t,m", DS_SETTINGS)
def test_deepspeed_log_warmup_uses_the_peak_at_iteration_n_minus_1(ds_lr_schedules, w, t, m):
    """The same JSON block with DeepSpeed's default warmup_type='log': ratio r + (1 - r) log(i + 1) / log(N), which is
    1 at i = N - 1 (to rounding): the peak is used once, one iteration before ours uses it; the decay after the
    warm-up is the linear block's, iteration for iteration."""
    n = t + 15
    conf = schedules.deepspeed_scheduler_config("WarmupCosineLR", peak_lr=PEAK, warmup_steps=w, total_steps=t,
                                                min_lr=m)["params"]
    big_n, r = conf["warmup_num_steps"], conf["warmup_min_ratio"]
    log = _ds_lrs(ds_lr_schedules.WarmupCosineLR(_opt(), **{**conf, "warmup_type": "log"}), n)
    linear = _ds_lrs(ds_lr_schedules.WarmupCosineLR(_opt(), **conf), n)
    want = [PEAK * (r + (1 - r) * math.log(i + 1) / math.log(big_n)) for i in range(big_n)]
    assert _max_rel(log[:big_n], want) <= RTOL
    assert max(range(n), key=lambda i: log[i]) == big_n - 1 and log[big_n - 1] == pytest.approx(PEAK, rel=1e-15)
    assert log[big_n:] == linear[big_n:]
    assert max(linear) < PEAK


def _engine_rates(kind: str, warmup_type: str, peak: float, low: float, big_n: int, updates: int) -> list[float]:
    """The rate each optimizer update uses under a DeepSpeed engine, as lesson 09 states it from engine.py: update k
    uses iteration k - 1; update 0 the rate the constructor wrote at iteration -1 (WarmupLR: warmup_min_lr;
    WarmupCosineLR: 0). ``low``: warmup_min_lr (WarmupLR) or warmup_min_ratio (WarmupCosineLR); big_n >= 2; the
    warm-up only (updates <= big_n + 1)."""
    assert updates <= big_n + 1

    def ramp(i):
        return i / big_n if warmup_type == "linear" else math.log(i + 1) / math.log(big_n)
    out = []
    for k in range(updates):
        i = k - 1
        if kind == "WarmupLR":
            out.append(low if i < 0 else low + (peak - low) * ramp(i))
        else:
            out.append(0.0 if i < 0 else peak * (low + (1 - low) * ramp(i)))
    return out


def _rank_engine_rates(blocks: list[dict], updates: int) -> list[list[float]]:
    """One rank: a DeepSpeed engine per JSON "scheduler" block (torch's AdamW at lr 1, fp32, no clipping); the
    optimizer's lr at each of ``updates`` updates, read just before ``engine.step()`` uses it."""
    import torch

    from course_lib.parallel.deepspeed_config import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.utils import logger
    logger.setLevel("ERROR")
    out = []
    for block in blocks:
        model = torch.nn.Linear(2, 1)
        conf = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "scheduler": block,
                "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "torch_adam": True}},
                "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
        device = next(engine.module.parameters()).device
        lrs = []
        for _ in range(updates):
            lrs.append(float(optimizer.param_groups[0]["lr"]))
            engine.backward(engine(torch.ones(1, 2, device=device)).sum())
            engine.step()
        out.append(lrs)
    return out


def test_deepspeed_engine_first_updates():
    """A real one-rank DeepSpeed engine with a JSON scheduler block: WarmupLR's updates 0 and 1 both use
    warmup_min_lr; WarmupCosineLR's update 0 uses 0 and update 1 warmup_min_ratio x peak; the log warm-up reaches the
    peak at update N (iteration N - 1), the linear one never in the warm-up. One launch, a few seconds warm."""
    import cloudpickle

    from course_lib.runtime.launch import run

    cloudpickle.register_pickle_by_value(sys.modules[__name__])       # the rank function travels by value
    big_n, updates = 4, 5                                              # updates 0..4: iterations -1..N-1
    cases = [("WarmupLR", typ, {"warmup_min_lr": 0.25, "warmup_max_lr": 1.0, "warmup_num_steps": big_n,
                                "warmup_type": typ}) for typ in ("linear", "log")]
    cases += [("WarmupCosineLR", typ, {"total_num_steps": 20, "warmup_num_steps": big_n, "warmup_min_ratio": 0.25,
                                       "cos_min_ratio": 0.1, "warmup_type": typ}) for typ in ("linear", "log")]
    got = run(_rank_engine_rates, 1, args=([{"type": k, "params": p} for k, _, p in cases], updates),
              stream=False, timeout_s=300).value
    for (kind, typ, _), lrs in zip(cases, got):
        want = _engine_rates(kind, typ, 1.0, 0.25, big_n, updates)
        assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, typ, lrs)
    assert got[2][:2] == [0.0, 0.25] and got[0][:2] == [0.25, 0.25]       # the lesson's sentences, literally
    assert got[3][big_n] == pytest.approx(1.0) and max(got[2][:big_n + 1]) < 1.0


def test_the_deepspeed_lines_lesson_09_quotes_are_in_the_installed_source(ds_lr_schedules):
    """Lesson 09 (sections 1 and 2) and `schedules`' docstring quote DeepSpeed's source; a DeepSpeed upgrade that
    changes a quoted line fails here, not silently in the lesson's prose."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    step = inspect.getsource(DeepSpeedEngine._take_model_step)
    order = [step.index(line) for line in ("if self.gradient_clipping() > 0.0:", "self.clip_fp32_gradients()",
                                           "self.optimizer.step()", "if overflow:", "self.skipped_steps += 1",
                                           "self.lr_scheduler.step(**(lr_kwargs or {}))")]
    assert order == sorted(order), "the engine clips, steps the optimizer, then the scheduler unless it overflowed"
    assert "clip_grad=self.gradient_clipping()" in inspect.getsource(DeepSpeedEngine)   # ZeRO / fp16 / bf16 clip
    assert ds_lr_schedules.WARMUP_LOG_RATE == "log" and ds_lr_schedules.WARMUP_LINEAR_RATE == "linear"
    constructor = "self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())"
    cosine = inspect.getsource(ds_lr_schedules.WarmupCosineLR)
    for line in (constructor, "return [0.0 for _ in self.org_lrs]", "warmup_type: str = WARMUP_LOG_RATE",
                 "ratio = self.last_batch_iteration / self.warmup_num_steps",
                 "ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)",
                 "real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1"):
        assert line in cosine, line
    warm = inspect.getsource(ds_lr_schedules.WarmupLR)
    for line in (constructor, "return self.min_lrs", "warmup_type: str = WARMUP_LOG_RATE"):
        assert line in warm, line


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
