"""The 3D planner (lesson 08): its memory checked against the shards PyTorch creates on a fake process group of up to
2,048 ranks, its terms checked one by one (GiB, the position table, the gradient dtype, Korthikanti et al.'s count,
the bubble, the stage that needs the most memory), and its choices checked for the properties a planner must have."""

from __future__ import annotations

import dataclasses
import math

import pytest

from course_lib.config import get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.lessons.l08_three_d.simulate import LAYOUTS, fake_group_shards
from course_lib.theory import comm, pipeline
from course_lib.theory.memory import zero_model_state_bytes
from course_lib.theory.planner import (NOT_MODELLED, Cluster, GiB, Layout, elementwise_bytes, estimate,
                                       gemm_intensity, korthikanti_layer_bytes, layer_activation_bytes, layer_params,
                                       link, model_state_bytes, plan, position_params, stage_params)

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
    assert mem[0] == pytest.approx(18 * stage_params(cfg, 8, 8))            # 2 + 4 + 12: fp32 gradients
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
    assert any("GiB per GPU (first stage) > 80 GiB" in w for w in why)
    assert all(r.feasible for r in rows[:5]) and rows[0].layout.tp == 8
    small = plan(get_preset("gpt2-1.5b"), H100, Cluster("1 node x 8 H100", 1, 8), 64)
    assert small[0].layout.tp == 1 and small[0].layout.pp == 1 and small[0].layout.dp == 8


def test_gpu_memory_is_gib():
    """An "80 GB" A100 holds 80 GiB = 85.9e9 bytes: a layout needing 82e9 bytes fits (it would not at 1e9 per GB);
    one needing 81 GiB does not, and the reason says GiB."""
    assert GiB == 2 ** 30
    cfg, layout = get_preset("gpt3-175b"), Layout(16, 8, 8, 1, "none", 1)
    base = estimate(cfg, A100, IB, layout, 1536, reserve_gib=0).memory["total"]
    fits = estimate(cfg, A100, IB, layout, 1536, reserve_gib=(82e9 - base) / GiB)
    assert fits.memory["total"] == pytest.approx(82e9) and fits.feasible, fits.why
    over = estimate(cfg, A100, IB, layout, 1536, reserve_gib=(81 * GiB - base) / GiB)
    assert not over.feasible and "81.0 GiB per GPU (first stage) > 80 GiB" in over.why


def test_stage_params_hold_the_learned_position_table_whole_on_the_first_stage():
    """GPT-3's 2,048 x 12,288 position table sits on the first stage, whole on every TP rank (replicated, not split):
    0.9-1.8 % of the first stage's parameters per GPU at pp 16-8; RoPE models have none, nor has the last stage."""
    cfg = get_preset("gpt3-175b")
    assert position_params(cfg) == 2048 * 12288
    assert position_params(get_preset("llama3-405b")) == 0
    for tp in (1, 8):
        for pp in (1, 8, 16):
            blocks = math.ceil(96 / pp) * layer_params(cfg)
            vocab = cfg.vocab_size * cfg.d_model
            assert stage_params(cfg, tp, pp) == (blocks + vocab) // tp + 2048 * 12288, (tp, pp)
            assert stage_params(cfg, tp, pp) - stage_params(cfg.replace(pos="rope"), tp, pp) == 2048 * 12288
    assert stage_params(cfg, 8, 16, "last") == (6 * layer_params(cfg) + cfg.vocab_size * cfg.d_model) // 8
    shares = [position_params(cfg) / stage_params(cfg, 8, pp) for pp in (8, 16)]
    assert 0.008 < shares[0] < 0.010 and 0.017 < shares[1] < 0.019, shares


