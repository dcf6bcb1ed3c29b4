"""FP8 training from scratch (lesson 12): scales, saturating casts, and a linear whose three GEMMs run in FP8.

An FP8 number has 8 bits: e4m3 (4 exponent bits, 3 mantissa bits, largest 448, no infinity) keeps more precision,
e5m2 (5 and 2, largest 57,344) more range (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; `FORMATS` and
`format_info` of `parallel.precision` print both). A tensor does not fit that range on its own, so it is *scaled*
first: s = max_fp8 / amax, stored as fp8(x * s), read back as fp8 / s. Where the amax is taken decides how much of
the tensor one outlier spoils:

    tensorwise   one scale per tensor                    torchao's "tensorwise" recipe (its default)
    rowwise      one scale per row of a GEMM operand     torchao's "rowwise" recipe (scales rounded down to 2^k)
    1 x 128      one scale per token per 128 channels    DeepSeek-V3's activations (weights: 128 x 128 blocks)

A GEMM sums over its inner dimension K, so a scale can be taken out of the sum only if it is constant along K: every
scale here is one per row of A (M x K) and one per column of B (K x N), never one per K. That is why the same tensor
is scaled along different axes in the three GEMMs of a linear layer y = x W^T:

    forward       y  = x  @ W^T     x (tokens x in) per token       W^T (in x out) per output feature
    grad input    dx = dy @ W       dy per token                    W (out x in) per input feature
    grad weight   dW = dy^T @ x     dy^T per output feature         x per input feature   (K is the token axis)

Each GEMM runs through `torch._scaled_mm(a_fp8, b_fp8, scale_a=1/s_a, scale_b=1/s_b)`, which multiplies the fp8
products back by the inverse scales (on a GPU with FP8 tensor cores: sm_89 and newer; torch 2.14 also runs it on the
CPU, tensorwise and rowwise, by dequantizing). Blockwise scales (1 x 128, 128 x 128) are not accepted by the CPU
`_scaled_mm` of torch 2.14 ("Invalid scaling configuration"), so `blockwise_matmul` *emulates* them: dequantize,
then one fp32 matmul. It shows the numerics of DeepSeek-V3's recipe, not its speed.

Checked against torchao 0.18's `Float8Linear` in tests/test_float8.py: the same fp8 bits and scales; tensorwise
outputs and gradients bit-equal, rowwise equal up to torchao's rounding of rowwise results to bf16 (see
`Float8Linear`). Left out: delayed scaling (amax history), FP8 all-gather of FSDP weights, fp8 attention.

    model = to_float8_training(build_model(cfg), recipe="rowwise",
                               module_filter_fn=lambda mod, fqn: fqn != "head")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from course_lib.reference import reference_for

__all__ = ["E4M3", "E5M2", "EPS", "Float8Recipe", "RECIPES", "amax_to_scale", "quantize", "dequantize",
           "round_trip_error", "scaled_mm", "fp8_matmul", "quantize_blocks", "dequantize_blocks", "blockwise_matmul",
           "Float8Linear", "to_float8_training"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12                       # amax floor: an all-zero tensor gets a large finite scale, not inf (torchao's EPS)


@dataclass(frozen=True)
class Float8Recipe:
    """How the operands of a Float8Linear's GEMMs are scaled.

    axiswise: one scale per row of A and per column of B (False: one scale per tensor).
    grad_dtype: the format of the output gradient dy (x and W are always e4m3).
    power_of_2: round every scale down to a power of two, so that x * s changes only the exponent (exact)."""
    name: str
    axiswise: bool
    grad_dtype: torch.dtype
    power_of_2: bool


# torchao 0.18, torchao/float8/config.py: `Float8LinearConfig()` (tensorwise: inputs and weights e4m3, grad_output
# e5m2) and `from_recipe_name("rowwise")` (AXISWISE, e4m3 for all three, round_scales_to_power_of_2=True).
RECIPES = {"tensorwise": Float8Recipe("tensorwise", axiswise=False, grad_dtype=E5M2, power_of_2=False),
           "rowwise": Float8Recipe("rowwise", axiswise=True, grad_dtype=E4M3, power_of_2=True)}


def _check_fp8(dtype: torch.dtype) -> None:
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"dtype={dtype} is not an FP8 format: use torch.float8_e4m3fn or torch.float8_e5m2")


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype = E4M3, power_of_2: bool = False) -> torch.Tensor:
    """s = max_fp8 / amax (in float64, then float32), amax floored at EPS; optionally rounded down to 2^floor(log2 s).
    Rounding *down* keeps amax * s <= max_fp8: the largest element still fits."""
    _check_fp8(dtype)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


@reference_for("12-fp8-rows")
@torch.no_grad()
def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3, axis: int | None = None,
             power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, fp32 scale) with x ~ data / scale. axis=None: one scale for the tensor (0-dim); axis=k: the amax
    is taken along k (keepdim), so the scale is constant along k and there is one per slice across it.
    Values beyond the format saturate at +-max_fp8 instead of overflowing."""
    _check_fp8(dtype)
    x32 = x.float()
    amax = x32.abs().amax() if axis is None else x32.abs().amax(dim=axis, keepdim=True)
    scale = amax_to_scale(amax, dtype, power_of_2)
    fp8_max = torch.finfo(dtype).max
    return (x32 * scale).clamp(-fp8_max, fp8_max).to(dtype), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data / scale in `dtype` (scale broadcasts: a 0-dim scale or one with a kept axis of size 1)."""
    return (data.float() / scale).to(dtype)


def round_trip_error(x: torch.Tensor, dequantized: torch.Tensor) -> float:
    """Relative error of a round trip, ||x - x'|| / ||x|| (Frobenius norms, fp32)."""
    x32 = x.float()
    return ((x32 - dequantized.float()).norm() / x32.norm().clamp(min=EPS)).item()


