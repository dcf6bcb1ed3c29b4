"""The matmuls of a training step by their shapes (lesson 08; `course_lib.theory.planner`, issue 44): what fraction
of its peak a GPU reaches on each GEMM, from tile and wave quantization and the roofline, and the seconds one GPU
spends on a layer's matmuls.

The planner's first model ("flat", `step_time`'s default) prices every FLOP at one efficiency. That cannot be right
for every shape: a GEMM runs as tiles of its output, one thread block per tile on one streaming multiprocessor
(SM), in waves of as many tiles as the GPU has SMs. NVIDIA's "Matrix Multiplication Background User's Guide"
(DU-09799-001, 2023, sections 2.3 and 3) names the two losses this model prices, and the roofline a third:

- **tile quantization**: an output dimension that is not a multiple of the tile leaves part of the last tile idle;
- **wave quantization**: a tile count that is not a multiple of the SMs leaves the last wave part-empty (A100: 108
  SMs; H100 and H800 SXM5: 132);
- **the roofline**: a GEMM moves at least its operands and its output, ``2 (MK + KN + MN)`` bytes in bf16; below the
  ridge point (peak / HBM bandwidth) it waits on memory, which a few rows per expert or a head of 64 to 128
  dimensions in unfused attention do.

A GEMM of ``M x K`` times ``K x N`` then takes ``max(2MNK / (peak x efficiency x q), bytes / bandwidth)`` seconds,
where q is the fraction of the tiles' work that is real and ``efficiency`` is the one calibrated constant (what a
full tile reaches). The tile: 256 x 128 or 128 x 256, whichever wastes less; the guide calls these cuBLAS's most
efficient tiles (an assumption: cuBLAS picks among many by heuristics, which this model does not reproduce).
FlashAttention's fused kernel is priced as compute at the same efficiency (no roofline: it keeps its tiles on chip).

Left out: split-K and stream-K (which cuBLAS uses to fill the waves of a GEMM with few tiles), the efficiency of
smaller tiles, L2 reuse, and kernel launch time.
"""

from __future__ import annotations

import dataclasses
import math

from course_lib.config import ModelConfig
from course_lib.reference import reference_for
from course_lib.theory.experts import MoESpec

__all__ = ["TILES", "Gemm", "quantization", "gemm_seconds", "layer_gemms", "head_gemm", "implied_efficiency",
           "matmul_seconds"]

TILES = ((256, 128), (128, 256))        # cuBLAS's largest tiles for 16-bit GEMMs (the guide, section 2.3)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``batch`` independent GEMMs of an ``(m, k)`` by a ``(k, n)`` matrix, forward; ``name`` says which."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    fused: bool = False                 # FlashAttention: priced as compute, no roofline

    @property
    def flops(self) -> float:
        return 2 * self.batch * self.m * self.n * self.k

    def backward(self) -> tuple[Gemm, Gemm]:
        """The two GEMMs of its backward: the input's gradient ``(m, n) @ (n, k)`` and the weight's ``(k, m) @ (m,
        n)``, each as many FLOPs as the forward."""
        return (Gemm(self.name + " dgrad", self.m, self.k, self.n, self.batch, self.fused),
                Gemm(self.name + " wgrad", self.k, self.n, self.m, self.batch, self.fused))


@reference_for("12-tile-waves")
def quantization(m: int, n: int, sms: int, batch: int = 1, tiles=TILES) -> float:
    """The fraction of the tiles' work that is the GEMM's own, for the better of ``tiles``: ``batch x m x n`` over
    (waves x SMs x the tile's area), waves = ceil(tiles / SMs). 1.0 when m and n are multiples of the tile and the
    tile count a multiple of the SMs; ``sms=0`` (unknown) leaves out wave quantization."""
    best = 0.0
    for tm, tn in tiles:
        count = batch * math.ceil(m / tm) * math.ceil(n / tn)
        slots = math.ceil(count / sms) * sms if sms else count
        best = max(best, batch * m * n / (slots * tm * tn))
    return best