def test_gradient_dtype_is_a_parameter_with_fp32_by_default():
    """2 + 4 + 12 bytes per parameter by default (fp32 gradients, Megatron-LM and Llama 3); ``grad_bytes=2`` is
    lesson 05's 2 + 2 + 12 for every ZeRO stage. DP moves the gradients in their dtype: ZeRO-1 reduce-scatters 4-byte
    gradients and all-gathers 2-byte parameters; with 2-byte gradients that is exactly one all-reduce."""
    for zero in range(4):
        for dp in (1, 8, 64):
            lesson05 = zero_model_state_bytes(1e9, dp, zero)
            mine = model_state_bytes(1e9, dp, zero, grad_bytes=2)
            assert mine == {k: lesson05[k] for k in mine}
    assert model_state_bytes(1, 1, 0)["total"] == 18 and model_state_bytes(1, 12, 1)["total"] == 6 + 12 / 12
    cfg, layout = get_preset("gpt3-175b"), Layout(16, 8, 8, 0, "none", 1)
    for g in (2, 4):
        assert estimate(cfg, A100, IB, layout, 1536, grad_bytes=g).memory["model_states"] == pytest.approx(
            (2 + g + 12) * stage_params(cfg, 8, 8))
    P = stage_params(cfg, 8, 8)
    alpha, bw = link(IB, A100, 8, 16)
    zero1 = {g: estimate(cfg, A100, IB, Layout(16, 8, 8, 1, "none", 1), 1536, grad_bytes=g).time["dp"] for g in (2, 4)}
    assert zero1[2] == pytest.approx(comm.collective_time("all_reduce", 2 * P, 16, alpha, bw))
    assert zero1[4] == pytest.approx(comm.collective_time("reduce_scatter", 4 * P, 16, alpha, bw)
                                     + comm.collective_time("all_gather", 2 * P, 16, alpha, bw))
    zero0 = estimate(cfg, A100, IB, layout, 1536).time["dp"]
    assert zero0 == pytest.approx(comm.collective_time("all_reduce", 4 * P, 16, alpha, bw))


def test_korthikanti_count_against_todays_block():
    """Korthikanti et al. 2022, table 2, for GPT-3 175B at t = 8: 23 sbh with TP, 14.25 sbh with TP + SP, 4.25 sbh
    with TP + SP and selective recomputation; the planner's fused-attention block keeps 4.0 sbh, Llama 3's about 6."""
    cfg = get_preset("gpt3-175b")
    sbh = cfg.seq_len * cfg.d_model
    assert korthikanti_layer_bytes(cfg, 8) / sbh == pytest.approx(14.25)
    assert korthikanti_layer_bytes(cfg, 8, sequence_parallel=False) / sbh == pytest.approx(23.0)
    assert korthikanti_layer_bytes(cfg, 8, selective=True) / sbh == pytest.approx(4.25)
    assert korthikanti_layer_bytes(cfg, 1) / sbh == pytest.approx(34 + 5 * 96 * 2048 / 12288)
    assert sum(layer_activation_bytes(cfg, 8).values()) / sbh == pytest.approx(4.0, abs=0.01)
    for name in ("llama3-70b", "llama3-405b"):
        c = get_preset(name)
        assert 5.5 < sum(layer_activation_bytes(c, 8).values()) / (c.seq_len * c.d_model) < 6.5, name


def test_selective_recomputation_frees_only_the_log_sum_exp():
    """With fused attention, selective recomputation frees the kernel's fp32 log-sum-exp only: 0.1 % of a GPT-3
    layer at t = 8, for the price of recomputing the attention core."""
    cfg = get_preset("gpt3-175b")
    parts = layer_activation_bytes(cfg, 8)
    assert parts["logsumexp"] / sum(parts.values()) < 0.002
    none, sel = (estimate(cfg, A100, IB, Layout(16, 8, 8, 1, c, 1), 1536) for c in ("none", "selective"))
    assert 0 < none.memory["activations"] - sel.memory["activations"] < 0.002 * none.memory["activations"]
    assert sel.time["compute"] > none.time["compute"]


