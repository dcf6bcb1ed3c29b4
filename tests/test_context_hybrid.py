"""Tests of hybrid context parallelism, Ulysses inside and the ring across (lesson 10):
course_lib/parallel/context_hybrid.py, course_lib/theory/context_hybrid.py, course_lib/lessons/l10_context/hybrid.py.

One process: the mesh's groups (cp 4 and 8), the ring's combined layouts and their balance, validation naming the
field and the fix, the byte formula at its two ends (u = 1: the ring; u = cp: Ulysses), the Ulysses degree caps.
One launch of 4 gloo ranks (tiny GPT, s = 32, B = 2, fp32): u = 2 x ring 2, u = 1 x ring 4, u = 4 x ring 1; loss,
logits and every gradient vs one process (rtol 1e-5, atol 1e-6); bytes of layer 0 == `hybrid_layer_comm`, attention
work == the balanced split's; two wrong meshes (the groups transposed, the combined layout in the wrong member
order) must fail.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from course_lib import theory
from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.one_process import train_reference
from course_lib.parallel.context import layouts
from course_lib.parallel.context_hybrid import (combined_layouts, hybrid_attention, hybrid_coords, hybrid_members,
                                                validate_hybrid)
from course_lib.runtime.launch import run
from course_lib.theory.context_hybrid import (UlyssesCap, hybrid_bytes_sent_per_rank, hybrid_layer_comm,
                                              ulysses_degree_cap)

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(get_preset("tiny"), seq_len=32)     # 2 layers, 4 heads, d_model 64, s = 32
BATCH = 2
WORLD = 4
DEGREES = (2, 1, 4)                                           # u x ring: 2 x 2, 1 x 4 (the ring), 4 x 1 (Ulysses)
WRONG = ["groups transposed", "member order reversed"]


# ------------------------------------------------------------------------------ one process

def test_mesh_groups():
    assert hybrid_members(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert hybrid_members(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert hybrid_members(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    for cp, u in ((4, 2), (8, 2), (8, 4), (4, 1), (4, 4)):
        uly, ring = hybrid_members(cp, u)
        for rank in range(cp):
            g, j = hybrid_coords(rank, cp, u)
            assert uly[g][j] == rank and ring[j][g] == rank           # member j of group g, member g of ring j
    with pytest.raises(ValueError, match="ulysses=3"):
        hybrid_coords(0, 4, 3)


def test_combined_layouts_keep_the_balance():
    lay = layouts(32, 4)                                        # chunks of 4 tokens: rank i holds i and 7 - i
    assert combined_layouts(lay, 2) == [[(0, 4), (28, 4), (4, 4), (24, 4)], [(8, 4), (20, 4), (12, 4), (16, 4)]]
    for cp, u in ((4, 2), (8, 2), (8, 4), (8, 8)):
        c = 64 // (2 * cp)
        needs = [sum(s // c + 1 for s, _ in rows) for rows in combined_layouts(layouts(64, cp), u)]
        assert needs == [u * (2 * cp + 1)] * (cp // u)          # causal chunk pairs per ring member: all equal


def test_one_process_hybrid_attention_is_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    out = hybrid_attention(q, k, v, None, None, layouts(16, 1))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=1e-5)


def test_validation_names_field_and_fix():
    validate_hybrid(32, 4, 2, 4)
    validate_hybrid(32, 4, 2, 4, tp=2)
    with pytest.raises(ValueError, match=r"ulysses=3 does not divide cp=4 .* pick ulysses in \{1, 2, 4\}"):
        validate_hybrid(48, 4, 3, 12)
    with pytest.raises(ValueError, match=r"ulysses=8 does not divide the heads per TP rank, n_head/tp = 4/1 = 4"):
        validate_hybrid(32, 8, 8, 4)
    with pytest.raises(ValueError, match=r"ulysses=4 .* n_head/tp = 4/2 = 2 .* pick ulysses in \{1, 2\}"):
        validate_hybrid(32, 4, 4, 4, tp=2)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_head=4"):
        validate_hybrid(32, 4, 2, 4, tp=3)
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible by 2\*cp=8"):
        validate_hybrid(30, 4, 2, 4)
    with pytest.raises(ValueError, match="ulysses=0"):
        validate_hybrid(32, 4, 0, 4)


def test_byte_formula_at_its_ends_and_caps():
    B, s, C = 2, 64, 32
    assert hybrid_layer_comm(B, s, C, 4, 1) == theory.context.layer_comm("ring", B, s, C, 4)
    assert hybrid_layer_comm(B, s, C, 4, 4) == theory.context.layer_comm("ulysses", B, s, C, 4)
    assert hybrid_layer_comm(B, s, C, 1, 1) == {}
    n = s // 8
    mixed = hybrid_bytes_sent_per_rank(B, s, C, 8, 2, phase="forward")
    assert mixed == {"ulysses": 4 * B * n * C * 4 / 2, "ring": 3 * 2 * B * n * C * 4}
    with pytest.raises(ValueError, match="ulysses=3 does not divide cp=4"):
        hybrid_layer_comm(B, s, C, 4, 3)
    assert ulysses_degree_cap(128, 8, 8) == UlyssesCap(kv=1, query=16)      # Llama 3 405B under TP 8
    assert ulysses_degree_cap(32, 8, 1) == UlyssesCap(kv=8, query=32)
    assert ulysses_degree_cap(4, 4) == UlyssesCap(kv=4, query=4)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_kv_head=8"):
        ulysses_degree_cap(128, 8, 3)
    with pytest.raises(ValueError, match=r"n_kv_head=3 does not divide n_head=128"):
        ulysses_degree_cap(128, 3, 1)


# ------------------------------------------------------------------------------ ranks

def _wrong(cfg, batch, wrong):
    from course_lib.lessons.l10_context.hybrid import rank_hybrid_lab
    from course_lib.parallel import context_hybrid

    if wrong == "groups transposed":             # the ring inside, Ulysses across; the layouts assume the opposite
        uly, ring, _ = context_hybrid.hybrid_groups(WORLD, 2)
        return rank_hybrid_lab(cfg, batch, 2, groups=(ring, uly))
    real = context_hybrid.combined_layouts
    context_hybrid.combined_layouts = lambda lay, u: [sum(reversed(lay[g * u:(g + 1) * u]), [])
                                                      for g in range(len(lay) // u)]
    try:
        return rank_hybrid_lab(cfg, batch, 2)
    finally:
        context_hybrid.combined_layouts = real


def _all_checks(cfg, batch):
    from course_lib.lessons.l10_context.hybrid import rank_hybrid_lab

    out = {u: rank_hybrid_lab(cfg, batch, u) for u in DEGREES}
    out["wrong"] = {w: _wrong(cfg, batch, w) for w in WRONG}
    return out


BATCHES = random_batches(CFG, BATCH, 1, seed=0)


@pytest.fixture(scope="module")
def reference():
    return train_reference(CFG, BATCHES, optimizer=None)


@pytest.fixture(scope="module")
def ranks():
    return run(_all_checks, WORLD, args=(CFG, BATCHES[0]), backend="gloo", timeout_s=120, stream=False).returns


@pytest.mark.parametrize("u", DEGREES)
def test_equals_one_process(ranks, reference, u):
    for r, res in enumerate(ranks):
        row, what = res[u], f"ulysses {u} x ring {WORLD // u}, rank {r}"
        assert row["coords"] == (r // u, r % u), what
        assert row["loss"] == pytest.approx(reference["losses"][0], rel=1e-5, abs=1e-6), what
        torch.testing.assert_close(row["logits"], reference["logits"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: logits {m}")
        assert row["grads"].keys() == reference["first_grads"].keys(), what
        for k, g in reference["first_grads"].items():
            torch.testing.assert_close(row["grads"][k], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: d{k} {m}")


@pytest.mark.parametrize("u", DEGREES)
def test_bytes_and_work_equal_formula(ranks, u):
    comm = hybrid_layer_comm(BATCH, CFG.seq_len, CFG.d_model, WORLD, u)
    assert comm, "every degree here sends something"
    work = theory.context.causal_work_per_rank(CFG.seq_len, WORLD, "balanced", BATCH, CFG.n_head)
    for r, res in enumerate(ranks):
        assert res[u]["comm"] == comm, f"ulysses {u}, rank {r}"
        assert res[u]["work"] == work[r], f"ulysses {u}, rank {r}: attention work"
        assert res[u]["hardware"]


@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_meshes_fail(ranks, reference, wrong):
    row = ranks[0]["wrong"][wrong]
    loss_err = abs(row["loss"] - reference["losses"][0])
    grad_err = max((row["grads"][k] - g).abs().max().item() for k, g in reference["first_grads"].items())
    logit_err = (row["logits"] - reference["logits"]).abs().max().item()
    assert max(loss_err, grad_err, logit_err) > 1e-3, \
        f"{wrong}: loss error {loss_err}, gradient error {grad_err}, logits error {logit_err}"
