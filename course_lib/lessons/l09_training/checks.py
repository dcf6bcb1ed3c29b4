"""What the graded exercises of lesson 09 call (solutions/09_training_in_practice.ipynb), but 09-resume
(`resume_checks`, which trains whole runs).

Each ``check_*`` runs the learner's code against the course's reference (`parallel.schedules`, `parallel.clipping`,
`alerts`, `spikes.SpikeDetector`) and raises ``course_lib.grading.check.CheckFailed`` (one line: what, expected, got,
a hint) at the first difference. Only `check_global_norm` starts processes (4 gloo ranks, one launch); the others run
in the notebook's process in well under a second. tests/test_training_checks.py calls them on wrong variants.
"""

from __future__ import annotations

import math
import random
from typing import Callable

import numpy as np
import torch

from course_lib.training.alerts import AlertEngine, Rule
from course_lib.config import small_config
from course_lib.data import random_batches
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.runtime.launch import run
from course_lib.lessons.errors import relative_error
from course_lib.lessons.l09_training.experiments import dp_tp_gradients, one_process_clip
from course_lib.one_process import grads_of
from course_lib.parallel import schedules
from course_lib.reference import reference_for

__all__ = ["SCHEDULE_SETTINGS", "check_schedule", "NORM_CFG", "MAX_NORM", "norm_reference", "check_global_norm",
           "ALERT_CASES", "alert_reference", "check_alert_rule", "SPIKE_STREAMS",
           "spike_reference", "check_spike_detector"]


# ------------------------------------------------------------------------------ 09-schedule

PEAK = 3e-4
SCHEDULE_SETTINGS = (  # (warmup_steps, total_steps, min_lr): no warm-up, W = 1, 2, W = T, long and short runs
    (0, 10, 0.0), (1, 12, 3e-5), (2, 10, 0.0), (3, 3, 0.0), (5, 40, 0.0), (5, 40, 3e-5), (10, 200, 3e-5),
    (100, 1000, 3e-5))
SCHEDULE_RTOL = 1e-9                        # closed forms written another way agree to ~1e-16; torch's recursion 1e-12


def _schedule_hint(s: int, w: int, t: int) -> str:
    e = max(w, 1) - 1
    if s == 0:
        return ("step 0 is the first update and already moves the weights: peak_lr / W (W = 0 or 1: no warm-up, "
                "the peak at once)")
    if s < e:
        return "warm-up: peak_lr * (step + 1) / W"
    if s == e:
        return "the peak is used once, at step W - 1 (step 0 when W is 0 or 1)"
    if s < t:
        return ("the cosine starts at the peak step e = max(W, 1) - 1 and reaches min_lr at total_steps: "
                "progress (s - e) / (T - e)")
    return "from total_steps on the rate stays at min_lr (a cosine alone would rise again)"


def check_schedule(lr_fn: Callable, settings=SCHEDULE_SETTINGS) -> list[dict]:
    """``lr_fn(step, peak_lr, warmup_steps, total_steps, min_lr)`` equals `schedules.warmup_cosine` at every step
    from 0 to 15 past the end (warm-up, peak, cosine, floor) of each setting; then, as the factor of a ``LambdaLR``,
    the rate of every optimizer update equals torch's ``LinearLR`` + ``CosineAnnealingLR`` + ``ConstantLR`` in a
    ``SequentialLR`` (`schedules.torch_warmup_cosine`)."""
    out = []
    for w, t, m in settings:
        n = t + 15
        kw = dict(peak_lr=PEAK, warmup_steps=w, total_steps=t, min_lr=m)
        want = [schedules.warmup_cosine(s, **kw) for s in range(n)]
        got = []
        for s in range(n):
            lr = lr_fn(s, PEAK, w, t, m)
            check_true(f"lr_fn({s}, W={w}, T={t}) returns a number (got {type(lr).__name__})",
                       isinstance(lr, (int, float)) or (torch.is_tensor(lr) and lr.numel() == 1),
                       hint="return a Python float")
            got.append(float(lr))
        for s in range(n):
            check_close(f"lr at step {s} (W={w}, T={t}, min_lr={m:g})", got[s], want[s], rtol=SCHEDULE_RTOL,
                        atol=1e-18, hint=_schedule_hint(s, w, t))
        # the learner's function as a LambdaLR factor, stepped as a loop steps it, against torch's own composition
        p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        opt_own, opt_torch = torch.optim.SGD([p1], lr=PEAK), torch.optim.SGD([p2], lr=1.0)
        own = torch.optim.lr_scheduler.LambdaLR(opt_own, lambda s: lr_fn(s, PEAK, w, t, m) / PEAK)
        ref = schedules.torch_warmup_cosine(opt_torch, **kw)
        for s in range(n):
            check_close(f"LambdaLR on lr_fn vs torch's LinearLR + CosineAnnealingLR at update {s} (W={w}, T={t})",
                        opt_own.param_groups[0]["lr"], opt_torch.param_groups[0]["lr"], rtol=SCHEDULE_RTOL,
                        atol=1e-18, hint=_schedule_hint(s, w, t))
            opt_own.step(), opt_torch.step(), own.step(), ref.step()
        out.append(dict(warmup=w, total=t, min_lr=m, steps=n, peak_step=max(w, 1) - 1, lrs=got))
    return out


