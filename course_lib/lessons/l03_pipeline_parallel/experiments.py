"""Experiments of lesson 03, shared by the lesson, its tests and benchmarks/bench_pipeline.py.

Functions named ``rank_*`` run inside `course_lib.launch.run` on every rank (each builds the same seeded
model and keeps its own stage); the others run in one process. Several experiments go in one launch,
because each launch costs seconds of start-up.
"""

from __future__ import annotations

import statistics

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.data import random_batches
from course_lib.lessons.common import grads_of, small_config
from course_lib.model import build_model, lm_loss
from course_lib.parallel.pipeline import P2P, build_stage, run_schedule, split_microbatches
from course_lib.parallel.pipeline_schedules import bubble_of, schedule_orders

__all__ = ["pipeline_config", "bubble_config", "rank_step", "rank_torch_step", "rank_correctness",
           "rank_bubble_sweep", "rank_memory"]


def pipeline_config(n_layer: int = 4, **overrides) -> ModelConfig:
    """`small_config` untied (the embedding and the head live on different stages) with n_layer blocks to split:
    milliseconds per micro-batch on a CPU."""
    return small_config(**{"n_layer": n_layer, "tie_embeddings": False, "name": "pipeline-test", **overrides})


def bubble_config(n_layer: int = 4, **overrides) -> ModelConfig:
    """A GPT whose blocks dominate the work (small vocabulary, wide layers): stages are balanced and each
    op takes tens of milliseconds on a CPU core, so timing noise is small against it."""
    return pipeline_config(n_layer, **{"seq_len": 64, "n_head": 4, "d_model": 256, "name": "pipeline-bubble",
                                       **overrides})


def rank_step(cfg: ModelConfig, x, y, kind: str, m: int, seed: int = 0, model=None) -> dict:
    """One pipelined training step (forward + backward, no optimizer step) of schedule `kind` on this rank.

    Returns run_schedule's result plus ``grads`` of this rank's parameters (named as in the full model).
    """
    rank, p, device = cdist.rank(), cdist.world_size(), cdist.device()
    model = model if model is not None else build_model(cfg, seed).to(device)
    model.zero_grad(set_to_none=True)
    stage = build_stage(model, rank, p)
    order = schedule_orders(kind, p, m)[rank]
    out = run_schedule(stage, order, split_microbatches(x, m), split_microbatches(y, m), P2P(rank, p, device))
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
    losses: list = []
    if rank == 0 and p == 1:
        schedule.step(x.to(device), target=y.to(device), losses=losses)
    elif rank == 0:
        schedule.step(x.to(device))
    elif rank == p - 1:
        schedule.step(target=y.to(device), losses=losses)
    else:
        schedule.step()
    return dict(losses=[float(v) for v in losses], grads=grads_of(model))


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
