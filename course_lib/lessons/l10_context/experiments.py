"""The measurements of lesson 10 (long sequences, context parallelism), in one process unless named ``rank_*``.

- :func:`attention_memory_sweep`: bytes one causal attention keeps for backward over the sequence length, naive
  (the (B, H, s, s) softmax) vs ``scaled_dot_product_attention`` vs our blockwise attention with the online
  softmax, next to `theory.savers.attention_saved_bytes` (lesson 07's formula).
- :func:`blockwise_errors`: blockwise attention vs SDPA, outputs and gradients, causal and not.
- :func:`rank_context_lab`: on every rank of a cp group: the tiny GPT with context parallelism in every block
  (ring balanced / contiguous, all-gather, Ulysses), one step: loss, gradients, bytes and attention work of a layer;
  a ring timeline (per-step compute and transfer timestamps) for both splits; PyTorch's ``context_parallel`` tried.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.measure.memory_stats import SavedActivations
from course_lib.parallel.block_attention import (attend_block, block_pairs, blocks_of, blockwise_attention,
                                                 merge_partials, no_partial)
from course_lib.theory.savers import attention_saved_bytes
from course_lib.model import naive_attention  # the written-out kernel, shared by lessons 07, 10 and 12

__all__ = ["naive_attention", "attention_memory_sweep", "blockwise_errors", "timed_ring_forward",
           "rank_context_lab", "rank_torch_context_parallel", "CASES"]

CASES = (("ring", "balanced"), ("ring", "contiguous"), ("all_gather", "balanced"), ("ulysses", "balanced"))




def attention_memory_sweep(seq_lens, batch: int = 1, n_head: int = 1, head_dim: int = 16,
                           naive_up_to: int = 8192, block_size: int = 512) -> list[dict]:
    """Bytes saved for backward (``SavedActivations``) by one causal attention, per sequence length: naive (only up
    to `naive_up_to`), SDPA and blockwise, with lesson 07's formulas, and the largest output difference."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for s in seq_lens:
        q, k, v = (torch.randn(batch, n_head, s, head_dim, generator=g).requires_grad_() for _ in range(3))
        row = dict(s=s, naive=None, naive_formula=attention_saved_bytes(batch, n_head, s, head_dim, "naive"),
                   sdpa_formula=attention_saved_bytes(batch, n_head, s, head_dim, "sdpa"))
        with SavedActivations() as acts:
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        row["sdpa"] = acts.bytes
        with SavedActivations() as acts:
            out = blockwise_attention(q, k, v, causal=True, block_size=block_size)
        row["blockwise"] = acts.bytes
        row["max_diff"] = (out - ref).abs().max().item()
        del out
        if s <= naive_up_to:
            with SavedActivations() as acts:
                naive = naive_attention(q, k, v)
            row["naive"] = acts.bytes
            row["max_diff"] = max(row["max_diff"], (naive - ref).abs().max().item())
            del naive
        rows.append(row)
    return rows