def test_bubble_is_p_minus_1_over_m_of_compute_and_p_minus_1_over_m_plus_p_minus_1_of_the_step():
    cfg = get_preset("gpt3-175b")
    e = estimate(cfg, A100, IB, Layout(16, 8, 8, 1, "none", 1), 1536)
    p, m = 8, e.accum
    assert e.time["bubble"] / e.time["compute"] == pytest.approx((p - 1) / m)
    share = e.time["bubble"] / (e.time["compute"] + e.time["bubble"])
    assert share == pytest.approx((p - 1) / (m + p - 1)) and share == pytest.approx(pipeline.bubble_fraction(p, m))
    assert e.time["bubble"] / e.time["compute"] == pytest.approx(pipeline.bubble_ratio(p, m))


def test_memory_is_the_largest_stage_not_a_sum_of_maxima():
    """The first stage holds min(pp, m) micro-batches and the embedding, the last one micro-batch and the logits:
    memory is that of the stage that needs more. With one micro-batch per step and a 128K vocabulary the last stage
    needs more (Llama 3 405B); with 96 micro-batches the first (GPT-3)."""
    cfg = get_preset("llama3-405b")
    lay = Layout(64, 8, 16, 1, "full", 1)
    e = estimate(cfg, GPU_SPECS["H100"], Cluster("1024 x 8", 1024, 8, 50.0), lay, 64)
    assert e.accum == 1 and e.memory_stage == "last" and e.memory["logits"] > 0
    first = (model_state_bytes(stage_params(cfg, 8, 16), 64, 1)["total"] + e.memory["activations"]
             + e.memory["reserve"])
    assert e.memory["total"] == pytest.approx(first - model_state_bytes(stage_params(cfg, 8, 16), 64, 1)["total"]
                                              + model_state_bytes(stage_params(cfg, 8, 16, "last"), 64, 1)["total"]
                                              + e.memory["logits"])
    assert e.memory["total"] > first
    g = estimate(get_preset("gpt3-175b"), A100, IB, Layout(16, 8, 8, 1, "none", 1), 1536)
    assert g.memory_stage == "first" and g.memory["logits"] == 0
    assert estimate(get_preset("gpt3-175b"), A100, IB, Layout(128, 8, 1, 1, "full", 1), 1536).memory_stage == "only"


def test_kernel_efficiency_is_hfu_and_mfu_is_three_quarters_of_it_with_full_recomputation():
    """The assumed efficiency applies to the FLOPs the GPUs execute; with full recomputation those are 8 per
    parameter per token where the model's are 6, so the step's MFU is 3/4 of its HFU."""
    cfg = get_preset("gpt3-175b")
    e = estimate(cfg, A100, IB, Layout(16, 8, 8, 1, "full", 1), 1536, kernel_efficiency=0.5)
    assert e.hfu == pytest.approx(0.5 * e.time["compute"] / e.time["total"])
    assert e.mfu == pytest.approx(0.75 * e.hfu)
    n = estimate(cfg, A100, IB, Layout(16, 8, 8, 1, "none", 1), 1536, kernel_efficiency=0.5)
    assert n.mfu == pytest.approx(n.hfu)


def test_pipeline_with_zero_2_or_3_is_not_modelled_rather_than_infeasible():
    rows = plan(get_preset("gpt3-175b"), A100, IB, 1536)
    skipped = [r for r in rows if r.status == "not modelled"]
    assert skipped and all(r.layout.pp > 1 and r.layout.zero >= 2 for r in skipped)
    assert all(NOT_MODELLED in r.not_modelled and "torchtitan does it" in r.not_modelled for r in skipped)
    assert not any(r.feasible for r in skipped)
    assert [r.status for r in rows] == sorted((r.status for r in rows),
                                              key=["feasible", "infeasible", "not modelled"].index)
    assert all(r.status != "not modelled" for r in rows if r.layout.pp == 1 or r.layout.zero < 2)


