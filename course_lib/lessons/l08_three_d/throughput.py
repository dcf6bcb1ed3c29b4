"""The planner's throughput against published runs (lesson 08; `benchmarks/bench_planner.py`): each run priced as its
software ran it, one matmul efficiency per GPU generation calibrated on ONE row of it (`runs.CALIBRATIONS`: the
A100's on `runs.CALIBRATION`, the H100's, which the H800 shares, on Llama 3's 8K-GPU row) and held fixed for every
other, beside a constant baseline; where each published layout ranks among the planner's; the long-context (CP) and
mixture-of-experts (EP) rows placed among the planner's layouts; interleaved 1F1B's gain on torchtitan's 405B.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from course_lib.config import get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory import flops
from course_lib.theory.planner import (CKPT, CP_VARIANTS, SCHEDULES, Cluster, Estimate, GiB, Layout, estimate, plan,
                                       stage_in_flight, step_flops)
from course_lib.lessons.l08_three_d.runs import (CALIBRATION, CALIBRATIONS, DEEPSEEK_V3, GENERATION, H800_FP8_TFLOPS,
                                                 LLAMA3_128K, THROUGHPUT_RUNS, TORCHTITAN_405B, PublishedRun)

__all__ = ["interleaving_gain", "layout_of", "source_flops", "predict", "tflops_of", "predicted_tflops", "calibrate",
           "efficiencies",
           "Throughput", "rank_among_layouts", "long_context", "long_context_text", "moe_run", "moe_run_text",
           "throughput_table", "throughput_summary", "throughput_text"]


def interleaving_gain(kernel_efficiency: float = 0.4) -> dict:
    """The planner's throughput gain of interleaved 1F1B over 1F1B on torchtitan's 405B layout (table 5 of its
    docs/performance.md), beside the reported 100 -> 128 tokens/s per GPU."""
    t = TORCHTITAN_405B
    cfg, gpu = get_preset(t["preset"]), GPU_SPECS[t["gpu"]]
    cluster = Cluster("64 x 8 H100", t["nodes"], 8, 50.0)
    mb = t["global_batch"] // (t["dp"] * t["m"])
    rows = {sch: estimate(cfg, gpu, cluster, Layout(t["dp"], t["tp"], t["pp"], 1, "full", mb, sch, v, "dp+tp"),
                          t["global_batch"], t["seq_len"], kernel_efficiency, elementwise="fused")
            for sch, v in (("1f1b", 1), ("interleaved", t["v"]))}
    predicted = rows["1f1b"].time["total"] / rows["interleaved"].time["total"] - 1
    reported = t["tokens_per_s"]["interleaved"] / t["tokens_per_s"]["1f1b"] - 1
    within_tenth = abs(predicted / reported - 1) <= 0.1      # +25.2 % to +30.8 % against the reported +28 %
    return dict(predicted=predicted, reported=reported, rows=rows, within_tenth=within_tenth)


# ------------------------------------------------------------------------------------- published throughput

def layout_of(run: PublishedRun) -> Layout:
    """The run's layout in the planner's terms (unstated ZeRO / recomputation / micro-batch: ZeRO-1, none, 1)."""
    return Layout(run.dp, run.tp, run.pp, 1 if run.zero is None else run.zero, run.ckpt or "none",
                  run.micro_batch or 1, run.pipeline, run.v, run.overlap, run.cp, run.cp_variant, run.ep)


def _cps(run: PublishedRun) -> tuple:
    """The cp degrees a run's ranking enumerates: 1 alone without CP (lesson 08's layouts); with CP, 1 and every
    power of two up to 2 cp."""
    return (1,) if run.cp == 1 else tuple(2 ** k for k in range(int(math.log2(2 * run.cp)) + 1))


def source_flops(run: PublishedRun) -> float:
    """FLOPs of one step as the source counts them: Megatron-LM's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with the
    recomputed forward (`flops.megatron_flops_per_token`), or model FLOPs (`flops.step_flops`)."""
    cfg = run.config
    if run.flop_count == "megatron":
        return flops.megatron_flops_per_token(cfg, run.seq_len, recompute=True) * run.global_batch * run.seq_len
    return step_flops(cfg, run.global_batch, run.seq_len, run.moe)


def _eps(run: PublishedRun) -> tuple:
    """The ep degrees a run's ranking enumerates: 1 alone for a dense model; with experts, every power of two up to
    the experts (`planner.plan` drops those dp x cp cannot take)."""
    return (1,) if run.moe is None else tuple(2 ** k for k in range(int(math.log2(run.moe.n_experts)) + 1))


def predict(run: PublishedRun, kernel_efficiency: float) -> Estimate:
    """The planner's estimate of exactly the published layout, schedule and overlap."""
    return estimate(run.config, GPU_SPECS[run.gpu], run.cluster, layout_of(run), run.global_batch, run.seq_len,
                    kernel_efficiency, grad_bytes=run.grad_bytes, elementwise=run.kernels, matmuls=run.matmuls,
                    moe=run.moe)


