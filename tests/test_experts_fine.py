"""Tests of fine-grained and shared experts at equal parameters (course_lib/theory/experts_fine.py,
course_lib/lessons/l11_experts/fine_grained.py; DeepSeekMoE, Dai et al. 2024).

Formulas: DeepSeekMoE's segmentation and shared isolation keep the expert parameters, total and active; the routing
combinations of its example (C(16, 2) = 120, C(64, 8) = 4,426,165,368); per-layer counts == `theory.experts`'
whole-model counts. Modules: parameters counted from the three variants' layers == the formula, expert parameters
equal, the whole GPT == `theory.experts.moe_params`. A short training of the three gives finite, falling losses and
tokens on every expert; unequal variants are refused.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from course_lib.config import get_preset
from course_lib.lessons.l11_experts import fine_grained
from course_lib.parallel.moe import moe_layers
from course_lib.theory import experts as theory_experts
from course_lib.theory import experts_fine

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(get_preset("tiny"), seq_len=16)     # 2 layers, d_model 64


def test_segmentation_keeps_expert_params():
    coarse = experts_fine.MoEShape(4, 1, 64)
    fine = experts_fine.fine_grained(4, 1, 64, 4)
    shared = experts_fine.fine_grained(4, 1, 64, 4, n_shared=1)
    assert (fine.n_experts, fine.top_k, fine.d_ff, fine.shared_d_ff) == (16, 4, 16, 0)
    assert (shared.n_experts, shared.top_k, shared.d_ff, shared.shared_d_ff) == (15, 3, 16, 16)
    params = [experts_fine.expert_params(64, s) for s in (coarse, fine, shared)]
    assert params[0] == params[1] == params[2] == {"total": 3 * 64 * 64 * 4, "active": 3 * 64 * 64}
    assert [experts_fine.total_params(64, s) - params[0]["total"] for s in (coarse, fine, shared)] == \
        [64 * 4, 64 * 16, 64 * 15]                                  # only the router differs: C E
    assert [experts_fine.active_params(64, s) - params[0]["active"] for s in (coarse, fine, shared)] == \
        [64 * 4, 64 * 16, 64 * 15]
    with pytest.raises(ValueError, match=r"d_ff=30 is not divisible by m=4 .* pick m in \{1, 2, 3, 5, 6, 10"):
        experts_fine.fine_grained(4, 1, 30, 4)
    with pytest.raises(ValueError, match=r"n_shared=4 must be in 0 .. top_k x m - 1 = 3"):
        experts_fine.fine_grained(4, 1, 64, 4, n_shared=4)


def test_routing_combinations_deepseekmoe_example():
    assert experts_fine.routing_combinations(16, 2) == 120
    assert experts_fine.routing_combinations(64, 8) == 4_426_165_368
    assert experts_fine.routing_combinations(63, 7) == 553_270_671 == math.comb(63, 7)
    assert [experts_fine.routing_combinations(s.n_experts, s.top_k)
            for s in fine_grained.variant_shapes().values()] == [4, 1820, 455]


@pytest.mark.parametrize("name", ["coarse", "fine", "shared"])
def test_params_counted_from_the_modules_equal_the_formula(name):
    shape = fine_grained.variant_shapes()[name]
    model = fine_grained.build_variant(CFG, shape)
    for layer in moe_layers(model):
        counted = fine_grained.count_params(layer)
        e = experts_fine.expert_params(CFG.d_model, shape)
        assert counted == {"total": experts_fine.total_params(CFG.d_model, shape),
                           "active": experts_fine.active_params(CFG.d_model, shape),
                           "expert_total": e["total"], "expert_active": e["active"]}
        assert counted["expert_total"] == 3 * 64 * 64 * 4 and counted["expert_active"] == 3 * 64 * 64
    whole = theory_experts.moe_params(CFG, shape.n_experts, shape.top_k, shape.d_ff, shape.shared_d_ff)
    assert whole["total"] == model.num_params()
    dense = model.num_params() - CFG.n_layer * experts_fine.total_params(CFG.d_model, shape)
    assert whole["active"] == dense + CFG.n_layer * experts_fine.active_params(CFG.d_model, shape)


def test_short_training_of_the_three():
    res = fine_grained.train_variants(12, batch=4, seq_len=16, eval_batches=2, corpus_bytes=200_000)
    assert set(res["variants"]) == {"coarse", "fine", "shared"} and res["hardware"]
    for name, row in res["variants"].items():
        assert len(row["loss"]) == 12 and all(math.isfinite(v) for v in row["loss"]), name
        assert row["loss"][-1] < row["loss"][0] and math.isfinite(row["eval_loss"]), name
        assert row["params"] == row["formula"], name
        for layer in row["tokens_per_expert"]:                   # last 10 steps: 10 x 4 x 16 tokens x k choices
            assert len(layer) == row["shape"]["n_experts"] and sum(layer) == 10 * 4 * 16 * row["shape"]["top_k"]


def test_unequal_variants_are_refused(monkeypatch):
    shapes = fine_grained.variant_shapes()
    unequal = {**shapes, "fine": experts_fine.MoEShape(16, 3, 16)}      # top-3 of 16: 3/4 of the active experts
    monkeypatch.setattr(fine_grained, "variant_shapes", lambda **kw: unequal)
    with pytest.raises(AssertionError, match="expert_active differs between the variants"):
        fine_grained.train_variants(1, batch=2, seq_len=8, eval_batches=1, corpus_bytes=50_000)   # before any step
