"""Tests of lesson 04's tensor and sequence parallelism (course_lib/parallel/{tensor,sequence,vocab,tensor_model,
tensor_dtensor}.py, lessons/l04_tensor_parallel, course_lib/theory/tensor.py).

One 4-rank launch covers tp = 2 (groups {0, 1}, {2, 3}) and tp = 4, with and without sequence parallelism:
logits, loss and gradients vs one process; collectives counted vs the formula; parameter and activation
bytes per rank vs the formula; own TP vs DTensor parallelize_module; wrong exercise answers fail clearly.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from course_lib import theory
from course_lib.config import ConfigError
from course_lib.runtime.launch import run
from course_lib.lessons.l04_tensor_parallel import checks as tp_checks
from course_lib.lessons.l04_tensor_parallel import experiments as tp_lab
from course_lib.lessons.l04_tensor_parallel.checks import EXERCISES, check_records
from course_lib.parallel.tensor import shard
from course_lib.parallel.tensor_dtensor import permute_qkv_rows
from course_lib.parallel.tensor_model import validate_tensor_parallel

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = tp_lab.tp_config()
BATCH = 2
TPS = (1, 2, 4)


def _all_checks(cfg, batch):
    return dict(report=tp_lab.rank_tp_report(cfg, batch, TPS),
                dtensor=tp_lab.rank_dtensor_compare(cfg, batch, (2, 4)),
                exercises=tp_checks.rank_try_all(tp_checks.reference_impls(), tps=(2, 4)),
                wrong=tp_checks.rank_try_all(tp_checks.wrong_impls(), tps=(2,)))


@pytest.fixture(scope="module")
def four_ranks():
    return run(_all_checks, nprocs=4, args=(CFG, BATCH), timeout_s=300, stream=False, backend="gloo").returns


# ------------------------------------------------------------------------------ single process

def test_config_validation_names_field_and_fix():
    validate_tensor_parallel(CFG, 4, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"tp=3 does not divide n_head=4: pick tp in \{1, 2, 4\}"):
        validate_tensor_parallel(CFG, 3)
    with pytest.raises(ConfigError, match="does not divide d_ff"):
        validate_tensor_parallel(tp_lab.tp_config(d_ff=100, n_head=8), 8)
    with pytest.raises(ConfigError, match="does not divide vocab_size=66"):
        validate_tensor_parallel(tp_lab.tp_config(vocab_size=66), 4)
    with pytest.raises(ConfigError, match="does not divide seq_len=18"):
        validate_tensor_parallel(tp_lab.tp_config(seq_len=18), 4, sequence_parallel=True)


def test_shard_and_qkv_permutation_agree():
    w = torch.arange(3 * 8 * 2.0).view(24, 2)                     # q, k, v of 8 rows each
    for tp in (1, 2, 4):
        parts = [shard(w, 0, r, tp, n_fused=3) for r in range(tp)]
        assert torch.equal(torch.cat(parts), permute_qkv_rows(w, tp))   # rank r's block = [q_r; k_r; v_r]
        assert torch.equal(torch.cat([shard(w.t(), 1, r, tp) for r in range(tp)], 1), w.t())


def test_theory_tables():
    assert theory.tensor.layer_collectives(CFG, BATCH, 16, 1) == {}
    s = BATCH * 16 * CFG.d_model * 4
    assert theory.tensor.layer_collectives(CFG, BATCH, 16, 2) == {("forward", "all_reduce"): {"calls": 2, "bytes": 2 * s},
                                                       ("backward", "all_reduce"): {"calls": 2, "bytes": 2 * s}}
    tp_table, sp_table = (theory.tensor.layer_collectives(CFG, BATCH, 16, 4, sp) for sp in (False, True))
    fwd = lambda t: theory.tensor.bytes_sent_per_rank({k: v for k, v in t.items() if k[0] == "forward"}, 4)  # noqa: E731
    assert fwd(tp_table) == fwd(sp_table) == 2 * 2 * 3 / 4 * s    # an all-reduce = reduce-scatter + all-gather
    for tp in (1, 2, 4):                                          # SP divides every activation by tp
        assert theory.tensor.activation_bytes_per_layer(CFG, BATCH, 16, tp, True) * tp == theory.tensor.activation_bytes_per_layer(CFG, BATCH, 16)
    assert theory.tensor.param_counts_per_rank(CFG, 1)["total"] == CFG.num_params()


# ------------------------------------------------------------------------------ four ranks

@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("sp", [False, True])
def test_equals_one_process(four_ranks, tp, sp):
    for rank, rows in enumerate(four_ranks):
        row = next(r for r in rows["report"] if r["tp"] == tp and r["sp"] == sp)
        what = f"tp={tp} sp={sp} rank {rank}"
        assert row["logits_err"] < 1e-6, f"{what}: logits differ by {row['logits_err']}"
        assert row["loss_err"] < 2e-6, f"{what}: loss differs by {row['loss_err']}"
        assert row["grad_err"] < 2e-6, f"{what}: gradients differ (relative {row['grad_err']})"


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("sp", [False, True])
def test_collectives_and_memory_equal_formula(four_ranks, tp, sp):
    for rank, rows in enumerate(four_ranks):
        row = next(r for r in rows["report"] if r["tp"] == tp and r["sp"] == sp)
        comm = {k: v for k, v in row["comm"].items() if k[0] != "grad sync"}
        assert comm == theory.tensor.model_collectives(CFG, BATCH, CFG.seq_len, tp, sp), f"tp={tp} sp={sp} rank {rank}"
        assert row["layer_comm"] == theory.tensor.layer_collectives(CFG, BATCH, CFG.seq_len, tp, sp)
        assert row["param_bytes"] == theory.tensor.param_bytes_per_rank(CFG, tp)
        assert row["act_bytes"] == theory.tensor.activation_bytes_per_layer(CFG, BATCH, CFG.seq_len, tp, sp)
        assert ("grad sync", "all_reduce") in row["comm"] if sp and tp > 1 else "grad sync" not in str(row["comm"])


def test_sequence_parallel_saves_activation_memory(four_ranks):
    rows = four_ranks[0]["report"]
    act = {(r["tp"], r["sp"]): r["act_bytes"] for r in rows}
    assert act[(1, False)] == act[(1, True)]
    assert act[(4, True)] * 4 == act[(1, False)]                  # every activation divided by tp
    assert act[(4, True)] < act[(4, False)] < act[(2, False)] < act[(1, False)]


def test_own_tp_equals_dtensor(four_ranks):
    for rank, ranks_rows in enumerate(four_ranks):
        for row in ranks_rows["dtensor"]:
            what = f"tp={row['tp']} sp={row['sp']} ({row['what']}) rank {rank}"
            assert row["out_ours_vs_theirs"] < 1e-6, what
            assert row["out_vs_ref"] < 1e-6 and row["grad_vs_ref"] < 2e-6, what
            if row["sp"]:
                assert row["grad_ours_vs_ref"] < 2e-6 and row["xgrad_ours_vs_ref"] < 1e-6, what
                assert row["xgrad_theirs_vs_ref"] < 1e-6, what
            else:
                assert row["loss_ours_vs_theirs"] < 2e-6 and row["grad_ours_vs_theirs"] < 2e-6, what


def test_exercise_checks_pass_the_reference(four_ranks):
    returns = [r["exercises"] for r in four_ranks]
    for exercise in EXERCISES.values():
        assert check_records(returns, exercise) > 4 * 2          # 4 ranks, tp 2 and 4, several checks each


WRONG = {  # variant -> words the first failing check's message must contain
    "missing all-reduce": ["collectives in backward", "expected {'all_reduce': 1}, got {}", "all-reduce the input gradient"],
    "all-reduce in forward": ["collectives in forward", "expected {}, got {'all_reduce': 1}", "identity in forward"],
    "wrong shard dim": ["shape of the weight shard", "expected [8, 12], got [16, 6]", "OUTPUT features"],
    "column layer": ["shape of the weight shard", "INPUT features"],
    "row layers": ["runs without error"],
    "local softmax": ["loss = F.cross_entropy of the full logits", "ALL ranks"],
}


@pytest.mark.parametrize("variant", list(WRONG))
def test_wrong_answers_fail_with_a_clear_message(four_ranks, variant):
    from course_lib.grading.check import CheckFailed

    records = [[r for r in ranks["wrong"] if r["variant"] == variant] for ranks in four_ranks]
    with pytest.raises(CheckFailed) as info:
        check_records(records, records[0][0]["exercise"])
    msg = str(info.value)
    assert "\n" not in msg and "tp=2, rank 0" in msg
    for words in WRONG[variant]:
        assert words in msg, msg


def test_launch_reuses_only_the_same_answers(monkeypatch):
    """The test cells after the first of a launch reuse its records only for the very same answer objects, so each
    exercise's cells also run on their own (tests/test_mistakes.py) and an answer cell run again is launched again."""
    calls = []
    monkeypatch.setattr(tp_checks, "run", lambda fn, nprocs, args, **kw: calls.append(args[0]) or object())
    monkeypatch.setattr(tp_checks, "_LAUNCHES", [])
    col, row, f = (lambda: 0), (lambda: 0), (lambda: 0)
    first = tp_checks.launch({"column": col, "row": row}, 4, "gloo", helpers=(f,))
    assert tp_checks.launch({"column": col, "row": row}, 4, "gloo", helpers=(f,), reuse=True) is first
    assert len(calls) == 1 and calls[0] == {"column": col, "row": row}
    assert tp_checks.launch({"column": col, "row": (lambda: 0)}, 4, "gloo", helpers=(f,), reuse=True) is not first
    assert tp_checks.launch({"column": col, "row": row}, 4, "gloo", helpers=((lambda: 0),), reuse=True) is not first
    assert tp_checks.launch({"column": col, "row": row}, 2, "gloo", helpers=(f,), reuse=True) is not first
    assert tp_checks.launch({"column": col, "row": row}, 4, "gloo", helpers=(f,)) is not first   # the first cell
    assert len(calls) == 5