def tflops_of(run: PublishedRun, est: Estimate) -> float:
    """TFLOP/s per GPU of the run at the step time of ``est``, counted as the source counts them."""
    return source_flops(run) / (run.cluster.n_gpus * est.time["total"]) / 1e12


def predicted_tflops(run: PublishedRun, kernel_efficiency: float) -> float:
    """TFLOP/s per GPU the planner predicts, counted as the source counts them."""
    return tflops_of(run, predict(run, kernel_efficiency))


def calibrate(run: PublishedRun) -> float:
    """The matmul efficiency (an HFU) at which the planner reproduces the run's reported TFLOP/s (bisection)."""
    lo, hi = 0.05, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_tflops(run, mid) < run.reported_tflops else (lo, mid)
    return (lo + hi) / 2


def efficiencies(calibrations: dict = CALIBRATIONS, runs=THROUGHPUT_RUNS, matmuls: str = "flat") -> dict:
    """{GPU generation: the matmul efficiency `calibrate` sets on its one row of ``runs``, its matmuls priced as
    ``matmuls`` says ("flat" or "shapes": a constant belongs to the time model it was calibrated in)}; every GPU of
    `runs.GENERATION` maps to one of them (the H800 to the H100's)."""
    by_name = {r.name: r for r in runs}
    return {gen: calibrate(dataclasses.replace(by_name[name], matmuls=matmuls)) for gen, name in calibrations.items()}


@dataclasses.dataclass
class Throughput:
    """One published run against the planner: ``predicted`` (TFLOP/s per GPU, the source's count) at the calibrated
    efficiency, ``baseline``: the calibration row's fraction of peak applied as is; errors relative to
    ``reported``; ``rank``: the published layout among the planner's feasible layouts (None: not ranked)."""

    run: PublishedRun
    estimate: Estimate
    predicted: float
    baseline: float
    rank: int | None = None
    n_feasible: int = 0
    best: str = ""
    efficiency: float = 0.0             # the constant of its GPU generation it was priced at

    @property
    def reported(self) -> float:
        return self.run.reported_tflops

    @property
    def error(self) -> float:
        return self.predicted / self.reported - 1

    @property
    def baseline_error(self) -> float:
        return self.baseline / self.reported - 1


