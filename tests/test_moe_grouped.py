"""Tests of lesson 11's grouped-GEMM experts, router z-loss and fp32 router (course_lib/parallel/moe_grouped.py).

One process. `GroupedSwiGLUExperts` = `moe.SwiGLUExperts` (outputs, the gradients of x and of w1, w3, w2) with empty
experts, all rows on one expert, no rows at all: fp32 at rtol/atol 1e-6; bf16 at rtol 1.6e-2 (bf16's half ulp, 2^-7
relative) and atol 1e-2 (O(1) values): on this CPU the two are equal bit for bit (the kernel loops matmuls in C++),
a GPU's grouped kernel may round differently. A GPT with grouped experts, capacity None = the same with a capacity
that drops nothing (dropped == 0) = the loop version (loss and every gradient, fp32, rtol 1e-5 atol 1e-7). Wrong
variants fail: offsets as counts or as starts (``torch._grouped_mm`` runs them without a word). The findings about
``torch._grouped_mm`` that the module's docstring states (int32 offsets, the expanded gradient, 16-byte strides).
z-loss = the hand formula, its gradient pulls logsumexp to 0 from either side; the fp32 router on bf16 weights
chooses as an all-fp32 computation does (0 flips of 4096 tokens), a bf16 router does not (> 0 flips).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.model import build_model
from course_lib.parallel import moe, moe_grouped
from course_lib.parallel.moe_grouped import (FP32Router, GroupedSwiGLUExperts, apply_grouped_experts,
                                             apply_router_options, grouped_mm_available, moe_loss_with_z, moe_z_loss,
                                             offsets_of, router_z_loss)

pytestmark = pytest.mark.usefixtures("one_thread")

E, C, F_ = 4, 32, 48                   # 16-byte aligned rows in fp32 (128, 192 B) and bf16 (64, 96 B)
COUNTS = {"mixed, two empty": [5, 0, 11, 0], "all on one": [0, 0, 16, 0], "even": [4, 4, 4, 4],
          "no rows": [0, 0, 0, 0]}
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
CFG = dataclasses.replace(get_preset("tiny"), seq_len=16)
GROUPED = {dt: grouped_mm_available(dt, "cpu")[0] for dt in TOL}


def _pair(dtype, seed=0):
    torch.manual_seed(seed)
    ref = moe.SwiGLUExperts(E, C, F_)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)                      # O(1) outputs
    ref = ref.to(dtype)
    ours = GroupedSwiGLUExperts(E, C, F_).to(dtype)
    ours.load_state_dict(ref.state_dict())                      # the same state dict
    return ref, ours


def _run(experts, x, counts, dy):
    x = x.clone().requires_grad_()
    y = experts(x, counts)
    (y.sum() if dy is None else (y * dy).sum()).backward()     # .sum(): an expanded output gradient
    return {"y": y.detach(), "x": x.grad, **{n: p.grad for n, p in experts.named_parameters()}}


# ------------------------------------------------------------------------------ torch._grouped_mm on this machine

def test_probe_reports_dtypes_and_survives_no_grad():
    moe_grouped._probe.cache_clear()
    with torch.no_grad():                                       # a first probe under no_grad must not cache "no"
        ok, why = grouped_mm_available(torch.float32, "cpu")
    assert ok == hasattr(torch, "_grouped_mm"), why
    ok64, why64 = grouped_mm_available(torch.float64, "cpu")
    assert not ok64 and why64                                   # fp64: no kernel, the reason is said


@pytest.mark.skipif(not GROUPED[torch.float32], reason="no torch._grouped_mm here")
def test_kernel_facts_from_the_docstring():
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(2, 16, 16, requires_grad=True)
    offs = offsets_of([3, 5])
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 8]          # cumulative ends
    with pytest.raises(RuntimeError, match="int32"):
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs.long())
    with pytest.raises(RuntimeError, match="16 bytes"):                   # 6 fp32 = 24 B rows
        torch._grouped_mm(torch.randn(8, 6), torch.randn(2, 6, 8), offs=offs)
    if torch.__version__.startswith("2.14"):                              # the bug _ContiguousGrad works around
        with pytest.raises(RuntimeError, match="strides"):
            torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).sum().backward()
    moe_grouped.grouped_matmul(x, w, offs).sum().backward()               # ours: the same, contiguous
    assert x.grad.abs().max() > 0 and w.grad.abs().max() > 0


# ------------------------------------------------------------------------------ grouped experts = the loop

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_equals_loop(dtype, case):
    counts = COUNTS[case]
    ref, ours = _pair(dtype)
    x = torch.randn(sum(counts), C).to(dtype)
    dy = torch.randn(sum(counts), C).to(dtype)
    for grad in (dy, None):
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
        want, got = _run(ref, x, counts, grad), _run(ours, x, counts, grad)
        assert ours.path == ("grouped_mm" if GROUPED[dtype] else "loop"), ours.reason
        if sum(counts):
            assert min(want[n].abs().max() for n in want) > 0, "a zero reference: nothing compared"
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")
        for e in range(E):
            if counts[e] == 0:                                  # an empty expert learns nothing
                assert got["w1"][e].abs().max() == 0 and got["w2"][e].abs().max() == 0


@pytest.mark.parametrize("how", ["offsets as counts", "offsets as starts"])
def test_wrong_offsets_fail(monkeypatch, how):
    if not GROUPED[torch.float32]:
        pytest.skip("no torch._grouped_mm here")
    right = offsets_of

    def wrong(counts, device=None):
        c = torch.as_tensor(counts, dtype=torch.int32)
        return c if how == "offsets as counts" else right(counts, device) - c      # starts, not ends

    counts = COUNTS["mixed, two empty"]
    ref, ours = _pair(torch.float32)
    x = torch.randn(sum(counts), C)
    want = ref(x, counts)
    monkeypatch.setattr(moe_grouped, "offsets_of", wrong)
    got = ours(x, counts)                                       # no error from the kernel: only numbers betray it
    assert ours.path == "grouped_mm"
    assert not torch.allclose(got[:sum(counts)], want, atol=1e-2)


def test_falls_back_to_the_loop_and_says_why():
    torch.manual_seed(0)
    odd = GroupedSwiGLUExperts(2, 6, 8)                         # d_model 6: 24-byte fp32 rows
    x = torch.randn(5, 6)
    y = odd(x, [2, 3])
    assert odd.path == "loop" and "16 bytes" in odd.reason
    torch.testing.assert_close(y, moe.SwiGLUExperts.forward(odd, x, [2, 3]), rtol=0, atol=0)
    ref, ours = _pair(torch.float64)
    x = torch.randn(16, C, dtype=torch.float64)
    torch.testing.assert_close(ours.double()(x, [4] * 4), ref(x, [4] * 4), rtol=0, atol=0)
    assert ours.path == "loop" and "Double" in ours.reason
    with pytest.raises(ValueError, match="summing to the 16 rows"):
        ours(x, [4, 4, 4, 3])


def test_state_dicts_load_both_ways():
    ref, ours = _pair(torch.float32)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["w1", "w3", "w2"]
    ref.load_state_dict(ours.state_dict())
    router = moe.TopKRouter(C, E, 2)
    fp32 = FP32Router.holding(router)
    assert fp32.weight is router.weight and fp32.expert_bias is router.expert_bias
    moe.TopKRouter(C, E, 2).load_state_dict(fp32.state_dict())
    FP32Router(C, E, 2).load_state_dict(router.state_dict())


# ------------------------------------------------------------------------------ dropless = capacity infinity = loop

def _gpt(top_k, cf, grouped):
    model = moe.apply_moe(build_model(CFG, 0), E, top_k, F_, alpha=0.1, capacity_factor=cf)
    return apply_grouped_experts(model) if grouped else model


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_grouped_equals_capacity_infinity_equals_loop(top_k):
    """lesson 11's dropless_runs: grouped dropless == grouped at capacity S (nothing dropped) == the loop."""
    from course_lib.lessons.l11_experts.grouped import dropless_runs

    batch, = random_batches(CFG, 4, 1)
    S = batch[0].numel()
    assert moe.capacity_of(E / top_k, S, top_k, E) == S                 # ceil(E/k * S k / E) = S: nobody drops
    runs = dropless_runs(CFG, batch, E, top_k, F_, alpha=0.1)
    for name, run_ in runs.items():
        assert run_["dropped"] == [0] * CFG.n_layer, name
        want_path = "grouped_mm" if GROUPED[torch.float32] and "grouped" in name else "loop"
        assert run_["path"] == want_path, name
    want = runs["loop, dropless"]
    for name, run_ in runs.items():
        torch.testing.assert_close(run_["loss"], want["loss"], rtol=1e-6, atol=0)
        assert run_["grads"].keys() == want["grads"].keys()
        for k in want["grads"]:
            torch.testing.assert_close(run_["grads"][k], want["grads"][k], rtol=1e-5, atol=1e-7,
                                       msg=lambda m, k=k: f"{name} {k}: {m}")
    assert max(want["grads"][k].abs().max() for k in want["grads"] if "experts" in k) > 1e-4


