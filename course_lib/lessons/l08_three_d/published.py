"""The planner against published training runs, and the seed's two tables re-derived from it (lesson 08).

- :data:`PUBLISHED`: layouts of real runs as data (Megatron-LM's GPT-3 175B, BLOOM-176B, Llama 3 405B at 8K and 16K
  GPUs), each with its cluster, batch, reported throughput, gradient dtype and source (table or section, quoted in
  ``note``). :func:`check_published` plans the paper's cluster and batch with `theory.planner.plan` and returns
  whether the published layout fits, its rank, the top 5 and the planner's MFU beside the reported one;
  ``Check.why_not`` says what the planner leaves out for that run, with the planner's numbers filled in.
- :func:`method_by_size`: which strategy families fit 1B-1T GPT models on 80 GiB GPUs (seed: data parallel < 10B,
  ZeRO 10-100B, tensor and pipeline parallel > 100B, 3D > 1T).
- :func:`efficiency_estimates`: each seed method's scaling efficiency on a stated cluster, by the planner's
  formulas, beside the seed's range (seed: DP 85-95 %, tensor 75-85 %, PP 80-90 %, ZeRO-2 80-90 %, ZeRO-3 70-80 %,
  FSDP 85-95 %).

    for c in check_all():
        print(c.run.name, c.feasible, c.shape_rank, f"{c.planner_mfu:.0%} vs {c.reported_mfu:.0%}")

- :data:`WEAK_SCALING` (Narayanan et al. 2021's table 1, each row's micro-batch, schedule and DDP read from the
  paper's artifact) and :data:`THROUGHPUT_RUNS` (those plus :data:`PUBLISHED`): :func:`throughput_table` calibrates
  one matmul efficiency (an HFU) per GPU generation on ONE row of it (:data:`CALIBRATIONS`: the A100's on
  :data:`CALIBRATION`, the H100's on Llama 3's 8K row; `efficiencies`) and predicts every other run's TFLOP/s per
  GPU with it held fixed, in the source's FLOP count, beside a constant baseline (the calibration row's fraction of
  peak); :func:`throughput_text` prints the table `benchmarks/bench_planner.py` prints.
  :func:`interleaving_gain`: the planner's gain of interleaved 1F1B over 1F1B on torchtitan's 405B layout beside the
  reported 100 -> 128 tokens/s per GPU.
- :data:`LONG_CONTEXT` (issue 31): Llama 3 405B's 128K row, context parallelism 16 (all-gather), kept out of the two
  tables above so that lesson 08's outputs stay as they are; :func:`long_context` places its shape among the
  planner's layouts with cp (`planner.plan(cps=...)`) and says why it ranks where it does; the benchmark adds it to
  its throughput table (not scored).

:func:`check_published` runs the planner as a learner first meets it (1F1B, no overlap, matmuls only, efficiency
0.4): its MFU is then a lower bound, and a published layout that relies on what that leaves out ranks lower than the
paper's result suggests. :func:`throughput_table` prices each run as its software ran it (schedule, overlap, the
memory-bound kernels of its block).
"""

from __future__ import annotations

import dataclasses
import math
import time

from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory.planner import Estimate, GiB, Layout, estimate, korthikanti_layer_bytes, plan, stage_in_flight
from course_lib.lessons.l08_three_d.method import (FAMILIES, SEED_EFFICIENCY, SEED_METHOD, SIZES, efficiency_estimates,
                                                   efficiency_table, family, method_by_size, method_table)
from course_lib.lessons.l08_three_d.runs import (CALIBRATION, CALIBRATIONS, DEEPSEEK_TOKENS_PER_GPU_S, DEEPSEEK_V3,
                                                 DEEPSEEK_V3_CFG, DEEPSEEK_V3_MHA, DEEPSEEK_V3_MLA, DEEPSEEK_V3_MOE,
                                                 GENERATION, H800_FP8_TFLOPS, LEFT_OUT, LLAMA3_128K, LONG_CONTEXT,
                                                 MOE_RUNS, PUBLISHED, THROUGHPUT_RUNS, TORCHTITAN_405B, WEAK_SCALING,
                                                 PublishedRun, Source)
