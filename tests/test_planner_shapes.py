"""The planner's block choices and its matmuls by shape (issue 44): sequence parallelism apart from the attention
kernel, with Korthikanti et al.'s counts for each combination; every published layout feasible where its source
states it; tile and wave quantization and the roofline per GEMM; the LM head never recomputed; experts' GEMMs by
their tokens per expert. Constructed cases; no hardware measured."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from course_lib.config import get_preset
from course_lib.lessons.l08_three_d import published
from course_lib.lessons.l08_three_d.throughput import layout_of
from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory import flops
from course_lib.theory.planner import (CKPT, Cluster, Gemm, Layout, activation_bytes_per_gpu, block_of, estimate,
                                       gemm_seconds, implied_efficiency, korthikanti_layer_bytes, layer_gemms,
                                       layer_kept_bytes, matmul_seconds, quantization)

A100 = GPU_SPECS["A100"]
GPT3 = get_preset("gpt3-175b")


# ------------------------------------------------------------------ sequence parallelism and the attention kernel

def test_block_defaults_keep_what_elementwise_always_meant():
    lay = Layout(8, 8, 1)
    assert block_of(lay, "unfused") == (False, "naive")
    assert block_of(lay, "fused") == block_of(lay, "none") == (True, "flash")
    assert block_of(dataclasses.replace(lay, sp=True, attention="naive"), "unfused") == (True, "naive")
    assert "sp=on attention=naive" in dataclasses.replace(lay, sp=True, attention="naive").label()


@pytest.mark.parametrize("field, value", [("sp", "yes"), ("attention", "flash2")])
def test_block_fields_refuse_a_value_that_is_no_choice(field, value):
    lay = dataclasses.replace(Layout(64, 8, 1), **{field: value})
    with pytest.raises(ValueError, match=field):
        estimate(GPT3, A100, Cluster("64 x 8", 64, 8, 25.0), lay, 512)


@pytest.mark.parametrize("sp, ckpt", itertools.product((False, True), ("none", "selective")))
def test_naive_attention_counts_korthikanti_table_2_for_each_combination(sp, ckpt):
    """Korthikanti et al. 2022, table 2 at GPT-3 175B, t = 8: TP 23 sbh, TP + SP 14.25, TP + selective 13, TP + SP
    + selective 4.25 (sbh (10 + 24/t + 5as/(ht)), (34/t + 5as/(ht)), (10 + 24/t), 34/t)."""
    s, h, t = 2048, GPT3.d_model, 8
    want = {(False, "none"): 23.0, (True, "none"): 14.25, (False, "selective"): 13.0, (True, "selective"): 4.25}
    got = layer_kept_bytes(GPT3, t, s, 1, sp, "naive", ckpt) / (s * h)
    assert got == pytest.approx(want[(sp, ckpt)], rel=1e-12)
    lay = Layout(1, t, 1, ckpt=ckpt, sp=sp, attention="naive")
    assert activation_bytes_per_gpu(GPT3, lay, 1, s) == int(GPT3.n_layer * got * s * h)


def test_flash_without_sequence_parallelism_keeps_the_replicated_parts_whole():
    """Without SP the norms' inputs and the gathered norm outputs are whole on every TP rank: 4 + 4 sbh for GPT-3's
    LayerNorm blocks (Korthikanti's replicated 10 sbh less the 2 of dropout masks, which the preset has not)."""
    s, h, t = 2048, GPT3.d_model, 8
    on, off = (layer_kept_bytes(GPT3, t, s, 1, sp, "flash") for sp in (True, False))
    assert (off - on) / (s * h) == pytest.approx((4 + 4) * (1 - 1 / t), rel=1e-12)
    full = [activation_bytes_per_gpu(GPT3, Layout(1, t, 1, ckpt="full", sp=sp), 1, s) for sp in (True, False)]
    layer = [layer_kept_bytes(GPT3, t, s, 1, sp, "flash") for sp in (True, False)]
    assert full[0] == int(GPT3.n_layer * 2 * s * h / t + layer[0])
    assert full[1] == int(GPT3.n_layer * 2 * s * h + layer[1])


def test_megatron_2022_block_fits_where_2021_block_does_not():
    """A constructed case of the issue: GPT-3 175B, t 8, p 4, ZeRO-1, micro-batch 1 on 64 x 8 A100s. Megatron-LM's 2022
    block (SP, unfused attention, selective recomputation) counts 34/t sbh per layer and fits; the 2021 block
    without recomputation (23 sbh) does not; before the split the planner could only say SP with flash attention."""
    cl, lay = Cluster("64 x 8 A100", 64, 8, 25.0), Layout(16, 8, 4, 1, "selective", 1)
    e22 = estimate(GPT3, A100, cl, dataclasses.replace(lay, sp=True, attention="naive"), 512, elementwise="unfused")
    e21 = estimate(GPT3, A100, cl, dataclasses.replace(lay, ckpt="none"), 512, elementwise="unfused")
    assert e22.feasible and not e21.feasible and "GiB per GPU" in e21.why
    assert e22.memory["activations"] < e21.memory["activations"] / 5


_STATED_MISSES = {
    # Llama 3 section 3.3.2 trained 8K sequences without activation checkpointing, after freeing each stage's input
    # and output tensors and taking a layer off the first and last stage: the planner has neither (runs.py why_not)
    "Llama 3 405B, 16K GPUs": "none", "Llama 3 405B, 8K GPUs": "none",
}


@pytest.mark.parametrize("run", published.THROUGHPUT_RUNS + published.LONG_CONTEXT + published.MOE_RUNS,
                         ids=lambda r: r.name)
def test_every_published_layout_is_feasible_for_a_choice_of_what_its_source_leaves_unstated(run):
    """The published dp x tp x pp (x cp, ep), ZeRO, recomputation and micro-batch where stated; each unstated field
    over its choices. Llama 3's stated 'no activation checkpointing' at 8K is a known miss, kept here so that the
    list stays true: the planner still finds it infeasible."""
    base = layout_of(run)
    choices = itertools.product((0, 1) if run.zero is None else (run.zero,),
                                CKPT if run.ckpt is None else (run.ckpt,),
                                (1, 2, 4) if run.micro_batch is None else (run.micro_batch,))
    rows = [estimate(run.config, GPU_SPECS[run.gpu], run.cluster,
                     dataclasses.replace(base, zero=z, ckpt=c, micro_batch=b), run.global_batch, run.seq_len,
                     0.5, grad_bytes=run.grad_bytes, elementwise=run.kernels, moe=run.moe) for z, c, b in choices]
    assert any(r.feasible for r in rows), [r.why for r in rows]
    if run.name in _STATED_MISSES:
        stated = [r for r in rows if r.layout.ckpt == _STATED_MISSES[run.name]]
        assert stated and not any(r.feasible for r in stated), "now feasible: drop it from _STATED_MISSES"


# ----------------------------------------------------------------------------------------- matmuls by shape

def test_quantization_of_tiles_and_waves():
    assert quantization(256 * 108, 128, 108) == 1.0                  # 108 full tiles, one full wave
    assert quantization(256 * 109, 128, 108) == pytest.approx(109 / 216)   # a second wave with one tile in it
    assert quantization(257, 128, 0) == pytest.approx(257 / 512)     # 2 tiles of 256 x 128 (3 of 128 x 256: 1/3)
    assert quantization(128, 256, 0, batch=7) == 1.0
    # the better orientation: 128 rows fill a 128 x 256 tile, not a 256 x 128 one
    assert quantization(128, 2048, 0) == 1.0 and quantization(2048, 128, 0) == 1.0


def test_a_gemm_is_priced_by_the_slower_of_compute_and_memory():
    big, thin = Gemm("big", 8192, 8192, 8192), Gemm("thin", 8192, 8192, 16)      # thin: K = 16
    peak, bw = A100.bf16_tflops * 1e12, A100.mem_bw_gbs * 1e9
    assert gemm_seconds(big, A100, 0.5) == pytest.approx(big.flops / (peak * 0.5 * quantization(8192, 8192, 108)))
    assert gemm_seconds(thin, A100, 0.5) == pytest.approx(2 * (8192 * 16 + 16 * 8192 + 8192 * 8192) / bw)
    fused = Gemm("core", 16, 8192, 8192, fused=True)
    assert gemm_seconds(fused, A100, 0.5) == pytest.approx(fused.flops / (peak * 0.5))
    dgrad, wgrad = big.backward()
    assert (dgrad.m, dgrad.n, dgrad.k) == (8192, 8192, 8192) and dgrad.flops == wgrad.flops == big.flops
    d2, w2 = Gemm("x", 10, 20, 30).backward()
    assert (d2.m, d2.n, d2.k, w2.m, w2.n, w2.k) == (10, 30, 20, 30, 20, 10)


@pytest.mark.parametrize("name, moe", [("gpt3-175b", None), ("llama3-405b", None),
                                       ("deepseek", published.DEEPSEEK_V3_MOE)])
def test_layer_gemms_hold_the_model_flops(name, moe):
    """Forward FLOPs of the GEMM list = 1/3 of the model's training FLOPs per micro-batch per GPU (flops.py's count,
    MLA and the routed experts included; the multi-token prediction module is the only FLOPs left to the flat
    rate). DeepSeek-V3 at tp 1, as it ran: its router is not split over tp (every TP rank routes every token)."""
    cfg = published.DEEPSEEK_V3_CFG if moe else get_preset(name)
    s, tp, pp, ep = cfg.seq_len, 1 if moe else 2, 1, 8
    mm = matmul_seconds(cfg, A100, tp, pp, s, s, 1, "none", 0.5, "flash", moe, ep)
    per_token = moe.flops_per_token(cfg, s) - moe.mtp_flops_per_token(cfg, s) if moe else flops.flops_per_token(cfg, s)
    assert mm["model_flops"] == pytest.approx(per_token * s / tp, rel=1e-6)


def test_shapes_equal_flat_without_quantization_or_memory_but_for_the_lm_head():
    """With no SMs recorded and an unbounded HBM, the shapes' compute is the flat model's on multiples of the tile;
    full recomputation then runs the layers' forward again and never the LM head's (Megatron-LM's 96 B s l h^2 (1 +
    s/(6h) + V/(16 l h)) charges the head three passes, the layers four)."""
    cfg = get_preset("gpt3-175b").replace(vocab_size=51200)
    gpu = dataclasses.replace(A100, mem_bw_gbs=1e12, sms=0)
    cl, lay = Cluster("16 x 8", 16, 8), Layout(16, 8, 1, ckpt="none", micro_batch=1)
    flat, shapes = (estimate(cfg, gpu, cl, lay, 128, kernel_efficiency=0.5, matmuls=m) for m in ("flat", "shapes"))
    assert shapes.time["compute"] == pytest.approx(flat.time["compute"], rel=1e-9)
    full = dataclasses.replace(lay, ckpt="full")
    flat, shapes = (estimate(cfg, gpu, cl, full, 128, kernel_efficiency=0.5, matmuls=m) for m in ("flat", "shapes"))
    hfu = flops.megatron_flops_per_token(cfg, 2048, recompute=True) / flops.megatron_flops_per_token(cfg, 2048)
    assert flat.hfu / flat.mfu == pytest.approx(8 / 6)
    assert shapes.hfu / shapes.mfu == pytest.approx(hfu, rel=1e-9) and hfu < 8 / 6


def test_experts_starve_with_few_tokens_each_and_ep_feeds_them():
    """DeepSeek-V3's routed experts at micro-batch 1 (4,096 tokens, top-8 of 256): ep 1 gives each expert 128
    rows, below the H800's ridge point (its GEMM is memory-bound); ep 64 gives 8,192 rows, compute-bound."""
    cfg, moe, gpu = published.DEEPSEEK_V3_CFG, published.DEEPSEEK_V3_MOE, GPU_SPECS["H800"]
    peak, bw = gpu.bf16_tflops * 1e12, gpu.mem_bw_gbs * 1e9

    def experts(ep):
        return [g for g in layer_gemms(cfg, 1, 4096, 4096, 1, "flash", moe, ep) if g.name.startswith("experts")]

    assert experts(1)[0].m == 128 and experts(64)[0].m == 8192
    starved, fed = implied_efficiency(experts(1), gpu, 0.7), implied_efficiency(experts(64), gpu, 0.7)
    assert starved < 0.7 * 0.6 < fed
    g = experts(1)[0]
    assert gemm_seconds(g, gpu, 0.7) == pytest.approx(2 * g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) / bw)
    assert g.flops / (2 * g.batch * (g.m * g.k + g.k * g.n + g.m * g.n)) < peak / bw     # below the ridge
    cl = Cluster("256 x 8 H800", 256, 8, 50.0)
    lay = Layout(128, 1, 16, 1, "full", 1, "zb-h1", ep=1)
    one, sixty_four = (estimate(cfg, gpu, cl, dataclasses.replace(lay, ep=ep), 15360, 4096, 0.7, moe=moe,
                                matmuls="shapes") for ep in (1, 64))
    assert one.time["compute"] > 1.2 * sixty_four.time["compute"]