def rank_among_layouts(run: PublishedRun, kernel_efficiency: float) -> tuple[int | None, int, str]:
    """Where the published layout ranks among the planner's feasible layouts of the same cluster and batch (every
    tp, pp, micro-batch, and the ZeRO stages, recomputation and schedules the run's software had: 2021's Megatron-LM
    had no ZB-H1, no selective recomputation, no distributed optimizer; the run's overlap and kernels, and so 2021's
    activations without sequence parallelism). Returns (rank or None, feasible layouts, the best layout and the
    published layout's step time over the best's)."""
    mine = layout_of(run)
    old = run.kernels == "unfused"      # 2021's Megatron-LM: no ZB-H1, no selective recomputation, no ZeRO
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                micro_batches=sorted({1, 2, 4, 8, mine.micro_batch}), zeros=sorted({0, mine.zero} if old else {0, 1}),
                ckpts=("none", "full") if old else CKPT, grad_bytes=run.grad_bytes,
                schedules=("1f1b", "interleaved") if old else SCHEDULES, vs=sorted({2, 3, 4, mine.v} - {1}),
                overlaps=(run.overlap,), elementwise=run.kernels, matmuls=run.matmuls, cps=_cps(run),
                cp_variants=CP_VARIANTS if run.cp > 1 else ("ring",), eps=_eps(run), moe=run.moe)
    feasible = [r for r in rows if r.feasible]
    rank = next((i + 1 for i, r in enumerate(feasible) if r.layout == mine), None)
    if not feasible:
        return rank, 0, "none"
    mine_s = predict(run, kernel_efficiency).time["total"]
    ratio = mine_s / feasible[0].time["total"]
    return rank, len(feasible), f"{feasible[0].layout.label()} (published step / best step = {ratio:.2f})"


def _placed(run: PublishedRun, rows: list, shape, kernel_efficiency: float, **kw) -> dict:
    """A published run's shape among the planner's ``rows`` (`long_context`, `moe_run`): its best feasible row, its
    rank among the feasible rows and among the shapes (``shape(layout)`` -> a tuple; the run's is
    ``shape(run)``), the planner's best, the same row without recomputation, and the facts its ``why_not`` needs that
    every such run shares. ``kw`` goes to `estimate` (the run's own options, e.g. ``moe=``)."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    feasible = [r for r in rows if r.feasible]
    mine = shape(run)
    row = next((r for r in feasible if shape(r.layout) == mine), None)
    if row is None:
        raise ValueError(f"{run.name}: no feasible layout of the published shape {mine}")
    shapes = list(dict.fromkeys(shape(r.layout) for r in feasible))
    best = feasible[0]
    one = lambda lay: estimate(cfg, gpu, run.cluster, lay, run.global_batch, run.seq_len, kernel_efficiency,
                               grad_bytes=run.grad_bytes, elementwise=run.kernels, matmuls=run.matmuls, **kw)
    none = one(dataclasses.replace(row.layout, ckpt="none"))
    tot = row.time["total"]
    recompute = row.time["compute"] * (1 - row.mfu / row.hfu)          # the recomputed forward's share of compute
    facts = dict(shape_best=row.layout.label(), shape_best_gib=row.memory["total"] / GiB,
                 in_flight=stage_in_flight(row.layout, row.accum), layers=math.ceil(cfg.n_layer / run.pp),
                 none_gib=none.memory["total"] / GiB, capacity=gpu.mem_gb, recompute_share=recompute / tot,
                 best=best.layout.label(), best_gib=best.memory["total"] / GiB, speedup=tot / best.time["total"])
    return dict(run=run, row=row, rank=feasible.index(row) + 1, shape_rank=shapes.index(mine) + 1,
                n_feasible=len(feasible), n_shapes=len(shapes), n_layouts=len(rows), best=best, none=none,
                facts=facts, estimate=one, predicted_tflops=tflops_of(run, row))


def _explained(out: dict, diffs: list[str], t0: float, **facts) -> dict:
    """`_placed`'s result with the run-specific facts and the planner's best's differences filled into ``why``."""
    out["facts"].update(facts, best_why="; ".join(diffs) or "the same shape")
    del out["estimate"]
    return dict(out, why=out["run"].why_not.format(**out["facts"]), seconds=time.perf_counter() - t0)


