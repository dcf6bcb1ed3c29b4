"""Lesson 12's coding exercises answered independently: written from exercises/12_one_device.ipynb and the
docstrings of the helpers it hands out, without reading the official solution or the course's implementation (see
README.md beside this file)."""

ANSWERS = {
    "12-fp8-rows": r'''def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype):
    """x (R, C) float -> data (R, C) in fp8_dtype, scale (R, 1) float32, with x ~ data / scale (lesson 12)."""
    fmax = torch.finfo(fp8_dtype).max
    xf = x.to(torch.float32)
    row_amax = xf.abs().amax(dim=1, keepdim=True)
    # an all-zero row: any finite scale will do, its data is zero anyway
    row_amax = torch.where(row_amax > 0, row_amax, torch.ones_like(row_amax))
    scale = (fmax / row_amax).to(torch.float32)
    scaled = (xf * scale).clamp(min=-fmax, max=fmax)   # saturate instead of overflowing
    data = scaled.to(fp8_dtype)
    return data, scale
''',
    "12-fp8-linear": r'''def fp8_linear_grads(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, quantize, fp8_mm):
    """x (T, in), weight (out, in), dy (T, out) -> y (T, out), dx (T, in), dw (out, in), every product through
    fp8_mm on operands from quantize (lesson 12)."""

    def gemm(a, b):
        # a (M, K) @ b (K, N): each scale must be constant along K, the summed axis
        a_q, a_s = quantize(a, 1)      # amax along K of each row of a  -> (M, 1)
        b_q, b_s = quantize(b, 0)      # amax along K of each column of b -> (1, N)
        return fp8_mm(a_q, a_s, b_q, b_s)

    y = gemm(x, weight.t())            # (T, in) @ (in, out): sums over in
    dx = gemm(dy, weight)              # (T, out) @ (out, in): sums over out
    dw = gemm(dy.t(), x)               # (out, T) @ (T, in): sums over tokens
    return y, dx, dw
''',
    "12-tile-waves": r'''def tile_fraction(m: int, n: int, sms: int, tile: tuple[int, int]) -> float:
    """The fraction of the launched tiles' work that is the m x n GEMM's own (lesson 12)."""
    tm, tn = tile
    n_tiles = math.ceil(m / tm) * math.ceil(n / tn)    # partial tiles count whole
    n_waves = math.ceil(n_tiles / sms)                  # a partial wave counts whole
    launched = n_waves * sms * tm * tn
    return (m * n) / launched
''',
    "12-profile-ceiling": r'''def step_ceilings(times: dict, step_s: float, model_flops: float, peak: float) -> dict:
    """{"mfu": MFU now, "ceiling": {category: MFU without that category}} for every category but matmul (lesson 12)."""
    def mfu_at(seconds):
        return model_flops / seconds / peak

    ceiling = {}
    for category, spent in times.items():
        if category == "matmul":
            continue
        ceiling[category] = mfu_at(step_s - spent)   # the idle gaps and the other kernels stay
    return {"mfu": mfu_at(step_s), "ceiling": ceiling}
''',
}
