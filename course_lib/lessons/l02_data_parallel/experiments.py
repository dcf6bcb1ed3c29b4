"""The experiments of lesson 02 (data parallelism), as functions that run on every rank.

Tests, the lesson, the benchmark and the exercise checks all call these, so that each experiment is
written once. Functions named ``rank_*`` run inside `course_lib.runtime.launch.run` (the default process group
is initialised); the others run in a single process.

Data: `course_lib.data.random_batches`, identical on every rank; rank r trains on rows [r*B/n, (r+1)*B/n)
of each global batch of B rows (`course_lib.data.shard_batch`); the one-process reference is
`course_lib.one_process.train_reference`.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.data import random_batches, shard_batch
from course_lib.dist import global_mean
from course_lib.measure.speed import Stopwatch, interval_union, intervals_length, synchronize
from course_lib.model import build_model, lm_loss
from course_lib.one_process import grads_of, params_of
from course_lib.parallel.collectives import ByteCounter, ring_all_reduce
from course_lib.parallel.ddp import BucketedDDP, average_gradients
from course_lib.reference import reference_for
from course_lib.training.token_loss import global_token_count, global_valid_tokens, loss_sum_and_tokens, mask_padding, \
    token_normalized

__all__ = ["rank_train", "accumulation_step", "accumulate_gradients", "padded_batches", "rank_throughput",
           "rank_ring_vs_all_reduce"]


def rank_train(cfg: ModelConfig, batches, mode: str = "bucketed", lr: float = 0.1, seed: int = 0,
               bucket_cap_mb: float = 25.0, accum_steps: int = 1, group=None, average_fn=None,
               ddp_cls=None, accum_fn=None, loss_norm: str | None = None) -> dict:
    """Train on this rank's shard of every global batch and return what a test compares.

    mode: 'naive' (`average_gradients` after backward; `average_fn` replaces it), 'bucketed'
    (`BucketedDDP`, or `ddp_cls(model, group=..., bucket_cap_mb=...)`), 'torch' (PyTorch DDP), 'none'.
    A DDP that is an `nn.Module` is used as PyTorch DDP is: the loss of its forward, an optimizer over its
    `parameters()`; any other DDP object only registers hooks, and the plain model is used.
    accum_steps > 1 splits this rank's shard into micro-batches (gradient accumulation with `no_sync`;
    `accum_fn(ddp, model, opt, micro_batches)` replaces the reference loop).
    loss_norm 'tokens' or 'mean' (mode='bucketed'; batches may be padded, targets -100 at padding, see
    `padded_batches`): `accumulate_gradients` over accum_steps micro-batches, the summed loss divided by the
    global number of valid tokens ('tokens', right) or each micro-batch's mean divided by accum_steps ('mean',
    what weighs tokens unequally); gradients of every step are then kept.
    Returns {'losses' (global mean loss per step), 'params', 'grads' (last step), 'first_grads' (first step;
    both None with accumulation unless loss_norm is given), 'num_all_reduces' (BucketedDDP's counter)}.
    """
    if (accum_steps > 1 or loss_norm is not None) and mode != "bucketed":
        raise ValueError(f"accum_steps={accum_steps}, loss_norm={loss_norm!r} need mode='bucketed' (its no_sync), "
                         f"not mode={mode!r}")
    r, n = dist.get_rank(group), dist.get_world_size(group)
    dev = cdist.device()
    model = build_model(cfg, seed).to(dev)
    ddp = None
    if mode == "bucketed":
        ddp = (ddp_cls or BucketedDDP)(model, group=group, bucket_cap_mb=bucket_cap_mb)
    elif mode == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    net = ddp if isinstance(ddp, nn.Module) else model     # a DDP module is used as torch DDP is: forward, parameters
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses, grads, first_grads = [], None, None
    for x, y in batches:
        x, y = shard_batch(x, r, n).to(dev), shard_batch(y, r, n).to(dev)
        if loss_norm is not None:
            micro = list(zip(x.chunk(accum_steps), y.chunk(accum_steps)))
            losses.append(accumulate_gradients(ddp, model, micro, loss_norm).item())
            grads = grads_of(model)
            first_grads = first_grads or grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        if accum_steps > 1:
            micro = list(zip(x.chunk(accum_steps), y.chunk(accum_steps)))
            loss = (accum_fn or accumulation_step)(ddp, model, opt, micro)
        else:
            loss = lm_loss(net(x), y)                        # torch DDP hooks into forward; ours into backward
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
        losses.append(global_mean(loss, group))       # mean of the shard means = mean of the global batch
    return {"losses": losses, "params": params_of(model), "grads": grads, "first_grads": first_grads,
            "num_all_reduces": getattr(ddp, "num_all_reduces", None)}


@reference_for("02-grad-accum")
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


def accumulate_gradients(ddp: BucketedDDP, model: nn.Module, micro_batches: list,
                         loss_norm: str = "tokens") -> torch.Tensor:
    """Forward and backward over this rank's micro-batches (communication on the last one only, `no_sync`
    before), leaving in `.grad` the gradient of the global batch's loss; no optimizer step (lessons 02, 09).

    loss_norm='tokens': each micro-batch back-propagates its summed loss x n / N, N the valid tokens over every
    micro-batch and rank (`course_lib.training.token_loss`; x n undoes the DDP's mean over n ranks): every valid token
    weighs 1/N, as in one process over the same tokens. loss_norm='mean': each micro-batch back-propagates its
    mean loss / k and DDP averages the ranks -- equal only when every micro-batch has as many valid tokens.
    micro_batches: [(x, y)], each (b, T), targets -100 at padding. Returns the loss of the global batch it
    optimises (the token mean, or the mean of the micro-batch means), the same on every rank.
    """
    if loss_norm not in ("tokens", "mean"):
        raise ValueError(f"loss_norm={loss_norm!r} is unknown: pick 'tokens' (sum / global valid tokens) or 'mean'")
    k, group = len(micro_batches), ddp.group
    n_global = global_valid_tokens([y for _, y in micro_batches], group)   # one all-reduce, before any backward
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        with (contextlib.nullcontext() if i == k - 1 else ddp.no_sync()):
            if loss_norm == "tokens":
                loss_sum, _ = loss_sum_and_tokens(model(x), y)                 # (b, T, V) -> ()
                loss = token_normalized(loss_sum, n_global, grad_divisor=ddp.world_size)
                total += loss_sum.detach()
            else:
                loss = lm_loss(model(x), y) / k
                total += loss.detach()
            loss.backward()
    ddp.finish_gradient_synchronization()
    if loss_norm == "tokens":
        return global_token_count(total, group) / n_global.clamp(min=1)
    return global_token_count(total, group) / ddp.world_size


def padded_batches(cfg: ModelConfig, global_batch: int, steps: int = 1, seed: int = 0,
                   min_len: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`random_batches` whose rows are right-padded sequences of random lengths in [min_len, T]: the targets past
    a row's length are -100 (ignored by the loss), so micro-batches and ranks hold different numbers of valid
    tokens (lesson 02, "a loss that counts tokens right"). The same on every rank for a seed."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for x, y in random_batches(cfg, global_batch, steps, seed):
        lengths = torch.randint(min_len, y.shape[1] + 1, (global_batch,), generator=g)   # (B,)
        out.append((x, mask_padding(y, lengths)))
    return out


# ----------------------------------------------------------------------------------------- throughput

def _comm_in_flight_s(prof, cuda: bool = False) -> float:
    """Seconds during which at least one all-reduce was in flight: the union of the intervals of the
    profiler's 'gloo:all_reduce' events (CPU), or of NCCL kernels (GPU); they overlap each other and backward."""
    if cuda:
        keep = lambda e: e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()  # noqa: E731
    else:
        keep = lambda e: e.name.endswith(":all_reduce")  # noqa: E731
    busy = interval_union((e.time_range.start, e.time_range.end) for e in prof.events() if keep(e))
    return intervals_length(busy) / 1e6            # profiler times are in microseconds


def rank_throughput(cfg: ModelConfig, batch_per_rank: int, variants=(("own", 25.0), ("torch", 25.0)),
                    steps: int = 6, warmup: int = 2, profile: bool = False, seed: int = 0) -> dict:
    """Training throughput of several DDP variants measured side by side in one run.

    variants: (kind, bucket_cap_mb) pairs; kind is 'own' (`BucketedDDP`), 'torch' (PyTorch DDP),
    'naive' (`average_gradients`) or 'local' (no communication at all). Timed steps of the variants are
    interleaved (and their order rotated), so that a noisy shared machine slows all of them alike.
    Returns {label: {'step_s', 'tokens_per_s', 'wait_s' (own, naive: time from the end of backward until the
    gradients are averaged, i.e. communication not hidden behind backward; CUDA events on a GPU),
    'comm_share' (profile=True: fraction of the step with an all-reduce in flight), 'buckets' (own),
    'times' (every timed step, in order: step i of each variant ran back to back)}}, label 'kind@capMB'.
    """
    r, n = dist.get_rank(), dist.get_world_size()
    dev = cdist.device()
    x, y = (t.to(dev) for t in random_batches(cfg, batch_per_rank * n, 1, seed)[0])
    x, y = shard_batch(x, r, n), shard_batch(y, r, n)                             # (b, T)
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

    clock = Stopwatch(dev)       # a wait on an NCCL all-reduce does not block the CPU: time it on the GPU's timeline

    def step(kind, model, wrapper, opt) -> float:
        loss = lm_loss(wrapper(x), y) if kind == "torch" else model.loss(x, y)
        loss.backward()
        before = clock.stamp()
        if kind == "own":
            wrapper.finish_gradient_synchronization()
        elif kind == "naive":
            average_gradients(model)
        after = clock.stamp()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return before, after

    labels = list(runs)
    times = {k: [] for k in labels}
    waits = {k: [] for k in labels}
    for i in range(warmup + steps):
        for j in range(len(labels)):
            label = labels[(i + j) % len(labels)]
            dist.barrier()
            synchronize(dev)
            t0 = time.perf_counter()
            w = step(*runs[label])
            synchronize(dev)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
                waits[label].append(clock.seconds(w[1]) - clock.seconds(w[0]))
    tokens = x.numel() * n                                                        # tokens per global step
    out = {}
    for label in labels:
        step_s = statistics.median(times[label])
        wrapper = runs[label][2]
        out[label] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "wait_s": statistics.median(waits[label]),
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
                synchronize(dev)
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


# ----------------------------------------------------------------------------------------- ring vs library

def rank_ring_vs_all_reduce(sizes_bytes, repeats: int = 5, warmup: int = 2) -> list[dict]:
    """Runs on every rank: median time of `ring_all_reduce` and of `dist.all_reduce` for fp32 tensors of
    each size, interleaved in one run (lesson 02). Returns [{'bytes', 'ring_s', 'library_s',
    'ring_bytes_sent'}] as seen by this rank."""
    dev = cdist.device()
    out = []
    for nbytes in sizes_bytes:
        t = torch.randn(max(1, int(nbytes) // 4), device=dev)
        times = {"ring": [], "library": []}
        counter = ByteCounter()
        for i in range(warmup + repeats):
            for name in (("ring", "library") if i % 2 else ("library", "ring")):
                dist.barrier()
                synchronize(dev)
                t0 = time.perf_counter()
                if name == "ring":
                    ring_all_reduce(t, counter=counter if i == 0 else None)
                else:
                    dist.all_reduce(t)
                synchronize(dev)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
            t.div_(dist.get_world_size() ** 2)      # keep the values bounded
        out.append({"bytes": t.numel() * 4, "ring_s": statistics.median(times["ring"]),
                    "library_s": statistics.median(times["library"]), "ring_bytes_sent": counter.bytes_sent})
    return out
