"""The experiments of lesson 02 (data parallelism), as functions that run on every rank.

Tests, the lesson, the benchmark and the exercise checks all call these, so that each experiment is
written once. Functions named ``rank_*`` run inside `course_lib.launch.run` (the default process group
is initialised); the others run in a single process.

Data: random token ids from a seeded generator, identical on every rank; rank r trains on rows
[r*B/n, (r+1)*B/n) of each global batch of B rows (`shard`).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.model import build_model
from course_lib.parallel.ddp import BucketedDDP, average_gradients

__all__ = ["small_config", "make_batches", "shard", "train_reference", "rank_train", "rank_compare_torch_ddp",
           "rank_throughput", "grads_of", "params_of"]


def small_config(**overrides) -> ModelConfig:
    """The 'tiny' preset made smaller still, so that a few training steps take milliseconds on a CPU."""
    base = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, name="ddp-test")
    base.update(overrides)
    return ModelConfig(**base)


def make_batches(cfg: ModelConfig, global_batch: int, steps: int, seed: int = 0,
                 seq_len: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (x, y) of token ids (global_batch, T), the same on every rank for a seed.
    y is x shifted by one (next-token prediction) of a random sequence of T+1 tokens."""
    g = torch.Generator().manual_seed(seed)
    T = seq_len or cfg.seq_len
    out = []
    for _ in range(steps):
        seq = torch.randint(cfg.vocab_size, (global_batch, T + 1), generator=g)   # (B, T+1)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))          # (B, T), (B, T)
    return out


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch: (B, ...) -> (B/world, ...). B must divide evenly."""
    if t.shape[0] % world:
        raise ValueError(f"global batch {t.shape[0]} does not split evenly over {world} ranks: "
                         f"use a multiple of {world}")
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone().cpu() for k, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone().cpu() for k, p in model.named_parameters() if p.grad is not None}


def train_reference(cfg: ModelConfig, batches, lr: float = 0.1, seed: int = 0,
                    device: torch.device | str = "cpu") -> dict:
    """One process on the whole global batch: the result every data-parallel run must reproduce.
    Returns {'losses': [...], 'params': {...}, 'grads': {...} (last step), 'first_grads' (first step)}."""
    model = build_model(cfg, seed).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = model.loss(x, y)
        loss.backward()
        grads = grads_of(model)
        first_grads = first_grads or grads
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": params_of(model), "grads": grads, "first_grads": first_grads}


def rank_train(cfg: ModelConfig, batches, mode: str = "bucketed", lr: float = 0.1, seed: int = 0,
               bucket_cap_mb: float = 25.0, accum_steps: int = 1, group=None, average_fn=None,
               ddp_cls=None, accum_fn=None) -> dict:
    """Train on this rank's shard of every global batch and return what a test compares.

    mode: 'naive' (`average_gradients` after backward; `average_fn` replaces it), 'bucketed'
    (`BucketedDDP`, or `ddp_cls(model, group=..., bucket_cap_mb=...)`), 'torch' (PyTorch DDP), 'none'.
    accum_steps > 1 splits this rank's shard into micro-batches (gradient accumulation with `no_sync`;
    `accum_fn(ddp, model, opt, micro_batches)` replaces the reference loop).
    Returns {'losses' (global mean loss per step), 'params', 'grads' (last step), 'first_grads' (first step;
    both None with accumulation), 'num_all_reduces' (BucketedDDP's counter)}.
    """
    if accum_steps > 1 and mode != "bucketed":
        raise ValueError(f"accum_steps={accum_steps} needs mode='bucketed' (its no_sync), not mode={mode!r}")
    r, n = dist.get_rank(group), dist.get_world_size(group)
    dev = cdist.device()
    model = build_model(cfg, seed).to(dev)
    ddp = None
    if mode == "bucketed":
        ddp = (ddp_cls or BucketedDDP)(model, group=group, bucket_cap_mb=bucket_cap_mb)
    elif mode == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads, first_grads = [], None, None
    for x, y in batches:
        x, y = shard(x, r, n).to(dev), shard(y, r, n).to(dev)
        if accum_steps > 1:
            micro = list(zip(x.chunk(accum_steps), y.chunk(accum_steps)))
            loss = (accum_fn or accumulation_step)(ddp, model, opt, micro)
        else:
            loss = _torch_ddp_loss(ddp, x, y) if mode == "torch" else model.loss(x, y)
            loss.backward()
            if mode == "naive":
                if average_fn is None:
                    average_gradients(model, group)
                else:
                    average_fn(model)
            elif mode == "bucketed":
                ddp.finish_gradient_synchronization()
            grads = grads_of(model)
            first_grads = first_grads or grads
            opt.step()
            opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=group)     # mean of the shard means = mean of the global batch
        losses.append(global_loss.item() / n)
    return {"losses": losses, "params": params_of(model), "grads": grads, "first_grads": first_grads,
            "num_all_reduces": getattr(ddp, "num_all_reduces", None)}


def _torch_ddp_loss(ddp: nn.parallel.DistributedDataParallel, x, y):
    """PyTorch DDP hooks into forward: call the wrapper, then compute the loss from its logits."""
    logits = ddp(x)                                                   # (B, T, V)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def accumulation_step(ddp: BucketedDDP, model: nn.Module, optimizer: torch.optim.Optimizer,
                      micro_batches: list) -> torch.Tensor:
    """One optimizer step over k micro-batches: no communication on the first k-1 (`no_sync`), one
    all-reduce of the accumulated gradients on the last. Each micro-batch loss is divided by k, so the
    accumulated gradient is the gradient of the mean loss. Returns the mean loss (detached)."""
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with (contextlib.nullcontext() if last else ddp.no_sync()):
            loss = model.loss(x, y) / k
            loss.backward()
        total += loss.detach()
    ddp.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


# ----------------------------------------------------------------------------------------- throughput

def _comm_in_flight_s(prof, cuda: bool = False) -> float:
    """Seconds during which at least one all-reduce was in flight: the union of the intervals of the
    profiler's 'gloo:all_reduce' events (CPU), or of NCCL kernels (GPU); they overlap each other and backward."""
    if cuda:
        keep = lambda e: e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()  # noqa: E731
    else:
        keep = lambda e: e.name.endswith(":all_reduce")  # noqa: E731
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if keep(e))
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e6            # profiler times are in microseconds


def rank_throughput(cfg: ModelConfig, batch_per_rank: int, variants=(("own", 25.0), ("torch", 25.0)),
                    steps: int = 6, warmup: int = 2, profile: bool = False, seed: int = 0) -> dict:
    """Training throughput of several DDP variants measured side by side in one run.

    variants: (kind, bucket_cap_mb) pairs; kind is 'own' (`BucketedDDP`), 'torch' (PyTorch DDP),
    'naive' (`average_gradients`) or 'local' (no communication at all). Timed steps of the variants are
    interleaved (and their order rotated), so that a noisy shared machine slows all of them alike.
    Returns {label: {'step_s', 'tokens_per_s', 'wait_s' (own: time blocked in the final wait),
    'comm_share' (profile=True: fraction of the step with an all-reduce in flight), 'buckets' (own),
    'times' (every timed step, in order: step i of each variant ran back to back)}}, label 'kind@capMB'.
    """
    r, n = dist.get_rank(), dist.get_world_size()
    dev = cdist.device()
    x, y = (t.to(dev) for t in make_batches(cfg, batch_per_rank * n, 1, seed)[0])
    x, y = shard(x, r, n), shard(y, r, n)                                         # (b, T)
    runs = {}
    for kind, cap in variants:
        model = build_model(cfg, seed).to(dev)
        wrapper = None
        if kind == "own":
            wrapper = BucketedDDP(model, bucket_cap_mb=cap)
        elif kind == "torch":
            wrapper = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        elif kind not in ("naive", "local"):
            raise ValueError(f"unknown variant kind {kind!r}: use 'own', 'torch', 'naive' or 'local'")
        runs[f"{kind}@{cap:g}MB"] = (kind, model, wrapper, torch.optim.SGD(model.parameters(), lr=1e-3))

    def step(kind, model, wrapper, opt) -> float:
        loss = _torch_ddp_loss(wrapper, x, y) if kind == "torch" else model.loss(x, y)
        loss.backward()
        t_wait = time.perf_counter()
        if kind == "own":
            wrapper.finish_gradient_synchronization()
        elif kind == "naive":
            average_gradients(model)
        t_wait = time.perf_counter() - t_wait
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t_wait

    labels = list(runs)
    times = {k: [] for k in labels}
    waits = {k: [] for k in labels}
    for i in range(warmup + steps):
        for j in range(len(labels)):
            label = labels[(i + j) % len(labels)]
            dist.barrier()
            cdist_sync(dev)
            t0 = time.perf_counter()
            w = step(*runs[label])
            cdist_sync(dev)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
                waits[label].append(w)
    tokens = x.numel() * n                                                        # tokens per global step
    out = {}
    for label in labels:
        step_s = _median(times[label])
        wrapper = runs[label][2]
        out[label] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "wait_s": _median(waits[label]),
                      "comm_share": None, "buckets": len(wrapper.buckets) if isinstance(wrapper, BucketedDDP) else None,
                      "times": times[label]}
    if profile:
        from torch.profiler import ProfilerActivity, profile as _profile
        for label in labels:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            dist.barrier()
            with _quiet_stderr(), _profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(3):
                    step(*runs[label])
                cdist_sync(dev)
                wall = time.perf_counter() - t0
            out[label]["comm_share"] = _comm_in_flight_s(prof, cuda=dev.type == "cuda") / wall
    return out


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler back-end's start/stop log lines (C-level output on file descriptors 1, 2)."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def cdist_sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])
