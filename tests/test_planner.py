"""The 3D planner (lesson 08): its memory checked against the shards PyTorch creates on a fake process group of up to
2,048 ranks, and its choices checked for the properties a planner must have."""

from __future__ import annotations

import pytest

from course_lib.config import get_preset
from course_lib.lessons.l08_three_d.simulate import LAYOUTS, fake_group_shards
from course_lib.measure import GPU_SPECS
from course_lib.theory.planner import Cluster, Layout, estimate, plan, stage_params

A100, H100 = GPU_SPECS["A100"], GPU_SPECS["H100"]
IB = Cluster("128 nodes x 8 A100, InfiniBand 200 Gb/s per GPU", 128, 8, 25.0)


def test_planner_model_states_equal_fake_group_shards_within_2_percent():
    """GPT-3 175B (the course's GPT), Llama-3-70B and -405B (transformers' Llama), DTensor TP x FSDP2 on fake groups
    of 512-2,048 ranks: the parameters each rank holds equal the planner's stage parameters / dp within 2 %."""
    rows = fake_group_shards()
    assert [(r["model"], r["world"], r["tp"], r["pp"]) for r in rows] == [tuple(x) for x in LAYOUTS]
    for r in rows:
        assert abs(r["error"]) < 0.02, r
    assert {r["model"] for r in rows if r["world"] >= 1024} == {"gpt3-175b", "llama3-70b", "llama3-405b"}


def test_memory_falls_with_zero_stage_and_checkpointing():
    cfg = get_preset("gpt3-175b")
    mem = {z: estimate(cfg, A100, IB, Layout(16, 8, 8, z, "none", 1), 1536).memory["model_states"] for z in (0, 1)}
    assert mem[1] < mem[0]
    assert mem[0] == pytest.approx(16 * stage_params(cfg, 8, 8))
    acts = [estimate(cfg, A100, IB, Layout(16, 8, 8, 1, c, 1), 1536).memory["activations"]
            for c in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_bubble_and_links():
    cfg = get_preset("gpt3-175b")
    e = estimate(cfg, A100, IB, Layout(16, 8, 8, 1, "selective", 1), 1536)
    assert e.accum == 96 and e.time["bubble"] == pytest.approx(e.time["compute"] * 7 / 96)
    layout = Layout(8, 16, 8, 1, "selective", 1)
    in_node = estimate(cfg, A100, Cluster("64 nodes x 16", 64, 16, 25.0), layout, 1536).time["tp"]
    two_nodes = estimate(cfg, A100, IB, layout, 1536).time["tp"]      # TP 16 over 8-GPU nodes: InfiniBand
    assert two_nodes > 5 * in_node


def test_infeasible_layouts_say_why_and_small_models_need_only_data_parallelism():
    cfg = get_preset("gpt3-175b")
    rows = plan(cfg, A100, IB, 1536)
    why = {r.why for r in rows if not r.feasible}
    assert any("GB per GPU > 80 GB" in w for w in why)
    assert any("ZeRO-2 with a pipeline" in w for w in why)
    assert all(r.feasible for r in rows[:5]) and rows[0].layout.tp == 8
    small = plan(get_preset("gpt2-1.5b"), H100, Cluster("1 node x 8 H100", 1, 8), 64)
    assert small[0].layout.tp == 1 and small[0].layout.pp == 1 and small[0].layout.dp == 8
