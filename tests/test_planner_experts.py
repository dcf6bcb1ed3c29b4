"""The planner learns expert parallelism (issue 32, part 3): ep = 1 changes nothing, refusals name the field, the
experts' bytes scale 1/ep, DeepSeek-V3's layout is feasible and ranked, and the parameter bytes per GPU agree with
EP x FSDP2 shards on a fake process group."""

import dataclasses

import pytest

from course_lib.config import get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.lessons.l08_three_d import published
from course_lib.theory import experts, planner
from course_lib.theory.planner import Cluster, Layout, MoESpec, estimate

DS, DS_MOE = published.DEEPSEEK_V3_MHA, published.DEEPSEEK_V3_MOE
H800 = GPU_SPECS["H800"]
CLUSTER = published.DEEPSEEK_V3.cluster


def test_ep_1_changes_nothing():
    cfg, gpu = get_preset("gpt3-175b"), GPU_SPECS["A100"]
    cl = Cluster("128 x 8", 128, 8, 25.0)
    for lay in (Layout(16, 8, 8, 1, "full"), Layout(16, 8, 8, 0, "none", 1, "zb-h1", overlap="dp")):
        a = estimate(cfg, gpu, cl, lay, 1536, elementwise="fused")
        b = estimate(cfg, gpu, cl, dataclasses.replace(lay, ep=1), 1536, elementwise="fused", moe=None)
        assert a.time == b.time and a.memory == b.memory and a.why == b.why and "ep" not in a.time
        assert lay.label() == dataclasses.replace(lay, ep=1).label()


def test_ep_refusals_name_the_field():
    dense = estimate(DS, H800, CLUSTER, Layout(128, 1, 16, ep=2), 15360)
    assert "ep=2 needs a mixture-of-experts model" in dense.why and "moe=MoESpec" in dense.why
    bad = estimate(DS, H800, CLUSTER, Layout(128, 1, 16, ep=3), 15360, moe=DS_MOE)
    assert "n_experts=256 is not divisible by ep=3" in bad.why and "ep=3 does not divide dp x cp" in bad.why
    big = estimate(DS, H800, CLUSTER, Layout(128, 1, 16, ep=256), 15360, moe=DS_MOE)
    assert "ep=256 does not divide dp x cp = 128 x 1 = 128" in big.why
    with pytest.raises(ValueError, match="ep=0"):
        estimate(DS, H800, CLUSTER, Layout(128, 1, 16, ep=0), 15360, moe=DS_MOE)
    assert not planner.ep_refusals(Layout(128, 1, 16, ep=64), DS_MOE)


def test_expert_params_scale_one_over_ep():
    split = planner.moe_stage_params(DS, DS_MOE, 1, 16, "last")
    assert split["experts"] == 4 * 3 * 7168 * 2048 * 256                 # 4 MoE blocks on the last stage
    first = planner.moe_stage_params(DS, DS_MOE, 1, 16, "first")
    assert first["experts"] == 1 * 3 * 7168 * 2048 * 256                 # blocks 0-3: 3 dense, 1 MoE
    assert DS_MOE.total_params(DS) / 1e9 == pytest.approx(671, rel=0.01)   # 671B total (MLA at the report's dimensions)
    assert DS_MOE.active_matmul_params(DS) / 1e9 == pytest.approx(37, rel=0.05)
    from course_lib.lessons.l08_three_d.simulate_experts import MIXTRAL_MOE, MIXTRAL_SHAPE
    one = planner.moe_stage_params(MIXTRAL_SHAPE, MIXTRAL_MOE, 1, 1)["experts"]   # one stage: pp = 1
    for zero, per_param in ((0, 18), (3, 18)):
        states = {ep: estimate(MIXTRAL_SHAPE, H800, Cluster("32 x 8", 32, 8, 50.0), Layout(256, 1, 1, zero, "full",
                               ep=ep), 256, moe=MIXTRAL_MOE).memory["model_states"] for ep in (1, 2, 8)}
        expert_dp = {1: 256, 2: 128, 8: 32} if zero == 3 else {1: 1, 2: 1, 8: 1}
        dense = states[1] - per_param * one / expert_dp[1]
        for ep in (2, 8):                                                 # / ep, and ZeRO-3 over dp / ep
            assert states[ep] - dense == pytest.approx(per_param * one / ep / expert_dp[ep], rel=1e-9)
    # all-to-all bytes: theory.experts' uniform formula, (ep-1)/ep of the payload leaves the rank
    t = planner.ep_layer_time(DS, H800, CLUSTER, Layout(128, 1, 16, ep=64), DS_MOE, 4096)
    leaving = experts.uniform_layer_comm(4096, 8, 7168, 64, 2)["leaving"]
    assert t == pytest.approx(63 * 20e-6 + leaving / 50e9)              # across nodes: tp x ep = 64 > 8
    inside = planner.ep_layer_time(DS, H800, CLUSTER, Layout(128, 1, 16, ep=8), DS_MOE, 4096)
    assert inside == pytest.approx(7 * 10e-6 + experts.uniform_layer_comm(4096, 8, 7168, 8, 2)["leaving"] / 200e9)


def test_deepseek_v3_is_feasible_and_ranked():
    run = published.DEEPSEEK_V3
    assert published.predict(run, 0.4).feasible
    out = published.moe_run(run, 0.4)
    assert out["row"].feasible and 1 <= out["rank"] <= out["n_feasible"]
    assert out["row"].layout.ep == 64 and out["row"].time["ep"] > 0
    assert "{" not in out["why"] and "DualPipe" in out["why"]
    assert run.stated_mfu == pytest.approx(0.455, abs=0.005)            # derived from tokens and GPU hours (bf16 peak)


def test_fake_group_ep_params_within_2_percent():
    from course_lib.lessons.l08_three_d import simulate_experts
    (row,) = simulate_experts.fake_group_ep_params(((256, 8),))
    assert row["dp"] == 256 and row["ep"] == 8 and row["edp"] == 32
    assert abs(row["error"]) < 0.02
    assert row["shard_expert_bytes"] == pytest.approx(row["planner_expert_bytes"], rel=1e-9)
