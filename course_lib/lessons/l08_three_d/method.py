"""The seed's two tables re-derived from the planner (lesson 08): which strategy families fit 1B-1T GPT models on
80 GiB GPUs (`method_by_size`; seed: data parallel < 10B, ZeRO 10-100B, tensor and pipeline parallel > 100B, 3D >
1T), and each seed method's scaling efficiency on a stated cluster (`efficiency_estimates`; seed: DP 85-95 %,
tensor 75-85 %, PP 80-90 %, ZeRO-2 80-90 %, ZeRO-3 70-80 %, FSDP 85-95 %).
"""

from __future__ import annotations

from course_lib.config import ModelConfig
from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory import flops
from course_lib.theory.planner import Cluster, Layout, estimate, plan

__all__ = ["SIZES", "SEED_METHOD", "FAMILIES", "family", "method_by_size", "method_table", "SEED_EFFICIENCY",
           "efficiency_estimates", "efficiency_table"]

# ----------------------------------------------------------------------------------------- method by size

def _gpt(name: str, n_layer: int, d_model: int, n_head: int) -> ModelConfig:
    """Narayanan et al. (2021, table 1)'s GPT shapes: vocabulary 51,200, sequence 2,048."""
    return ModelConfig(vocab_size=51200, seq_len=2048, n_layer=n_layer, n_head=n_head, d_model=d_model, name=name)


# ~12 L h^2 parameters each: 1.3B (GPT-3 XL's shape), 10B (32 heads, so that tp=32 divides them), 100B and
# Narayanan's 1T (128 layers, h 25,600, 160 heads).
SIZES = {"1B": _gpt("gpt-1.3b", 24, 2048, 16), "10B": _gpt("gpt-10b", 32, 5120, 32),
         "100B": _gpt("gpt-100b", 80, 10240, 80), "1T": _gpt("gpt-1t", 128, 25600, 160)}
SEED_METHOD = {"1B": "DP", "10B": "ZeRO", "100B": "TP/PP", "1T": "3D"}
FAMILIES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP+DP", "PP+DP", "TP+PP+DP")


def family(layout: Layout) -> str:
    """The strategy family of a layout: data parallel alone (by ZeRO stage), or which model dimensions it uses."""
    if layout.tp == 1 and layout.pp == 1:
        return "DP" if layout.zero == 0 else f"ZeRO-{layout.zero}"
    return "TP+DP" if layout.pp == 1 else ("PP+DP" if layout.tp == 1 else "TP+PP+DP")


def method_by_size(gpu: str = "H100", nodes=(1, 8, 64), gpus_per_node: int = 8, inter_gbs_per_gpu: float = 50.0,
                   global_batch: int = 1024, kernel_efficiency: float = 0.4) -> list[dict]:
    """For each size in :data:`SIZES` and each cluster of ``nodes x gpus_per_node`` GPUs: the fastest feasible
    layout of every strategy family (None: no layout of that family fits), and the planner's overall choice.
    ZeRO-3's working buffers (two layers' gathered 16-bit parameters: the one in use and the prefetched one) are
    counted: 29 GiB for the 1T model without TP (tests/test_published_layouts.py)."""
    out = []
    for size, cfg in SIZES.items():
        for n in nodes:
            cluster = Cluster(f"{n} x {gpus_per_node} {gpu}, {inter_gbs_per_gpu:g} GB/s per GPU", n, gpus_per_node,
                              inter_gbs_per_gpu)
            best: dict = {f: None for f in FAMILIES}
            for r in plan(cfg, GPU_SPECS[gpu], cluster, global_batch, kernel_efficiency=kernel_efficiency):
                if r.feasible and best[family(r.layout)] is None:
                    best[family(r.layout)] = r
            fits = [f for f in FAMILIES if best[f] is not None]
            fastest = min(fits, key=lambda f: best[f].time["total"]) if fits else None
            out.append(dict(size=size, params=cfg.num_params(), nodes=n, gpus=cluster.n_gpus, best=best, fits=fits,
                            fastest=fastest, seed=SEED_METHOD[size]))
    return out


def method_table(rows: list[dict]) -> str:
    lines = [f"{'size':<5} {'GPUs':>5} {'seed':>6}  " + " ".join(f"{f:>8}" for f in FAMILIES) + "  fastest"]
    for r in rows:
        cells = " ".join(f"{r['best'][f].mfu:>8.0%}" if r["best"][f] else f"{'-':>8}" for f in FAMILIES)
        lines.append(f"{r['size']:<5} {r['gpus']:>5} {r['seed']:>6}  {cells}  {r['fastest'] or 'nothing fits'}")
    return "\n".join(lines) + "\n(cells: the family's best MFU by the planner; '-': no layout of it fits)"


# -------------------------------------------------------------------------------------------- efficiency

SEED_EFFICIENCY = {"DP": (0.85, 0.95), "TP": (0.75, 0.85), "PP": (0.80, 0.90), "ZeRO-2": (0.80, 0.90),
                   "ZeRO-3": (0.70, 0.80), "FSDP": (0.85, 0.95)}

