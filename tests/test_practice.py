"""Tests of lesson 09's formulas (course_lib/theory/practice.py): cost of a run and the checkpoint interval."""

from __future__ import annotations

import math

import pytest

from course_lib.config import get_preset
from course_lib.theory import practice
from course_lib.theory.flops import training_flops


def test_gpt3_cost_and_the_syllabus_claim_of_tens_of_thousands_of_gpu_hours():
    n = get_preset("gpt3-175b").num_params()
    cost = practice.training_cost(n, 300e9, peak_flops_per_gpu=312e12, mfu=0.4, usd_per_gpu_hour=2.0)
    assert cost["flops"] == pytest.approx(3.14e23, rel=0.01)              # Brown et al. 2020, table D.1
    assert cost["gpu_hours"] == pytest.approx(cost["flops"] / (312e12 * 0.4) / 3600)
    assert cost["usd"] == pytest.approx(2.0 * cost["gpu_hours"])
    # "数万 GPU 小时" (a few tens of thousands) is an order of magnitude short even at 40 % MFU on A100s:
    assert cost["gpu_hours"] > 5e5
    assert practice.gpu_hours(training_flops(n, 300e9), 312e12, 1.0) > 1e5   # ... and even at 100 % MFU
    with pytest.raises(ValueError, match="mfu"):
        practice.gpu_hours(1e20, 1e12, 40)


def test_young_interval_minimises_the_first_order_waste():
    delta, mtbf = 60.0, practice.job_mtbf(50_000 * 3600, 1000)      # 1,000 GPUs: one failure every 50 hours
    tau = practice.young_daly_interval(delta, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * delta * mtbf))
    grid = [tau * f for f in (0.5, 0.8, 0.9, 0.99, 1.01, 1.1, 1.25, 2.0)]
    best = practice.waste_fraction(tau, delta, mtbf)
    assert all(practice.waste_fraction(t, delta, mtbf) > best for t in grid)
    # Daly's higher-order optimum is within a few percent of Young's when delta << M, and M beyond 2M.
    assert practice.daly_interval(delta, mtbf) == pytest.approx(tau, rel=0.05)
    assert practice.daly_interval(10.0, 4.0) == 4.0


def test_llama3_interruptions_and_the_checkpoint_bytes_the_lesson_uses():
    """Lesson 09, section 5.2: Llama 3's 419 interruptions (all causes) in 54 days on 16,384 GPUs are one per about
    50,000 GPU-hours; a 175B mixed-precision Adam checkpoint is 14 bytes per parameter, 2.4 TB, 60 s at 40 GB/s."""
    per = practice.gpu_hours_per_interruption(419, 54, 16_384)
    assert per == pytest.approx(16_384 * 54 * 24 / 419) and per == pytest.approx(50_000, rel=0.02)
    assert practice.job_mtbf(per * 3600, 16_384) / 3600 == pytest.approx(54 * 24 / 419)   # one every ~3 hours
    assert practice.CHECKPOINT_BYTES_PER_PARAM == {"bf16 weights": 2, "fp32 master weights": 4, "Adam m (fp32)": 4,
                                                   "Adam v (fp32)": 4}
    n = get_preset("gpt3-175b").num_params()
    assert practice.checkpoint_bytes(n) == 14 * n
    assert practice.checkpoint_bytes(n) / 1e12 == pytest.approx(2.4, rel=0.03)
    assert practice.checkpoint_bytes(n) / 40e9 == pytest.approx(60.0, rel=0.05)
    assert practice.checkpoint_bytes(1.0, {"fp32 weights": 4}) == 4.0
    with pytest.raises(ValueError, match="interruptions"):
        practice.gpu_hours_per_interruption(0, 54, 16_384)
