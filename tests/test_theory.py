"""course_lib.theory: every formula against a measurement or a published number (lesson 01)."""

import numpy as np
import pytest
import torch

from course_lib.config import get_preset
from course_lib.measure.speed import count_flops
from course_lib.measure.memory_stats import SavedActivations, model_state_bytes
from course_lib.model import build_model
from course_lib.theory import comm, flops, memory


def _batch(cfg, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_flops_per_token_within_2_percent_of_flop_counter(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    idx, tgt = _batch(cfg, 2)
    counted = count_flops(lambda: model.loss(idx, tgt).backward()) / idx.numel()
    predicted = flops.flops_per_token(cfg)
    assert predicted == pytest.approx(counted, rel=0.02)
    # The attention term matters at these sizes: without it the formula is off by more than 2%.
    assert 6 * flops.matmul_params(cfg) != pytest.approx(counted, rel=0.02)


def test_flops_conventions():
    cfg = get_preset("tiny")
    assert flops.attention_flops_per_token(cfg) == 12 * cfg.n_layer * cfg.seq_len * cfg.d_model
    assert flops.attention_flops_per_token(cfg, causal=True) == 6 * cfg.n_layer * cfg.seq_len * cfg.d_model
    assert flops.flops_per_token(cfg, training=False) * 3 == flops.flops_per_token(cfg)
    # N of the 6N rule = non-embedding weights in matmuls + the (tied) head
    n = cfg.n_layer * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff) + cfg.d_model * cfg.vocab_size
    assert flops.matmul_params(cfg) == n
    assert flops.step_flops(cfg, 8) == flops.flops_per_token(cfg) * 8 * cfg.seq_len


def test_gpt3_training_flops_claim():
    # Syllabus / Brown et al. 2020 table D.1: GPT-3 175B on 300B tokens needs about 3.14e23 FLOPs.
    assert flops.training_flops(175e9, 300e9) == pytest.approx(3.14e23, rel=0.01)
    cfg = get_preset("gpt3-175b")
    assert cfg.num_params() == pytest.approx(175e9, rel=0.01)


def test_llama_gqa_matmul_params():
    cfg = get_preset("llama-70b")
    d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * cfg.d_ff
    assert flops.matmul_params(cfg) == cfg.n_layer * per_layer + d * cfg.vocab_size
    assert flops.matmul_params(cfg) == pytest.approx(cfg.num_params(), rel=0.01)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_training_memory_exact_for_adam(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters())
    idx, tgt = _batch(cfg, 2)
    model.loss(idx, tgt).backward()
    opt.step()
    measured = model_state_bytes(model, opt)
    assert len(list(model.parameters())) == memory.num_param_tensors(cfg)
    predicted = memory.training_memory_bytes(cfg, "adam", torch.float32,
                                             step_counters=memory.num_param_tensors(cfg))
    for key in ("params", "grads", "optimizer", "total"):
        assert predicted[key] == measured[key], key
    P = cfg.num_params()
    assert predicted["optimizer"] == 8 * P + 4 * memory.num_param_tensors(cfg)


def test_training_memory_sgd_and_dtypes():
    P = 1000
    assert memory.training_memory_bytes(P, "sgd", torch.float32)["total"] == 8 * P
    assert memory.training_memory_bytes(P, "momentum", torch.float32)["optimizer"] == 4 * P
    assert memory.training_memory_bytes(P, "adamw", torch.bfloat16)["total"] == 8 * P
    assert memory.mixed_precision_bytes(P)["total"] == 16 * P
    with pytest.raises(ValueError, match="unknown optimizer"):
        memory.training_memory_bytes(P, "lion")


@pytest.mark.parametrize("name,B", [("tiny", 2), ("tiny", 8), ("small", 2)])
def test_activation_estimate_within_10_percent(name, B):
    cfg = get_preset(name)
    model = build_model(cfg)
    idx, tgt = _batch(cfg, B)
    with SavedActivations(model) as acts:
        loss = model.loss(idx, tgt)
    predicted = memory.activation_bytes(cfg, B)["total"]
    assert predicted == pytest.approx(acts.bytes, rel=0.10)
    loss.backward()


def test_bus_bandwidth_nccl_tests_factors():
    for n in (2, 4, 8):
        assert comm.bus_factor("all_reduce", n) == 2 * (n - 1) / n
        assert comm.bus_factor("all_gather", n) == (n - 1) / n
        assert comm.bus_factor("reduce_scatter", n) == (n - 1) / n
        assert comm.bus_factor("broadcast", n) == 1
    assert comm.bus_bandwidth("all_reduce", 64e6, 0.1, 4) == 64e6 / 0.1 * 2 * 3 / 4
    assert comm.alg_bandwidth(1e6, 1e-3) == 1e9
    with pytest.raises(ValueError):
        comm.bus_factor("gossip", 2)


def test_collective_time_and_fit_recovers_alpha_beta():
    alpha, bw = 20e-6, 5e9
    sizes = np.logspace(3, 8, 12)
    times = comm.alpha_beta_time(sizes, alpha, bw)
    a, b = comm.fit_alpha_beta(sizes, times)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    noisy = times * (1 + 0.05 * np.random.default_rng(0).standard_normal(times.size))
    a, b = comm.fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(alpha, rel=0.3) and b == pytest.approx(bw, rel=0.2)
    assert comm.collective_time("all_reduce", 1e6, 4, alpha, bw) == pytest.approx(6 * alpha + 1.5e6 / bw)
    assert comm.collective_time("all_gather", 1e6, 1, alpha, bw) == 0
    assert comm.fit_alpha_beta([1e3, 1e6], [2e-3, 1e-3]) == (1.5e-3, float("inf"))  # no size trend


# ---------------------------------------------------------------------------------------------
# FLOPs per token by convention (lesson 01, section 1.5): hand computations on the tiny preset
# (l = 2, h = d = 64, s = 64, V = 256, 4 heads of 16, d_ff = 256, tied head, biases, learned positions)
# ---------------------------------------------------------------------------------------------


def test_megatron_formula_by_hand_equals_course_formula_on_a_gpt_block():
    cfg = get_preset("tiny")
    # 72 l h^2 (1 + s/(6h) + V/(12 l h)) = 72*2*4096 * (1 + 1/6 + 1/6) = 589,824 * 4/3
    assert flops.megatron_flops_per_token(cfg) == pytest.approx(786_432, rel=1e-12)
    # course: 6 * (2 * 12 * 64^2 + 64 * 256) + 12 * 2 * 64 * 64 = 688,128 + 98,304
    assert flops.flops_per_token(cfg) == 786_432
    # with full recomputation (the paper's 96 B s l h^2 (1 + s/(6h) + V/(16 l h))): 589,824*4/3 * (1 + 1/6 + 1/8)
    assert flops.megatron_flops_per_token(cfg, recompute=True) == pytest.approx(1_015_808, rel=1e-12)
    # the same by layers: 8 * 98,304 (layer weights) + 6 * 16,384 (head, not recomputed) + 16 * 2 * 64 * 64
    assert flops.hardware_flops_per_token(cfg, recompute="full") == 1_015_808
    # flash attention recomputes Q K^T in the backward: + 2 L T d = 2 * 2 * 64 * 64 = 16,384
    assert flops.hardware_flops_per_token(cfg, recompute="attention") == 786_432 + 16_384
    assert flops.hardware_flops_per_token(cfg) == flops.flops_per_token(cfg)
    with pytest.raises(ValueError, match="recompute"):
        flops.hardware_flops_per_token(cfg, recompute="selective")
    # Llama 3 is not a GPT block (SwiGLU, d_ff = 3.25 h, 8 KV heads): the paper's formula is off there
    llama = get_preset("llama3-405b")
    assert flops.megatron_flops_per_token(llama) / flops.flops_per_token(llama) - 1 == pytest.approx(0.0097, abs=5e-4)


def test_palm_and_torchtitan_formulas_by_hand():
    cfg = get_preset("tiny")
    # every parameter: per layer 2 norms (256) + attention (4*4096 + 4*64) + MLP (2*64*256 + 256 + 64) = 49,984;
    # x2 layers, + final norm 128, + token table 16,384 (tied head) + position table 4,096 = 120,576
    assert cfg.num_params() == sum(p.numel() for p in build_model(cfg).parameters()) == 120_576
    attention = 12 * 2 * 4 * 16 * 64                                        # 12 L H Q T = 98,304
    assert flops.palm_flops_per_token(cfg) == 6 * 120_576 + attention == 821_760
    assert flops.torchtitan_flops_per_token(cfg) == 821_760                  # tied: every parameter, head included
    # before torchtitan's PR #3225 the tied table was subtracted: 120,576 - 16,384 - 4,096 = 100,096
    assert flops.torchtitan_flops_per_token(cfg, before_tying_fix=True) == 6 * 100_096 + attention
    assert flops.flops_per_token(cfg, causal=True) == 786_432 - attention // 2


@pytest.mark.parametrize("tie", [True, False])
def test_torchtitan_formula_follows_its_procedure_on_a_real_model(tie):
    """torchtitan's get_dense_model_nparams_and_flops on the module: model.parameters() (a tied table once), minus
    the nn.Embedding children unless tied; attention 6 * n_layers * n_heads * (2 * head_dim) * seq_len."""
    from dataclasses import replace
    cfg = replace(get_preset("tiny"), tie_embeddings=tie)
    model = build_model(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    emb = sum(sum(p.numel() for p in m.parameters()) for m in model.children() if isinstance(m, torch.nn.Embedding))
    attention = 6 * cfg.n_layer * cfg.n_head * 2 * cfg.head_dim * cfg.seq_len
    assert flops.torchtitan_flops_per_token(cfg) == 6 * (nparams if tie else nparams - emb) + attention
    assert flops.torchtitan_flops_per_token(cfg, before_tying_fix=True) == 6 * (nparams - emb) + attention


def test_flop_counter_agrees_with_course_and_megatron_and_not_with_the_others():
    cfg = get_preset("tiny")
    model = build_model(cfg)
    idx, tgt = _batch(cfg, 2)
    counted = count_flops(lambda: model.loss(idx, tgt).backward()) / idx.numel()
    assert counted == flops.flops_per_token(cfg) == pytest.approx(flops.megatron_flops_per_token(cfg), rel=1e-12)
    for wrong in ("Kaplan (causal half)", "Megatron-LM code (causal half)", "PaLM (6N_all + 12LHQT)", "torchtitan",
                  "torchtitan before #3225", "HFU, full recompute"):
        assert flops.FLOP_CONVENTIONS[wrong](cfg) != pytest.approx(counted, rel=0.01), wrong


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "llama-7b", "llama3-405b"])
def test_megatron_code_counts_the_causal_half_and_its_paper_the_full_matrix(preset):
    """Megatron-LM's code today (training.py, num_floating_point_operations: "causal mask (only half of the mask is
    non-zero)") counts 6 L T d of attention per token, the course's causal convention, on GPT, SwiGLU and GQA blocks;
    the 2021 paper's formula counts the full 12 L T d (on a GPT block, where it applies, equal to the course's)."""
    cfg = get_preset(preset)
    half = flops.attention_flops_per_token(cfg, causal=True)
    assert half == 6 * cfg.n_layer * cfg.seq_len * cfg.n_head * cfg.head_dim
    assert flops.megatron_code_flops_per_token(cfg) == pytest.approx(flops.flops_per_token(cfg, causal=True), rel=1e-12)
    assert flops.flops_per_token(cfg) - flops.megatron_code_flops_per_token(cfg) == pytest.approx(half, rel=1e-12)
    if cfg.mlp == "gelu" and cfg.n_kv_head == cfg.n_head and cfg.d_ff == 4 * cfg.d_model:
        assert flops.megatron_flops_per_token(cfg) == pytest.approx(flops.flops_per_token(cfg), rel=1e-12)