def long_context(run: PublishedRun = LLAMA3_128K, kernel_efficiency: float = 0.4) -> dict:
    """A context-parallel run among the planner's layouts of its model, cluster, batch and sequence (every tp, pp,
    cp of `_cps`, CP variant, ZeRO 0-1, recomputation, micro-batch, schedule; the run's overlap and kernels). The
    published shape (dp, tp, pp, cp, variant) at its best feasible row, its rank among all feasible rows and among
    shapes, the planner's best, and ``why``: the run's ``why_not`` with these numbers filled in."""
    t0 = time.perf_counter()
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                zeros=(0, 1), schedules=SCHEDULES, grad_bytes=run.grad_bytes, overlaps=(run.overlap,),
                elementwise=run.kernels, matmuls=run.matmuls, cps=_cps(run), cp_variants=CP_VARIANTS)
    shape = lambda lay: (lay.dp, lay.tp, lay.pp, lay.cp, lay.cp_variant if lay.cp > 1 else "ring")
    out = _placed(run, rows, shape, kernel_efficiency)
    row, best, tot = out["row"], out["best"], out["row"].time["total"]
    ring = out["estimate"](dataclasses.replace(row.layout, cp_variant="ring"))
    diffs = []
    if best.layout.cp != run.cp:
        diffs.append(f"cp {best.layout.cp} leaves {run.seq_len // best.layout.cp:,} tokens per GPU, which fit "
                     f"without recomputation" if best.layout.ckpt == "none" else f"cp {best.layout.cp}")
    if best.layout.cp_variant != run.cp_variant:
        diffs.append(f"the {best.layout.cp_variant} variant ({best.exposed['cp'] / best.time['total']:.1%} of its "
                     f"step exposed)")
    if best.layout.schedule != row.layout.schedule:
        diffs.append(f"{best.layout.schedule} (bubble {best.time['bubble'] / best.time['total']:.0%} of its step, "
                     f"{row.time['bubble'] / tot:.0%} here)")
    out["ring"] = ring
    return _explained(out, diffs, t0, cp_share=row.exposed["cp"] / tot,
                      ring_cp_share=ring.exposed["cp"] / ring.time["total"])


def moe_run(run: PublishedRun = DEEPSEEK_V3, kernel_efficiency: float = 0.4) -> dict:
    """A MoE run among the planner's layouts of its model, cluster, batch and sequence (every tp, pp, ep of `_eps`,
    ZeRO 0-1, recomputation, micro-batch 1-4, 1F1B and ZB-H1; the run's overlap and kernels). The published shape
    (dp, tp, pp, ep) at its best feasible row, its rank among all feasible rows and among shapes, the planner's
    best, and ``why``: the run's ``why_not`` with these numbers filled in."""
    t0 = time.perf_counter()
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                micro_batches=(1, 2, 4), zeros=(0, 1), schedules=("1f1b", "zb-h1"), grad_bytes=run.grad_bytes,
                overlaps=(run.overlap,), elementwise=run.kernels, matmuls=run.matmuls, eps=_eps(run), moe=run.moe)
    out = _placed(run, rows, lambda lay: (lay.dp, lay.tp, lay.pp, lay.ep), kernel_efficiency, moe=run.moe)
    row, best, tot = out["row"], out["best"], out["row"].time["total"]
    diffs = [f"{name} {getattr(best.layout, name)} instead of {getattr(row.layout, name)}"
             for name in ("tp", "pp", "ep") if getattr(best.layout, name) != getattr(row.layout, name)]
    diffs.append(f"all-to-all {best.exposed['ep'] / best.time['total']:.0%} of its step, bubble "
                 f"{best.time['bubble'] / best.time['total']:.0%} (here {row.time['bubble'] / tot:.0%}), "
                 f"recomputation {best.layout.ckpt}")
    return _explained(out, diffs, t0, ep=run.ep, ep_span=run.ep * run.tp, ep_share=row.exposed["ep"] / tot,
                      planner_error=out["predicted_tflops"] / run.reported_tflops - 1,
                      planner_tflops=out["predicted_tflops"], derived_tflops=run.reported_tflops)