# ------------------------------------------------------------------------------ 09-global-norm

NORM_CFG = small_config()            # vocab 64, T 16, 2 layers, 2 heads, d_model 32: tp = 2 divides it
NORM_BATCH = 4                       # global batch: 2 rows per data-parallel rank
MAX_NORM = 0.05                      # well below the gradient norm (~1): clipping happens
NORM_RTOL = 1e-5                     # fp32 sums of ~30k squares in another order: ~1e-7 measured
GRAD_RTOL = 2e-6                     # TP gradients vs one process (tests/test_clipping.py); eps or not: 1e-6


def norm_reference(seed: int = 0) -> dict:
    """One process on the global batch: the batch, the norm and the gradients clipped by
    ``torch.nn.utils.clip_grad_norm_``."""
    x, y = random_batches(NORM_CFG, NORM_BATCH, steps=1, seed=seed)[0]
    return {"x": x, "y": y, **one_process_clip(NORM_CFG, x, y, MAX_NORM)}


def _rank_global_norm(clip_fn: Callable, x, y, clipped: dict) -> dict:
    """DP 2 x TP 2: this rank's rows, gradients averaged over dp; the learner's norm with a max_norm that does not
    clip, then with MAX_NORM; what the typical mistakes would give, for the hint."""
    from course_lib.parallel.clipping import global_grad_norm
    from course_lib.parallel.tensor_model import shard_like

    model, grid, parts = dp_tp_gradients(NORM_CFG, x, y)
    tp, dp = grid.group("tp"), grid.group("dp")
    sharded = [g for g, spec in parts if spec is not None]
    replicated = [g for g, spec in parts if spec is None]
    out = {"n_sharded": len(sharded), "n_replicated": len(replicated),
           "wrong": {"the replicated gradients counted on every TP rank (summed over the tp group)":
                     global_grad_norm([(g, tp) for g, _ in parts]).item(),
                     "everything summed over all 4 ranks (no group given: dp replicas twice, replicated 4 times)":
                     global_grad_norm([(g, (tp, dp)) for g, _ in parts]).item(),
                     "the shards summed over all 4 ranks: the dp replicas counted twice":
                     global_grad_norm([(g, s and (tp, dp)) for g, s in parts]).item(),
                     "the shards never summed over the tp group: this rank's part only":
                     global_grad_norm([(g, None) for g, _ in parts]).item()}}
    before = grads_of(model)
    total = clip_fn(sharded, replicated, tp, 1e6)
    out["norm_unclipped"] = None if total is None else float(total)
    out["unclipped_err"] = relative_error(grads_of(model), before)
    total = clip_fn(sharded, replicated, tp, MAX_NORM)
    out["norm"] = None if total is None else float(total)
    out["clip_err"] = relative_error(grads_of(model), shard_like(model, clipped, tp))
    return out