def test_plan_lists_only_tp_that_divides_a_node_and_links_need_groups_inside_a_node():
    """tp = 64 on 8-GPU nodes is never listed (estimate still prices it); a group stays on NVLink only when
    stride x size divides the GPUs per node."""
    rows = plan(get_preset("gpt3-175b"), A100, IB, 1536)
    assert {r.layout.tp for r in rows} == {1, 2, 4, 8}
    wide = estimate(get_preset("gpt3-175b"), A100, IB, Layout(2, 64, 8, 1, "none", 1), 1536)
    assert "tp=64 does not divide n_head=96" in wide.why
    nvlink, network = A100.link_gbs * 1e9, 25.0 * 1e9
    assert link(IB, A100, 1, 8)[1] == nvlink and link(IB, A100, 2, 4)[1] == nvlink
    assert link(IB, A100, 1, 3)[1] == network and link(IB, A100, 2, 3)[1] == network
    assert link(IB, A100, 8, 2)[1] == network


# ------------------------------------------------------------------------------- schedules and overlap (issue 30)

GPT3 = get_preset("gpt3-175b")
WIDE = Cluster("192 nodes x 8 A100", 192, 8, 25.0)


def _gpt3(schedule="1f1b", v=1, overlap="none", ckpt="full", zero=1, batch=1536, **kw):
    return estimate(GPT3, A100, WIDE, Layout(16, 8, 12, zero, ckpt, 1, schedule, v, overlap), batch, **kw)


def test_schedules_change_bubble_memory_and_p2p_as_the_formulas_say():
    """GPT-3 175B, dp 16 x tp 8 x pp 12, m = 96: interleaving divides the bubble by v (`pipeline`'s (p-1)/(v m)),
    holds p + (p-1)/v micro-batches on the first stage instead of p, and sends 2v messages per micro-batch; ZB-H1
    keeps 1F1B's memory and messages and idles (p-1)(t_F + t_B - t_W)."""
    one, inter, zb = _gpt3(), _gpt3("interleaved", 2), _gpt3("zb-h1")
    assert one.feasible and inter.feasible and zb.feasible
    m, p = one.accum, 12
    assert m == 96 and one.time["bubble"] == pytest.approx(one.time["compute"] * (p - 1) / m)
    f = pipeline.interleaved_bubble_fraction(p, m, 2)
    assert inter.time["bubble"] == pytest.approx(inter.time["compute"] * f / (1 - f))
    assert inter.time["bubble"] == pytest.approx(one.time["bubble"] / 2)
    # ZB-H1 with full recomputation: F 2, B 2 + 2 (the recomputed forward), W 2 of 8 parts of a micro-batch
    c = one.time["compute"] / m
    assert zb.time["bubble"] == pytest.approx(pipeline.zero_bubble_idle_time(p, c / 4, c / 2, c / 4))
    assert zb.time["bubble"] == pytest.approx(one.time["bubble"] / 2)
    assert zb.memory["total"] == one.memory["total"] and zb.p2p_messages == one.p2p_messages == 2
    assert one.in_flight == pipeline.peak_microbatches_in_flight("1f1b", p, m) == 12
    assert inter.in_flight == pytest.approx(pipeline.interleaved_in_flight(p, 2, m)) == pytest.approx(12 + 11 / 2)
    layer_input = 2 * GPT3.seq_len * GPT3.d_model / 8                 # full recomputation keeps 2sbh/t per layer
    extra = (inter.in_flight - one.in_flight) * 8 * layer_input     # 8 layers per stage
    assert inter.memory["activations"] - one.memory["activations"] == pytest.approx(extra, rel=1e-6)
    assert inter.p2p_messages == 4 and inter.p2p_bytes == pytest.approx(2 * one.p2p_bytes)
    assert inter.time["pp"] == pytest.approx(2 * one.time["pp"])
    # without recomputation F, B and W are equal: ZB-H1 idles a third of 1F1B
    one_n, zb_n = _gpt3(ckpt="none", zero=0), _gpt3("zb-h1", ckpt="none", zero=0)
    assert zb_n.time["bubble"] == pytest.approx(one_n.time["bubble"] / 3)


