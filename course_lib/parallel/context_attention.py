"""The three ways to attend over a sequence split across cp ranks (lesson 10): ring, all-gather, Ulysses.

Each rank holds the queries, keys and values of its own rows of the sequence (a *layout*: the chunks of global
positions it owns, `course_lib.parallel.context.chunk_layout`), (B, H, n, D) with n = s/cp. They differ in what
travels:

* **ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context",
  arXiv 2310.01889; Megatron-LM's and torchtitan's context parallelism): the queries stay, the K/V chunks travel
  around the ring r -> r+1 in cp steps; at each step the next transfer is posted before this step's blocks are
  computed (communication hidden behind compute), and the partial results merge by log-sum-exp
  (`block_attention.merge_partials`). Backward (`_RingAttention.backward`): K/V travel the ring again, and an
  accumulator of dK/dV travels with each chunk, collecting every rank's contribution, and makes one more hop home:
  per rank, forward (cp-1) K/V chunks sent, backward (cp-1) K/V chunks + cp dK/dV chunks.
  Precision: scores, the running output, the log-sum-exp and dQ are kept in fp32 whatever the inputs' dtype
  (`block_attention.no_partial`); the dK/dV accumulators travel in the inputs' dtype, so that bf16 sends the bytes
  of `theory.context.layer_comm` (PyTorch's ring attention sends them in fp32 instead, `convert_to_f32`).
* **all-gather** (Llama 3, Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2): all-gather K and V
  of the whole sequence, attend locally with the causal mask of the rank's own chunks; backward reduce-scatters
  dK, dV to their owners. Simple and exact; costs the whole sequence's K/V in memory (small with GQA).
* **Ulysses** (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv 2309.14509): an all-to-all turns the
  sequence-sharded q, k, v (B, H, s/cp, D) into head-sharded ones (B, H/cp, s, D); full attention on H/cp heads;
  an all-to-all turns the output back. 4 all-to-alls forward, 4 backward; needs cp | n_head.

Every call is counted in a `ContextCounter` (bytes per phase and op, and the score elements computed).
Shorthand: B batch, H heads, D head_dim, s sequence, n = s/cp rows per rank, r this rank's index in the cp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.measure.collective_counter import LayerCounter
from course_lib.parallel import block_attention
from course_lib.parallel.block_attention import Chunks, attend_block, block_grads, block_pairs, blocks_of
from course_lib.reference import reference_for

__all__ = ["VARIANTS", "ContextCounter", "cp_rank", "ring_attention", "all_gather_attention", "ulysses_attention"]

VARIANTS = ("ring", "all_gather", "ulysses")


ContextCounter = LayerCounter   # what one rank's attention layer sent and computed (work: score elements, forward)


def cp_rank(group=None) -> tuple[int, int]:
    """(cp, this rank's index) in `group`; (1, 0) outside a distributed run, so one process works unchanged."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _post(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, counter, phase: str):
    """Post one ring step (send to the right, receive from the left) as one `batch_isend_irecv` group (NCCL's rule:
    the two directions between a pair travel together); returns the works to wait for after the compute."""
    if counter is not None:
        counter.record(phase, "send", send)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, group),
                                   dist.P2POp(dist.irecv, recv, src, group)])