def check_global_norm(clip_fn: Callable, ref: dict | None = None) -> list[dict]:
    """``clip_fn(sharded, replicated, tp_group, max_norm)`` on 4 gloo ranks (DP 2 x TP 2, the course's
    tensor-parallel GPT, gradients already averaged over dp) returns the global gradient norm before clipping and
    clips every gradient in place: the norm equals one process's ``clip_grad_norm_`` on the global batch on every
    rank, a max_norm above it leaves the gradients alone, and the clipped TP shards equal one process's clipped
    gradients, sliced the same way."""
    ref = ref or norm_reference()
    res = run(_rank_global_norm, 4, args=(clip_fn, ref["x"], ref["y"], ref["clipped"]), backend="gloo",
              stream=False, timeout_s=180)
    want = ref["norm"]
    for r, out in enumerate(res.returns):
        for key, what in (("norm_unclipped", "max_norm 1e6"), ("norm", f"max_norm {MAX_NORM}")):
            got = out[key]
            check_true(f"rank {r}: clip_fn returns the global norm ({what}; got {got!r})", got is not None,
                       hint="return the norm before clipping, like torch.nn.utils.clip_grad_norm_")
            hint = ("sum the squares of the sharded gradients over the tp group (one all-reduce); add those of "
                    "the replicated ones once, on every rank; then the square root")
            for mistake, value in out["wrong"].items():
                if abs(got - value) <= NORM_RTOL * abs(value):
                    hint = f"this is the value with {mistake}"
            check_close(f"rank {r} of DP 2 x TP 2: global gradient norm before clipping ({what})", got, want,
                        rtol=NORM_RTOL, hint=hint)
            if key == "norm_unclipped":
                check_close(f"rank {r}: change of the gradients with max_norm 1e6 (above the norm)",
                            out["unclipped_err"], 0.0, atol=GRAD_RTOL,
                            hint="scale by min(1, max_norm / (norm + 1e-6)): never amplify")
        check_close(f"rank {r}: clipped gradients vs one process's clip_grad_norm_ (relative difference)",
                    out["clip_err"], 0.0, atol=GRAD_RTOL,
                    hint="multiply every gradient, sharded and replicated, in place by max_norm / (norm + 1e-6)")
    return [dict(rank=r, norm=o["norm"], reference=want, n_sharded=o["n_sharded"], n_replicated=o["n_replicated"],
                 wrong=o["wrong"]) for r, o in enumerate(res.returns)]


# ------------------------------------------------------------------------------ 09-alert-rule

NAN = math.nan


def _stream(values, dt: float = 10.0, start: float = 0.0) -> list[tuple[float, float]]:
    return [(start + i * dt, v) for i, v in enumerate(values)]


ALERT_CASES = (  # (name, op, threshold, for_s, [(t, value), ...], hint)
    ("healthy loss", ">", 10.0, 30.0, _stream([3.2, 3.1, 3.0, 2.9, 2.9, 2.8, 2.7, 2.7]),
     "the condition never holds: never fire"),
    ("loss above 10 from t=30, for 30 s", ">", 10.0, 30.0, _stream([3.0, 3.0, 3.0, 12, 12, 12, 12, 12, 12, 12]),
     "the episode starts at the first sample that holds; fire once, at the first t with t - since >= for_s"),
    ("the same stream stopped one sample before", ">", 10.0, 30.0, _stream([3.0, 3.0, 3.0, 12, 12, 12]),
     "30 s have not passed since the first sample that holds: stay silent"),
    ("interrupted one sample before the end, then held again", ">", 10.0, 30.0,
     _stream([3.0, 12, 12, 12, 3.0, 12, 12, 12, 12, 12]),
     "a sample where the condition does not hold ends the episode: the duration starts over"),
    ("fires, recovers, fires again", ">", 10.0, 20.0, _stream([12, 12, 12, 12, 3.0, 3.0, 12, 12, 12, 12]),
     "fire once per episode; a sample that does not hold re-arms the rule"),
    ("a NaN inside an episode", ">", 10.0, 30.0, _stream([3.0, 12, 12, NAN, 12, 12, 3.0]),
     "a NaN says nothing about a threshold: neither a reset nor a sample that holds"),
    ("NaNs on a healthy run", ">", 10.0, 10.0, _stream([3.0, NAN, NAN, NAN, 3.0, NAN]),
     "a NaN compares false with every threshold: it never fires a '>' or '<' rule"),
    ("exactly at the threshold", ">", 10.0, 10.0, _stream([10.0, 10.0, 10.0, 10.0]),
     "the condition is strict: value > threshold"),
    ("throughput below 500 for 60 s", "<", 500.0, 60.0,
     _stream([800, 790, 320, 310, 300, 300, 320, 330, 340, 800, 320]),
     "op '<': the condition is value < threshold"),
    ("a duration of 0 s", ">", 0.9, 0.0, _stream([0.5, 0.95, 0.97, 0.5, 0.93]),
     "for_s = 0: fire at the first sample that holds"),
    ("irregular samples", ">", 100.0, 60.0,
     [(0.0, 1.0), (7.0, 250.0), (15.0, 260.0), (40.0, 240.0), (66.0, 230.0), (67.0, 220.0), (90.0, 1.0),
      (95.0, 300.0), (150.0, 300.0), (156.0, 300.0)],
     "measure the duration from the first sample that held, in seconds of t, not in numbers of samples"),
)