# ------------------------------------------------------------------------------ z-loss

def test_z_loss_equals_the_hand_formula():
    rows = [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [-5.0, -5.0, -5.0]]
    lse = [math.log(sum(math.exp(v) for v in r)) for r in rows]
    hand = 1e-3 * sum(v * v for v in lse) / len(rows)
    got = router_z_loss(torch.tensor(rows, dtype=torch.bfloat16))           # these values are exact in bf16
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(hand, rel=1e-6)
    assert router_z_loss(torch.tensor(rows)).item() == pytest.approx(hand, rel=1e-6)
    assert router_z_loss(torch.tensor(rows), coef=0.5).item() == pytest.approx(500 * hand, rel=1e-6)


def test_z_loss_gradient_pulls_logsumexp_to_zero():
    logits = torch.tensor([[1.0, 2.0, 3.0], [-5.0, -5.0, -4.0]], requires_grad=True)   # lse 3.4 > 0, -3.4 < 0
    router_z_loss(logits, coef=1.0).backward()
    g = logits.grad
    assert (g[0] > 0).all() and (g[1] < 0).all()                # descent lowers the first row, raises the second
    stepped = (logits - 0.1 * g).detach()
    before, after = logits.detach().logsumexp(-1).abs(), stepped.logsumexp(-1).abs()
    assert (after < before).all()