from course_lib.lessons.l08_three_d.throughput import (Throughput, calibrate, efficiencies, interleaving_gain,
                                                       layout_of, long_context, long_context_text, moe_run,
                                                       moe_run_text, predict, predicted_tflops, rank_among_layouts,
                                                       source_flops, tflops_of, throughput_summary, throughput_table,
                                                       throughput_text)

__all__ = ["Source", "PublishedRun", "PUBLISHED", "WEAK_SCALING", "THROUGHPUT_RUNS", "CALIBRATION", "CALIBRATIONS",
           "GENERATION", "efficiencies", "TORCHTITAN_405B",
           "LONG_CONTEXT", "LLAMA3_128K", "long_context", "long_context_text", "DEEPSEEK_V3", "DEEPSEEK_V3_CFG",
           "DEEPSEEK_V3_MHA", "DEEPSEEK_V3_MLA", "DEEPSEEK_V3_MOE", "DEEPSEEK_TOKENS_PER_GPU_S", "H800_FP8_TFLOPS",
           "MOE_RUNS", "moe_run", "moe_run_text", "interleaving_gain", "layout_of", "source_flops", "predict",
           "tflops_of", "predicted_tflops", "calibrate", "Throughput", "rank_among_layouts", "throughput_table",
           "throughput_summary", "throughput_text", "Check", "check_published", "check_all", "published_table",
           "LEFT_OUT", "SIZES", "SEED_METHOD", "FAMILIES", "family", "method_by_size", "method_table",
           "SEED_EFFICIENCY", "efficiency_estimates", "efficiency_table"]


@dataclasses.dataclass
class Check:
    """A published run in the planner. ``row``: the published layout (unstated fields filled with the planner's
    best feasible choice); ``rank``: its place among all feasible rows by step time (1 = fastest; None if
    infeasible or not enumerated); ``shape_rank``: its dp x tp x pp among all shapes, each at its best row;
    ``top5``: the best row of each of the five fastest shapes; ``facts``: the numbers its ``why_not`` quotes."""

    run: PublishedRun
    row: Estimate
    rank: int | None
    shape_rank: int | None
    top5: list
    n_layouts: int
    seconds: float                      # time plan() took
    facts: dict = dataclasses.field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.row.feasible

    @property
    def in_top5(self) -> bool:
        return self.shape_rank is not None and self.shape_rank <= 5

    @property
    def planner_mfu(self) -> float:
        return self.row.mfu

    @property
    def reported_mfu(self) -> float:
        return self.run.reported_mfu

    @property
    def mfu_without_bubble_and_dp(self) -> float:
        """What the planner's MFU would be if the pipeline bubble and the DP communication were hidden (an upper
        bound for interleaving plus overlap; recomputation and the assumed kernel efficiency stay)."""
        t = self.row.time
        return self.row.mfu * t["total"] / (t["total"] - t["bubble"] - t["dp"])

    @property
    def why_not(self) -> str:
        """The run's ``why_not`` with the planner's numbers filled in."""
        return self.run.why_not.format(**self.facts)


def _shape(layout: Layout) -> tuple[int, int, int]:
    return layout.dp, layout.tp, layout.pp