@reference_for("09-alert-rule")
def alert_reference(op: str, threshold: float, for_s: float, samples) -> list[float]:
    """The times at which `alerts.AlertEngine` fires a rule ``metric op threshold for for_s`` on ``samples``."""
    engine = AlertEngine([Rule("rule", "metric", op, threshold, for_s, "")])
    return [t for t, v in samples if engine.observe(t, {"metric": v})]


def check_alert_rule(rule_cls: Callable, cases=ALERT_CASES) -> list[dict]:
    """A fresh ``rule_cls(op, threshold, for_s)`` per stream; ``observe(t, value)`` must return True exactly at the
    samples where `alerts.AlertEngine` fires the same rule: at the sample its duration is reached (not one sample
    earlier), once per episode, starting over when the condition stops holding, ignoring NaN, never on healthy
    streams."""
    out = []
    for name, op, threshold, for_s, samples, hint in cases:
        want = alert_reference(op, threshold, for_s, samples)
        rule = rule_cls(op, threshold, for_s)
        got = []
        for t, v in samples:
            fired = rule.observe(t, v)
            check_true(f"stream '{name}': observe({t:g}, {v:g}) returns True or False (got {fired!r:.40})",
                       isinstance(fired, (bool, np.bool_)), hint="return whether the rule fires at this sample")
            if fired:
                got.append(t)
        check_equal(f"stream '{name}' ({op} {threshold:g} for {for_s:g} s): times at which the rule fires",
                    got, want, hint=hint)
        out.append(dict(stream=name, rule=f"{op} {threshold:g} for {for_s:g} s", samples=len(samples), fired=want))
    return out


# ------------------------------------------------------------------------------ 09-spike-detector

def _noise(n: int, level: float, sigma: float, seed: int) -> list[float]:
    """n values of ``level`` + Gaussian noise of ``sigma`` (Python's generator: the same on every platform)."""
    rng = random.Random(seed)
    return [level + sigma * rng.gauss(0.0, 1.0) for _ in range(n)]


def _with(values: list[float], at: dict[int, float]) -> list[float]:
    out = list(values)
    for step, v in at.items():
        out[step] = v
    return out


def _ramp(n: int, start: float, stop: float, sigma: float, seed: int) -> list[float]:
    return [start + (stop - start) * i / (n - 1) + e for i, e in enumerate(_noise(n, 0.0, sigma, seed))]


