"""Lesson 09's graded checks (course_lib/lessons/l09_training/checks.py; 09-resume's are in tests/test_resume_checks.py):
the course's own references pass, and each typical wrong answer fails with a one-line message naming the check that
caught it. The solution notebook's answers are graded in tests/test_grading.py; the right answers here come from the
course's modules (schedules, clipping, alerts, spikes), so a check that disagreed with them would show up here. One
4-rank launch per global-norm variant (warm ranks outside grading), everything else in this process.
"""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

import cloudpickle
import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.training.alerts import AlertEngine, Rule
from course_lib.lessons.l09_training import checks
from course_lib.parallel import clipping, schedules
from course_lib.training.spikes import SpikeDetector

from check_assertions import fails_check as _fails

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the clip functions below travel to the ranks by value


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


class ListWindow(SpikeAnswer):
    """Right, written another way: a list trimmed to the last `window` values after each append."""

    def __init__(self, window=20, warmup=10, z=6.0):
        super().__init__(window, warmup, z)
        self.values = []

    def update(self, value):
        spike = self.is_spike(value)
        if not spike:
            self.values.append(value)
            if len(self.values) > self.window:
                self.values.pop(0)
        return spike


class SlicedHistory:
    """Right, written another way: every accepted value kept, the statistics of the last `window` (numpy, ddof=1),
    warm-up counted on its own, z compared as a ratio."""

    def __init__(self, window=20, warmup=10, z=6.0):
        self.window, self.warmup, self.z, self.accepted = window, warmup, z, []

    def update(self, value):
        if not np.isfinite(value):
            return True
        if len(self.accepted) >= self.warmup:
            recent = np.array(self.accepted[-self.window:])
            if (value - recent.mean()) / recent.std(ddof=1) > self.z:
                return True
        self.accepted.append(value)
        return False


class NoWindow(SpikeAnswer):
    """Every accepted value kept: the mean and std of the whole history, not of the last `window`."""

    def __init__(self, window=20, warmup=10, z=6.0):
        super().__init__(window, warmup, z)
        self.values = []


class WindowOneShort(ListWindow):
    """Appended, then trimmed while len >= window: the window holds window - 1 values."""

    def update(self, value):
        spike = self.is_spike(value)
        if not spike:
            self.values.append(value)
            if len(self.values) >= self.window:
                self.values.pop(0)
        return spike


class Ewma:
    """An exponentially weighted mean and variance (alpha = 2 / (window + 1)) instead of a window."""

    def __init__(self, window=20, warmup=10, z=6.0):
        self.alpha, self.warmup, self.z, self.n, self.mean, self.var = 2 / (window + 1), warmup, z, 0, 0.0, 0.0

    def update(self, value):
        if not math.isfinite(value):
            return True
        if self.n >= self.warmup and value - self.mean > self.z * math.sqrt(self.var):
            return True
        diff = value - self.mean if self.n else 0.0
        self.mean = value if self.n == 0 else self.mean + self.alpha * diff
        self.var = (1 - self.alpha) * (self.var + self.alpha * diff * diff)
        self.n += 1
        return False


class TwoSided(SpikeAnswer):
    """|z| above z: a loss that falls fast is called a spike too."""

    def is_spike(self, value):
        if not math.isfinite(value):
            return True
        n = len(self.values)
        if n < self.warmup:
            return False
        mean = sum(self.values) / n
        return abs(value - mean) > self.z * self.std(mean)


class WarmupOneLate(SpikeAnswer):
    """A verdict only once more than `warmup` values are in (n > warmup)."""

    def is_spike(self, value):
        if not math.isfinite(value):
            return True
        return len(self.values) > self.warmup and super().is_spike(value)


class WarmupCountsSteps(SpikeAnswer):
    """The warm-up counts every value seen, a NaN too, instead of the values accepted."""

    def update(self, value):
        self.seen = getattr(self, "seen", 0) + 1
        if not math.isfinite(value):
            return True
        if self.seen > self.warmup:
            mean = sum(self.values) / len(self.values)
            if value - mean > self.z * self.std(mean):
                return True
        self.values.append(value)
        return False


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
    by_stream = {r["stream"]: r["spikes"] for r in rows}
    window_in, window_gone, dip, edge, nan_edge = (by_stream[name] for name, _, _ in checks.SPIKE_STREAMS[-5:])
    assert window_in == [] and window_gone == [15]          # the outlier in the window hides the jump, then leaves
    assert dip == [90] and edge == [10] and nan_edge == [2]
    checks.check_spike_detector(SpikeDetector)                 # the course's own, outside grading


@pytest.mark.parametrize("right", [PopulationStd, ListWindow, SlicedHistory])
def test_spike_detectors_that_follow_the_rules_pass(right):
    """What the exercise leaves free (n or n - 1, a deque or a list or a slice, a counter or the window's length for
    the warm-up, z compared as a ratio or a product) passes."""
    checks.check_spike_detector(right)


@pytest.mark.parametrize("wrong, stream, why", [
    (SpikesEnterWindow, "two spikes in a row", "stayed out of the window"),
    (NoWarmup, "a spike during warm-up", "fewer than warm-up = 10"),
    (FixedThreshold, "steady noise", "not in units of the loss"),
    (NanNotSpike, "a NaN during warm-up", "a NaN or inf loss is a spike"),
    (FrozenStatistics, "a ramp", "updated at every step"),
    (DefaultSettings, "other settings", "standard deviations"),
    (NoWindow, r"window 12, .* at step 15", "older ones drop out"),
    (Ewma, r"window 12, .* at step 15", "older ones drop out"),
    (WindowOneShort, r"window 12, .* at step 14", "older ones drop out"),
    (TwoSided, "a dip of -0.3", "upward"),
    (WarmupOneLate, "a jump of \\+0.3 at step 10, the first step", "the warm-up is over"),
    (WarmupCountsSteps, "a NaN at step 2", "a value kept out does not count")])
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