def gemm_seconds(g: Gemm, gpu, efficiency: float) -> float:
    """Seconds of ``g`` on ``gpu``: the larger of its FLOPs at ``efficiency`` x `quantization` of the bf16 peak
    and, unless fused, its bytes (operands and output, bf16) at the HBM bandwidth."""
    peak = gpu.bf16_tflops * 1e12
    if g.fused:
        return g.flops / (peak * efficiency)
    compute = g.flops / (peak * efficiency * quantization(g.m, g.n, getattr(gpu, "sms", 0), g.batch))
    memory = 2 * g.batch * (g.m * g.k + g.k * g.n + g.m * g.n) / (gpu.mem_bw_gbs * 1e9)
    return max(compute, memory)


def implied_efficiency(gemms, gpu, efficiency: float) -> float:
    """The fraction of the peak that ``gemms`` reach together, forward and backward: their FLOPs over (their
    seconds x peak). Below ``efficiency`` by what quantization and the roofline cost."""
    seconds = flops = 0.0
    for g in gemms:
        for one in (g, *g.backward()):
            seconds += gemm_seconds(one, gpu, efficiency)
            flops += one.flops
    return flops / (seconds * gpu.bf16_tflops * 1e12)


def layer_gemms(cfg: ModelConfig, tp: int, tokens: int, seq_len: int, micro_batch: int = 1,
                attention: str = "flash", moe: MoESpec | None = None, ep: int = 1, moe_block: bool = True) -> list:
    """A layer's forward GEMMs on one GPU for one micro-batch of ``micro_batch`` sequences, ``tokens`` of each on
    this GPU (s / cp) attending to ``seq_len`` keys, Megatron-style TP over ``tp`` ranks (column-parallel first
    matmuls split N, row-parallel second ones split K; with sequence parallelism the first ones see the gathered
    tokens, so every GEMM has M = b x tokens rows).

    Attention: q, k, v (k and v of ``n_kv_head`` heads) and the output projection, or ``moe.mla``'s five (their
    latent projections split over tp as well, so that the FLOPs are the model's / tp); the core per head, full s x
    s as the FLOP counts take it: ``q k^T`` and ``p v``, one fused kernel with ``attention="flash"``, two batched
    GEMMs (below the ridge point for heads of 64-128) with ``"naive"``. MLP: GELU's two, SwiGLU's gate-and-up and
    down. A MoE block (``moe`` and ``moe_block``): the router, the shared experts as one SwiGLU, and the E / ep
    routed experts of this rank, each with ``b x tokens x k x ep / E`` rows (uniform routing: the ep ranks' tokens
    spread over the experts), split over tp (expert TP = tp). The router is not split: every TP rank routes every
    token."""
    M, h, t = micro_batch * tokens, cfg.d_model, tp
    mla = None if moe is None else moe.mla
    if mla is None:
        heads, dqk, dv = cfg.n_head // t, cfg.head_dim, cfg.head_dim
        out = [Gemm("qkv", M, (h + 2 * cfg.n_kv_head * cfg.head_dim) // t, h), Gemm("attention out", M, h, h // t)]
    else:
        heads, dqk, dv = mla.n_head // t, mla.qk_head_dim, mla.v_head_dim
        out = [Gemm("q down", M, mla.q_lora_rank // t, h), Gemm("q up", M, mla.n_head * dqk // t, mla.q_lora_rank),
               Gemm("kv down", M, (mla.kv_lora_rank + mla.qk_rope_head_dim) // t, h),
               Gemm("kv up", M, mla.n_head * (mla.qk_nope_head_dim + dv) // t, mla.kv_lora_rank),
               Gemm("attention out", M, h, mla.n_head * dv // t)]
    fused = attention == "flash"
    out += [Gemm("scores", tokens, seq_len, dqk, micro_batch * heads, fused),
            Gemm("weighted values", tokens, dv, seq_len, micro_batch * heads, fused)]
    if moe is not None and moe_block:
        E, k, F = moe.n_experts, moe.top_k, moe.expert_d_ff
        rows = max(1, M * k * ep // E)
        out.append(Gemm("router", M, E, h))
        if moe.shared_d_ff:
            out += [Gemm("shared gate+up", M, 2 * moe.shared_d_ff // t, h), Gemm("shared down", M, h,
                                                                             moe.shared_d_ff // t)]
        out += [Gemm("experts gate+up", rows, 2 * F // t, h, E // ep), Gemm("experts down", rows, h, F // t, E // ep)]
    elif cfg.mlp == "swiglu":
        out += [Gemm("mlp gate+up", M, 2 * cfg.d_ff // t, h), Gemm("mlp down", M, h, cfg.d_ff // t)]
    else:
        out += [Gemm("mlp up", M, cfg.d_ff // t, h), Gemm("mlp down", M, h, cfg.d_ff // t)]
    return out


def head_gemm(cfg: ModelConfig, tp: int, tokens: int, micro_batch: int = 1) -> Gemm:
    """The LM head's GEMM on one GPU of the last stage: ``(b x tokens, h) @ (h, V / tp)``."""
    return Gemm("lm head", micro_batch * tokens, cfg.vocab_size // tp, cfg.d_model)


def _pass_seconds(gemms, gpu, efficiency: float) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, forward FLOPs) of ``gemms``."""
    fwd = sum(gemm_seconds(g, gpu, efficiency) for g in gemms)
    bwd = sum(gemm_seconds(b, gpu, efficiency) for g in gemms for b in g.backward())
    return fwd, bwd, sum(g.flops for g in gemms)


def matmul_seconds(cfg: ModelConfig, gpu, tp: int, pp: int, tokens: int, seq_len: int, micro_batch: int,
                   ckpt: str, efficiency: float, attention: str = "flash", moe: MoESpec | None = None,
                   ep: int = 1) -> dict:
    """One micro-batch's matmuls on one GPU, averaged over the pp stages (each holds L / pp layers; the last
    adds the LM head: uneven stages are left out, as in the flat model): {forward, backward, recompute, seconds,
    flops (executed), model_flops}. Full recomputation runs each layer's forward again, never the LM head's (it is
    not checkpointed: Megatron-LM's FLOP count, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), charges it three passes
    where the layers get four); selective recomputation runs the attention core's forward again."""
    s = seq_len
    dense = layer_gemms(cfg, tp, tokens, s, micro_batch, attention, moe, ep, moe_block=False)
    n_moe = 0 if moe is None else moe.moe_layers(cfg)
    n_dense = cfg.n_layer - n_moe
    parts = [(n_dense, dense)]
    if n_moe:
        parts.append((n_moe, layer_gemms(cfg, tp, tokens, s, micro_batch, attention, moe, ep)))
    fwd = bwd = again = flops = again_flops = 0.0
    for count, gemms in parts:
        f, b, fl = _pass_seconds(gemms, gpu, efficiency)
        core = [g for g in gemms if g.name in ("scores", "weighted values")]
        cf, _, cfl = _pass_seconds(core, gpu, efficiency)
        fwd, bwd, flops = fwd + count * f, bwd + count * b, flops + count * fl
        redo, redo_flops = {"none": (0.0, 0.0), "selective": (cf, cfl), "full": (f, fl)}[ckpt]
        again, again_flops = again + count * redo, again_flops + count * redo_flops
    hf, hb, hfl = _pass_seconds([head_gemm(cfg, tp, tokens, micro_batch)], gpu, efficiency)
    fwd, bwd, flops = (fwd + hf) / pp, (bwd + hb) / pp, (flops + hfl) / pp
    again, again_flops = again / pp, again_flops / pp
    return dict(forward=fwd, backward=bwd, recompute=again, seconds=fwd + bwd + again,
                flops=3 * flops + again_flops, model_flops=3 * flops)