_STEADY = _noise(120, 3.0, 0.01, seed=1)
_WARM = _noise(60, 2.0, 0.01, seed=3)
_TWICE = _noise(120, 2.5, 0.01, seed=5)
_NAN = _noise(100, 2.2, 0.01, seed=6)
_WAVE = [1.0 + 0.02 * math.sin(2.1 * i) for i in range(60)]     # bounded: a short window's z-scores stay small
_OUT_IN = _noise(30, 2.0, 0.01, seed=11)
_OUT_GONE = _noise(30, 2.0, 0.01, seed=12)
_DIP = _noise(110, 2.4, 0.01, seed=8)
_EDGE = _noise(40, 1.5, 0.01, seed=9)
_NAN_EDGE = _noise(40, 1.8, 0.01, seed=10)
SPIKE_STREAMS = (  # (name, (window, warmup, z), values): every step's verdict is compared with the reference's
    ("steady noise, one spike of +0.3 at step 60 (a loss of 3.0, noise 0.01)", (20, 10, 6.0),
     _with(_STEADY, {60: _STEADY[60] + 0.3})),
    ("a ramp: a gradient norm growing from 0.5 to 1.5 over 300 steps (noise 0.02)", (20, 10, 6.0),
     _ramp(300, 0.5, 1.5, 0.02, seed=2)),
    ("a spike during warm-up (+0.6 at step 5), another at step 40", (20, 10, 6.0),
     _with(_WARM, {5: _WARM[5] + 0.6, 40: _WARM[40] + 0.6})),
    ("two spikes in a row (+0.5 at steps 80 and 81)", (20, 10, 6.0),
     _with(_TWICE, {80: _TWICE[80] + 0.5, 81: _TWICE[81] + 0.5})),
    ("a NaN during warm-up (step 3), an inf at step 40, a spike of +0.2 at step 70", (20, 10, 6.0),
     _with(_NAN, {3: math.nan, 40: math.inf, 70: _NAN[70] + 0.2})),
    ("other settings: window 8, warm-up 4, z 3; a wave of +-0.02, bumps of +0.06 at steps 6 and 40", (8, 4, 3.0),
     _with(_WAVE, {6: _WAVE[6] + 0.06, 40: _WAVE[40] + 0.06})),
    # the window's length: an outlier accepted in the warm-up (step 2) is one of the last 12 accepted values up to
    # step 14 and gone at step 15; a jump of +0.1 is no spike beside it and a spike without it
    ("window 12, warm-up 6, z 5: an outlier of +1 at step 2 (warm-up), a jump of +0.1 at step 14", (12, 6, 5.0),
     _with(_OUT_IN, {2: _OUT_IN[2] + 1.0, 14: _OUT_IN[14] + 0.1})),
    ("window 12, warm-up 6, z 5: an outlier of +1 at step 2 (warm-up), a jump of +0.1 at step 15", (12, 6, 5.0),
     _with(_OUT_GONE, {2: _OUT_GONE[2] + 1.0, 15: _OUT_GONE[15] + 0.1})),
    ("a dip of -0.3 at step 50 (a loss falling fast), a spike of +0.3 at step 90", (20, 10, 6.0),
     _with(_DIP, {50: _DIP[50] - 0.3, 90: _DIP[90] + 0.3})),
    ("a jump of +0.3 at step 10, the first step after a warm-up of 10", (20, 10, 6.0),
     _with(_EDGE, {10: _EDGE[10] + 0.3})),
    ("a NaN at step 2, a jump of +0.3 at step 10 (warm-up 10)", (20, 10, 6.0),
     _with(_NAN_EDGE, {2: math.nan, 10: _NAN_EDGE[10] + 0.3})),
)


def spike_reference(window: int, warmup: int, z: float, values) -> list[bool]:
    """The verdict of the course's detector (`course_lib.training.spikes.SpikeDetector`) at every value."""
    from course_lib.training.spikes import SpikeDetector

    det = SpikeDetector(window=window, warmup=warmup, z=z)
    return [det.update(v) for v in values]


def _spike_zscores(window: int, warmup: int, z: float, values) -> list[float]:
    """The reference's z-score of every value against its window (0 in warm-up, inf when not finite)."""
    from course_lib.training.spikes import SpikeDetector

    det, out = SpikeDetector(window=window, warmup=warmup, z=z), []
    for v in values:
        det.update(v)
        out.append(det.last_z)
    return out


def _z_verdict(span: list[float], value: float, z: float) -> bool:
    """Whether ``value`` is a spike against the accepted values ``span`` (sample standard deviation)."""
    n = len(span)
    mean = sum(span) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in span) / (n - 1))
    return value - mean > z * std


