"""FP8 from scratch (course_lib/parallel/float8.py) against its definition and against torchao 0.18's Float8Linear.

Tolerances: tensorwise results (fp32 and bf16) and rowwise bf16 results are compared bit for bit: both sides cast the
same values with the same scales and call the same `torch._scaled_mm`. Rowwise with fp32 activations is compared to
one bf16 rounding (2^-8 relative), because torchao asks `_scaled_mm` for a bf16 result there and casts it back
(torchao/float8/float8_ops.py, `addmm_float8_unwrapped`; its later multiply by power-of-two scales is exact); a wrong
scale axis or a missing inverse is off by factors, far beyond that.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torchao.float8 as ao

from course_lib.config import PRESETS
from course_lib.model import build_model
from course_lib.parallel import float8 as f8

BF16_ONCE = 2.0 ** -8 * (1 + 2.0 ** -7)  # one bf16 rounding (8 significant bits): at most 2^-8 relative, and slack


def _torchao_linear(linear: nn.Linear, recipe: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ao.convert_to_float8_training(nn.Sequential(copy.deepcopy(linear)),
                                             config=ao.Float8LinearConfig.from_recipe_name(recipe))[0]


def _run(module, x, dy):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad


def _batch(dtype, shape=(3, 20, 96)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to(dtype)
    x[0, 0, 5] = 60.0                                    # one outlier: scales differ between rows and columns
    return x


# --- scales and casts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [f8.E4M3, f8.E5M2])
def test_scale_maps_the_amax_to_the_format_max(dtype):
    amax = torch.tensor([0.3, 7.0, 1000.0])
    s = f8.amax_to_scale(amax, dtype)
    assert torch.allclose(amax * s, torch.full_like(amax, torch.finfo(dtype).max), rtol=1e-6)
    s2 = f8.amax_to_scale(amax, dtype, power_of_2=True)
    assert torch.equal(s2, torch.exp2(torch.round(torch.log2(s2)))), "power_of_2 scales are powers of two"
    assert bool(((amax * s2 <= torch.finfo(dtype).max) & (amax * s2 > torch.finfo(dtype).max / 2)).all()), \
        "a power-of-2 scale is rounded down: the amax still fits, within a factor 2 of the max"
    assert torch.isfinite(f8.amax_to_scale(torch.tensor(0.0), dtype)), "an all-zero tensor gets a finite scale"


def test_quantize_axis_keeps_the_scale_constant_along_that_axis():
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(0))
    x[2, 4] = 60.0
    data, s_row = f8.quantize(x, axis=-1)
    assert s_row.shape == (7, 1) and data.dtype == f8.E4M3
    _, s_col = f8.quantize(x, axis=0)
    assert s_col.shape == (1, 33)
    _, s_t = f8.quantize(x)
    assert s_t.dim() == 0
    # every row reaches the format's max after scaling: the amax was taken per row
    assert torch.equal(data.float().abs().amax(dim=1), torch.full((7,), 448.0))


def test_round_trip_error_drops_with_finer_scales_when_one_value_is_an_outlier():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-4, 0, 64)[:, None]   # rows of very different size
    x[-1, 0] = 1e3                                                              # one outlier, in the largest row
    small = slice(0, 32)                                                        # rows with |x| <~ 1e-2
    errors = {}
    for name, deq in (("tensorwise", f8.dequantize(*f8.quantize(x))),
                      ("rowwise", f8.dequantize(*f8.quantize(x, axis=-1))),
                      ("1 x 128", f8.dequantize_blocks(*f8.quantize_blocks(x, (1, 128))))):
        errors[name] = f8.round_trip_error(x[small], deq[small])
    # e4m3 keeps 3 mantissa bits: round to nearest errs by at most 2^-4 relative for a normal number
    assert errors["rowwise"] <= 2 ** -4 and errors["1 x 128"] <= 2 ** -4, errors
    # one scale for the tensor: amax 1e3 maps to 448, so |x| < 2^-6 * 1e3 / 448 ~ 0.035 lands below e4m3's smallest
    # normal (2^-6) and keeps fewer mantissa bits; |x| < 2^-10 * 1e3 / 448 ~ 2.2e-3 rounds to zero
    assert errors["tensorwise"] > 4 * errors["rowwise"], errors
    zeros = (f8.quantize(x)[0][small].float() == 0).float().mean().item()
    assert zeros > 0.5, f"only {zeros:.0%} of the small rows' values flushed to zero with one scale"
    assert (f8.quantize(x, axis=-1)[0][small].float() == 0).float().mean().item() < 0.01


def test_casts_saturate_instead_of_overflowing():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    data, s = f8.quantize(x)
    wide = (x * 100 * s).clamp(-448, 448).to(f8.E4M3)
    assert torch.isfinite(wide.float()).all()
    assert data.float().abs().max().item() == 448.0


def test_bad_format_and_shapes_are_refused():
    with pytest.raises(ValueError, match="not an FP8 format"):
        f8.quantize(torch.ones(4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole number of 1 x 128 blocks"):
        f8.quantize_blocks(torch.ones(4, 100))
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        f8.fp8_matmul(torch.ones(4, 8), torch.ones(4, 8))


# --- the GEMM -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_matmul_is_the_product_of_the_dequantized_operands(recipe):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(24, 80, generator=g), torch.randn(80, 40, generator=g)   # M, K, N all different
    a[3, 7] = 30.0
    axis = recipe == "rowwise"
    r = f8.RECIPES[recipe]
    a_deq = f8.dequantize(*f8.quantize(a, axis=-1 if axis else None, power_of_2=r.power_of_2))
    b_deq = f8.dequantize(*f8.quantize(b, axis=0 if axis else None, power_of_2=r.power_of_2))
    got = f8.fp8_matmul(a, b, recipe)
    torch.testing.assert_close(got, a_deq @ b_deq, rtol=1e-5, atol=1e-5)
    # and it is an approximation of the exact product: relative Frobenius error of a few e4m3 ulps
    assert f8.round_trip_error(a @ b, got) < 0.1


def test_blockwise_matmul_tracks_a_few_outliers_better_than_tensorwise():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 256, generator=g), torch.randn(256, 128, generator=g)
    a[:, :4] *= 200.0                                              # outlier channels, as in LLM activations
    exact = a @ b
    err_block = f8.round_trip_error(exact, f8.blockwise_matmul(a, b))
    err_tensor = f8.round_trip_error(exact, f8.fp8_matmul(a, b, "tensorwise"))
    assert err_block < err_tensor
    assert err_block < 0.1


# --- the linear against torchao ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_equals_torchao(recipe, dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=False).to(dtype)
    x = _batch(dtype)
    dy = torch.linspace(-3, 3, 3 * 20 * 160).reshape(3, 20, 160).to(dtype)
    ao = _run(_torchao_linear(linear, recipe), x, dy)
    ours = _run(f8.Float8Linear.from_linear(copy.deepcopy(linear), recipe), x, dy)
    for name, mine, theirs in zip(("y", "dx", "dW"), ours, ao):
        assert mine.dtype == theirs.dtype == dtype, name
        if recipe == "tensorwise" or dtype == torch.bfloat16:
            assert torch.equal(mine, theirs), f"{name}: {recipe} {dtype} should be bit-equal to torchao"
        else:
            rel = ((mine - theirs).abs() / theirs.abs().clamp(min=1e-30)).max().item()
            assert rel <= BF16_ONCE, f"{name}: relative difference {rel:.2e} > one bf16 rounding"


def test_float8_linear_bias_and_autocast():
    torch.manual_seed(0)
    lin = f8.Float8Linear.from_linear(nn.Linear(32, 48), "tensorwise")
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16, "under autocast the input and output take the autocast dtype"
    assert lin.weight.dtype == torch.float32, "the weight keeps its own precision"
    ref = x @ lin.weight.detach().t() + lin.bias.detach()
    assert f8.round_trip_error(ref, y.detach().float()) < 0.1


def test_to_float8_training_swaps_linears_and_honours_the_filter():
    model = build_model(PRESETS["small"], seed=0)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    weights = {n: p for n, p in model.named_parameters()}
    f8.to_float8_training(model, "rowwise", module_filter_fn=lambda m, fqn: fqn != "head")
    swapped = [n for n, m in model.named_modules() if isinstance(m, f8.Float8Linear)]
    assert len(swapped) == n_linear - 1 and "head" not in swapped
    assert type(model.head) is nn.Linear
    assert all(p is weights[n] for n, p in model.named_parameters()), "parameters are shared, not copied"
    odd = nn.Sequential(nn.Linear(30, 64))
    f8.to_float8_training(odd)
    assert type(odd[0]) is nn.Linear, "in_features 30 is not a multiple of 16: kept in high precision"


def test_fp8_training_equals_torchao_step_for_step_and_follows_bf16():
    """Three AdamW steps of the course's GPT, every linear but the head in FP8 tensorwise: the losses equal
    torchao's bit for bit; and they stay near the bf16 run's (FP8's rounding is the only difference)."""
    cfg = PRESETS["small"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    keep_head = lambda m, fqn: fqn != "head"   # noqa: E731

    def train(model, steps=3):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(steps):
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    base = build_model(cfg, seed=0)
    ours = train(f8.to_float8_training(copy.deepcopy(base), "tensorwise", keep_head))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = train(ao.convert_to_float8_training(copy.deepcopy(base), module_filter_fn=keep_head))
    assert ours == theirs
    bf16 = train(copy.deepcopy(base).to(torch.bfloat16))
    assert all(abs(a - b) < 0.05 * b for a, b in zip(ours, bf16)), (ours, bf16)
    assert ours[-1] < ours[0]


# --- lesson 12's FP8 experiments (course_lib/lessons/l12_one_device/fp8.py) ---------------------------------------

def test_outlier_sweep_shows_where_the_scale_granularity_starts_to_matter():
    from course_lib.lessons.l12_one_device import fp8 as lab
    rows = {(r["factor"], r["granularity"]): r for r in lab.outlier_sweep(factors=(1e1, 1e5))}
    calm = [rows[(1e1, g)]["ordinary"] for g in ("per tensor", "per row (token)", "1 x 128 tiles")]
    assert max(calm) - min(calm) < 0.005, "outliers 10x: e4m3's range holds every channel whatever the scales"
    wild = {g: rows[(1e5, g)] for g in ("per tensor", "per row (token)", "per column (channel)", "1 x 128 tiles")}
    assert wild["per tensor"]["ordinary"] > 0.3 and wild["per tensor"]["zeros"] > 0.3
    assert wild["per column (channel)"]["ordinary"] < 0.03
    assert wild["1 x 128 tiles"]["ordinary"] < wild["per row (token)"]["ordinary"] < wild["per tensor"]["ordinary"]


def test_loss_curves_fp8_follows_bf16_and_refuses_a_wrong_vocabulary():
    from course_lib.lessons.l12_one_device import fp8 as lab
    curves = lab.loss_curves(PRESETS["small"], steps=4, batch_size=2)
    assert set(curves) == {"bf16", "tensorwise", "rowwise"} and all(len(v) == 4 for v in curves.values())
    for recipe in ("tensorwise", "rowwise"):
        assert all(abs(a - b) < 0.02 * b for a, b in zip(curves[recipe], curves["bf16"])), (recipe, curves)
    assert curves["tensorwise"] != curves["bf16"], "the fp8 run must run something else than bf16"
    with pytest.raises(ValueError, match="vocab_size=64"):
        lab.loss_curves(PRESETS["small"].replace(vocab_size=64), steps=1, batch_size=1)


def test_fp8_gemm_availability_by_device(monkeypatch):
    from course_lib.lessons.l12_one_device import fp8 as lab
    ok, why = lab.fp8_gemm_available("cpu")
    assert not ok and "dequantizes" in why
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, why = lab.fp8_gemm_available(torch.device("cuda", 0))
    assert not ok and "sm_80" in why and "A100" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert lab.fp8_gemm_available(torch.device("cuda", 0)) == (True, "")


def test_matmul_speed_reports_each_path():
    from course_lib.lessons.l12_one_device import fp8 as lab
    out = lab.matmul_speed(64, 128, 32, device="cpu", repeats=1)
    for name in ("bf16", "fp8 tensorwise", "fp8 rowwise"):
        assert out[name]["seconds"] > 0 and out[name]["flop_s"] == pytest.approx(2 * 64 * 128 * 32 / out[name]["seconds"])
    assert out["fp8_tensor_cores"] is False and out["hardware"].startswith("CPU")
