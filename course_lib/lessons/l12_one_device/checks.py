"""What the graded exercises of lesson 12 call (solutions/12_one_device.ipynb).

The learner writes, with the signatures below:

    quantize_rows(x, fp8_dtype) -> (data, scale)                                 12-fp8-rows
    fp8_linear_grads(x, weight, dy, quantize, fp8_mm) -> (y, dx, dw)             12-fp8-linear
    tile_fraction(m, n, sms, tile) -> float                                      12-tile-waves
    step_ceilings(times, step_s, model_flops, peak) -> dict                      12-profile-ceiling

Each check compares with the course's implementation (`course_lib.parallel.float8`, `theory.planner.matmuls`) or
with values the rules fix, on sizes chosen so that the usual mistakes show (M, K and N all different; an all-zero
row; a row whose largest magnitude is negative; both FP8 formats), and a failure raises `CheckFailed` with a
one-line message naming the case.
"""

from __future__ import annotations

import functools

import torch

from course_lib.grading.check import CheckFailed, check_close, check_equal, check_true
from course_lib.parallel import float8 as f8
from course_lib.theory.planner.matmuls import quantization

__all__ = ["quantize_along", "fp8_mm", "check_quantize_rows", "check_fp8_linear", "check_tile_fraction",
           "check_step_ceilings"]


def _call(name: str, fn, *args):
    """fn(*args); a learner's exception becomes a failed check naming the case (one line, no traceback)."""
    try:
        return fn(*args)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check, not a crash
        hint = ("read the shapes in the message: which operand, which axis"
                if isinstance(exc, (ValueError, RuntimeError, IndexError)) else "the error is in your function")
        raise CheckFailed(name, f"raised {type(exc).__name__}: {exc}", hint) from None


# ------------------------------------------------------------------------------ 12-fp8-rows

def _rows_input(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 40, generator=g) * torch.logspace(-2, 2, 6)[:, None]   # rows of very different size
    x[1, 7] = -300.0                                                         # a row whose largest |x| is negative
    x[3] = 0.0                                                               # an all-zero row
    x[5] = x[5] / x[5].abs().max() * 1e-4                                    # a gradient-sized row: amax 1e-4
    x[4, 20:30] *= 1e-3                 # values that land below 1 once scaled, still in e4m3's normal range
    return x


def check_quantize_rows(quantize_rows) -> dict:
    """quantize_rows(x, fp8_dtype) -> (data, scale) for e4m3 and e5m2: scale float32 of shape (rows, 1); data in
    the format; each non-zero row's largest magnitude lands on the format's largest finite value; an all-zero row
    gives finite scales and zeros; the round trip data / scale is within half a step of the format of x (relative
    2^-4 for e4m3, 2^-3 for e5m2, for values in the normal range). Returns {format: relative round-trip error}."""
    x = _rows_input()
    out = {}
    for dtype, name in ((f8.E4M3, "e4m3"), (f8.E5M2, "e5m2")):
        case = f"quantize_rows(x of shape (6, 40), {name})"
        data, scale = _call(case, quantize_rows, x.clone(), dtype)
        check_equal(f"{case}: data dtype", str(data.dtype), str(dtype),
                    hint="cast the scaled values to the FP8 dtype you were given")
        check_equal(f"{case}: scale shape", tuple(scale.shape), (6, 1),
                    hint="one scale per row, kept as a column so that it broadcasts over the row")
        check_equal(f"{case}: scale dtype", str(scale.dtype), "torch.float32", hint="keep the scales in float32")
        fmax = torch.finfo(dtype).max
        top = data.float().abs().amax(dim=1)
        nonzero = [0, 1, 2, 4, 5]
        check_close(f"{case}: each row's largest |value| after scaling (row 1's largest is -300)",
                    top[nonzero], torch.full((5,), fmax), rtol=1e-6, atol=0,
                    hint="the scale maps the row's largest magnitude (abs!) onto the format's own largest finite "
                         "value, torch.finfo(fp8_dtype).max")
        check_true(f"{case}: the all-zero row's scale is finite", bool(torch.isfinite(scale[3]).all()),
                   hint="an all-zero row has amax 0: floor the amax at a tiny positive number before dividing")
        check_true(f"{case}: the all-zero row's scale is positive", bool((scale[3] > 0).all()),
                   hint="data / scale reads the row back: a zero scale gives 0 / 0")
        check_equal(f"{case}: the all-zero row stays zero", data[3].float().abs().max().item(), 0.0)
        back = data.float() / scale
        step = torch.finfo(dtype).eps / 2                              # half the gap between 1 and the next value
        scaled = x.abs() * fmax / x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
        normal = (scaled >= torch.finfo(dtype).smallest_normal) & (x != 0)   # where the format keeps its precision
        rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[normal]
        worst = int(rel.argmax())
        check_true(f"{case}: round trip data / scale (largest relative error {rel.max().item():.3g} at "
                   f"{x[normal][worst].item():.3g} in a row of largest |value| "
                   f"{x.abs().amax(dim=1, keepdim=True).expand_as(x)[normal][worst].item():.3g}; allowed {step})",
                   rel.max().item() <= step * (1 + 1e-5),
                   hint="x is read back as data / scale: multiply by the scale before the cast, not divide, and let "
                        "the cast do the rounding (the format keeps values below 1 too)")
        out[name] = f8.round_trip_error(x, back)
    return out