def _placed_text(out: dict, published: str, exchange: str, mfu_note: str = "") -> str:
    """What `moe_run` or `long_context` found, in a few lines: ``published`` (the run as published) and ``exchange``
    (its own communication) are the lines that differ."""
    row, best = out["row"], out["best"]
    return "\n".join([
        published,
        f"  feasible as {row.layout.label()}: {row.memory['total'] / GiB:.1f} GiB per GPU, step {row.time['total']:.1f}"
        f" s, {out['predicted_tflops']:.0f} TFLOP/s per GPU (MFU {row.mfu:.1%}{mfu_note}); rank {out['rank']} of "
        f"{out['n_feasible']} feasible layouts, its shape {out['shape_rank']} of {out['n_shapes']} shapes; {exchange}",
        f"  the planner's best: {best.layout.label()} (step {best.time['total']:.1f} s, MFU {best.mfu:.1%})",
        f"  why: {out['why']}"])


def moe_run_text(out: dict) -> str:
    """What `moe_run` found, in a few lines."""
    r, row = out["run"], out["row"]
    return _placed_text(
        out,
        f"{r.name}: published dp {r.dp} x tp {r.tp} x pp {r.pp}, ep {r.ep} (borrowed from dp), batch "
        f"{r.global_batch:,} x {r.seq_len:,} tokens on {r.cluster.n_gpus:,} {r.gpu}s; derived {r.reported_tflops:.0f}"
        f" TFLOP/s per GPU, an average over the pre-training's GPU hours (from tokens and GPU hours, not stated): "
        f"{r.stated_mfu:.0%} of the {r.gpu}'s dense bf16 peak ({GPU_SPECS[r.gpu].bf16_tflops:,.0f} TFLOP/s), "
        f"{r.reported_tflops / H800_FP8_TFLOPS:.0%} of its dense FP8 peak ({H800_FP8_TFLOPS:,.0f} TFLOP/s; most of "
        f"its GEMMs ran in FP8)",
        f"all-to-all {row.time['ep']:.1f} s per step, exposed", mfu_note=", active FLOPs")


def long_context_text(out: dict) -> str:
    """What `long_context` found, in a few lines."""
    r, row = out["run"], out["row"]
    return _placed_text(
        out,
        f"{r.name}: published dp {r.dp} x tp {r.tp} x pp {r.pp} x cp {r.cp} ({r.cp_variant}), batch {r.global_batch}"
        f" x {r.seq_len:,} tokens on {r.cluster.n_gpus:,} {r.gpu}s; reported {r.reported_tflops:g} TFLOP/s per GPU "
        f"({r.stated_mfu:.0%} MFU)",
        f"CP exchange {row.time['cp']:.2f} s per step, {row.exposed['cp']:.2f} s exposed")


def throughput_table(runs=THROUGHPUT_RUNS, calibration: str = CALIBRATION, rank: bool = True,
                     matmuls: str | None = None) -> tuple[float, list]:
    """Calibrate one efficiency per GPU generation on its one row (`efficiencies`: ``calibration`` for the A100,
    `runs.CALIBRATIONS` for the others), then predict every run at its generation's, held fixed. Returns (the A100's
    efficiency, [Throughput]); each row's own is ``Throughput.efficiency``. The constant baseline applies the
    generation's calibration row's fraction of peak. ``rank=False`` skips the planner's search over layouts
    (seconds). ``matmuls``: price every run's GEMMs so ("flat" or "shapes"; None: each run's own
    ``PublishedRun.matmuls``), its constants calibrated the same way."""
    if matmuls is not None:
        runs = tuple(dataclasses.replace(r, matmuls=matmuls) for r in runs)
    models = {r.matmuls for r in runs}
    table = {m: efficiencies(dict(CALIBRATIONS, A100=calibration), matmuls=m) for m in models | {"flat"}}
    by_name = {r.name: r for r in THROUGHPUT_RUNS + tuple(runs)}
    fraction = {gen: by_name[name].reported_tflops / GPU_SPECS[by_name[name].gpu].bf16_tflops
                for gen, name in dict(CALIBRATIONS, A100=calibration).items()}
    out = []
    for r in runs:
        gen, eff = GENERATION[r.gpu], table[r.matmuls][GENERATION[r.gpu]]
        est = predict(r, eff)
        t = Throughput(r, est, tflops_of(r, est), fraction[gen] * GPU_SPECS[r.gpu].bf16_tflops, efficiency=eff)
        if rank:
            t.rank, t.n_feasible, t.best = rank_among_layouts(r, eff)
        out.append(t)
    return table[matmuls or "flat"]["A100"], out


