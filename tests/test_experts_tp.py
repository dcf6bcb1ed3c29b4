"""Tests of expert tensor parallelism and EP x ETP (course_lib/parallel/experts_tp.py, course_lib/theory/experts_tp.py).

One launch per world size (gloo): 2 ranks (ep 1 x etp 2) and 4 ranks (ep 2 x etp 2), the tiny GPT with a MoE layer
(4 experts, top-2) in every block: losses, the first gradients of every parameter and the parameters after 3 SGD
steps == one process on the global batch (rtol 1e-5, atol 1e-6); bytes of every all-to-all and all-reduce per layer
== `theory.experts_tp.layer_comm` for the routing that happened, and the collectives of the whole step add up to
them. Wrong variants fail: no all-reduce after the row-parallel w2 (the loss differs), no all-reduce of the rows'
gradient before w1, w3 (the loss agrees, the router's and attention's gradients do not), w2 sliced along F but from
another rank's features (the loss differs), w2 split along C instead of F (refused by the shapes). The arrangement of
the groups and the validation messages are checked without ranks.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest
import torch

from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.lessons.l11_experts.expert_tp import moe_model
from course_lib.one_process import train_reference
from course_lib.parallel.experts_tp import expert_tp_layout, validate_expert_tensor_parallel
from course_lib.parallel.moe import moe_loss
from course_lib.runtime.launch import run
from course_lib.theory import experts_tp as theory_tp

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(get_preset("tiny"), seq_len=16)     # 2 layers, d_model 64
BATCH, STEPS, LR, E, TOP_K, F_EXPERT, ALPHA = 4, 3, 0.3, 4, 2, 32, 0.1
BATCHES = random_batches(CFG, BATCH, STEPS, seed=0)
WRONG = ("no all-reduce after w2", "no all-reduce of the rows' gradient", "w2 from another rank's features")


def _moe_model(cfg, groups, dev="cpu"):
    return moe_model(cfg, E, TOP_K, F_EXPERT, ALPHA, groups, dev)


def _patched(variant):
    """{module attribute: wrong replacement} of a wrong variant (set inside a rank, restored after)."""
    from course_lib.parallel import experts_tp

    real = experts_tp.expert_shard

    def other_rank(full, first, n, t, etp):                 # w2 sliced along F, but another rank's features
        w1, w3, _ = real(full, first, n, t, etp)
        return w1, w3, real(full, first, n, (t + 1) % etp, etp)[2]

    def along_c(full, first, n, t, etp):                    # w2 (E, C, F) split along C: (n, C/etp, F)
        w1, w3, _ = real(full, first, n, t, etp)
        c = full.w2.shape[1] // etp
        return w1, w3, full.w2[first:first + n, t * c:(t + 1) * c].clone()

    return {None: {}, WRONG[0]: {"leave_experts": lambda y, group, counter: y},
            WRONG[1]: {"enter_experts": lambda x, group, counter: x},
            WRONG[2]: {"expert_shard": other_rank}, "w2 along C": {"expert_shard": along_c}}[variant]


def _run(cfg, batches, ep, etp, lr, variant=None):
    """The lesson's `rank_expert_tp` with a wrong variant's replacements set in `experts_tp` (restored after)."""
    from course_lib.lessons.l11_experts.expert_tp import rank_expert_tp
    from course_lib.parallel import experts_tp

    saved = {name: getattr(experts_tp, name) for name in _patched(variant)}
    try:
        for name, wrong in _patched(variant).items():
            setattr(experts_tp, name, wrong)
        return rank_expert_tp(cfg, batches, ep, etp, lr, E, TOP_K, F_EXPERT, ALPHA)
    finally:
        for name, real in saved.items():
            setattr(experts_tp, name, real)


def _all_runs(cfg, batches, lr, world):
    ep = world // 2
    out = {"right": _run(cfg, batches, ep, 2, lr)}
    for variant in (*WRONG, "w2 along C"):
        out[variant] = _run(cfg, batches[:1], ep, 2, lr, variant)
    return out


@pytest.fixture(scope="module")
def ranks():
    """{world size: every rank's results}: one launch per world size (2: ep 1 x etp 2; 4: ep 2 x etp 2)."""
    return {n: run(_all_runs, nprocs=n, args=(CFG, BATCHES, LR, n), timeout_s=300, stream=False,
                   backend="gloo").returns for n in (2, 4)}


@pytest.fixture(scope="module")
def references():
    """One process on the global batch, one balancing group per data rank (dp = world / etp)."""
    return {dp: train_reference(CFG, BATCHES, "sgd", LR, model=_moe_model(CFG, dp), loss_fn=moe_loss)
            for dp in (1, 2)}


def _shard(name, full, row, world):
    """The slice of a one-process tensor that a rank holds: experts ep_rank E/ep .., features etp_rank F/2 .."""
    if ".experts." not in name:
        return full
    ep, etp = world // 2, 2
    n, f = E // ep, F_EXPERT // etp
    j, t = row["ep_rank"], row["etp_rank"]
    full = full[j * n:(j + 1) * n]                                 # (E, ...) -> (E/ep, ...)
    return full[:, :, t * f:(t + 1) * f] if name.endswith("w2") else full[:, t * f:(t + 1) * f]


@pytest.mark.parametrize("world", [2, 4])
def test_ep_x_etp_equals_one_process(ranks, references, world):
    ref = references[world // 2]
    for res in ranks[world]:
        row = res["right"]
        what = f"ep {world // 2} x etp 2, rank {row['rank']}"
        assert row["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6), what
        for part in ("first_grads", "params"):
            assert row[part].keys() == ref[part].keys(), what
            for name, full in ref[part].items():
                torch.testing.assert_close(row[part][name], _shard(name, full, row, world), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what}: {part} {name}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_groups_are_the_layout(ranks, world):
    layout = expert_tp_layout(world, world // 2, 2)
    for res in ranks[world]:
        row = res["right"]
        for kind, mine in row["groups"].items():
            assert mine in layout[kind] and row["rank"] in mine, f"rank {row['rank']}: {kind} group {mine}"
    if world == 4:
        assert layout == {"etp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "ep": [[0, 2], [1, 3]],
                          "edp": [[0], [1], [2], [3]]}


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_equal_formula(ranks, world):
    ep = world // 2
    for res in ranks[world]:
        row = res["right"]
        members = [r["right"] for r in ranks[world] if r["right"]["rank"] in row["groups"]["ep"]]
        members.sort(key=lambda r: r["ep_rank"])
        for layer, table in enumerate(row["comm"]):
            M = [m["sent"][layer] for m in members]                # (ep, E) rows each ep rank sent per expert
            want = theory_tp.layer_comm(M, row["ep_rank"], CFG.d_model, etp=2)
            assert table == want, f"world {world} rank {row['rank']} layer {layer}"
            assert (("forward", "dispatch") in table) == (ep > 1) and ("forward", "all_reduce") in table
        for op, mine in (("all_to_all_single", ("counts", "dispatch", "combine")), ("all_reduce", ("all_reduce",))):
            for phase in ("forward", "backward"):                  # the whole step's collectives: the layers' only
                counted = row["collectives"].get((phase, op), {"bytes": 0})["bytes"]
                assert counted == sum(v["bytes"] for t in row["comm"] for (ph, o), v in t.items()
                                      if ph == phase and o in mine), f"{op} {phase}, world {world}"


@pytest.mark.parametrize("world", [2, 4])
def test_wrong_variants_fail(ranks, references, world):
    """Each wrong variant fails the check the right one passes: its first loss or its first dense gradients (at
    init the experts add little to the loss: 1.8e-4 without g, 5e-4 with w2's wrong features; 0 without f, whose
    dense gradients are off by 1e-2)."""
    ref = references[world // 2]
    for res in ranks[world]:
        for variant in WRONG:
            row = res[variant]
            same_loss = row["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-5, abs=1e-6)
            assert same_loss == (variant == WRONG[1]), f"{variant}: loss {row['losses'][0]} vs {ref['losses'][0]}"
            wrong = [name for name, g in ref["first_grads"].items()
                     if ".experts." not in name and (row["first_grads"][name] - g).abs().max() > 1e-3]
            assert any(".attn." in name for name in wrong), f"{variant}: the dense gradients agree"
        assert "size" in res["w2 along C"]["error"], res["w2 along C"]      # (n, C/etp, F) into (n, C, F/etp)


def test_validation_names_field_and_fix():
    validate_expert_tensor_parallel(4, 32, 2, 2, 4)
    with pytest.raises(ValueError, match=r"d_ff=30 is not divisible by etp=4 .* pick etp in \{1, 2, 3, 5, 6, 10"):
        validate_expert_tensor_parallel(4, 30, 1, 4, 4)
    with pytest.raises(ValueError, match=r"n_experts=6 is not divisible by ep=4 .* pick ep in \{1, 2, 3, 6\}"):
        validate_expert_tensor_parallel(6, 32, 4, 2, 8)
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by ep x etp = 2 x 2 = 4"):
        validate_expert_tensor_parallel(4, 32, 2, 2, 6)
    with pytest.raises(ValueError, match=r"etp=0 must be a positive int"):
        validate_expert_tensor_parallel(4, 32, 2, 0, 4)


def test_formulas():
    assert theory_tp.expert_params_per_rank(64, 32, 4, ep=2, etp=2) == 3 * 64 * 32 * 4 // 4
    M = [[2, 2, 2, 2], [2, 2, 2, 2]]                     # uniform: T k = 8 rows a rank, 2 per expert
    uni = theory_tp.uniform_layer_comm(4, 2, 16, ep=2, etp=2)
    table = theory_tp.layer_comm(M, 0, 16, etp=2)
    assert table[("forward", "all_reduce")]["bytes"] == uni["all_reduce"] == table[("forward", "dispatch")]["bytes"]
    assert uni["all_reduce_sent"] == uni["all_reduce"] and theory_tp.layer_comm(M, 0, 16, etp=1) == \
        {k: v for k, v in table.items() if k[1] != "all_reduce"}
    assert theory_tp.layer_comm([[3, 5]], 0, 16, etp=2) == {(p, "all_reduce"): {"calls": 1, "bytes": 8 * 16 * 4}
                                                            for p in ("forward", "backward")}
