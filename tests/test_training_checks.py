"""Lesson 09's graded checks (course_lib/lessons/l09_training/checks.py): the course's own references pass, and each
typical wrong answer fails with a one-line message naming the check that caught it. The solution notebook's answers
are graded in tests/test_grading.py; the right answers here come from the course's modules (schedules, clipping,
alerts, dist_checkpoint, spikes), so a check that disagreed with them would show up here. One 4-rank launch per global-norm
variant (warm ranks outside grading), everything else in this process.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.training.alerts import AlertEngine, Rule
from course_lib.grading.check import CheckFailed
from course_lib.lessons.l09_training import checks, resume_checks
from course_lib.parallel import clipping, schedules
from course_lib.parallel import dist_checkpoint as ckpt
from course_lib.training.spikes import SpikeDetector

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the clip functions below travel to the ranks by value


def _fails(match: str, fn, *args):
    """``fn(*args)`` raises CheckFailed whose one-line message matches ``match``; returns the message."""
    with pytest.raises(CheckFailed, match=match) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg and "Hint:" in msg, msg
    return msg


# ------------------------------------------------------------------------------ 09-schedule

def lr_reference(step, peak_lr, warmup_steps, total_steps, min_lr=0.0):
    return schedules.warmup_cosine(step, peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps,
                                   min_lr=min_lr)


def lr_warmup_from_zero(step, peak_lr, warmup_steps, total_steps, min_lr=0.0):   # Hugging Face's: lr(0) = 0
    if step < warmup_steps:
        return peak_lr * step / warmup_steps
    progress = min(step - warmup_steps, total_steps - warmup_steps) / max(total_steps - warmup_steps, 1)
    return min_lr + (peak_lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def lr_rises_again(step, peak_lr, warmup_steps, total_steps, min_lr=0.0):        # CosineAnnealingLR alone
    e = max(warmup_steps, 1) - 1
    if step < e:
        return peak_lr * (step + 1) / warmup_steps
    return min_lr + (peak_lr - min_lr) * (1 + math.cos(math.pi * (step - e) / (total_steps - e))) / 2


def lr_to_zero(step, peak_lr, warmup_steps, total_steps, min_lr=0.0):            # ignores min_lr
    return lr_reference(step, peak_lr, warmup_steps, total_steps, 0.0)


def test_schedule_reference_passes():
    rows = checks.check_schedule(lr_reference)
    assert len(rows) == len(checks.SCHEDULE_SETTINGS)
    assert all(r["lrs"][r["peak_step"]] == checks.PEAK for r in rows)


@pytest.mark.parametrize("wrong, where", [(lr_warmup_from_zero, r"lr at step 0 \(W=1"),
                                          (lr_rises_again, r"lr at step 11 \(W=0, T=10"),
                                          (lr_to_zero, r"lr at step 1 \(W=1, T=12, min_lr=3e-05")])
def test_wrong_schedules_fail_at_the_first_wrong_step(wrong, where):
    msg = _fails(where, checks.check_schedule, wrong)
    assert "step" in msg.split("Hint:")[1]


def test_a_schedule_that_returns_no_number_fails():
    _fails("returns a number", checks.check_schedule, lambda s, *a: torch.zeros(2))


# ------------------------------------------------------------------------------ 09-global-norm

def clip_reference(sharded, replicated, tp_group, max_norm):
    parts = [(g, tp_group) for g in sharded] + [(g, None) for g in replicated]
    return clipping.clip_grad_norm_(parts, max_norm)


def clip_over_world(sharded, replicated, tp_group, max_norm):       # all_reduce without a group: over all 4 ranks
    parts = [(g, dist.group.WORLD) for g in sharded] + [(g, dist.group.WORLD) for g in replicated]
    return clipping.clip_grad_norm_(parts, max_norm)


def clip_replicated_summed(sharded, replicated, tp_group, max_norm):   # replicated parts counted on every TP rank
    return clipping.clip_grad_norm_([(g, tp_group) for g in list(sharded) + list(replicated)], max_norm)


def clip_amplifies(sharded, replicated, tp_group, max_norm):         # right norm, scale not clamped at 1
    parts = [(g, tp_group) for g in sharded] + [(g, None) for g in replicated]
    norm = clipping.global_grad_norm(parts)
    for g, _ in parts:
        g.mul_(max_norm / (norm + 1e-6))
    return norm


def clip_forgets_replicated(sharded, replicated, tp_group, max_norm):   # right norm, replicated ones not clipped
    parts = [(g, tp_group) for g in sharded] + [(g, None) for g in replicated]
    norm = clipping.global_grad_norm(parts)
    clipping.clip_grads_with_norm_(list(sharded), max_norm, norm)
    return norm


@pytest.fixture(scope="module")
def norm_ref():
    return checks.norm_reference()


def test_global_norm_reference_passes(norm_ref):
    rows = checks.check_global_norm(clip_reference, norm_ref)
    assert len(rows) == 4 and all(r["n_sharded"] and r["n_replicated"] for r in rows)
    assert norm_ref["norm"] > checks.MAX_NORM                       # the reference itself clips
    for r in rows:                                                  # the mistakes are far from the right norm
        assert all(abs(v - r["reference"]) > 100 * checks.NORM_RTOL * r["reference"] for v in r["wrong"].values())


@pytest.mark.parametrize("wrong, where, why", [
    (clip_over_world, "global gradient norm before clipping", "everything summed over all 4 ranks"),
    (clip_replicated_summed, "global gradient norm before clipping", "counted on every TP rank"),
    (clip_amplifies, "change of the gradients with max_norm 1e6", "never amplify"),
    (clip_forgets_replicated, "clipped gradients vs one process", "sharded and replicated")])
def test_wrong_global_norms_fail(norm_ref, wrong, where, why):
    msg = _fails(where, checks.check_global_norm, wrong, norm_ref)
    assert why in msg, msg


# ------------------------------------------------------------------------------ 09-alert-rule

class RuleReference:
    """The course's AlertEngine behind the exercise's interface."""

    def __init__(self, op, threshold, for_s):
        self.engine = AlertEngine([Rule("r", "m", op, threshold, for_s, "")])

    def observe(self, t, value):
        return bool(self.engine.observe(t, {"m": value}))


class RuleNanResets(RuleReference):
    """A NaN ends the episode (it should say nothing)."""

    def observe(self, t, value):
        return super().observe(t, 0.0 if self.engine.rules[0].op == ">" else 1e18) if math.isnan(value) \
            else super().observe(t, value)


class RuleAtThreshold:
    """>= instead of >: the value at the threshold holds."""

    def __init__(self, op, threshold, for_s):
        self.op, self.threshold, self.for_s, self.since, self.fired = op, threshold, for_s, None, False

    def observe(self, t, value):
        if math.isnan(value):
            return False
        holds = value >= self.threshold if self.op == ">" else value <= self.threshold
        if not holds:
            self.since, self.fired = None, False
            return False
        self.since = t if self.since is None else self.since
        if not self.fired and t - self.since >= self.for_s:
            self.fired = True
            return True
        return False


class RuleCountsSamples(RuleAtThreshold):
    """Strict, but counts samples of 10 s instead of seconds (wrong on irregular samples)."""

    def observe(self, t, value):
        if math.isnan(value):
            return False
        holds = value > self.threshold if self.op == ">" else value < self.threshold
        if not holds:
            self.since, self.fired = None, False
            return False
        self.since = 0 if self.since is None else self.since + 1
        if not self.fired and self.since * 10 >= self.for_s:
            self.fired = True
            return True
        return False


class RuleFiresEverySample(RuleReference):
    """Fires at every sample once the duration is reached (not once per episode)."""

    def __init__(self, op, threshold, for_s):
        self.rule, self.since = Rule("r", "m", op, threshold, for_s, ""), None

    def observe(self, t, value):
        holds = self.rule.holds(value)
        if holds is None:
            return False
        if not holds:
            self.since = None
            return False
        self.since = t if self.since is None else self.since
        return t - self.since >= self.rule.for_s


def test_alert_reference_passes_and_the_streams_test_something():
    rows = checks.check_alert_rule(RuleReference)
    assert len(rows) == len(checks.ALERT_CASES)
    fired = {r["stream"]: r["fired"] for r in rows}
    assert fired["healthy loss"] == [] and fired["the same stream stopped one sample before"] == []
    assert fired["loss above 10 from t=30, for 30 s"] == [60.0]        # 30 s after the first sample that holds
    assert len(fired["fires, recovers, fires again"]) == 2


@pytest.mark.parametrize("wrong, stream", [(RuleNanResets, "a NaN inside an episode"),
                                           (RuleAtThreshold, "exactly at the threshold"),
                                           (RuleCountsSamples, "a NaN inside an episode"),
                                           (RuleFiresEverySample, "loss above 10 from t=30")])
def test_wrong_alert_rules_fail_on_the_stream_that_shows_it(wrong, stream):
    _fails(f"stream '{stream}", checks.check_alert_rule, wrong)


def test_an_alert_rule_that_returns_no_bool_fails():
    class Silent(RuleReference):
        def observe(self, t, value):
            super().observe(t, value)
    _fails("returns True or False", checks.check_alert_rule, Silent)


# ------------------------------------------------------------------------------ 09-resume

def save_reference(folder, *, model, optimizer, scheduler, step, data_position):
    ckpt.save(folder, model=model, optimizer=optimizer, scheduler=scheduler, step=step, data_position=data_position)


def load_reference(folder, *, model, optimizer, scheduler):
    state = ckpt.load(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    return state.step, state.data_position


def _save(folder, *, model, optimizer, scheduler, step, data_position, rng=("torch", "python", "numpy", "cuda")):
    os.makedirs(folder, exist_ok=True)
    streams = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        streams["cuda"] = torch.cuda.get_rng_state_all()
    rng = [k for k in rng if k in streams]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "data_position": data_position, "rng": {k: streams[k] for k in rng}},
               os.path.join(folder, "state.pt"))


def _load(folder, *, model, optimizer, scheduler, parts=("optimizer", "scheduler")):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    if "optimizer" in parts:
        optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in parts:
        scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(rng["python"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["data_position"]


def save_without_cuda(folder, **kw):                 # right on a CPU machine, wrong where CUDA is present
    _save(folder, rng=("torch", "python", "numpy"), **kw)


def save_torch_rng_only(folder, **kw):
    _save(folder, rng=("torch",), **kw)


def load_no_optimizer(folder, **kw):
    return _load(folder, parts=("scheduler",), **kw)


def load_no_scheduler(folder, **kw):
    return _load(folder, parts=("optimizer",), **kw)


def load_step_as_position(folder, **kw):
    step, _ = _load(folder, **kw)
    return step, step


def save_draws_a_number(folder, **kw):             # e.g. a random file name: moves torch's stream
    torch.rand(1)
    _save(folder, **kw)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")      # dist_checkpoint on one process
def test_resume_references_pass():
    for save, load in ((save_reference, load_reference), (_save, _load)):
        out = resume_checks.check_resume(save, load)
        assert out["resumed"] == out["losses"][resume_checks.STOP:] and out["files"]


@pytest.mark.parametrize("save, load, where", [
    (save_torch_rng_only, _load, "Python's random state after load_checkpoint"),
    (_save, load_no_optimizer, "AdamW's state after load_checkpoint"),
    (_save, load_no_scheduler, "schedule's position"),
    (_save, load_step_as_position, r"\(step, data_position\) returned by load_checkpoint"),
    (save_draws_a_number, _load, "saving leaves torch's random state as it was")])
def test_wrong_resumes_fail_naming_what_was_lost(save, load, where):
    _fails(where, resume_checks.check_resume, save, load)


def test_a_load_that_draws_random_numbers_after_restoring_fails():
    def load_reseeding(folder, **kw):
        out = _load(folder, **kw)
        torch.manual_seed(0)
        return out
    _fails("torch's random state after load_checkpoint", resume_checks.check_resume, _save, load_reseeding)


@pytest.fixture
def cuda_present(monkeypatch):
    """CUDA present, as the checks and the answers see it, on a CPU machine: one GPU whose generator state is a small
    tensor, set by torch.manual_seed (through torch.cuda.manual_seed_all) and by set_rng_state_all."""
    gen = {"states": [torch.zeros(8, dtype=torch.uint8)]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)   # AdamW asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in gen["states"]])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: gen.update(states=[t.clone() for t in states]))
    monkeypatch.setattr(torch.cuda, "manual_seed_all",
                        lambda seed: gen.update(states=[torch.full((8,), int(seed) % 251, dtype=torch.uint8)]))
    return gen


def test_resume_check_leaves_the_cuda_generators_out_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: there the CUDA generators must be saved")
    out = resume_checks.check_resume(save_without_cuda, _load)        # nothing to save: the same answer passes
    assert out["resumed"] == out["losses"][resume_checks.STOP:]


def test_resume_check_compares_the_cuda_generators_where_cuda_is_present(cuda_present):
    """Where CUDA is present the table's CUDA row counts: an answer that saves torch's, Python's and NumPy's
    generators but not the CUDA ones fails, naming them; the solution's way passes. (dist_checkpoint's own save would
    open a CUDA stream, which this fake CUDA does not have.)"""
    resume_checks.check_resume(_save, _load)
    msg = _fails("the CUDA generators' random state after load_checkpoint", resume_checks.check_resume,
                 save_without_cuda, _load)
    assert "torch.cuda" in msg


# ------------------------------------------------------------------------------ 09-spike-detector

class SpikeAnswer:
    """The exercise's answer written as a learner would (the solution notebook's), not the course's class."""

    def __init__(self, window=20, warmup=10, z=6.0):
        self.window, self.warmup, self.z = window, warmup, z
        self.values = collections.deque(maxlen=window)

    def std(self, mean):
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / (len(self.values) - 1))

    def is_spike(self, value):
        if not math.isfinite(value):
            return True
        n = len(self.values)
        if n < self.warmup:
            return False
        mean = sum(self.values) / n
        return value - mean > self.z * self.std(mean)

    def update(self, value):
        spike = self.is_spike(value)
        if not spike:
            self.values.append(value)
        return spike