def _spike_hint(step: int, values: list[float], want: list[bool], settings: tuple, expected: bool) -> str:
    """Where to look, from what the reference saw at the first step the learner's verdict differs: the exercise's
    rule that decides this verdict, found by asking which other reading of the rules gives the learner's verdict
    (fewer accepted values than the warm-up, a span of accepted values other than the last `window`, a value below
    the mean)."""
    window, warmup, z = settings
    v = values[step]
    if not math.isfinite(v):
        return ("a NaN or inf loss is a spike at any step, warm-up included, and never enters the window "
                "(the rule on what a spike is)")
    accepted = [values[i] for i in range(step) if not want[i]]      # every value the reference accepted so far
    if not expected and len(accepted) < warmup:
        return (f"only {len(accepted)} values accepted so far, fewer than warm-up = {warmup}: no verdict yet, the "
                f"value only fills the window; a value kept out does not count (the warm-up rule)")
    if expected and len(accepted) == warmup:
        return (f"{warmup} values accepted so far, as many as warm-up = {warmup}: the warm-up is over, this value "
                "gets a verdict (the warm-up rule)")
    if any(not math.isfinite(x) for x in values[:step]):
        return "a non-finite value earlier in the stream must have stayed out of the window (the window rule)"
    if expected and any(want[max(0, step - 3):step]):
        return ("a spike a few steps earlier must have stayed out of the window, else it widens the band and "
                "hides this one (the window rule)")
    spans = [accepted, accepted[-(window + 1):]] + ([accepted[-(window - 1):]] if window > 2 else [])
    if any(_z_verdict(span, v, z) != expected for span in spans if len(span) >= 2):
        return (f"the mean and standard deviation are those of the last {window} accepted values, updated at every "
                "step: older ones drop out as new ones come in, whatever their size (the window rule)")
    window_values = accepted[-window:]
    if not expected and v < sum(window_values) / len(window_values):
        return ("this value lies below the window's mean: a loss that falls fast is good news, only a z-score above "
                "z (upward) is a spike (the rule on what a spike is)")
    if expected:
        return ("a spike is measured in standard deviations of the window, not in units of the loss, with this "
                f"stream's window = {window}, warm-up = {warmup}, z = {z:g} (the z-score above the exercise)")
    return ("the mean and standard deviation are those of the last `window` accepted values, updated at every "
            "step; only a z-score above z (upward) is a spike (the z-score and the window rule)")


def check_spike_detector(detector_cls: Callable, streams=SPIKE_STREAMS) -> list[dict]:
    """A fresh ``detector_cls(window=, warmup=, z=)`` per stream; ``update(value)`` must return the verdict of the
    course's reference (`course_lib.training.spikes.SpikeDetector`: a z-score over a sliding window of accepted values,
    sample standard deviation, no verdict before ``warmup`` accepted values, spikes and non-finite values kept out
    of the window, a non-finite value always a spike) at every step of steady noise, a ramp, a spike during warm-up,
    two spikes in a row, a NaN and an inf, other settings, an outlier one step before and one step after it leaves
    the window (its length), a dip (upward only), a jump at the first step with a verdict and the same after a NaN
    (the warm-up counts accepted values). Every verdict is clear (no z-score within 25 % of z), so a detector that
    follows the rules passes whichever way it is written. Fails at the first step that differs, naming the stream,
    the step, the value and the verdicts."""
    out = []
    for name, (window, warmup, z), values in streams:
        want = spike_reference(window, warmup, z, values)
        zs = _spike_zscores(window, warmup, z, values)
        det = detector_cls(window=window, warmup=warmup, z=z)
        for step, v in enumerate(values):
            got = det.update(v)
            check_true(f"stream '{name}': update({v:.4g}) at step {step} returns True or False (got {got!r:.40})",
                       isinstance(got, (bool, np.bool_)), hint="return whether this value is a spike")
            if bool(got) != want[step]:
                check_equal(f"stream '{name}', step {step}: is the value {v:.4g} a spike? (its z-score against "
                            f"the reference's window: {zs[step]:.3g})", bool(got), want[step],
                            hint=_spike_hint(step, values, want, (window, warmup, z), want[step]))
        out.append(dict(stream=name, window=window, warmup=warmup, z=z, steps=len(values),
                        spikes=[s for s, w in enumerate(want) if w]))
    return out
