"""What fraction of peak the matmuls reach, by shape (lesson 08, section 5.2; issue 44): each published A100 row's
implied efficiency (the one constant that would reproduce it alone) beside what tile and wave quantization and the
roofline predict for its layer's GEMMs (`theory.planner.matmuls`), and DeepSeek-V3's expert GEMMs against the tokens
each expert receives. Formulas and datasheet numbers only; no GPU is measured here.
"""

from __future__ import annotations

from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory.planner import implied_efficiency, layer_gemms
from course_lib.lessons.l08_three_d.runs import DEEPSEEK_V3, THROUGHPUT_RUNS, PublishedRun
from course_lib.lessons.l08_three_d.throughput import calibrate, efficiencies, layout_of

__all__ = ["EPS", "by_hidden_size", "by_tokens_per_expert", "efficiency_text"]

EPS = (1, 2, 4, 8, 16, 32, 64, 128, 256)      # expert-parallel degrees of DeepSeek-V3's 256 experts


def _layer(run: PublishedRun) -> list:
    lay = layout_of(run)
    attention = "naive" if run.kernels == "unfused" else "flash"
    return layer_gemms(run.config, lay.tp, run.seq_len // lay.cp, run.seq_len, lay.micro_batch, attention)


def by_hidden_size(runs=THROUGHPUT_RUNS) -> list[dict]:
    """Per scored A100 run: its hidden size, ``implied`` (the flat model's efficiency that reproduces its reported
    TFLOP/s alone: `throughput.calibrate` on that row) and ``shapes`` (its layer's GEMMs, forward and backward, at
    the A100 constant of the shapes model: what quantization and the roofline leave of it)."""
    eff = efficiencies(matmuls="shapes")["A100"]
    gpu = GPU_SPECS["A100"]
    return [dict(name=r.name, h=r.config.d_model, tp=r.tp, implied=calibrate(r),
                 shapes=implied_efficiency(_layer(r), gpu, eff)) for r in runs if r.scored and r.gpu == "A100"]


def by_tokens_per_expert(run: PublishedRun = DEEPSEEK_V3, eps=EPS) -> dict:
    """DeepSeek-V3's routed-expert GEMMs on one GPU of the run (gate and up, then down: C 7,168, F 2,048, tp 1; the
    rank's E / ep experts as one grouped GEMM each), micro-batch 1 of 4,096 tokens, at the H100 constant of the
    shapes model, for each ep of ``eps``: each expert receives ``s k ep / E`` rows (uniform routing). Also the rows
    at which an expert's GEMM reaches the GPU's ridge point (peak / HBM bandwidth)."""
    gpu, eff = GPU_SPECS[run.gpu], efficiencies(matmuls="shapes")["H100"]
    cfg, moe = run.config, run.moe

    def experts(ep: int) -> list:
        return [g for g in layer_gemms(cfg, 1, run.seq_len, run.seq_len, 1, "flash", moe, ep)
                if g.name.startswith("experts")]

    ridge = gpu.bf16_tflops * 1e3 / gpu.mem_bw_gbs                 # FLOP per byte
    g = experts(1)[0]
    k, n = g.k, g.n                                                # rows m: intensity m k n / (m k + k n + m n)
    rows_at = lambda r: r * k * n / (k * n - r * (k + n))          # the rows whose intensity is r
    groups = [experts(ep) for ep in eps]
    return dict(eps=list(eps), rows=[gemms[0].m for gemms in groups],
                efficiency=[implied_efficiency(gemms, gpu, eff) for gemms in groups], constant=eff,
                published_ep=run.ep, ridge=ridge, ridge_rows=rows_at(ridge),
                ridge_rows_at_constant=rows_at(ridge * eff), gpu=gpu.name)


def efficiency_text(hidden: list[dict], experts: dict) -> str:
    """The two tables behind the figure, in a few lines."""
    lines = [f"{'run':<30} {'h':>6} {'tp':>3} {'implied (flat)':>15} {'shapes model':>13}"]
    lines += [f"{r['name']:<30} {r['h']:>6,} {r['tp']:>3} {r['implied']:>15.3f} {r['shapes']:>13.3f}" for r in hidden]
    lines.append(f"DeepSeek-V3's expert GEMMs on one {experts['gpu']} (shapes model at {experts['constant']:.3f}; "
                 f"ridge point {experts['ridge']:.0f} FLOP/B, reached at {experts['ridge_rows']:.0f} rows per expert; "
                 f"at the constant's {experts['constant']:.0%} of peak, memory binds below "
                 f"{experts['ridge_rows_at_constant']:.0f} rows):")
    lines += [f"  ep {ep:>3}: {m:>6,} rows per expert -> {e:.2f} of peak" + (" (published)" if ep ==
              experts["published_ep"] else "") for ep, m, e in zip(experts["eps"], experts["rows"],
                                                                    experts["efficiency"])]
    return "\n".join(lines)