class SpikesEnterWindow(SpikeAnswer):
    """Every value enters the window, spikes too."""

    def update(self, value):
        spike = self.is_spike(value)
        self.values.append(value)
        return spike


class NoWarmup(SpikeAnswer):
    """A verdict as soon as two values give a standard deviation."""

    def __init__(self, window=20, warmup=10, z=6.0):
        super().__init__(window, 2, z)


class FixedThreshold(SpikeAnswer):
    """z used as a margin in units of the loss: value > mean + z."""

    def is_spike(self, value):
        if not math.isfinite(value):
            return True
        return len(self.values) >= self.warmup and value > sum(self.values) / len(self.values) + self.z


class NanNotSpike(SpikeAnswer):
    """No test for NaN or inf: a NaN compares false (no spike) and enters the window."""

    def is_spike(self, value):
        n = len(self.values)
        if n < self.warmup:
            return False
        mean = sum(self.values) / n
        return value - mean > self.z * self.std(mean)


class FrozenStatistics(SpikeAnswer):
    """The mean and std of the warm-up values, never updated after."""

    def is_spike(self, value):
        if not math.isfinite(value):
            return True
        if len(self.values) < self.warmup:
            return False
        if not hasattr(self, "frozen"):
            mean = sum(self.values) / len(self.values)
            self.frozen = (mean, self.std(mean))
        return value - self.frozen[0] > self.z * self.frozen[1]


