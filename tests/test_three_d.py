"""3D parallelism from the course's pieces (lesson 08): 8 gloo ranks as dp 2 x pp 2 x tp 2 train a GPT for 3 steps
and must equal one process on the global batch (losses and every parameter shard), with plain data parallelism
and with ZeRO-1 over the dp group, and with sequence parallelism in the tp group."""

from __future__ import annotations

import pytest

from course_lib.config import small_config
from course_lib.runtime.launch import run, run_nodes
from course_lib.lessons.l08_three_d.experiments import rank_3d_comm, rank_torch_3d

# fp32; the only differences from one process are the orders of sums (TP's all-reduce, DP's average, micro-batches).
TOL = 1e-5
CFG = small_config(n_layer=4, tie_embeddings=False)
STEPS, BATCH, M, LR = 3, 8, 2, 0.1


VARIANTS = (("ddp", False), ("zero1", False), ("zero1", True))       # (data parallelism, sequence parallelism)


def _rank_both() -> list[dict]:
    return [rank_3d_comm(CFG, 2, 2, 2, BATCH, M, STEPS, dp_kind, lr=LR, sequence_parallel=sp)
            for dp_kind, sp in VARIANTS]


@pytest.fixture(scope="module")
def one_launcher():
    return run(_rank_both, nprocs=8, backend="gloo", timeout_s=300, stream=False)


def test_3d_on_8_gloo_ranks_equals_one_process_and_moves_what_the_formulas_say(one_launcher):
    """Losses and every parameter shard equal one process; the bytes each dimension moved on each rank (TP's
    all-reduces, PP's messages, DP's gradient all-reduce or ZeRO-1's reduce-scatter + all-gather) equal lessons
    02-05's formulas exactly."""
    res = one_launcher
    for variant in range(len(VARIANTS)):
        outs = [r[variant] for r in res.returns]
        for out in outs:
            assert out["param_err"] < TOL, (variant, out["coords"], out["param_err"])
            assert out["counted"] == out["formula"] and min(out["counted"].values()) > 0, (variant, out)
        last = [o for o in outs if o["coords"]["pp"] == 1]          # the last stage holds the losses
        assert len(last) == 4
        for step in range(STEPS):
            mean = sum(o["losses"][step] for o in last) / len(last)  # 2 tp copies x 2 dp halves
            ref = outs[0]["ref_losses"][step]
            assert abs(mean - ref) <= TOL * abs(ref), (variant, step, mean, ref)
        assert all(o["losses"] == [None] * STEPS for o in outs if o["coords"]["pp"] == 0)
    for r in res.returns:                       # sequence parallelism: each TP rank sends its half of the sequence
        assert r[2]["counted"]["pp"] * 2 == r[1]["counted"]["pp"] and r[2]["counted"]["dp"] == r[1]["counted"]["dp"]


def _rank_ddp() -> dict:
    return rank_3d_comm(CFG, 2, 2, 2, BATCH, M, STEPS, "ddp", lr=LR)


def test_3d_on_two_nodes_of_4_equals_one_launcher_of_8(one_launcher):
    """The README's multi-node command on one machine: two launchers of 4 ranks meeting in a c10d rendezvous give
    bit for bit what one launcher of 8 gives (the same ranks, groups and order of sums)."""
    one = [r[0] for r in one_launcher.returns]                      # the "ddp" run
    two = run_nodes(_rank_ddp, 2, 4, backend="gloo", timeout_s=300, stream=False)
    for key in ("losses", "param_err", "counted"):
        assert [r[key] for r in two.returns] == [r[key] for r in one], key
    assert max(r["param_err"] for r in two.returns) < TOL


def _rank_torch_3d(dp: int, pp: int, tp: int) -> dict:
    return rank_torch_3d(CFG, dp, pp, tp, BATCH, M, STEPS, lr=LR)


def test_3d_with_pytorch_pieces_equals_one_process():
    """torchtitan's composition on 8 gloo ranks (2 x 2 x 2): equal to one process within the same tolerance."""
    res = run(_rank_torch_3d, nprocs=8, args=(2, 2, 2), backend="gloo", timeout_s=300, stream=False)
    for out in res.returns:
        assert out["n_params"] > 0 and out["param_err"] < TOL, (out["pp"], out["param_err"])
    last = [o for o in res.returns if o["pp"] == 1]
    for step in range(STEPS):
        mean = sum(o["losses"][step] for o in last) / len(last)
        ref = res.returns[0]["ref_losses"][step]
        assert abs(mean - ref) <= TOL * abs(ref), (step, mean, ref)
