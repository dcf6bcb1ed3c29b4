"""Tests of lesson 09's "when a large run goes wrong" experiments (course_lib/lessons/l09_training/large_runs.py).

Instability: past its stable learning rate the plain model's attention logits grow; QK-norm keeps them bounded by a
large factor; z-loss (on the output softmax) does not, and the summary must say so. Checkpoints: an async save
blocks the loop for less time than a synchronous one (a ratio measured side by side, not a timed threshold); a
ZeRO-2 checkpoint written by 4 gloo ranks loads on 2 with every tensor equal to the saved one.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.config import small_config
from course_lib.lessons.l09_training import large_runs
from course_lib.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def instability():
    return large_runs.instability_runs(steps=60)       # the lesson runs 150; the logits part ways well before 60


def test_qk_norm_bounds_the_attention_logits_and_z_loss_does_not(instability):
    runs, summary = instability["runs"], instability["summary"]
    peak = {v: max(r["max_logits"]) for v, r in runs.items()}
    print(f"\n{summary}")
    assert runs["plain"]["max_logits"][0] < 1.0 < 100 < peak["plain"], "plain's logits did not grow from ~0"
    assert peak["plain"] > 20 * peak["qk_norm"], peak              # measured: 60x at 60 steps, 195x at 150
    assert peak["plain"] < 3 * peak["z_loss"], peak                 # z-loss does not act on attention
    assert "qk_norm: keeps the attention logits bounded" in summary
    assert "z_loss: does not keep the attention logits from growing" in summary
    assert all(len(r["losses"]) == len(r["max_logits"]) == len(r["log_z"]) == 60 for r in runs.values())


def test_instability_runs_refuse_an_unknown_variant():
    with pytest.raises(ValueError, match="'bf16'"):
        large_runs.instability_runs(steps=1, variants=("plain", "bf16"))


def test_instability_figure_names_the_hardware(instability):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    fig = large_runs.instability_figure(instability, "CPU: test, gloo")
    assert "CPU: test, gloo" in fig.axes[0].get_title() and len(fig.axes[0].lines) == 3


def test_bf16_spacing():
    assert large_runs.bf16_spacing(1.0) == 2 ** -7 and large_runs.bf16_spacing(1953.0) == 8.0
    bf16 = lambda v: torch.tensor(v).to(torch.bfloat16).item()      # noqa: E731
    assert bf16(1952.0 + 3.9) == 1952.0 and bf16(1952.0 + 4.1) == 1960.0    # neighbours 8 apart near 1953
    assert bf16(1.0 + 2 ** -9) == 1.0 and bf16(1.0 + 2 ** -7) == 1.0 + 2 ** -7


def test_zero_checkpoint_written_by_4_ranks_loads_on_2_unchanged():
    r = large_runs.reshard_demo()
    print(f"\n4 -> 2 ranks: {r['n_tensors']} tensors, shard {r['shard_numel'][4]} -> {r['shard_numel'][2]} elements "
          f"per rank, equal: {r['equal']} (largest difference {r['max_abs_diff']:.1e}), {r['seconds']:.1f} s")
    assert r["equal"] and r["max_abs_diff"] == 0.0
    assert r["shard_numel"][2] >= 2 * r["shard_numel"][4] - 64               # each rank of 2 holds twice as much
    saved = r["saved"]
    assert {k.rsplit(".", 1)[1] for k in saved["optim"]} == {"step", "exp_avg", "exp_avg_sq"}
    assert any(v.abs().sum() > 0 for k, v in saved["optim"].items() if k.endswith("exp_avg_sq"))
    # the 2 loading ranks start from other weights (seed 1): equality means the load happened
    other = dict(build_model(small_config(), seed=1).named_parameters())
    assert not all(torch.equal(other[k].detach(), v) for k, v in r["loaded"]["params"].items())