def blockwise_errors(seq_len: int = 256, block_size: int = 48, batch: int = 2, n_head: int = 4,
                     head_dim: int = 16) -> dict:
    """{causal: {"out": max |blockwise - SDPA|, "grad": max over dq, dk, dv}} in fp32 (block_size need not divide s)."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for causal in (True, False):
        q, k, v = (torch.randn(batch, n_head, seq_len, head_dim, generator=g).requires_grad_() for _ in range(3))
        ours = blockwise_attention(q, k, v, causal=causal, block_size=block_size)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        dout = torch.randn(ref.shape, generator=g)
        g_ours = torch.autograd.grad(ours, (q, k, v), dout)
        g_ref = torch.autograd.grad(ref, (q, k, v), dout)
        out[causal] = dict(out=(ours - ref).abs().max().item(),
                           grad=max((a - b).abs().max().item() for a, b in zip(g_ours, g_ref)))
    return out


# ------------------------------------------------------------------------------ ranks

@torch.no_grad()
def timed_ring_forward(q, k, v, layouts: list, clock) -> tuple[torch.Tensor, list[dict]]:
    """Ring attention's forward (as in `course_lib.parallel.context_attention`) with timestamps: this rank's
    q, k, v (B, H, n, D) -> (out (B, H, n, D), events). Per ring step: a "transfer" from posting the next K/V chunk to
    its arrival, and a "compute" over the blocks of the chunk held now (``perf_counter`` seconds; CUDA events on a GPU)."""
    cp, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % cp, (r - 1) % cp
    q_blocks = blocks_of(layouts[r])
    kv = torch.stack([k, v])                                          # (2, B, H, n, D)
    out, lse = no_partial(q)                                          # fp32 accumulators
    stamps = []
    for t in range(cp):
        src = (r - t) % cp
        works, nxt, t_post = [], None, None
        if t < cp - 1:
            nxt = torch.empty_like(kv)
            t_post = clock.stamp()
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, right), dist.P2POp(dist.irecv, nxt, left)])
        t0 = clock.stamp()
        for (qr, qs, qn), (kr, ks, kn), masked in block_pairs(q_blocks, blocks_of(layouts[src]), True):
            rows = slice(qr, qr + qn)
            o, l = attend_block(q[..., rows, :], kv[0, ..., kr:kr + kn, :], kv[1, ..., kr:kr + kn, :], qs, ks, masked)
            out[..., rows, :], lse[..., rows] = merge_partials(out[..., rows, :], lse[..., rows], o, l)
        t1 = clock.stamp()
        for w in works:
            w.wait()
        t_done = clock.stamp()
        stamps.append((t, t_post, t0, t1, t_done))
        kv = nxt if nxt is not None else kv
    events = []
    for t, t_post, t0, t1, t_done in stamps:
        events.append(dict(step=t, kind="compute", start=clock.seconds(t0), end=clock.seconds(t1)))
        if t_post is not None:
            events.append(dict(step=t, kind="transfer", start=clock.seconds(t_post), end=clock.seconds(t_done)))
    return out.to(q.dtype), events


def _ring_timeline(batch, n_head, seq_len, head_dim, split, repeats):
    """The fastest of `repeats` timed ring forwards (a barrier before each) and its error vs SDPA on one rank."""
    from course_lib.measure.speed import Stopwatch
    from course_lib.parallel.context import layouts as cp_layouts, split_sequence

    dev = cdist.device()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(batch, n_head, seq_len, head_dim, generator=g).to(dev) for _ in range(3))
    lay = cp_layouts(seq_len, dist.get_world_size(), split)
    qr, kr, vr = (split_sequence(t, None, split, dim=2).contiguous() for t in (q, k, v))
    tries = []
    for _ in range(repeats):
        dist.barrier()
        clock = Stopwatch(dev)
        start = clock.seconds(clock.stamp())
        out, events = timed_ring_forward(qr, kr, vr, lay, clock)      # perf_counter seconds: one clock per machine
        tries.append((max(e["end"] for e in events) - start, events, out))
    totals = torch.tensor([t[0] for t in tries], dtype=torch.float64, device=dev)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)                     # the same try on every rank: the fastest ring
    best = tries[int(totals.argmin())]
    ref = split_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), None, split, dim=2)
    return dict(events=best[1], max_diff=(best[2] - ref).abs().max().item(),
                compute_s=sum(e["end"] - e["start"] for e in best[1] if e["kind"] == "compute"))


def _one_step(cfg, batch, variant, split):
    """One forward and backward of the tiny GPT with CP in every block: global loss, gradients (summed over the
    ranks and divided by cp), bytes per (phase, op) and attention work of layer 0 on this rank."""
    from course_lib.model import build_model, lm_loss
    from course_lib.one_process import grads_of
    from course_lib.parallel import context

    dev = cdist.device()
    model = context.apply_context_parallel(build_model(cfg, 0).to(dev), None, variant, split)
    x, y = (context.split_sequence(t.to(dev), None, split) for t in batch)         # (B, s) -> (B, s/cp)
    loss = lm_loss(model(x), y)
    loss.backward()
    context.sync_context_parallel_grads(model)
    attn = model.blocks[0].attn
    return dict(loss=context.context_parallel_loss(loss), grads={k: v.cpu() for k, v in grads_of(model).items()},
                comm={f"{ph}/{op}": v for (ph, op), v in attn.counter.table().items()}, work=attn.counter.work)


def rank_torch_context_parallel(cfg, batch) -> dict:
    """PyTorch's ``context_parallel`` (torch.distributed.tensor.experimental) on the plain GPT, one forward and
    backward: {"loss", "grads"} where it runs, {"error": "Type: message"} where it refuses (gloo / CPU)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    from course_lib.model import build_model
    from course_lib.one_process import grads_of
    from course_lib.parallel.context import (ContextParallelPositions, context_parallel_loss,
                                             sync_context_parallel_grads)

    dev = cdist.device()
    model = build_model(cfg, 0).to(dev)
    model.pos_emb = ContextParallelPositions(model.pos_emb, None, "balanced")   # its load balancer: the same split
    x, y = (t.to(dev).clone() for t in batch)
    try:
        with context_parallel(DeviceMesh(dev.type, list(range(dist.get_world_size()))), buffers=[x, y],
                              buffer_seq_dims=[1, 1], no_restore_buffers={x, y}):
            loss = model.loss(x, y)                                   # x, y are now this rank's (B, s/cp)
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        return dict(error=" ".join(f"{type(exc).__name__}: {exc}".split())[:400])
    sync_context_parallel_grads(model)
    return dict(loss=context_parallel_loss(loss), grads={k: v.cpu() for k, v in grads_of(model).items()})


def rank_context_lab(cfg, batch, timeline: dict | None = None, try_torch: bool = False) -> dict:
    """Every experiment of sections 3-5 on this rank, in one launch (cp = the world size):
    {"cases": {"variant/split": `_one_step`}, "timeline": {split: ...}, "torch": {...}, "hardware": label}.
    `timeline`: dict(batch=, n_head=, seq_len=, head_dim=, repeats=) for the timed ring forward (None: skipped)."""
    from course_lib.measure.hardware import hardware_label

    out = dict(cases={f"{v}/{s}": _one_step(cfg, batch, v, s) for v, s in CASES},
               hardware=hardware_label(cdist.backend(), cdist.device()))
    if timeline:
        out["timeline"] = {split: _ring_timeline(split=split, **timeline) for split in ("contiguous", "balanced")}
    if try_torch:
        out["torch"] = rank_torch_context_parallel(cfg, batch)
    return out