def scaled_mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a_data / a_scale) @ (b_data / b_scale) through `torch._scaled_mm`, which takes the inverse scales and its
    second operand column-major (laid out so here)."""
    return torch._scaled_mm(a_data.contiguous(), b_data.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


@reference_for("12-fp8-linear")
def fp8_matmul(a: torch.Tensor, b: torch.Tensor, recipe: Float8Recipe | str = "tensorwise",
               a_dtype: torch.dtype = E4M3, b_dtype: torch.dtype = E4M3,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a (M, K) @ b (K, N) with both operands cast to FP8, scales constant along K, through `torch._scaled_mm`.
    out_dtype: a's dtype unless given."""
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul multiplies (M, K) @ (K, N); got {tuple(a.shape)} @ {tuple(b.shape)}")
    a8, sa = quantize(a, a_dtype, axis=-1 if recipe.axiswise else None, power_of_2=recipe.power_of_2)   # (M, 1)
    b8, sb = quantize(b, b_dtype, axis=0 if recipe.axiswise else None, power_of_2=recipe.power_of_2)    # (1, N)
    return scaled_mm(a8, sa, b8, sb, out_dtype or a.dtype)


class _Float8Matmul(torch.autograd.Function):
    """y = x @ W^T with x (T, in), W (out, in); forward and both backward GEMMs in FP8 (the table in the module
    docstring). Saves x and W in their own precision and casts them again in the backward, as torchao does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        return fp8_matmul(x, weight.t(), recipe)                            # (T, in) @ (in, out)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        r = ctx.recipe
        dx = fp8_matmul(dy, weight, r, a_dtype=r.grad_dtype)                # (T, out) @ (out, in): K = out
        dw = fp8_matmul(dy.t(), x, r, a_dtype=r.grad_dtype)                 # (out, T) @ (T, in): K = tokens
        return dx, dw, None


class Float8Linear(nn.Linear):
    """nn.Linear whose matmul runs in FP8 (`recipe`); the bias is added in the output's precision.

    Under autocast the input is cast to the autocast dtype first (the weight stays in its own: it is cast to FP8).
    The output and dx have the input's (dy's) dtype. torchao 0.18 differs in one place: for rowwise scales with an
    fp32 or fp16 output it asks `_scaled_mm` for bf16 and casts back ("work around torch._scaled_mm not having float32
    output type", torchao/float8/float8_ops.py), so its fp32 results carry bf16 rounding; torch 2.14's CPU
    `_scaled_mm` returns fp32 directly, and this class asks for it."""

    recipe: Float8Recipe

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Float8Recipe | str = "tensorwise") -> "Float8Linear":
        """A Float8Linear sharing `linear`'s parameters (no copy)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.recipe)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"


def to_float8_training(model: nn.Module, recipe: Float8Recipe | str = "tensorwise",
                       module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for a Float8Linear sharing its parameters; returns the model.
    module_filter_fn(module, fully qualified name) -> False keeps that linear in high precision (the argument and
    its order are those of torchao's `convert_to_float8_training`). Unlike torchao, which swaps every linear the
    filter lets through, a linear whose in or out features are not multiples of 16 is kept as is here (the GPU's
    FP8 GEMMs need them so)."""
    recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or child.in_features % 16 or child.out_features % 16:
                continue
            if module_filter_fn is None or module_filter_fn(child, full):
                setattr(mod, child_name, Float8Linear.from_linear(child, recipe))
    return model


# --- DeepSeek-V3's fine-grained scales (emulated: the CPU `_scaled_mm` takes no block scales) --------------------

@torch.no_grad()
def quantize_blocks(x: torch.Tensor, block: tuple[int, int] = (1, 128),
                    dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, scales of shape (R / br, C / bc)) for a 2-D x cut into br x bc blocks, one scale each.
    DeepSeek-V3: (1, 128) for activations (per token per 128 channels), (128, 128) for weights."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks takes a 2-D tensor, got shape {tuple(x.shape)}")
    (R, C), (br, bc) = x.shape, block
    if R % br or C % bc:
        raise ValueError(f"shape {tuple(x.shape)} is not a whole number of {br} x {bc} blocks: pad it, or pick a "
                         f"block that divides both sides")
    tiles = x.float().reshape(R // br, br, C // bc, bc)                      # (R/br, br, C/bc, bc)
    scale = amax_to_scale(tiles.abs().amax(dim=(1, 3)), dtype)               # (R/br, C/bc)
    fp8_max = torch.finfo(dtype).max
    data = (tiles * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(dtype)
    return data.reshape(R, C), scale


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor that `quantize_blocks` encoded: each block divided by its scale."""
    R, C = data.shape
    br, bc = R // scale.shape[0], C // scale.shape[1]
    tiles = data.float().reshape(scale.shape[0], br, scale.shape[1], bc)
    return (tiles / scale[:, None, :, None]).reshape(R, C)


def blockwise_matmul(a: torch.Tensor, b: torch.Tensor, block: int = 128) -> torch.Tensor:
    """a (M, K) @ b (K, N) in DeepSeek-V3's FP8 numerics, emulated: a in 1 x block tiles, b in block x block blocks,
    both e4m3, dequantized (data / scale, rounded to fp32), then one fp32 matmul (the GPU kernel instead multiplies each
    128-element partial sum of K by its scales when it promotes it to fp32). fp32 result."""
    a8, sa = quantize_blocks(a, (1, block))
    b8, sb = quantize_blocks(b, (block, block))
    return dequantize_blocks(a8, sa) @ dequantize_blocks(b8, sb)