class DefaultSettings(SpikeAnswer):
    """The arguments ignored: always window 20, warm-up 10, z 6."""

    def __init__(self, window=20, warmup=10, z=6.0):
        super().__init__()


class PopulationStd(SpikeAnswer):
    """Divides by n instead of n - 1: a decision the check leaves free (no verdict of its streams depends on it)."""

    def std(self, mean):
        return math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))


def test_spike_answer_passes_and_the_streams_test_something():
    rows = checks.check_spike_detector(SpikeAnswer)
    assert len(rows) == len(checks.SPIKE_STREAMS)
    spikes = {r["stream"].split(":")[0].split(",")[0]: r["spikes"] for r in rows}
    assert spikes["steady noise"] == [60] and spikes["a ramp"] == []
    assert spikes["a spike during warm-up (+0.6 at step 5)"] == [40]          # the warm-up gives no verdict
    assert spikes["two spikes in a row (+0.5 at steps 80 and 81)"] == [80, 81]
    assert spikes["a NaN during warm-up (step 3)"] == [3, 40, 70] and spikes["other settings"] == [6, 40]
    # every verdict is clear: a z-score within 25 % of z nowhere, so n or n - 1 in the std decides nothing
    for name, (window, warmup, z), values in checks.SPIKE_STREAMS:
        for x in checks._spike_zscores(window, warmup, z, values):
            assert not 0.75 * z <= x <= 1.25 * z, (name, x)
    checks.check_spike_detector(PopulationStd)
    checks.check_spike_detector(SpikeDetector)                 # the course's own, outside grading


