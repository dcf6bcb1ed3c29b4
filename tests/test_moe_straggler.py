"""Tests of lesson 11's straggler (course_lib/lessons/l11_experts/straggler.py, course_lib/theory/moe_imbalance.py).

One process: the bytes SwiGLU experts save for backward (SavedActivations) == R (C + 4F) b exactly, fp32 and bf16,
with empty experts; a count that forgets silu's input or the product fails; the step-time model; the skew bias hits
its fraction. One launch on 2 gloo ranks (ep = 2), three skew levels: rows received per rank == counted from a
one-process routing; saved bytes == formula; the expert-parallel output and input gradient == one process with the
same bias; at the strong skew (9 times the rows) the hot rank's expert CPU time (median of 5) > 2 x the cold one's.
CPU time of the rank's one thread, not wall time: another process holding the core does not count in it.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from course_lib.lessons.l11_experts.straggler import (SKEWS, StragglerSizes, routed_rows, skew_bias, straggler_setup,
                                                      straggler_table)
from course_lib.measure.memory_stats import SavedActivations
from course_lib.parallel.moe import SwiGLUExperts
from course_lib.runtime.launch import run
from course_lib.theory.moe_imbalance import (expert_activation_bytes, expert_flops, skewed_loads,
                                             straggler_step_time)

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = StragglerSizes(tokens=512, d_model=64, d_ff=256)
REPEATS = 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 0, 7], [0, 0, 0], [1, 2, 3, 40]])
def test_saved_bytes_equal_formula(counts, dtype):
    torch.manual_seed(0)
    C, F_ = 16, 24
    experts = SwiGLUExperts(len(counts), C, F_).to(dtype)
    R = sum(counts)
    x = torch.randn(R, C, dtype=dtype, requires_grad=True)[torch.randperm(R)]   # a fresh (R, C), as x[order]
    with SavedActivations(experts) as acts:
        experts(x, counts)
    b = torch.finfo(dtype).bits // 8
    assert acts.bytes == expert_activation_bytes(R, C, F_, b)
    if R:
        assert acts.bytes != R * (C + 3 * F_) * b          # forgetting one of a, s, b, h
        assert acts.bytes != R * 4 * F_ * b                # forgetting the input row


def test_step_time_model():
    m = straggler_step_time([3, 1], seconds_per_row=2.0, other_s=1.0)
    assert m == dict(step=7.0, balanced=5.0, ratio=1.5, wait=[0.0, 4.0], slowest=0)
    assert skewed_loads(100, 0.9, 2) == pytest.approx([90, 10])
    assert straggler_step_time(skewed_loads(100, 0.9, 2), 1.0)["ratio"] == pytest.approx(1.8)   # P f
    assert expert_flops(10, 4, 8) == 3 * expert_flops(10, 4, 8, backward=False) == 18 * 10 * 4 * 8
    with pytest.raises(ValueError, match="fraction=1.2 must be in"):
        skewed_loads(100, 1.2, 2)


def test_skew_bias_hits_the_fraction():
    layer, x, _ = straggler_setup(SIZES, 2)
    for fraction in (0.5, 0.75, 0.9):
        rows = routed_rows(layer.router, x, skew_bias(layer.router, x, 2, fraction), 2)
        assert fraction <= rows[0] / sum(rows) < fraction + 0.01
    with pytest.raises(ValueError, match=r"fraction=1.5: .* pick fraction <= 1.00"):
        skew_bias(layer.router, x, 2, 1.5)


# ------------------------------------------------------------------------------ 2 ranks

def _ranks(sizes, repeats):
    from course_lib.lessons.l11_experts.straggler import rank_straggler

    return rank_straggler(sizes, SKEWS, repeats)


@pytest.fixture(scope="module")
def ranks():
    return run(_ranks, 2, args=(SIZES, REPEATS), backend="gloo", timeout_s=120, stream=False).returns


def _reference(fraction):
    """One process: the same layer on both ranks' tokens with the same bias: (rows per rank, output, dx)."""
    layer, x, dy = straggler_setup(SIZES, 2)
    bias = skew_bias(layer.router, x, 2, fraction)
    layer.router.expert_bias.copy_(bias)
    xin = x.clone().requires_grad_()
    y = layer(xin.view(1, *x.shape)).view_as(x)
    (y * dy).sum().backward()
    return routed_rows(layer.router, x, bias, 2), y.detach(), xin.grad


@pytest.mark.parametrize("level", list(SKEWS))
def test_rows_bytes_and_outputs_equal_one_process(ranks, level):
    i = list(SKEWS).index(level)
    rows, y, dx = _reference(SKEWS[level])
    assert sum(rows) == 2 * SIZES.tokens * SIZES.top_k
    for r, res in enumerate(ranks):
        row, what = res["levels"][i], f"{level}, rank {r}"
        assert row["rows"] == rows[r], what
        assert row["saved_bytes"] == row["formula_bytes"] == expert_activation_bytes(
            rows[r], SIZES.d_model, SIZES.d_ff, 4), what
        mine = slice(r * SIZES.tokens, (r + 1) * SIZES.tokens)
        torch.testing.assert_close(row["out"], y[mine], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: out {m}")
        torch.testing.assert_close(row["dx"], dx[mine], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: dx {m}")


def test_hot_rank_computes_longer_at_strong_skew(ranks):
    """9 times the rows (0.9 of the assignments on rank 0): its experts' CPU time, median of 5, above twice the cold
    rank's. The waits are left to the lesson (wall clock, shared cores)."""
    table = {row["name"]: row for row in straggler_table(ranks)}
    strong = table["strong"]
    assert strong["rows"][0] >= 8 * strong["rows"][1]
    hot, cold = strong["expert_cpu_s"]
    assert hot > 2 * cold, f"hot rank {hot * 1e3:.2f} ms, cold rank {cold * 1e3:.2f} ms of expert CPU time"
    assert strong["load_ratio"] == pytest.approx(2 * strong["achieved"])