def throughput_summary(rows: list, calibration: str = CALIBRATION) -> str:
    """The benchmark's last line: scored runs without the calibration row."""
    scored = [t for t in rows if t.run.scored and t.run.name not in {calibration, *CALIBRATIONS.values()}]
    err = [abs(t.error) * 100 for t in scored]
    base = [abs(t.baseline_error) * 100 for t in scored]
    return (f"published throughput: {len(scored)} runs, median |error| {statistics.median(err):.1f} %, max |error| "
            f"{max(err):.1f} % (constant baseline: median {statistics.median(base):.1f} %, max {max(base):.1f} %)")


def throughput_text(eff: float, rows: list, calibration: str = CALIBRATION) -> str:
    """Per run: the published layout, the planner's TFLOP/s per GPU, the reported, the error, the constant
    baseline and its error, the bubble and the exposed communication (shares of the step), the rank among the
    planner's feasible layouts (where ranked); then the summary line."""
    head = (f"{'run':<30} {'GPUs':>5} {'dp x tp x pp':>13} {'mb':>3} {'schedule':>14} {'overlap':>7} "
            f"{'planner':>8} {'reported':>8} {'error':>7} {'baseline':>8} {'error':>7} {'bubble':>6} {'comm':>5}"
            + (f" {'rank':>9}" if any(t.n_feasible for t in rows) else ""))
    others = {GENERATION[t.run.gpu]: t for t in rows if t.run.name in CALIBRATIONS.values() and t.run.gpu != "A100"}
    shared = {gen: ", ".join(g for g, v in GENERATION.items() if v == gen and g != gen) for gen in others}
    lines = [f"A100 matmul efficiency (HFU) calibrated on {calibration}: {eff:.3f} of peak"
             + "".join(f"; {gen} (and {shared[gen]}) on {t.run.name}: {t.efficiency:.3f}" for gen, t in others.items())
             + "; TFLOP/s per GPU as each source counts them", head]
    for t in rows:
        r, e = t.run, t.estimate
        sched = r.pipeline + (f" v{r.v}" if r.v > 1 else "")
        tot = e.time["total"]
        comm = sum(e.exposed.values())
        mark = (" (calibration)" if r.name in {calibration, *CALIBRATIONS.values()} else
                ("" if r.scored else " (not scored)"))
        rank = (f" {f'{t.rank}/{t.n_feasible}' if t.rank else f'-/{t.n_feasible}':>9}" if t.n_feasible else "")
        shape = f"{r.dp}x{r.tp}x{r.pp}" + (f"cp{r.cp}" if r.cp > 1 else "") + (f"ep{r.ep}" if r.ep > 1 else "")
        lines.append(f"{r.name:<30} {r.cluster.n_gpus:>5} {shape:>13} {layout_of(r).micro_batch:>3} "
                     f"{sched:>14} {r.overlap:>7} {t.predicted:>8.1f} {t.reported:>8.1f} {t.error:>+7.1%} "
                     f"{t.baseline:>8.1f} {t.baseline_error:>+7.1%} {e.time['bubble'] / tot:>6.1%} "
                     f"{comm / tot:>5.1%}{rank}{mark}")
    return "\n".join(lines + [throughput_summary(rows, calibration)])