@reference_for("10-ring-step")
class _RingAttention(torch.autograd.Function):
    """Ring attention: q stays, K/V chunks travel r -> r+1; dK/dV travel back to their owners (lesson 10)."""

    @staticmethod
    def forward(ctx, q, k, v, group, layouts, causal, counter):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        right, left = _global(group, (r + 1) % cp), _global(group, (r - 1) % cp)
        q_blocks = blocks_of(layouts[r])
        kv = torch.stack([k, v])                                      # 2 x (B, H, n, D) -> (2, B, H, n, D)
        out, lse = block_attention.no_partial(q)                      # (B, H, n, D), (B, H, n), fp32
        # no_partial keeps q's memory layout, (B, n, H, D): the model's transpose back to (B, n, C) is free, as
        # after SDPA, and the output is the projection's input too (theory.context.activation_bytes_per_layer)
        for t in range(cp):
            src = (r - t) % cp                                        # whose K/V chunk this rank holds now
            works, nxt = [], None
            if t < cp - 1:                                            # post the next transfer before computing
                nxt = torch.empty_like(kv)
                works = _post(kv, right, nxt, left, group, counter, "forward")
            for (qr, qs, qn), (kr, ks, kn), masked in block_pairs(q_blocks, blocks_of(layouts[src]), causal):
                rows = slice(qr, qr + qn)
                o, l = attend_block(q[..., rows, :], kv[0, ..., kr:kr + kn, :], kv[1, ..., kr:kr + kn, :],
                                    qs, ks, masked)                  # (B, H, qn, D), (B, H, qn)
                merged = block_attention.merge_partials(out[..., rows, :], lse[..., rows], o, l)
                out[..., rows, :], lse[..., rows] = merged                # online softmax: one more key chunk
                if counter is not None:
                    counter.add_work(q.shape[0] * q.shape[1] * qn * kn)
            for w in works:
                w.wait()
            kv = nxt if nxt is not None else kv
        out = out.to(q.dtype)                                         # (no copy in fp32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (group, layouts, causal, counter)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, layouts, causal, counter = ctx.setup
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        right, left = _global(group, (r + 1) % cp), _global(group, (r - 1) % cp)
        q_blocks = blocks_of(layouts[r])
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)                  # D = rowsum(dO * O): (B, H, n)
        dq = torch.zeros_like(q, dtype=torch.float32)                 # (B, H, n, D)
        kv = torch.stack([k, v])                                      # (2, B, H, n, D)
        dkv = torch.zeros_like(kv)                                    # dK/dV of the chunk this rank holds now
        for t in range(cp):
            src = (r - t) % cp
            works, nxt = [], None
            if t < cp - 1:
                nxt = torch.empty_like(kv)
                works = _post(kv, right, nxt, left, group, counter, "backward")
            for (qr, qs, qn), (kr, ks, kn), masked in block_pairs(q_blocks, blocks_of(layouts[src]), causal):
                rows, cols = slice(qr, qr + qn), slice(kr, kr + kn)
                g = block_grads(q[..., rows, :], kv[0, ..., cols, :], kv[1, ..., cols, :], dout[..., rows, :],
                                lse[..., rows], delta[..., rows], qs, ks, masked)
                dq[..., rows, :] += g[0]
                dkv[0, ..., cols, :] += g[1]
                dkv[1, ..., cols, :] += g[2]
            dnext = torch.empty_like(dkv)                             # after the last step: this rank's own dK/dV
            works += _post(dkv, right, dnext, left, group, counter, "backward")
            for w in works:
                w.wait()
            kv, dkv = (nxt if nxt is not None else kv), dnext
        return dq.to(q.dtype), dkv[0], dkv[1], None, None, None, None


@reference_for("10-ring-step")
def ring_attention(q, k, v, group, layouts: list[Chunks], causal: bool = True, counter=None) -> torch.Tensor:
    """Ring attention of this rank's q over every rank's k, v: (B, H, n, D) -> (B, H, n, D) (Liu et al. 2023).

    `layouts[j]` is rank j's chunks of global positions (j = rank in `group`)."""
    if cp_rank(group)[0] == 1:
        return block_attention.blockwise_attention(q, k, v, causal, None, layouts[0], layouts[0], counter)
    return _RingAttention.apply(q, k, v, group, layouts, causal, counter)[0]