# ------------------------------------------------------------------------------ 12-fp8-linear

# The exercise's recipe: every operand e4m3, one scale per row of A and per column of B, scales not rounded
EXERCISE_RECIPE = f8.Float8Recipe("exercise", axiswise=True, grad_dtype=f8.E4M3, power_of_2=False)


def quantize_along(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Given to the learner: (e4m3 data, float32 scale) of a 2-D t with the amax taken along `axis`, so the scale is
    constant along `axis` (kept as a size-1 dimension): axis=1 gives one scale per row, axis=0 one per column."""
    if t.dim() != 2 or axis not in (0, 1, -1, -2):
        raise ValueError(f"quantize_along takes a 2-D tensor and axis 0 or 1, got shape {tuple(t.shape)}, "
                         f"axis {axis}")
    return f8.quantize(t, f8.E4M3, axis=axis)


def fp8_mm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor,
           b_scale: torch.Tensor) -> torch.Tensor:
    """Given to the learner: (a_data / a_scale) @ (b_data / b_scale) in float32 through `torch._scaled_mm`, for
    a (M, K), b (K, N). The scales must be constant along K: a_scale of shape (M, 1), b_scale of shape (1, N)."""
    (M, K), (K2, N) = a_data.shape, b_data.shape
    if K != K2:
        raise ValueError(f"fp8_mm: a is {M} x {K} and b is {K2} x {N}: the inner sizes differ")
    if tuple(a_scale.shape) != (M, 1) or tuple(b_scale.shape) != (1, N):
        raise ValueError(f"fp8_mm: a ({M} x {K}) needs a scale of shape ({M}, 1), got {tuple(a_scale.shape)}; b "
                         f"({K} x {N}) needs ({1}, {N}), got {tuple(b_scale.shape)}: a scale that varies along "
                         f"K cannot be taken out of the sum")
    return f8.scaled_mm(a_data, a_scale, b_data, b_scale, torch.float32)


def check_fp8_linear(fp8_linear_grads) -> dict:
    """fp8_linear_grads(x (T, in), weight (out, in), dy (T, out), quantize_along, fp8_mm) -> y, dx, dw, each equal
    (to float32 summation order) to the course's FP8 linear with one scale per row of A and per column of B, all
    e4m3; T, in and out all different; each also within FP8's error of the exact product. Returns the relative
    errors against the exact products."""
    g = torch.Generator().manual_seed(5)
    T, n_in, n_out = 24, 48, 32
    x, w, dy = torch.randn(T, n_in, generator=g), torch.randn(n_out, n_in, generator=g), torch.randn(T, n_out, generator=g)
    x[2, 3], w[5, 1], dy[7, 9] = 40.0, -9.0, 25.0                  # outliers: each axis's scales differ
    case = f"fp8_linear_grads(x {T}x{n_in}, weight {n_out}x{n_in}, dy {T}x{n_out})"
    returned = []                                                # every product fp8_mm computed in the call

    @functools.wraps(fp8_mm)
    def recorded_mm(*args):
        out = fp8_mm(*args)
        returned.append(out)
        return out

    got = _call(case, fp8_linear_grads, x.clone(), w.clone(), dy.clone(), quantize_along, recorded_mm)
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise CheckFailed(case, f"returned {type(got).__name__}, expected a tuple (y, dx, dw)")
    r = EXERCISE_RECIPE
    want = {"y": f8.fp8_matmul(x, w.t(), r), "dx": f8.fp8_matmul(dy, w, r), "dw": f8.fp8_matmul(dy.t(), x, r)}
    exact = {"y": x @ w.t(), "dx": dy @ w, "dw": dy.t() @ x}
    hints = {"y": "y = x W^T sums over the input features: each operand's scale must be constant along them",
             "dx": "dx = dy W sums over the output features: each operand's scale must be constant along them",
             "dw": "dW = dy^T x sums over the tokens: each operand's scale must be constant along them"}
    errors = {}
    for name, value in zip(("y", "dx", "dw"), got):
        check_equal(f"{case}: {name} shape", tuple(value.shape), tuple(want[name].shape),
                    hint=f"{name} has the shape of the tensor it is the gradient of (or the output)")
        check_close(f"{case}: {name} (each operand cast to e4m3 with scales constant along the summed axis)",
                    value.float(), want[name], rtol=1e-5, atol=1e-4, hint=hints[name])
        check_true(f"{case}: {name} is a product that fp8_mm returned (or its transpose)",
                   any(_same_product(value, out) for out in returned),
                   hint="compute each of the three products with fp8_mm on operands from quantize, not with @ or "
                        "torch.matmul on dequantized copies")
        errors[name] = f8.round_trip_error(exact[name], value)
    return errors


def _same_product(value: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``value`` is ``out`` or its transpose: the same storage (a view) or equal element for element."""
    if value.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        return True
    return any(tuple(value.shape) == tuple(o.shape) and torch.equal(value.float(), o.float()) for o in (out, out.t()))


# ------------------------------------------------------------------------------ 12-tile-waves

TILE_CASES = [  # (m, n, sms, tile): each makes a mistake show
    (8192, 50304, 132, (256, 128)),     # the padded vocabulary: whole tiles, 12,576 of them on 132 SMs
    (8192, 50257, 132, (256, 128)),     # GPT-2's vocabulary: a last column of partial tiles
    (1000, 1000, 108, (256, 128)),      # partial tiles both ways
    (256, 128 * 133, 132, (256, 128)),  # 133 tiles on 132 SMs: a second wave for one tile
    (512, 256, 4, (128, 128)),          # 8 tiles on 4 SMs: two full waves
    (300, 512, 4, (256, 128)),          # a partial row of tiles that needs a second wave
    (256, 640, 5, (256, 128)),          # m != n under a non-square tile: 5 tiles fill 5 SMs exactly
    (300, 512, 5, (256, 128)),          # 8 tiles in 2 waves, where the output's area would say 5 tiles in 1
]


def check_tile_fraction(tile_fraction) -> list:
    """tile_fraction(m, n, sms, tile) equals the fraction of the launched tile slots' work that is the GEMM's own
    (course_lib.theory.planner.matmuls.quantization with the one tile) on `TILE_CASES`. Returns [(case, value)]."""
    out = []
    for m, n, sms, tile in TILE_CASES:
        case = f"tile_fraction(m={m}, n={n}, sms={sms}, tile={tile})"
        got = _call(case, tile_fraction, m, n, sms, tile)
        want = quantization(m, n, sms, tiles=(tile,))
        check_close(case, got, want, rtol=1e-9, atol=0,
                    hint="count whole tiles along m with the tile's first size and along n with its second (a "
                         "partial tile costs a whole one); the SMs run them in waves, and a last wave that is "
                         "not full costs a whole wave")
        out.append((case, float(got)))
    return out


# ------------------------------------------------------------------------------ 12-profile-ceiling

PROFILE = dict(times={"matmul": 0.050, "attention": 0.012, "elementwise": 0.028, "optimizer": 0.015},
               step_s=0.125, model_flops=2.0e13, peak=989e12)     # 0.020 s of the step is idle: no kernel runs


def check_step_ceilings(step_ceilings) -> dict:
    """step_ceilings(times, step_s, model_flops, peak) -> {"mfu": fraction now, "ceiling": {category: MFU if that
    category took no time}} for every category but "matmul"; on `PROFILE` (whose categories leave 20 ms idle) and
    on the same profile with no idle time. Returns the first result."""
    first = None
    for label, prof in (("a step with 20 ms idle", PROFILE),
                        ("a step with no idle time", dict(PROFILE, step_s=sum(PROFILE["times"].values()))),
                        ("a profile with an 'other' category", dict(PROFILE, times=dict(PROFILE["times"], other=0.009)))):
        case = f"step_ceilings({label})"
        got = _call(case, step_ceilings, dict(prof["times"]), prof["step_s"], prof["model_flops"], prof["peak"])
        if not isinstance(got, dict) or set(got) != {"mfu", "ceiling"}:
            raise CheckFailed(case, f"returned {got!r:.80}, expected a dict with keys 'mfu' and 'ceiling'")
        mfu = prof["model_flops"] / (prof["step_s"] * prof["peak"])
        check_close(f"{case}: mfu (a fraction of the peak)", got["mfu"], mfu, rtol=1e-6, atol=0,
                    hint="MFU divides the model's FLOPs by what the peak could do in the whole step's wall time, "
                         "idle included; a fraction, not a percentage")
        want = {c: prof["model_flops"] / ((prof["step_s"] - t) * prof["peak"])
                for c, t in prof["times"].items() if c != "matmul"}
        check_equal(f"{case}: ceiling's categories", sorted(got["ceiling"]), sorted(want),
                    hint="every category of the profile but the matmuls (the work itself)")
        for c, value in want.items():
            check_close(f"{case}: ceiling[{c!r}]", got["ceiling"][c], value, rtol=1e-6, atol=0,
                        hint="the step without that category's time: the rest of the step, idle included, stays")
        first = first or got
    return first
