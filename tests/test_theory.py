"""course_lib.theory: every formula against a measurement or a published number (lesson 01)."""

import numpy as np
import pytest
import torch

from course_lib.config import get_preset
from course_lib.measure import SavedActivations, count_flops, model_state_bytes
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