def test_mfu_divides_by_the_dense_peak():
    from course_lib.measure import speed
    from course_lib.measure.hardware import GPU_SPECS
    # NVIDIA H100 SXM datasheet: BF16 tensor core 1,979 TFLOPS "shown with sparsity", half without: 989.4 dense
    assert GPU_SPECS["H100"].bf16_tflops == pytest.approx(1978.9 / 2, rel=1e-4)
    gpt3 = get_preset("gpt3-175b")
    f = flops.flops_per_token(gpt3)
    assert f == pytest.approx(1.0764e12, rel=1e-4)
    mfu = speed.mfu(370 * f, GPU_SPECS["H100"].bf16_tflops * 1e12)
    assert mfu == pytest.approx(370 * f / 989.4e12) == pytest.approx(0.4025, abs=1e-3)
    # full recomputation raises the numerator by about a third: HFU, not MFU
    assert flops.hardware_flops_per_token(gpt3, recompute="full") / f == pytest.approx(1.332, abs=1e-3)


def test_mla_flops_per_token_from_the_report_dimensions():
    """DeepSeek-V3's multi-head latent attention (report, arXiv 2412.19437, section 4.2: 128 heads of 128, 64
    decoupled RoPE dimensions for q.k, KV compression 512, query compression 1,536; width 7,168), counted by hand."""
    d, h, s = 7168, 128, 4096
    mla = flops.MLASpec(n_head=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128)
    down_q, up_q = d * 1536, 1536 * h * (128 + 64)            # query: compress, then up to 128 heads of 192
    down_kv = d * (512 + 64)                                   # KV latent and the shared RoPE key
    up_kv = 512 * h * (128 + 128)                              # keys' 128 and values' 128 per head
    out = h * 128 * d
    assert mla.matmul_params(d) == down_q + up_q + down_kv + up_kv + out == 187_105_280
    assert mla.params(d) == mla.matmul_params(d) + 1536 + 512   # the two latents' RMSNorms
    core = 3 * (2 * s * h * 192 + 2 * s * h * 128)             # q.k over 192, weights x values over 128; x3 training
    assert mla.core_flops_per_token(s) == core == 1_006_632_960
    assert mla.core_flops_per_token(s, causal=True) == core / 2
    assert mla.core_flops_per_token(s, training=False) == core / 3
    per_token_layer = 6 * mla.matmul_params(d) + mla.core_flops_per_token(s)
    assert per_token_layer == 6 * 187_105_280 + 1_006_632_960
    # multi-head attention of the same width (128 heads of 56), as the planner priced it before: its score and value
    # matmuls are 12 s d per token per layer, 2.86x fewer than MLA's; with its projections (4 d^2 weights) the whole
    # attention of a layer is priced 26 % under MLA's
    mha_core = flops.attention_flops_per_token(get_preset("tiny").replace(n_layer=1, d_model=d, n_head=h), s)
    assert mha_core == 12 * s * d and core / mha_core == pytest.approx(320 / 112)
    assert (6 * 4 * d * d + mha_core) / per_token_layer == pytest.approx(0.745, abs=1e-3)


def test_mla_equals_transformers_deepseek_v3_attention():
    """`flops.MLASpec` against transformers' DeepseekV3Attention at a small size: the same matmul weights, and the
    FLOPs FlopCounterMode counts in its forward and backward equal 6 x weights + the score and value matmuls."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_hidden_layers=1,
                           vocab_size=100, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    att = DeepseekV3Attention(cfg, 0)
    mla = flops.MLASpec(4, 32, 16, 8, 4, 8)
    assert sum(m.weight.numel() for m in att.modules() if isinstance(m, torch.nn.Linear)) == mla.matmul_params(64)
    assert sum(p.numel() for p in att.parameters()) == mla.params(64)
    B, s = 2, 16
    x = torch.randn(B, s, 64, requires_grad=True)
    pe = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(s)[None].expand(B, -1))
    with FlopCounterMode(display=False) as counter:
        att(x, pe, None)[0].sum().backward()
    assert counter.get_total_flops() / (B * s) == 6 * mla.matmul_params(64) + mla.core_flops_per_token(s)