# (seed method, what is run, model, (dp, tp, pp, zero) of n GPUs, on one node?, why it scores what it scores)
_METHOD_RUNS = (
    ("DP", "DDP over all GPUs", "1B", lambda n: (n, 1, 1, 0), False,
     "one gradient all-reduce per step, not overlapped here; DDP's buckets overlap it with the backward"),
    ("TP", "tensor parallel 8, one node", "10B", lambda n: (1, n, 1, 0), True,
     "4 all-reduces of (b, s, h) per layer per micro-batch on NVLink, on the critical path"),
    ("TP", "tensor parallel over all GPUs", "10B", lambda n: (1, n, 1, 0), False,
     "the same all-reduces over InfiniBand: the seed's range holds inside a node only"),
    ("PP", "pipeline over all GPUs", "10B", lambda n: (1, 1, n, 0), False,
     "the 1F1B bubble (p-1)/m falls with more micro-batches per step; each micro-batch's (b, s, h) activation "
     "crosses the stage boundaries on the critical path"),
    ("ZeRO-2", "ZeRO-2 over all GPUs", "10B", lambda n: (n, 1, 1, 2), False,
     "DP's volume (reduce-scatter + all-gather), not overlapped"),
    ("ZeRO-3", "ZeRO-3 over all GPUs", "10B", lambda n: (n, 1, 1, 3), False,
     "parameters all-gathered in forward and backward and gradients reduce-scattered for every micro-batch, where "
     "ZeRO-1/2 reduce-scatter and all-gather once per step; none of it prefetched or overlapped here"),
    ("FSDP", "FSDP full shard over all GPUs", "10B", lambda n: (n, 1, 1, 3), False,
     "FSDP's full shard is ZeRO-3: the same number; the seed's higher range for FSDP can only come from "
     "prefetching and overlap (or SHARD_GRAD_OP, which is ZeRO-2), not from the algorithm"),
)


def efficiency_estimates(gpu: str = "H100", nodes: int = 4, gpus_per_node: int = 8, inter_gbs_per_gpu: float = 50.0,
                         global_batch: int = 512, kernel_efficiency: float = 0.4) -> list[dict]:
    """Each seed method alone on ``nodes x gpus_per_node`` GPUs (400 Gb/s InfiniBand = 50 GB/s per GPU by default):
    scaling efficiency = time of the model FLOPs at the assumed kernel efficiency / step time (= planner MFU /
    kernel_efficiency), for the best feasible recomputation and micro-batch. No communication overlaps compute in
    the planner, so these are lower bounds for implementations that overlap (DDP, FSDP, DeepSpeed)."""
    cluster = Cluster(f"{nodes} x {gpus_per_node} {gpu}, {inter_gbs_per_gpu:g} GB/s per GPU", nodes, gpus_per_node,
                      inter_gbs_per_gpu)
    node = Cluster(f"1 x {gpus_per_node} {gpu}", 1, gpus_per_node, inter_gbs_per_gpu)
    out = []
    for method, what, size, layout_of, one_node, why in _METHOD_RUNS:
        on = node if one_node else cluster
        n, cfg = on.n_gpus, SIZES[size]
        dp, tp, pp, zero = layout_of(n)
        rows = [estimate(cfg, GPU_SPECS[gpu], on, Layout(dp, tp, pp, zero, ckpt, b), global_batch,
                         kernel_efficiency=kernel_efficiency)
                for ckpt in ("none", "selective", "full") for b in (1, 2, 4, 8)]
        feasible = sorted((r for r in rows if r.feasible), key=lambda r: r.time["total"])
        if not feasible:
            raise ValueError(f"{what}: no feasible layout for {size} on {on.name}: {rows[0].why}")
        best = feasible[0]
        eff = best.mfu / kernel_efficiency
        lo, hi = SEED_EFFICIENCY[method]
        t = best.time
        model_time = flops.step_flops(cfg, global_batch) / (n * GPU_SPECS[gpu].bf16_tflops * 1e12 * kernel_efficiency)
        overheads = {"recomputation": t["compute"] - model_time, "bubble": t["bubble"], "tp": t["tp"], "pp": t["pp"],
                     "dp": t["dp"]}
        top = sorted((k for k in overheads if overheads[k] > 0.01 * t["total"]), key=overheads.get, reverse=True)
        shares = ", ".join(f"{k} {overheads[k] / t['total']:.0%}" for k in top[:2]) or "no overhead"
        where = "within" if lo <= eff <= hi else ("below" if eff < lo else "above")
        verdict = f"{where} the seed's {lo:.0%}-{hi:.0%}: {shares} of the step; {why}"
        out.append(dict(method=method, what=what, model=size, gpus=n, layout=best.layout, efficiency=eff,
                        seed=(lo, hi), verdict=verdict, estimate=best))
    return out


def efficiency_table(rows: list[dict]) -> str:
    lines = [f"{'seed method':<7} {'run':<31} {'model':>5} {'GPUs':>4} {'planner':>8} {'seed':>9}  verdict"]
    for r in rows:
        lo, hi = r["seed"]
        lines.append(f"{r['method']:<7} {r['what']:<31} {r['model']:>5} {r['gpus']:>4} {r['efficiency']:>8.0%} "
                     f"{f'{lo:.0%}-{hi:.0%}':>9}  {r['verdict'].split(':')[0]}")
    return "\n".join(lines)

