"""Experiments of lesson 03, shared by the lesson, its tests and benchmarks/bench_pipeline.py.

Functions named ``rank_*`` run inside `course_lib.runtime.launch.run` on every rank (each builds the same seeded
model and keeps its own stage); the others run in one process. Several experiments go in one launch,
because each launch costs seconds of start-up.
"""

from __future__ import annotations

import statistics

from course_lib import dist as cdist
from course_lib.config import ModelConfig, small_config
from course_lib.data import random_batches
from course_lib.model import build_model, lm_loss
from course_lib.one_process import grads_of
from course_lib.parallel.pipeline import P2P, build_chunks, build_stage, run_schedule, split_microbatches
from course_lib.parallel.pipeline_messages import p2p_plan
from course_lib.parallel.pipeline_schedules import (V_SHAPED, bubble_of, placement_of, position, schedule_orders,
                                                    simulate, split_stages)

__all__ = ["pipeline_config", "bubble_config", "rank_step", "rank_torch_step", "rank_correctness",
           "rank_bubble_sweep", "rank_memory", "rank_torch_chunked_step", "rank_beyond_1f1b", "op_times", "replayed",
           "span_of", "bubble_rows", "rank_v_schedules", "V_SHAPED", "TORCH_V_SHAPED", "TWIN"]

CHUNKED = ("interleaved", *V_SHAPED)     # schedules whose ranks hold several model chunks (V_SHAPED: two, in a V)


def pipeline_config(n_layer: int = 4, **overrides) -> ModelConfig:
    """`small_config` untied (the embedding and the head live on different stages) with n_layer blocks to split:
    milliseconds per micro-batch on a CPU."""
    return small_config(**{"n_layer": n_layer, "tie_embeddings": False, "name": "pipeline-test", **overrides})


def bubble_config(n_layer: int = 4, **overrides) -> ModelConfig:
    """A GPT whose blocks dominate the work (small vocabulary, wide layers): stages are balanced and each
    op takes tens of milliseconds on a CPU core, so timing noise is small against it."""
    return pipeline_config(n_layer, **{"seq_len": 64, "n_head": 4, "d_model": 256, "name": "pipeline-bubble",
                                       **overrides})


def rank_step(cfg: ModelConfig, x, y, kind: str, m: int, seed: int = 0, model=None, v: int = 2) -> dict:
    """One pipelined training step (forward + backward, no optimizer step) of schedule `kind` on this rank
    ("naive", "gpipe", "1f1b", "zb-h1", "interleaved" with v chunks per rank, or the V-shaped "zb-v" and "dualpipev",
    two chunks per rank whatever v is).

    Returns run_schedule's result plus ``grads`` of this rank's parameters (named as in the full model).
    """
    rank, p, device = cdist.rank(), cdist.world_size(), cdist.device()
    model = model if model is not None else build_model(cfg, seed).to(device)
    model.zero_grad(set_to_none=True)
    chunked, placement = kind in CHUNKED, placement_of(kind)
    v = 2 if kind in V_SHAPED else v if chunked else 1
    stage = build_chunks(model, rank, p, v, placement) if chunked else build_stage(model, rank, p)
    orders = schedule_orders(kind, p, m, v)
    plan = p2p_plan(orders, rank, placement) if chunked else None
    out = run_schedule(stage, orders[rank], split_microbatches(x, m), split_microbatches(y, m), P2P(rank, p, device),
                       plan=plan, placement=placement)
    out["grads"] = grads_of(model)
    return out