def test_moe_z_loss_keeps_the_routers_graph():
    model = apply_router_options(_gpt(2, None, True), z_loss_coef=0.5)
    (x, y), = random_batches(CFG, 2, 1)
    total = moe_loss_with_z(model, x, y)
    layers = moe.moe_layers(model)
    z = moe_z_loss(model)
    hand = sum(0.5 * m.router_logits.detach().float().logsumexp(-1).square().mean() for m in layers)
    torch.testing.assert_close(z.detach(), hand, rtol=1e-6, atol=0)
    torch.testing.assert_close(total.detach(), (moe.moe_loss(model, x, y) + z).detach(), rtol=1e-6, atol=0)
    model.zero_grad(set_to_none=True)
    moe_z_loss(model).backward()
    for m in layers:
        assert m.router.weight.grad.abs().max() > 0             # through router_logits to every router
    assert layers[0].experts.w1.grad.abs().max() > 0            # layer 0's experts shape layer 1's router input
    assert layers[-1].experts.w1.grad is None                   # the last layer's do not


# ------------------------------------------------------------------------------ fp32 router

def _flips(indices, ref):
    return int((indices.sort(-1).values != ref.sort(-1).values).any(-1).sum())


def test_fp32_router_chooses_as_fp32_and_a_bf16_router_does_not():
    """4096 tokens N(0, 1), 8 experts, top-2, router weights N(0, 0.02): all bf16 values. The reference: top-2 of
    F.linear in fp32 on those same values. bf16 logits keep 8 bits: near-ties between the 2nd and 3rd expert flip."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g).bfloat16()
    router = moe.TopKRouter(64, 8, 2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 64, generator=g) * 0.02)
    router = router.bfloat16()
    ref = torch.topk(F.linear(x.float(), router.weight.float()), 2, -1).indices
    with torch.no_grad():
        lb, _, wb, ib = router(x)
        l32, _, w32, i32 = FP32Router.holding(router)(x)
    assert lb.dtype == torch.bfloat16 and l32.dtype == torch.float32 and w32.dtype == torch.bfloat16
    assert _flips(i32, ref) == 0
    assert _flips(ib, ref) > 0


def test_fp32_router_in_a_bf16_model():
    model = apply_router_options(_gpt(2, None, True).bfloat16(), fp32=True)
    params = {id(p) for p in model.parameters()}
    seen = []

    def check(module, inputs, output):
        x, = inputs
        ref = torch.topk(F.linear(x.float(), module.weight.float()), module.top_k, -1).indices
        seen.append(_flips(output[3], ref))

    for m in moe.moe_layers(model):
        assert isinstance(m.router, FP32Router) and m.router.weight.dtype == torch.bfloat16
        m.router.register_forward_hook(check)
    (x, y), = random_batches(CFG, 4, 1)
    moe_loss_with_z(model, x, y).backward()
    assert seen == [0] * CFG.n_layer and params == {id(p) for p in model.parameters()}
    assert all(m.router_logits.dtype == torch.float32 and m.router.weight.grad.abs().max() > 0
               for m in moe.moe_layers(model))


# ------------------------------------------------------------------------------ the lesson's experiments

def test_lesson_experiments_run_small():
    from course_lib.lessons.l11_experts import grouped

    curve = grouped.expert_gemm_curve((1, 16), d_model=32, d_ff=64, n_experts=4, repeats=1, min_rows=64)
    assert curve["path"] == ("grouped_mm" if GROUPED[torch.float32] else "loop") and curve["hardware"]
    for r in curve["rows"]:
        assert r["gflop"] == pytest.approx(2 * 4 * r["n"] * 32 * 64 / 1e9)
        assert all(r[f"{w}_gflops"] > 0 for w in ("grouped", "loop", "dense"))
    (row,) = grouped.router_precision(n_tokens=4096, scales=(0.02,))
    assert row["fp32_flips"] == 0 and row["bf16_flips"] > 0 and row["max_logit_diff"] > 0
    run = grouped.z_loss_run(steps=2, coefs=(0.0, 1e-3))
    assert len(run[0.0]["loss"]) == 2 and run[0.0]["loss"][0] == run[1e-3]["loss"][0]   # same start
    assert run[1e-3]["z"][0] == pytest.approx(CFG.n_layer * math.log(4) ** 2, rel=0.05)  # near-uniform at init