class _AllGatherKV(torch.autograd.Function):
    """All-gather K/V forward (B, H, n, D) x 2 -> (2, B, H, s, D) in rank order; reduce-scatter dK/dV backward."""

    @staticmethod
    def forward(ctx, k, v, group, counter):
        cp = dist.get_world_size(group)
        B, H, n, D = k.shape
        kv = torch.stack([k, v])                                      # (2, B, H, n, D)
        gathered = kv.new_empty((cp * 2, B, H, n, D))                 # rank j's K/V at rows 2j, 2j+1
        dist.all_gather_into_tensor(gathered, kv, group=group)
        if counter is not None:
            counter.record("forward", "all_gather", gathered)
        ctx.setup = (group, counter, cp)
        gathered = gathered.view(cp, 2, B, H, n, D)
        return gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, B, H, cp * n, D)   # -> (2, B, H, s, D)

    @staticmethod
    def backward(ctx, grad):                                          # (2, B, H, s, D)
        group, counter, cp = ctx.setup
        two, B, H, s, D = grad.shape
        parts = grad.reshape(2, B, H, cp, s // cp, D).permute(3, 0, 1, 2, 4, 5)                 # (cp, 2, B, H, n, D)
        parts = parts.reshape(cp * 2, B, H, s // cp, D)               # rank j's dK/dV at rows 2j, 2j+1 (a copy)
        mine = parts.new_empty((2, B, H, s // cp, D))
        dist.reduce_scatter_tensor(mine, parts, op=dist.ReduceOp.SUM, group=group)
        if counter is not None:
            counter.record("backward", "reduce_scatter", parts)
        return mine[0], mine[1], None, None


def all_gather_attention(q, k, v, group, layouts: list[Chunks], causal: bool = True, counter=None) -> torch.Tensor:
    """Llama 3's context parallelism: all-gather K/V, attend this rank's q with its chunks' causal mask.
    (B, H, n, D) -> (B, H, n, D)."""
    cp, r = cp_rank(group)
    if cp == 1:
        return ring_attention(q, k, v, group, layouts, causal, counter)
    kv = _AllGatherKV.apply(k, v, group, counter)                     # (2, B, H, s, D)
    every = [c for layout in layouts for c in layout]                 # the gathered rows' positions, rank order
    return block_attention.blockwise_attention(q, kv[0], kv[1], causal, None, layouts[r], every, counter)


@reference_for("10-ulysses-reshape")
def _seq_to_heads(x: torch.Tensor, group, counter, phase: str) -> torch.Tensor:
    """(B, H, n, D) sequence-sharded -> (B, H/cp, s, D) head-sharded, rows in rank order (one all-to-all)."""
    cp = dist.get_world_size(group)
    B, H, n, D = x.shape
    send = x.reshape(B, cp, H // cp, n, D).transpose(0, 1).contiguous()    # (cp, B, H/cp, n, D): part j to rank j
    recv = torch.empty_like(send)                                     # recv[j]: rank j's rows of my heads
    dist.all_to_all_single(recv, send, group=group)
    if counter is not None:
        counter.record(phase, "all_to_all", send)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * n, D)      # (cp, B, H/cp, n, D) -> (B, H/cp, s, D)


@reference_for("10-ulysses-reshape")
def _heads_to_seq(x: torch.Tensor, group, counter, phase: str) -> torch.Tensor:
    """(B, H/cp, s, D) head-sharded -> (B, H, n, D) sequence-sharded: the inverse all-to-all."""
    cp = dist.get_world_size(group)
    B, h, s, D = x.shape
    send = x.reshape(B, h, cp, s // cp, D).permute(2, 0, 1, 3, 4).contiguous()   # (cp, B, H/cp, n, D): rank j's rows
    recv = torch.empty_like(send)                                     # recv[j]: my rows of rank j's heads
    dist.all_to_all_single(recv, send, group=group)
    if counter is not None:
        counter.record(phase, "all_to_all", send)
    return recv.transpose(0, 1).reshape(B, cp * h, s // cp, D)        # (B, cp, H/cp, n, D) -> (B, H, n, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.setup = (group, counter)
        return _seq_to_heads(x, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, *ctx.setup, "backward"), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.setup = (group, counter)
        return _heads_to_seq(x, group, counter, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, *ctx.setup, "backward"), None, None


@reference_for("10-ulysses-reshape")
def ulysses_attention(q, k, v, group, layouts: list[Chunks], causal: bool = True, counter=None) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to H/cp heads of the whole sequence, attend, all-to-all back.
    (B, H, n, D) -> (B, H, n, D); H must be divisible by cp."""
    if cp_rank(group)[0] == 1:
        return ring_attention(q, k, v, group, layouts, causal, counter)
    every = [c for layout in layouts for c in layout]                 # rows after the all-to-all: rank order
    qh, kh, vh = (_SeqToHeads.apply(x, group, counter) for x in (q, k, v))    # 3 x (B, H/cp, s, D)
    out = block_attention.blockwise_attention(qh, kh, vh, causal, None, every, every, counter)
    return _HeadsToSeq.apply(out, group, counter)                     # (B, H/cp, s, D) -> (B, H, n, D)