def rank_torch_step(cfg: ModelConfig, x, y, kind: str, m: int, seed: int = 0) -> dict:
    """The same step with torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B) on
    stages built from the same split. Returns losses (last stage) and this rank's gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, p, device = cdist.rank(), cdist.world_size(), cdist.device()
    model = build_model(cfg, seed).to(device)
    stage = build_stage(model, rank, p)
    pipe_stage = PipelineStage(stage, stage_index=rank, num_stages=p, device=device)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    schedule = cls(pipe_stage, n_microbatches=m, loss_fn=lm_loss)   # scale_grads: gradients / m
    losses = _torch_step(schedule, x, y, device, rank == 0, rank == p - 1)
    return dict(losses=losses, grads=grads_of(model))


def _torch_step(schedule, x, y, device, first: bool, last: bool) -> list:
    """Drive a torch.distributed.pipelining schedule: the rank holding the first stage feeds x, the one holding the
    last gets the targets and returns the micro-batch losses."""
    losses: list = []
    inputs = (x.to(device),) if first else ()
    extra = dict(target=y.to(device), losses=losses) if last else {}
    schedule.step(*inputs, **extra)
    return [float(v) for v in losses]


def rank_torch_chunked_step(cfg: ModelConfig, x, y, name: str, m: int, v: int = 2, seed: int = 0) -> dict:
    """The step with torch.distributed.pipelining's multi-stage schedules (`name`: "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV") on the same v p chunks as ours;
    ZBV and DualPipeV place them in a V (rank r holds chunks r and 2p - 1 - r, v = 2), the others round-robin.
    Returns losses (on the rank holding the last chunk) and this rank's gradients, or ``error`` (the exception's type
    and first line) where PyTorch refuses."""
    import torch.distributed.pipelining as pipelining

    rank, p, device = cdist.rank(), cdist.world_size(), cdist.device()
    model = build_model(cfg, seed).to(device)
    placement = "v" if name in TORCH_V_SHAPED else "loop"
    positions = [position(rank, c, p, placement) for c in range(2 if placement == "v" else v)]
    ranges = split_stages(len(model.blocks), v * p)
    try:
        stages = [pipelining.PipelineStage(build_stage(model, s, v * p, ranges), stage_index=s, num_stages=v * p,
                                           device=device) for s in positions]
        schedule = getattr(pipelining, name)(stages, n_microbatches=m, loss_fn=lm_loss)
        losses = _torch_step(schedule, x, y, device, 0 in positions, v * p - 1 in positions)
    except Exception as e:   # noqa: BLE001 - the lesson shows which schedule PyTorch refuses here, and why
        return dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    return dict(losses=losses, grads=grads_of(model))


def rank_correctness(cfg: ModelConfig, batch: int, ms, kinds=("gpipe", "1f1b"), torch_ms=(), seed: int = 0) -> dict:
    """Own schedules for every m in `ms` (and torch's for `torch_ms`): losses and gradients per run."""
    x, y = random_batches(cfg, batch, seed=seed)[0]
    out = {}
    for kind in kinds:
        for m in ms:
            r = rank_step(cfg, x, y, kind, m, seed)
            out[(kind, m)] = dict(losses=r["losses"], grads=r["grads"])
    for kind in ("gpipe", "1f1b") if torch_ms else ():
        for m in torch_ms:
            if kind == "1f1b" and m < cdist.world_size():
                continue   # torch's Schedule1F1B refuses m < p ("must be greater than or equal to the number
                #            of stages"); our runner accepts it
            out[("torch-" + kind, m)] = rank_torch_step(cfg, x, y, kind, m, seed)
    return out


def rank_bubble_sweep(cfg: ModelConfig, micro_batch: int, ms, kinds=("gpipe", "1f1b"), repeats: int = 3,
                      warmup: int = 1, seed: int = 0) -> dict:
    """Measured timelines for each (kind, m): batch = m x micro_batch, so every op has the same work.

    The configurations take turns (repeat 1 of every (kind, m), then repeat 2, ...), so that a burst of load
    from other processes on a shared machine spreads over all of them instead of spoiling one.
    Returns per (kind, m): ``bubbles`` (idle fraction of each repeat, from all ranks' timelines), ``bubble``
    (their median) and ``timelines`` (all ranks' ops of the median repeat).
    """
    import torch.distributed as dist

    p, device = cdist.world_size(), cdist.device()
    model = build_model(cfg, seed).to(device)
    configs = [(kind, m) for kind in kinds for m in ms]
    batches = {m: random_batches(cfg, m * micro_batch, seed=seed)[0] for m in ms}
    runs: dict = {c: [] for c in configs}
    for it in range(warmup + repeats):
        for kind, m in configs:
            r = rank_step(cfg, *batches[m], kind, m, seed, model=model)
            if it >= warmup:
                gathered = [None] * p
                dist.all_gather_object(gathered, r["timeline"])
                runs[(kind, m)].append((bubble_of(gathered), gathered))
    out = {}
    for c, rs in runs.items():
        bubbles = [b for b, _ in rs]
        med = sorted(rs, key=lambda t: t[0])[len(rs) // 2]
        out[c] = dict(bubbles=bubbles, bubble=statistics.median(bubbles), timelines=med[1])
    return out


def rank_memory(cfg: ModelConfig, micro_batch: int, ms, kinds=("gpipe", "1f1b"), seed: int = 0) -> dict:
    """Peak bytes of saved activations on this rank for each (kind, m), counted exactly."""
    device = cdist.device()
    model = build_model(cfg, seed).to(device)
    out = {}
    for kind in kinds:
        for m in ms:
            x, y = random_batches(cfg, m * micro_batch, seed=seed)[0]
            r = rank_step(cfg, x, y, kind, m, seed, model=model)
            out[(kind, m)] = dict(peak=r["act_peak"], per_mb=r["act_per_mb"][0])
    return out


TORCH_CHUNKED = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")     # loop placement: section 9
TORCH_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
TWIN = {"ScheduleInterleaved1F1B": "interleaved", "ScheduleInterleavedZeroBubble": "interleaved",
        "ScheduleZBVZeroBubble": "zb-v", "ScheduleDualPipeV": "dualpipev"}   # PyTorch's schedule -> ours


def rank_beyond_1f1b(cfg: ModelConfig, batch: int, m: int, v: int = 2, seed: int = 0,
                     kinds=("1f1b", "interleaved", "zb-h1"), torch_names=TORCH_CHUNKED) -> dict:
    """Section 9 of lesson 03 on this rank: our 1F1B, interleaved 1F1B (v chunks) and ZB-H1 on one batch, and
    torch.distributed.pipelining's multi-chunk schedules on the same model and micro-batches.
    Returns per schedule: losses, grads, timeline, act_peak, act_per_mb, messages, bytes_sent (ours); losses and
    grads, or error (torch's)."""
    x, y = random_batches(cfg, batch, seed=seed)[0]
    out = {kind: rank_step(cfg, x, y, kind, m, seed, v=v) for kind in kinds}
    for name in torch_names:
        out[name] = rank_torch_chunked_step(cfg, x, y, name, m, v, seed)
    return out


def rank_v_schedules(cfg: ModelConfig, batch: int, m: int, seed: int = 0) -> dict:
    """Section 10 of lesson 03 on this rank: our ZB-V and DualPipeV and PyTorch's ScheduleZBVZeroBubble and
    ScheduleDualPipeV on one batch split into m micro-batches, the model cut into 2 p chunks in the V placement
    (n_layer a multiple of 2 p). DualPipeV (ours and PyTorch's) needs m >= 2 p: below that only ZB-V runs.
    Returns what `rank_beyond_1f1b` returns, per schedule."""
    p = cdist.world_size()
    kinds = [k for k in V_SHAPED if k == "zb-v" or m >= 2 * p]
    return rank_beyond_1f1b(cfg, batch, m, 2, seed, kinds=kinds,
                            torch_names=[n for n in TORCH_V_SHAPED if TWIN[n] in kinds])


def op_times(timelines: list[list[dict]]) -> dict[str, float]:
    """Median duration of each kind of op (F, B, W) over all ranks of a measured step, in seconds."""
    kinds = sorted({op["kind"] for ops in timelines for op in ops})
    return {k: statistics.median(op["end"] - op["start"] for ops in timelines for op in ops if op["kind"] == k)
            for k in kinds}


def replayed(timelines: list[list[dict]]) -> list[list[dict]]:
    """A measured step replayed by `simulate`: every rank runs the ops it ran, in the order it ran them, each op lasting
    the median measured duration of its kind (F, B, W) and chunk on that rank; messages are instant and nothing else
    waits. The chunks' placement is read from the ops' ring positions (``pos``, as `run_schedule` records them).
    What the schedule gives with these op times, without the operating system's scheduler: on a shared or
    oversubscribed CPU one op can be stretched several times by a rank that was not running, and the raw timeline then
    shows the scheduler, not the schedule (lesson 03, sections 8 and 9)."""
    orders, durations = [], []
    for ops in timelines:
        by_op: dict[tuple, list[float]] = {}
        for op in ops:
            by_op.setdefault((op["kind"], op.get("chunk", 0)), []).append(op["end"] - op["start"])
        median = {k: statistics.median(v) for k, v in by_op.items()}
        orders.append([(op["kind"], op["mb"], op.get("chunk", 0)) for op in ops])
        durations.append([median[(op["kind"], op.get("chunk", 0))] for op in ops])
    return simulate(orders, durations=durations, placement=_placement(timelines))


def _placement(timelines: list[list[dict]]) -> str:
    """"v" when some op's recorded ring position is the V placement's and not the loop's, else "loop"."""
    p = len(timelines)
    return "v" if any(op.get("pos", position(r, op.get("chunk", 0), p)) != position(r, op.get("chunk", 0), p)
                      for r, ops in enumerate(timelines) for op in ops) else "loop"


def span_of(timelines: list[list[dict]]) -> float:
    """Length of a step: from the first op's start to the last op's end over all ranks (seconds)."""
    ops = [op for r in timelines for op in r]
    return max(op["end"] for op in ops) - min(op["start"] for op in ops)


def bubble_rows(sweep: dict, p: int, v: int = 2) -> list[dict]:
    """Per (schedule, m) of a `rank_bubble_sweep`: the measured bubble; the replayed one (`replayed`: the same ops
    with the median measured duration of each kind and chunk per rank, instant messages and no other waiting: unequal
    chunks and slow ops count, message time and the scheduler do not) and its step time ``replayed_span`` (seconds);
    and the formula's, with the median F, B, W times where it needs them: (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) for
    interleaved, `theory.pipeline.zero_bubble_fraction` for ZB-H1, (p-1)/(6 m+p-1) for ZB-V and DualPipeV
    (`theory.pipeline.v_shape_bubble_fraction`, equal chunk F, B, W times). The formulas assume equal stages (chunks)
    and free messages."""
    from course_lib import theory

    rows = []
    for (kind, m), r in sweep.items():
        t = op_times(r["timelines"])
        replay = replayed(r["timelines"])
        if kind == "interleaved":
            formula = theory.pipeline.interleaved_bubble_fraction(p, m, v)
        elif kind == "zb-h1":
            formula = theory.pipeline.zero_bubble_fraction(p, m, t["F"], t["B"], t["W"])
        elif kind in V_SHAPED:
            formula = theory.pipeline.v_shape_bubble_fraction(kind, p, m)
        else:
            formula = theory.pipeline.bubble_fraction(p, m)
        rows.append(dict(kind=kind, m=m, measured=r["bubble"], bubbles=r["bubbles"], simulated=bubble_of(replay),
                         replayed_span=span_of(replay), measured_span=span_of(r["timelines"]), formula=formula,
                         times=t))
    return rows