def test_interleaving_refuses_what_megatron_refuses():
    """v must divide the layers per stage (96 / pp 12 = 8), m must be a multiple of pp, v needs the interleaved
    schedule, and interleaving needs a pipeline; each reason names the field and the fix."""
    assert "v=3 does not divide the layers per stage" in _gpt3("interleaved", 3).why
    assert "multiple of pp = 12" in _gpt3("interleaved", 2, batch=16 * 18).why              # m = 18
    assert "need schedule='interleaved'" in _gpt3("1f1b", 2).why
    flat = estimate(GPT3, A100, WIDE, Layout(192, 8, 1, 1, "full", 1, "interleaved", 2), 1536)
    assert "interleaved needs pp >= 2" in flat.why
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        _gpt3("gpipe")
    with pytest.raises(ValueError, match="overlap='all'"):
        _gpt3(overlap="all")
    rows = plan(GPT3, A100, WIDE, 1536, zeros=(1,), ckpts=("full",), micro_batches=(1,),
                schedules=("1f1b", "interleaved", "zb-h1"), vs=(2, 3))
    inter = [r for r in rows if r.layout.schedule == "interleaved"]
    assert inter and all(GPT3.n_layer % (r.layout.pp * r.layout.v) == 0 for r in inter)
    assert all(r.layout.schedule == "1f1b" for r in rows if r.layout.pp == 1)


def test_overlap_never_exceeds_the_no_overlap_bound():
    """Overlap hides DP's buckets behind the backward (all but the last bucket, which holds at least the embedding)
    and TP's collectives behind the matmuls; the step with overlap is never longer than the bound without."""
    for zero in (0, 1, 3):
        for ckpt in ("none", "full"):
            base = _gpt3(zero=zero, ckpt=ckpt) if zero < 2 else estimate(
                GPT3, A100, WIDE, Layout(192, 8, 1, 3, ckpt, 1), 1536)
            for ov in ("dp", "dp+tp"):
                lay = dataclasses.replace(base.layout, overlap=ov)
                e = estimate(GPT3, A100, WIDE, lay, 1536)
                assert e.time["total"] <= e.no_overlap_s + 1e-12
                assert e.no_overlap_s == pytest.approx(base.time["total"])
                assert e.exposed["dp"] <= e.time["dp"] and e.exposed["tp"] <= e.time["tp"]
                assert e.exposed["pp"] == e.time["pp"]                 # p2p is not overlapped
                if ov == "dp":
                    assert e.exposed["tp"] == e.time["tp"]
                else:
                    assert e.exposed["tp"] >= e.time["tp"] / 8 - 1e-12  # one chunk of tp stays exposed
        assert base.time["total"] == pytest.approx(base.no_overlap_s)   # no overlap: the bound itself
    # the last bucket cannot hide: plain DDP of a small model on one node keeps at least the embedding's share
    small = get_preset("gpt2-1.5b")
    node = Cluster("1 x 8 A100", 1, 8, None)
    e = estimate(small, A100, node, Layout(8, 1, 1, 0, "none", 1, overlap="dp"), 8)
    share = 4 * small.vocab_size * small.d_model / (4 * stage_params(small, 1, 1))
    assert e.exposed["dp"] >= share * e.time["dp"] - 1e-12 and e.exposed["dp"] < e.time["dp"]