@pytest.mark.parametrize("wrong, stream, why", [
    (SpikesEnterWindow, "two spikes in a row", "stayed out of the window"),
    (NoWarmup, "a spike during warm-up", "fewer than warm-up = 10"),
    (FixedThreshold, "steady noise", "not in units of the loss"),
    (NanNotSpike, "a NaN during warm-up", "a NaN or inf loss is a spike"),
    (FrozenStatistics, "a ramp", "updated at every step"),
    (DefaultSettings, "other settings", "standard deviations")])
def test_wrong_spike_detectors_fail_on_the_stream_that_shows_it(wrong, stream, why):
    msg = _fails(f"stream '{stream}", checks.check_spike_detector, wrong)
    assert why in msg.split("Hint:")[1], msg
    assert "expected True, got False" in msg or "expected False, got True" in msg, msg


def test_a_spike_detector_that_returns_no_bool_fails():
    class Silent(SpikeAnswer):
        def update(self, value):
            super().update(value)
    _fails("returns True or False", checks.check_spike_detector, Silent)


def test_the_spike_detector_stub_fails_not_implemented():
    """The student copy's cell (exercises/, generated by `course build`) raises NotImplementedError in the check."""
    nb = json.loads((ROOT / "exercises" / "09_training_in_practice.ipynb").read_text())
    src = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
               and "class SpikeDetector" in "".join(c["source"]))
    scope = {"math": math, "collections": collections}
    exec(src, scope)
    with pytest.raises(NotImplementedError):
        checks.check_spike_detector(scope["SpikeDetector"])