def facts(run: PublishedRun, row: Estimate, best_of_shape: Estimate | None, rank, shape_rank,
          kernel_efficiency: float) -> dict:
    """The numbers a run's ``why_not`` quotes, each computed here: the best row of the published shape, the
    published shape without recomputation, and its memory with Korthikanti et al.'s activations without sequence
    parallelism (`planner.korthikanti_layer_bytes`), in GiB."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    lay = row.layout
    layers = math.ceil(cfg.n_layer / lay.pp)
    in_flight = stage_in_flight(lay, row.accum)
    none = estimate(cfg, gpu, run.cluster, dataclasses.replace(lay, ckpt="none"), run.global_batch, run.seq_len,
                    kernel_efficiency=kernel_efficiency, grad_bytes=run.grad_bytes)
    no_sp_layer = korthikanti_layer_bytes(cfg, lay.tp, run.seq_len, lay.micro_batch, sequence_parallel=False)
    no_sp_acts = no_sp_layer * layers * in_flight
    states = none.memory["model_states"]
    no_sp_total = states + no_sp_acts + none.memory["logits"] + none.memory["zero3_buffers"] + none.memory["reserve"]
    sbh = run.seq_len * lay.micro_batch * cfg.d_model
    return dict(m=row.accum, bubble=(lay.pp - 1) / row.accum, layers=layers, in_flight=in_flight,
                kernel_efficiency=kernel_efficiency, stated_mfu=run.stated_mfu, capacity=gpu.mem_gb,
                rank=rank or "-", shape_rank=shape_rank or "-",
                shape_best=best_of_shape.layout.label() if best_of_shape else "none",
                shape_best_gib=best_of_shape.memory["total"] / GiB if best_of_shape else float("nan"),
                none_gib=none.memory["total"] / GiB, states_gib=states / GiB,
                no_sp_sbh=no_sp_layer / sbh, no_sp_layer_gib=no_sp_layer / GiB, no_sp_acts_gib=no_sp_acts / GiB,
                no_sp_total_gib=no_sp_total / GiB)


def check_published(run: PublishedRun, kernel_efficiency: float = 0.4) -> Check:
    """Plan the run's cluster and batch; place the published layout among the feasible ones."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    t0 = time.perf_counter()
    rows = plan(cfg, gpu, run.cluster, run.global_batch, run.seq_len, kernel_efficiency=kernel_efficiency,
                grad_bytes=run.grad_bytes)
    seconds = time.perf_counter() - t0
    feasible = [r for r in rows if r.feasible]
    stated = {k: getattr(run, k) for k in ("zero", "ckpt", "micro_batch") if getattr(run, k) is not None}
    mine = [r for r in feasible if _shape(r.layout) == (run.dp, run.tp, run.pp)
            and all(getattr(r.layout, k) == v for k, v in stated.items())]
    if mine:
        row, rank = mine[0], feasible.index(mine[0]) + 1
    else:                               # infeasible: the planner's reason for the stated (or default) choices
        layout = Layout(run.dp, run.tp, run.pp, **{"zero": 1, "ckpt": "none", "micro_batch": 1, **stated})
        row, rank = estimate(cfg, gpu, run.cluster, layout, run.global_batch, run.seq_len,
                             kernel_efficiency=kernel_efficiency, grad_bytes=run.grad_bytes), None
    best_of_shape: dict = {}
    for r in feasible:
        best_of_shape.setdefault(_shape(r.layout), r)
    shapes = list(best_of_shape)
    shape = (run.dp, run.tp, run.pp)
    shape_rank = shapes.index(shape) + 1 if shape in best_of_shape else None
    return Check(run, row, rank, shape_rank, [best_of_shape[s] for s in shapes[:5]], len(rows), seconds,
                 facts(run, row, best_of_shape.get(shape), rank, shape_rank, kernel_efficiency))


def check_all(runs=PUBLISHED, kernel_efficiency: float = 0.4) -> list[Check]:
    return [check_published(r, kernel_efficiency) for r in runs]


def published_table(checks: list[Check]) -> str:
    """One line per run: published layout, feasible, ranks, planner vs reported MFU (model FLOPs), and the reported
    TFLOP/s per GPU as the source counts them."""
    lines = [f"{'run':<24} {'GPUs':>6} {'published dp x tp x pp':>22} {'feasible':>8} {'rank':>5} {'shape':>5} "
             f"{'MFU planner':>11} {'no bubble/dp':>12} {'reported':>8} {'TFLOP/s':>8}"]
    for c in checks:
        r = c.run
        lines.append(f"{r.name:<24} {r.cluster.n_gpus:>6} {f'{r.dp} x {r.tp} x {r.pp}':>22} {str(c.feasible):>8} "
                     f"{c.rank or '-':>5} {c.shape_rank or '-':>5} {c.planner_mfu:>11.1%} "
                     f"{c.mfu_without_bubble_and_dp:>12.1%} {c.reported_mfu:>8.1%} {r.reported_tflops:>8.0f}")
    return "\n".join(lines)