def test_memory_bound_kernels_follow_the_roofline():
    """The elementwise kernels' time is their HBM bytes over the GPU's bandwidth; 'unfused' (2021's block, Korthikanti
    et al.'s count without SP) moves more than 'fused'; every weight matmul of the published shapes sits above the
    A100's ridge point, so the roofline gives them one efficiency."""
    none, fused, unfused = (_gpt3(elementwise=k) for k in ("none", "fused", "unfused"))
    assert none.time["memory_bound"] == 0 == none.time["optimizer"]
    per_layer = elementwise_bytes(GPT3, 8, micro_batch=1, ckpt="full", kernels="unfused")
    assert per_layer == pytest.approx(5 * korthikanti_layer_bytes(GPT3, 8, sequence_parallel=False))
    assert unfused.time["memory_bound"] == pytest.approx(8 * 96 * per_layer / (A100.mem_bw_gbs * 1e9))
    assert unfused.time["memory_bound"] > fused.time["memory_bound"] > 0
    assert fused.time["optimizer"] == pytest.approx(2 * fused.memory["model_states"] / (A100.mem_bw_gbs * 1e9))
    ridge = A100.bf16_tflops * 1e12 / (A100.mem_bw_gbs * 1e9)
    assert gemm_intensity(GPT3, 8) > 3 * ridge
    assert unfused.memory["activations"] > none.memory["activations"]          # no SP in 2021: 2sbh per layer


# ------------------------------------------------------------------------------ context parallelism (issue 31)

LLAMA405 = get_preset("llama3-405b")
RO_CE = Cluster("2048 x 8 H100", 2048, 8, 50.0)


def _cp(cp=16, variant="ring", ckpt="full", dp=8, tp=8, pp=16, seq=131072, cluster=RO_CE, batch=128, **kw):
    return estimate(LLAMA405, H100, cluster, Layout(dp, tp, pp, 1, ckpt, 1, "1f1b", 1, "dp", cp, variant), batch, seq,
                    **kw)


def test_cp_one_changes_nothing():
    """cp = 1 is lesson 08's planner: same label, same numbers, and plan() lists no cp unless asked."""
    for layout in (Layout(16, 8, 12, 1, "full", 1), Layout(16, 8, 12, 0, "none", 2, "interleaved", 2, "dp+tp")):
        one = dataclasses.replace(layout, cp=1, cp_variant="ulysses")      # the variant is moot at cp = 1
        a, b = estimate(GPT3, A100, WIDE, layout, 1536), estimate(GPT3, A100, WIDE, one, 1536)
        assert one.label() == layout.label() and "cp" not in layout.label()
        assert (a.memory, a.time, a.why) == (b.memory, b.time, b.why)
        assert a.time["cp"] == 0 == a.exposed["cp"]
    default = plan(GPT3, A100, IB, 1536, micro_batches=(1,), zeros=(1,))
    assert all(r.layout.cp == 1 for r in default)
    asked = plan(GPT3, A100, IB, 1536, micro_batches=(1,), zeros=(1,), cps=(1, 2))
    assert [r.layout for r in asked if r.layout.cp == 1] == [r.layout for r in default]
    assert any(r.layout.cp == 2 for r in asked) and "cp2" in next(r for r in asked if r.layout.cp == 2).layout.label()


def test_cp_refusals_name_the_field_and_the_fix():
    assert "seq_len=131088 is not divisible by 2 x cp = 32" in _cp(seq=131088).why     # load-balanced split
    assert "use cp=8 or a seq_len multiple of 32" in _cp(seq=131088).why
    why = _cp(cp=16, tp=8, seq=2 * 16 * 4, batch=128).why                            # 8 tokens per CP rank, tp 8
    assert "seq_len/cp = 8 tokens per CP rank are not divisible by tp=8" not in why  # 8 % 8 == 0: fine
    assert "not divisible by tp=8" in _cp(cp=16, tp=8, seq=2 * 16 * 6).why           # 12 tokens per CP rank
    ul = _cp(variant="ulysses").why                                                   # 8 KV heads, tp x cp = 128
    assert "cp_variant='ulysses' needs tp x cp = 128 to divide n_head=128 and n_kv_head=8" in ul
    assert "cp_variant='ring'" in ul
    assert _cp(variant="ulysses", cp=1, dp=128).why == ""                             # no CP, nothing to refuse
    assert "dp x tp x pp x cp = 8192, not the cluster's 16384 GPUs" in _cp(dp=4).why
    with pytest.raises(ValueError, match="cp_variant='zigzag'"):
        _cp(variant="zigzag")
    with pytest.raises(ValueError, match="cp=0 must be a positive int"):
        _cp(cp=0)


