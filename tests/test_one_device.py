"""Tests of lesson 12's ladder (course_lib/lessons/l12_one_device) and the model options it needs (config.py's
`padded_vocab`, model.py's `pad_vocab`, `set_attention`, `naive_attention`).

Each rung must do what its name claims, read from what runs (SDPA called or not, fp32 masters kept, the fused or
foreach AdamW kernels in the profile), not from its options; padding is checked against the true statement (the
extra logits enter the softmax's normaliser, they are never targets); MFU counts the unpadded model's FLOPs; the
transformers baseline computes the course model's loss at the same weights; a rung that cannot run (CUDA graphs on a
CPU, a failed torch.compile) is reported as skipped with its reason. Tiny sizes: the fast tests take seconds; the
one test that really compiles is marked slow.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

from course_lib.config import ConfigError, ModelConfig, get_preset
from course_lib.data import random_batches
from course_lib.lessons.l12_one_device import ladder as ladder_mod
from course_lib.lessons.l12_one_device.ladder import (RUNGS, TWIN, bf16_support, cuda_graphs_support, insert_rung,
                                                      ladder)
from course_lib.lessons.l12_one_device.profile import classify, profile_step
from course_lib.lessons.l12_one_device.report import fp8_speedup, ladder_table, summary_line
from course_lib.lessons.l12_one_device.steps import StepOptions, build_step
from course_lib.model import build_model, lm_loss, naive_attention, pad_vocab, set_attention
from course_lib.parallel.precision import MasterWeightOptimizer
from course_lib.theory.flops import step_flops

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors run fastest on one thread

CFG = ModelConfig(vocab_size=300, seq_len=32, n_layer=2, n_head=4, d_model=64, name="ladder-test")  # 300: not x128
CPU = torch.device("cpu")
NO_COMPILE = [r for r in RUNGS if r.name != "torch.compile"]


@pytest.fixture
def sdpa_calls(monkeypatch) -> list:
    """One entry per call of F.scaled_dot_product_attention (the model calls it through torch.nn.functional)."""
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: (calls.append(1), sdpa(*a, **k))[1])
    return calls


def _batch(batch: int = 2):
    (x, y), = random_batches(CFG, batch, 1, 0)
    return x, y


# ------------------------------------------------------------------------------ padded vocabulary (config, model)

def test_padded_vocab_rounds_up_to_the_multiple_and_leaves_presets_alone():
    gpt2 = get_preset("gpt2-124m")
    padded = gpt2.padded_vocab()
    assert gpt2.vocab_size == 50257 and padded.vocab_size == 50304 and padded.vocab_size % 128 == 0
    assert gpt2.padded_vocab(64).vocab_size == 50304 and CFG.padded_vocab(128).vocab_size == 384
    assert padded.padded_vocab(128) == padded                                  # already a multiple: unchanged
    assert padded.num_params() - gpt2.num_params() == 47 * 768                 # the tied (V, C) matrix grows
    assert gpt2.num_params() == 124_439_808 and get_preset("gpt2-124m").vocab_size == 50257   # the preset is not
    for bad in (0, -128, 1.5, True, None):
        with pytest.raises(ValueError, match=r"multiple=.* vocab_size"):
            gpt2.padded_vocab(bad)
    assert issubclass(ConfigError, ValueError)


def test_padded_model_keeps_the_logits_and_adds_zero_logits_to_the_normaliser():
    """The true statement: the first V logits are the unpadded model's; each extra logit is 0 (zero rows), never a
    target, but it enters the softmax's sum, so the loss is the cross-entropy with the extra logits appended and is
    larger than the unpadded loss. Training pushes the extra logits down."""
    x, y = _batch()
    model = build_model(CFG, seed=0)
    rng = torch.get_rng_state()
    padded = pad_vocab(model, 128)
    assert torch.equal(torch.get_rng_state(), rng)                             # its throw-away init left the RNG
    assert padded.cfg.vocab_size == 384 and padded.head.weight is padded.tok_emb.weight    # still tied
    logits, logits_p = model(x), padded(x)
    assert logits_p.shape[-1] == 384
    torch.testing.assert_close(logits_p[..., :300], logits, rtol=0, atol=1e-5)
    assert torch.all(logits_p[..., 300:] == 0)
    loss, loss_p = lm_loss(logits, y).item(), padded.loss(x, y).item()
    appended = torch.cat([logits, torch.zeros(*logits.shape[:-1], 84)], dim=-1)
    assert loss_p == pytest.approx(lm_loss(appended, y).item(), abs=1e-5)
    assert loss_p > loss + 1e-3                                                # not the unpadded loss
    opt = torch.optim.SGD(padded.parameters(), lr=1.0)
    padded.loss(x, y).backward()
    opt.step()
    assert padded(x)[..., 300:].mean() < 0                                     # the extra logits went down


# ------------------------------------------------------------------------------ attention kernels

def test_set_attention_switches_the_kernel_and_both_give_the_same_loss(sdpa_calls):
    calls = sdpa_calls
    x, y = _batch()
    model = build_model(CFG, seed=0)
    fused = model.loss(x, y)
    assert len(calls) == CFG.n_layer                                           # the default is SDPA
    naive = set_attention(model, "naive").loss(x, y)
    assert len(calls) == CFG.n_layer                                           # naive: SDPA not called
    torch.testing.assert_close(naive, fused, rtol=1e-5, atol=1e-5)
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    torch.testing.assert_close(naive_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kind='flash'"):
        set_attention(model, "flash")
    with pytest.raises(ConfigError, match="dropout"):
        set_attention(build_model(CFG.replace(dropout=0.1)), "naive")


def test_the_naive_rung_never_calls_sdpa_and_the_sdpa_rung_does(sdpa_calls):
    x, y = _batch()
    build_step(CFG, StepOptions(), x, y)                                       # the first rung: naive
    assert sdpa_calls == []
    build_step(CFG, StepOptions(attention="sdpa"), x, y)
    assert len(sdpa_calls) == CFG.n_layer


# ------------------------------------------------------------------------------ precision and optimizer rungs

def test_the_master_weight_rung_keeps_fp32_masters_and_bf16_weights():
    x, y = _batch()
    built = build_step(CFG, StepOptions(autocast=True, bf16_weights=True), x, y)
    opt = built.optimizer
    assert isinstance(opt, MasterWeightOptimizer)
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in opt.masters} == {torch.float32}
    assert {v.dtype for s in opt.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    start = build_model(CFG, seed=0)
    moved = [(m - p0).abs().max().item() for m, p0 in zip(opt.masters, start.parameters())]
    assert max(moved) > 0                                                      # the masters took the step
    for p, m in zip(built.model.parameters(), opt.masters):
        assert torch.equal(p, m.to(torch.bfloat16)) and p.grad is None and m.grad is None
    # held between steps: bf16 weights (2 B) + fp32 masters (4 B) + two fp32 moments (8 B) + Adam's step counters
    n, tensors = sum(p.numel() for p in built.model.parameters()), len(opt.masters)
    assert built.state_bytes() == 14 * n + 4 * tensors


@pytest.mark.parametrize("kind, foreach, fused", [("for-loop", False, False), ("foreach", True, False),
                                                   ("fused", None, True)])
def test_the_optimizer_rungs_run_the_kernels_they_name(kind, foreach, fused):
    """for-loop: per-tensor operators only; foreach: ``_foreach_*`` over the lists; fused: ``_fused_adamw_`` (torch
    counts the steps with a ``_foreach_add_`` beside it, so foreach operators may appear there)."""
    x, y = _batch()
    built = build_step(CFG, StepOptions(attention="sdpa", optimizer=kind), x, y)
    group = built.optimizer.param_groups[0]
    assert bool(group["foreach"]) is (kind == "foreach") and bool(group["fused"]) is fused
    names = [t["name"] for t in profile_step(built.step, CPU, top=1000)["top"]]
    assert any(n.startswith("aten::_fused_adamw") for n in names) is fused, kind
    if foreach is not None:
        assert any(n.startswith("aten::_foreach_") for n in names) is foreach, kind


# ------------------------------------------------------------------------------ the ladder

@pytest.fixture(scope="module")
def rows():
    """The whole ladder but torch.compile, at a tiny size, with the transformers row."""
    return ladder(CFG, 2, device="cpu", rungs=NO_COMPILE, steps=1, warmup=1, rounds=2)


def test_ladder_rows_have_their_fields_and_positive_numbers(rows):
    names = [r["rung"] for r in rows]
    assert names[:len(NO_COMPILE)] == [r.name for r in NO_COMPILE]
    assert names[-2].startswith("transformers") and names[-1] == TWIN
    twin, theirs = rows[-1], rows[-2]
    assert twin["options"] == dict(theirs["options"], library="course"), "like for like: the same switches"
    assert twin["loss0"] == pytest.approx(theirs["loss0"], rel=1e-3)
    measured = [r for r in rows if r["status"] == "measured"]
    skipped = [r["rung"] for r in rows if r["status"] == "skipped"]
    assert skipped == ["fp8", "CUDA graphs"], skipped                          # a CPU has no FP8 tensor cores
    for r in measured:
        for key in ("tokens_per_s", "step_s", "mfu", "mfu_matmul", "hfu", "peak", "matmul_peak", "peak_bytes",
                    "state_bytes", "model_flops", "first_step_s"):
            assert r[key] > 0 and math.isfinite(r[key]), (r["rung"], key)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * CFG.seq_len / r["step_s"])
        assert 5.0 < r["loss0"] < 6.5 and r["hardware"].startswith("CPU") and r["kernels"] > 0   # ln 300 = 5.7
        assert r["peak_bytes"] > r["state_bytes"] and set(r["breakdown"]["seconds"]) >= {"matmul", "optimizer"}
    by = {r["rung"]: r for r in rows}
    assert by["larger micro-batch"]["batch"] == 4 and by["fp32 eager"]["batch"] == 2
    assert by["bf16 autocast"]["matmul_dtype"] == "bfloat16" and by["fp32 eager"]["matmul_dtype"] == "float32"


def test_cuda_graphs_and_fp8_are_skipped_on_a_cpu_with_the_reason(rows):
    fp8_row = next(r for r in rows if r["rung"] == "fp8")
    assert fp8_row["status"] == "skipped" and "dequantizes" in fp8_row["note"] and "8.9" in fp8_row["note"]
    graphs = next(r for r in rows if r["rung"] == "CUDA graphs")
    assert graphs["status"] == "skipped" and "CUDA device" in graphs["note"] and "step_s" not in graphs
    assert cuda_graphs_support(CPU)[0] is False
    assert "skipped: CUDA graphs need a CUDA device" in ladder_table(rows)


def test_mfu_counts_the_unpadded_model_and_hfu_the_padded_work(rows):
    by = {r["rung"]: r for r in rows}
    eager, padded = by["fp32 eager"], by["padded vocab"]
    assert eager["model_flops"] == padded["model_flops"] == step_flops(CFG, 2)
    assert padded["executed_flops"] == step_flops(CFG.padded_vocab(128), 2) > padded["model_flops"]
    assert eager["executed_flops"] == eager["model_flops"] and eager["hfu"] == pytest.approx(eager["mfu"])
    for r in (eager, padded):
        assert r["mfu"] == pytest.approx(r["model_flops"] / r["step_s"] / r["peak"])
        assert r["hfu"] / r["mfu"] == pytest.approx(r["executed_flops"] / r["model_flops"])
    assert padded["vocab_size"] == 384 and eager["vocab_size"] == 300
    assert padded["loss0"] != by["bf16 weights + fp32 master"]["loss0"]       # the zero logits show in the loss


def test_the_transformers_step_computes_the_course_models_loss_at_the_same_weights():
    """fp32, the same weights (`to_hf_gpt2`), the same batch and AdamW: the loss of the first step within 1e-5 and
    of the step after the update within 1e-4 (GPT-2's Conv1D sums in another order than nn.Linear)."""
    x, y = _batch()
    for attention in ("sdpa", "naive"):
        ours = build_step(CFG, StepOptions(attention=attention), x, y)
        theirs = build_step(CFG, StepOptions(attention=attention, library="transformers"), x, y)
        assert theirs.loss0 == pytest.approx(ours.loss0, abs=1e-5)
        assert theirs.step().item() == pytest.approx(ours.step().item(), abs=1e-4)


def test_a_failed_compile_is_skipped_with_its_reason_and_the_next_rung_still_runs(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    picked = [r for r in RUNGS if r.name in ("fp32 eager", "torch.compile", "larger micro-batch")]
    rows = ladder(CFG, 2, device="cpu", rungs=picked, steps=1, warmup=1, rounds=1, baseline=False, profile=False)
    compiled, bigger = rows[1], rows[2]
    assert compiled["status"] == "skipped" and "torch.compile failed: RuntimeError: InvalidCxxCompiler" in \
        compiled["note"]
    assert bigger["status"] == "measured" and bigger["options"]["compile"] is None and bigger["batch"] == 4
    assert bigger["peak_bytes"] is None and "not measured" in bigger["memory_source"]


def test_the_larger_micro_batch_halves_until_it_fits(monkeypatch):
    """Out of memory at 8 sequences (a stand-in for the GPU's limit): the rung tries 8, then 4, and keeps 4; where
    nothing above the ladder's batch fits, it is skipped with the reason."""
    tried, build = [], ladder_mod.build_step

    def limited(cfg, opts, x, y, *args, limit=4):
        tried.append(x.shape[0])
        if x.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return build(cfg, opts, x, y, *args)

    monkeypatch.setattr(ladder_mod, "build_step", limited)
    picked = [r for r in RUNGS if r.name in ("fp32 eager", "larger micro-batch")]
    rows = ladder(CFG, 2, device="cpu", rungs=picked, max_micro_batch=8, steps=1, warmup=1, rounds=1,
                  baseline=False, profile=False)
    assert tried == [2, 8, 4] and rows[1]["batch"] == 4 and rows[1]["status"] == "measured"
    monkeypatch.setattr(ladder_mod, "build_step", lambda *a: limited(*a, limit=2))
    rows = ladder(CFG, 2, device="cpu", rungs=picked, max_micro_batch=8, steps=1, warmup=1, rounds=1,
                  baseline=False, profile=False)
    assert rows[1]["status"] == "skipped" and rows[1]["note"] == "out of memory at micro-batch 4"


def test_bf16_is_measured_everywhere_but_flagged_where_it_is_not_native(monkeypatch):
    monkeypatch.setattr(ladder_mod.hardware, "cpu_features", lambda: dict(isa="AVX2", bf16=False, fp16=False, amx=[]))
    runs, note = bf16_support(CPU)
    assert runs and note.startswith("FLAGGED") and "AVX2" in note
    monkeypatch.setattr(ladder_mod.hardware, "cpu_features", lambda: dict(isa="AVX512", bf16=True, fp16=False,
                                                                         amx=["amx_bf16"]))
    assert bf16_support(CPU) == (True, "native bf16 (AVX512, amx_bf16)")


def test_the_fp8_rung_swaps_the_linears_and_the_summary_reads_it():
    """The real fp8 rung, forced to run on this CPU (where `_scaled_mm` dequantizes: numerics, not speed): every
    linear but the head becomes a Float8Linear, the loss stays that of the model it swapped, fp8_speedup reads it;
    and `insert_rung` places a rung after the one named."""
    real = next(r for r in RUNGS if r.name == "fp8")
    forced = dataclasses.replace(real, available=lambda device: (True, "forced on a CPU by the test"))
    picked = [r for r in RUNGS if r.name in ("fp32 eager", "foreach/fused AdamW")]
    rungs = insert_rung(picked, forced, after="foreach/fused AdamW")
    assert [r.name for r in rungs] == ["fp32 eager", "foreach/fused AdamW", "fp8"]
    with pytest.raises(ValueError, match="after='fp16'"):
        insert_rung(RUNGS, forced, after="fp16")
    opts = forced.change(StepOptions(), None)
    model = opts.transforms[-1](build_model(CFG, 0))
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("head") == "Linear" and set(kinds.values()) == {"Float8Linear"}
    rows = ladder(CFG, 2, device="cpu", rungs=rungs, steps=1, warmup=1, rounds=1, baseline=False, profile=False)
    assert rows[2]["rung"] == "fp8" and rows[2]["status"] == "measured"
    assert rows[2]["loss0"] == pytest.approx(rows[1]["loss0"], rel=0.02)       # FP8 rounding, same weights
    assert fp8_speedup(rows) == pytest.approx(rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"])
    assert re.search(r"fp8/bf16 \d+\.\d\d x$", summary_line(rows, "ladder-test"))


def test_summary_line_has_the_benchmarks_form(rows):
    line = summary_line(rows, "ladder-test")
    assert re.fullmatch(r"one device: CPU: .+: ladder-test MFU \d+\.\d % \(transformers baseline \d+\.\d %\), "
                        r"fp8/bf16 n/a x", line), line
    best = max(r["mfu"] for r in rows if r["status"] == "measured" and r["library"] == "course")
    assert f"MFU {best * 100:.1f} %" in line and fp8_speedup(rows) is None


# ------------------------------------------------------------------------------ profile

def test_profile_sorts_time_by_kind_and_counts_memory():
    assert [classify(n) for n in ("aten::mm", "aten::bmm", "aten::_scaled_mm", "ampere_sgemm_128x64_tn",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax",
                                  "aten::_log_softmax", "aten::_fused_adamw_", "aten::native_layer_norm",
                                  "triton_poi_fused_add_0", "CompiledFunction")] == \
        ["matmul", "matmul", "matmul", "matmul", "attention", "attention", "elementwise", "optimizer", "elementwise",
         "elementwise", "other"]
    x, y = _batch()
    built = build_step(CFG, StepOptions(attention="sdpa"), x, y)               # for-loop AdamW: ops of its own
    prof = profile_step(built.step, CPU)
    assert prof["total_s"] == pytest.approx(sum(prof["seconds"].values())) and prof["total_s"] > 0
    assert sum(prof["share"].values()) == pytest.approx(1.0)
    assert prof["seconds"]["matmul"] > 0 and prof["seconds"]["attention"] > 0 and prof["seconds"]["optimizer"] > 0
    logits = 2 * CFG.seq_len * CFG.vocab_size * 4                              # (B, T, V) fp32, one of several
    assert prof["peak_bytes"] > logits and prof["kernels"] > 50


@pytest.mark.slow
def test_the_compile_rung_compiles_and_dispatches_fewer_operators():
    """Inductor's C++ kernels on a CPU (tens of seconds the first time): compile time reported apart, fewer ATen
    operators per step than the same step eager, the same first-step loss (fp32) within 1e-4."""
    picked = [r for r in RUNGS if r.name in ("fp32 eager", "foreach/fused AdamW", "torch.compile")]
    rows = ladder(CFG, 2, device="cpu", rungs=picked, steps=1, warmup=2, rounds=1, baseline=False)
    eager, compiled = rows[1], rows[2]
    if compiled["status"] == "skipped":
        pytest.skip(compiled["note"])
    assert compiled["compile_s"] > 0.5 and compiled["kernels"] < eager["kernels"]
    assert compiled["loss0"] == pytest.approx(eager["loss0"], abs=1e-4)