def test_matmuls_refuses_an_unknown_model():
    with pytest.raises(ValueError, match="matmuls"):
        estimate(GPT3, A100, Cluster("64 x 8", 64, 8, 25.0), Layout(64, 8, 1), 512, matmuls="exact")


# ------------------------------------------------------------------------------ TP's backward behind wgrad

def test_tp_backward_collectives_hide_behind_the_weight_gradients():
    """Issue 44, item 3, constructed: Megatron-LM's asynchronous TP all-reduce runs each column-parallel linear's
    input-gradient collective while its weight-gradient GEMM runs. With a long micro-batch (8 sequences) both hide:
    what stays exposed is the forward's 2 of the 4 collectives per layer (4 of 6 with full recomputation); TP
    across nodes at 1 GB/s with one sequence per micro-batch hides only the weight gradients' length of each; DP's
    overlap comes with "dp+tp-bwd" only."""
    cl = Cluster("64 x 8 A100", 64, 8, 25.0)
    for ckpt, forward_share in (("none", 2 / 4), ("full", 4 / 6)):
        lay = Layout(8, 8, 8, 1, ckpt, 8, overlap="tp-bwd")
        e = estimate(GPT3, A100, cl, lay, 512, kernel_efficiency=0.5)
        assert e.exposed["tp"] == pytest.approx(forward_share * e.time["tp"], rel=1e-12)
        far = Cluster("512 x 1 A100", 512, 1, 1.0)
        slow = estimate(GPT3, A100, far, dataclasses.replace(lay, micro_batch=1), 512, kernel_efficiency=0.5)
        hidden = slow.time["tp"] - slow.exposed["tp"]
        assert forward_share * slow.time["tp"] < slow.exposed["tp"] < slow.time["tp"]
        assert hidden < 0.05 * slow.time["tp"]                                  # the wgrad GEMMs are short
        none = estimate(GPT3, A100, cl, dataclasses.replace(lay, overlap="none"), 512, kernel_efficiency=0.5)
        assert none.exposed["tp"] == none.time["tp"] == e.time["tp"] and none.exposed["dp"] == e.exposed["dp"]
        both = estimate(GPT3, A100, cl, dataclasses.replace(lay, overlap="dp+tp-bwd"), 512, kernel_efficiency=0.5)
        assert both.exposed["tp"] == e.exposed["tp"] and both.exposed["dp"] < e.exposed["dp"]
        assert both.time["total"] <= both.no_overlap_s
    one = estimate(GPT3, A100, Cluster("512", 512, 1, 25.0), Layout(64, 1, 8, 1, "none", 8, overlap="tp-bwd"), 512)
    assert one.exposed["tp"] == one.time["tp"] == 0.0                   # tp 1: nothing to hide