def test_cp_divides_activations_and_logits_and_keeps_the_variants_extra():
    """Each GPU holds s/cp tokens: activations (every recomputation choice) and the last stage's logits fall as
    1/cp; the all-gather keeps the whole sequence's K/V (GQA: n_kv_head x head_dim / tp wide), Ulysses its output
    twice; model states are the same parameters sharded over dp x cp."""
    from course_lib.theory import context
    from course_lib.theory.planner import activation_bytes_per_gpu, cp_extra_layer_bytes
    s = 131072
    for ckpt in ("none", "selective", "full"):
        base = activation_bytes_per_gpu(LLAMA405, Layout(8, 8, 16, 1, ckpt, 1), 16, s // 16)  # s/16 tokens, no CP
        for cp in (2, 4, 16):
            layout = Layout(128 // cp, 8, 16, 1, ckpt, 1, cp=cp)
            acts = activation_bytes_per_gpu(LLAMA405, layout, 16, s)
            one = activation_bytes_per_gpu(LLAMA405, Layout(128, 8, 16, 1, ckpt, 1), 16, s)
            assert acts == pytest.approx(one / cp, rel=1e-6), (ckpt, cp)
        assert activation_bytes_per_gpu(LLAMA405, Layout(8, 8, 16, 1, ckpt, 1, cp=16), 16, s) == base
    ring, ag = _cp(ckpt="none"), _cp(ckpt="none", variant="all_gather")
    kv = 2 * s * LLAMA405.n_kv_head * LLAMA405.head_dim // 8 * 2                      # bf16 K and V, 1/tp of them
    assert cp_extra_layer_bytes(LLAMA405, ag.layout, s) == kv
    assert kv == context.extra_activation_bytes("all_gather", 1, s, LLAMA405.d_model // 8, 16, 2,
                                                LLAMA405.n_kv_head * LLAMA405.head_dim // 8)
    assert ag.memory["activations"] - ring.memory["activations"] == pytest.approx(8 * 16 * kv, rel=1e-6)
    ul = Layout(8, 8, 16, 1, "none", 1, cp=16, cp_variant="ulysses")
    assert cp_extra_layer_bytes(LLAMA405, ul, s) == s // 16 * LLAMA405.d_model // 8 * 2
    no_cp = estimate(LLAMA405, H100, RO_CE, Layout(128, 8, 16, 1, "full", 1, "1f1b", 1, "dp"), 128, s)
    assert _cp().memory["model_states"] == pytest.approx(no_cp.memory["model_states"])   # ZeRO over dp x cp = 128
    one_stage = _cp(pp=1, dp=128, batch=2048)                           # pp = 1: the only stage holds the logits
    assert one_stage.memory["logits"] == pytest.approx(8192 * LLAMA405.vocab_size / 8 * 6)   # s/cp = 8,192


def test_cp_exchange_on_the_alpha_beta_model():
    """The K/V bytes are theory.context's; all-gather and Ulysses are exposed whole, the ring hides all but the
    last dK/dV hop when a block's attention outlasts a chunk's transfer (Llama 3 405B at 128K: it does), and less
    as the blocks shrink; the step is never above the no-overlap bound; a CP group inside a node uses NVLink."""
    from course_lib.theory import context
    from course_lib.theory.planner import cp_layer_time, link
    ag = _cp(variant="all_gather", ckpt="none")
    lay = ag.layout
    alpha, bw = link(RO_CE, H100, 8, 16)
    assert bw == 50e9                                                   # tp 8 x cp 16 spans 16 nodes
    whole = 2 * 131072 * 1024 // 8 * 2                                   # K and V of the sequence, 1/tp, bf16
    table = context.layer_comm("all_gather", 1, 131072, LLAMA405.d_model // 8, 16, 2, kv_dim=1024 // 8)
    assert table[("forward", "all_gather")]["bytes"] == whole
    t = cp_layer_time(LLAMA405, H100, RO_CE, lay, 131072)
    assert t["forward"] == pytest.approx(comm.collective_time("all_gather", whole, 16, alpha, bw))
    assert t["forward_exposed"] == t["forward"] and t["backward_exposed"] == t["backward"]
    layers, m = 8, 16
    assert ag.time["cp"] == pytest.approx(layers * m * (t["forward"] + t["backward"]))
    for e in (ag, _cp(variant="all_gather"), _cp(), _cp(ckpt="none")):
        assert e.time["total"] <= e.no_overlap_s + 1e-12 and e.exposed["cp"] <= e.time["cp"] + 1e-12
        assert e.no_overlap_s - e.time["total"] == pytest.approx(
            sum(e.time[k] - e.exposed[k] for k in ("tp", "pp", "dp", "cp")))
    ring = cp_layer_time(LLAMA405, H100, RO_CE, dataclasses.replace(lay, cp_variant="ring"), 131072)
    send = alpha + 2 * 131072 // 16 * 128 * 2 / bw                     # one K/V chunk
    assert ring["forward_exposed"] == 0 and ring["backward_exposed"] == pytest.approx(send)
    assert ring["forward"] == pytest.approx(15 * send) and ring["backward"] == pytest.approx(31 * send)
    short = cp_layer_time(LLAMA405, H100, RO_CE, dataclasses.replace(lay, cp_variant="ring"), 2048)
    assert short["forward_exposed"] > 0                                  # 64-token blocks hide nothing
    node = Cluster("1 x 8 H100", 1, 8, None)
    assert link(node, H100, 2, 4)[1] == H100.link_gbs * 1e9              # tp 2 x cp 4 inside a node
    assert estimate(LLAMA405, H100, node, Layout(1, 2, 1, 3, "full", 1, cp=4), 1, 32768).time["cp"] > 0


def test_cp_ring_exposure_flips_at_the_hiding_condition():
    """The planner's ring hides a step's K/V send exactly when theory.context.ring_hiding_tokens says so: with no
    latency, forward exposure is 0 at tokens per rank >= b F eff (n_kv/n_head) / (2 BW (2cp+1)/(4cp)) and > 0 below
    (one formula, two places: the lesson's condition and the planner's price)."""
    from course_lib.theory import context
    from course_lib.theory.planner import cp_layer_time
    eff, cp, tp = 0.4, 4, 8
    no_latency = Cluster("2 x 8 H100, no latency", 2, 8, 50.0, alpha_us=0.0, inter_alpha_us=0.0)
    lay = Layout(1, tp, 1, 1, "full", 1, cp=cp, cp_variant="ring")
    n_star = context.ring_hiding_tokens(H100.bf16_tflops * 1e12 * eff, 50e9, 2,
                                        LLAMA405.n_kv_head / LLAMA405.n_head, (2 * cp + 1) / (4 * cp))
    c_star = n_star / 2                                                  # a balanced chunk is n/2 tokens
    above, below = 2 * cp * math.ceil(c_star * 1.02), 2 * cp * math.floor(c_star * 0.98)
    assert cp_layer_time(LLAMA405, H100, no_latency, lay, above, eff)["forward_exposed"] == 0
    assert cp_layer_time(LLAMA405, H100, no_latency, lay, below, eff)["forward_exposed"] > 0
    assert context.ring_hiding_tokens(312e12, 300e9, pair_fraction=0.5) == pytest.approx(2080)
