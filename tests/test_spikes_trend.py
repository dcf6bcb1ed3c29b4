"""Lesson 09, section 7.1: a falling loss fools a plain window; the detrended detector judges the residual."""

from __future__ import annotations

import math
import random

import pytest

from course_lib.training.spikes import DetrendedSpikeDetector, SpikeDetector, replay_zscores


def _falling(n: int, slope: float = -0.1, noise: float = 0.01, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [5.0 + slope * t + rng.gauss(0.0, noise) for t in range(n)]


def test_a_plain_window_on_a_straight_line_gives_the_quiz_value():
    """Lesson 09's quiz q4: a noiseless fall of 0.1 a step over a window of 10, last value 3.00, then 3.50."""
    window = [3.9 - 0.1 * k for k in range(10)]                       # 3.90 ... 3.00
    z = replay_zscores(window + [3.5], SpikeDetector(window=10, warmup=10))[-1]
    mean, s = 3.45, 0.1 * math.sqrt(10 * 11 / 12)                   # sample std of a line: |b| sqrt(n (n + 1) / 12)
    assert z == pytest.approx((3.5 - mean) / s, rel=1e-12) and z == pytest.approx(0.16514, rel=1e-4)


def test_the_trend_hides_a_spike_from_a_long_plain_window_but_not_from_the_detrended_one():
    values = _falling(30)
    values[20] += 0.5                                                   # 50 x the noise above the line
    plain = {w: replay_zscores(values[:21], SpikeDetector(window=w, warmup=6))[20] for w in (6, 10, 20)}
    detrended = {w: replay_zscores(values[:21], DetrendedSpikeDetector(window=w, warmup=6))[20] for w in (6, 10, 20)}
    assert plain[6] > plain[10] > plain[20] and plain[20] < 6.0
    assert all(z > 20.0 for z in detrended.values()), detrended
    clean = replay_zscores(_falling(30), DetrendedSpikeDetector(window=10, warmup=6))
    assert max(clean) < 6.0


def test_detrended_detector_keeps_spikes_out_and_resumes_from_its_state():
    det = DetrendedSpikeDetector(window=8, warmup=4, z=6.0)
    values = _falling(12)
    values[9] += 1.0
    verdicts = [det.update(v) for v in values[:10]]
    assert verdicts == [False] * 9 + [True] and 9 not in det.times and len(det.values) == 8
    twin = DetrendedSpikeDetector(window=8, warmup=4, z=6.0)
    twin.load_state_dict(det.state_dict())
    assert [twin.update(v) for v in values[10:]] == [det.update(v) for v in values[10:]]
    assert twin.t == det.t == 12 and math.isinf(det.zscore(float("nan")))
    with pytest.raises(ValueError, match="warmup >= 3"):
        DetrendedSpikeDetector(window=8, warmup=2)


def test_trend_rows_replays_both_detectors_on_a_runs_records():
    from course_lib.lessons.l09_training import experiments, report

    clean = [{"step": s, "loss": v, "grad_norm": 1.0 + 0.01 * (s % 3)} for s, v in enumerate(_falling(20))]
    spiked = [dict(r) for r in clean]
    spiked[14]["loss"] += 1.0
    rows = experiments.trend_rows(clean, spiked, 14, metrics=("loss",))
    assert [(r["window"], r["detector"]) for r in rows] == [(w, d) for w in (6, 10, 14)
                                                            for d in ("plain window", "detrended")]
    z = {(r["window"], r["detector"]): r["z_spike"] for r in rows}
    assert z[6, "plain window"] > z[14, "plain window"] and min(z[w, "detrended"] for w in (6, 10, 14)) > 20
    assert "z of the spike (step 14)" in report.trend_table(rows, 14)
    with pytest.raises(ValueError, match="never rewound"):
        experiments.trend_rows(clean[:5] + clean[3:], spiked, 14)


def test_the_detrended_z_of_pure_noise_is_students_t_with_n_minus_2_degrees_of_freedom():
    """Scaled by the prediction error, not by the residuals' spread alone (which would give about 1.9 at window 6)."""
    rng = random.Random(1)
    for window in (6, 14):
        z = []
        for _ in range(300):
            values = [rng.gauss(0.0, 1.0) for _ in range(60)]
            z += replay_zscores(values, DetrendedSpikeDetector(window=window, warmup=window, z=1e9))[window:]
        spread = math.sqrt(sum(v * v for v in z) / len(z) - (sum(z) / len(z)) ** 2)
        assert spread == pytest.approx(math.sqrt((window - 2) / (window - 4)), rel=0.05), (window, spread)
    det = DetrendedSpikeDetector(window=6, warmup=6)
    for v in (0.0, 1.0, 0.0, 1.0, 0.0, 1.0):
        det.update(v)
    s_r = math.sqrt(sum((v - 0.5 - (3 / 35) * (t - 2.5)) ** 2 for t, v in enumerate((0, 1, 0, 1, 0, 1))) / 4)
    line_at_6 = 0.5 + (3 / 35) * (6 - 2.5)
    assert det.zscore(2.0) == pytest.approx((2.0 - line_at_6) / (s_r * math.sqrt(1 + 1 / 6 + 3.5 ** 2 / 17.5)))
