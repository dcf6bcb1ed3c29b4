"""Blockwise attention with the online softmax, in one process (lesson 10).

Attention ``softmax(q k^T / sqrt(D) + mask) v`` never needs the whole (T, T) score matrix at once. Milakov &
Gimelshein 2018 ("Online normalizer calculation for softmax") and FlashAttention (Dao et al. 2022, "FlashAttention:
Fast and Memory-Efficient Exact Attention with IO-Awareness", its forward: algorithms 1 and 2) compute it block by
block: for a block of queries and one block of keys/values,

    S = q k^T / sqrt(D)   (masked),   lse = log sum_j exp(S_ij),   out = exp(S - lse) v

is a *partial result* (out, lse) over that key block. Two partial results over disjoint key blocks merge exactly:

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b      (`merge_partials`)

so the output is built from key/value blocks one at a time and only (out, lse) is kept: memory O(T), not O(T^2).
The backward recomputes the scores block by block from the saved lse alone. FlashAttention's own backward
(Dao et al. 2022, algorithm 4; its algorithm 2 is the forward pass) keeps each row's max and sum of exponentials;
saving the one log-sum-exp per row instead is FlashAttention-2's change (Dao 2023, "FlashAttention-2: Faster
Attention with Better Parallelism and Work Partitioning", section 3.1.2 and its algorithm 2), which this follows:

    P = exp(S - lse),  dV += P^T dO,  dP = dO V^T,  D = rowsum(dO * O),  dS = P * (dP - D),
    dQ += dS K / sqrt(D_head),  dK += dS^T Q / sqrt(D_head)                                    (`block_grads`)

These pieces are also the steps of ring attention (`course_lib.parallel.context`): there the key blocks are the
chunks that travel around the ring of cp ranks.

Positions. A tensor's rows are a list of *chunks*, each a run of consecutive global positions ``(start, length)``;
the causal mask is ``key position > query position``. So a rank's non-contiguous rows (the load-balanced split of
context parallelism) are attended correctly, and a (query block, key block) pair whose keys all come after its
queries is skipped: its scores are never computed (`block_pairs`).

    out = blockwise_attention(q, k, v, causal=True, block_size=16)     # = F.scaled_dot_product_attention(...)

Shorthand: B batch, H heads, T (or n) rows, D head_dim; q, k, v are (B, H, T, D).
"""

from __future__ import annotations

import math

import torch
from course_lib.reference import reference_for

__all__ = ["Chunks", "blocks_of", "block_pairs", "attend_block", "no_partial", "merge_partials", "block_grads",
           "BlockwiseAttention", "blockwise_attention"]

Chunks = list[tuple[int, int]]   # [(first global position, length), ...] of a tensor's rows, in row order


def blocks_of(chunks: Chunks, block_size: int | None = None) -> list[tuple[int, int, int]]:
    """Cut a tensor's chunks into blocks of at most `block_size` rows: [(first row, first position, length)]."""
    out, row = [], 0
    for start, length in chunks:
        step = length if block_size is None else block_size
        for off in range(0, length, step):
            out.append((row + off, start + off, min(step, length - off)))
        row += length
    return out


@reference_for("10-balanced-split")
def block_pairs(q_blocks, k_blocks, causal: bool):
    """(q block, k block, needs a mask) for every pair that has at least one visible score: with the causal mask a
    pair whose first key comes after its last query is fully masked and skipped; one whose last key is at or before
    its first query is fully visible (no mask)."""
    for qb in q_blocks:
        for kb in k_blocks:
            if not causal:
                yield qb, kb, False
            elif kb[1] <= qb[1] + qb[2] - 1:                         # first key <= last query
                yield qb, kb, kb[1] + kb[2] - 1 > qb[1]              # last key > first query: partly masked


def _scores(q, k, q_start: int, k_start: int, masked: bool, scale: float) -> torch.Tensor:
    """S = q k^T * scale, -inf where key position > query position: (B, H, nq, D), (B, H, nk, D) -> (B, H, nq, nk),
    in fp32 whatever the inputs' dtype, as the accumulators of `no_partial`."""
    s = (q.float() @ k.float().transpose(-2, -1)) * scale            # (B, H, nq, nk)
    if masked:
        qpos = torch.arange(q_start, q_start + q.shape[-2], device=q.device)
        kpos = torch.arange(k_start, k_start + k.shape[-2], device=q.device)
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key) replaced by 0, so that exp(x - lse) is 0, never nan."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def attend_block(q, k, v, q_start: int = 0, k_start: int = 0, masked: bool = False, scale: float | None = None):
    """One partial result over one key block: (out, lse), out (B, H, nq, D), lse (B, H, nq), both in fp32 whatever
    the inputs' dtype: in bf16 an lse rounded to 8 bits of mantissa would weight every later merge wrongly.

    A query row that sees no key of the block gets lse = -inf and out = 0 (the merge then gives it weight 0)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, q_start, k_start, masked, scale)               # (B, H, nq, nk)
    lse = torch.logsumexp(s, dim=-1)                                  # (B, H, nq, nk) -> (B, H, nq)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))                     # softmax over this block's keys
    return p @ v.float(), lse                                         # (B, H, nq, nk) @ (B, H, nk, D) -> (B, H, nq, D)


def no_partial(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (out, lse) of rows that have seen no key yet, the accumulators of the online softmax: zeros (B, H, nq, D)
    and -inf (B, H, nq), in fp32 whatever q's dtype (PyTorch's ring attention likewise upcasts, its
    `_ContextParallelOptions.convert_to_f32`: "to avoid accumulation errors"). `zeros_like` keeps q's memory layout."""
    return (torch.zeros_like(q, dtype=torch.float32),
            q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32))


@reference_for("10-merge-lse")
def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two partial results over disjoint key sets by log-sum-exp (the online softmax): (out, lse).

    ``lse = logaddexp(lse_a, lse_b)``; each output is reweighted by ``exp(lse_x - lse)``, its share of the
    softmax's denominator. `out_a` None means "nothing yet" (returns b)."""
    if out_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)                               # (B, H, nq)
    w_a = torch.exp(lse_a - _finite(lse)).unsqueeze(-1)               # (B, H, nq, 1)
    w_b = torch.exp(lse_b - _finite(lse)).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def block_grads(q, k, v, dout, lse, delta, q_start: int = 0, k_start: int = 0, masked: bool = False,
                scale: float | None = None):
    """The backward for one (query block, key block) pair from the saved log-sum-exp (FlashAttention-2's form, Dao
    2023, section 3.1.2): (dq, dk, dv) contributions.

    lse (B, H, nq) is the *final* log-sum-exp of the query rows (over all keys), delta = rowsum(dO * O) (B, H, nq).
    Computed and returned in fp32 whatever the inputs' dtype (the caller accumulates them)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v, dout = q.float(), k.float(), v.float(), dout.float()
    s = _scores(q, k, q_start, k_start, masked, scale)               # recomputed: (B, H, nq, nk)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))                     # the softmax probabilities of this block
    dv = p.transpose(-2, -1) @ dout                                   # (B, H, nk, nq) @ (B, H, nq, D) -> (B, H, nk, D)
    dp = dout @ v.transpose(-2, -1)                                   # (B, H, nq, nk)
    ds = p * (dp - delta.unsqueeze(-1))                               # (B, H, nq, nk)
    dq = (ds @ k) * scale                                             # (B, H, nq, D)
    dk = (ds.transpose(-2, -1) @ q) * scale                           # (B, H, nk, D)
    return dq, dk, dv


class BlockwiseAttention(torch.autograd.Function):
    """Attention of q (rows laid out as `q_chunks`) over k, v (rows laid out as `k_chunks`), block by block.

    Forward keeps only q, k, v, the output and the log-sum-exp per query row (B, H, nq), never a score matrix;
    backward recomputes each block's scores from it (FlashAttention-2, Dao 2023, section 3.1.2). Lesson 10."""

    @staticmethod
    def forward(ctx, q, k, v, q_chunks, k_chunks, causal, block_size, counter):
        q_blocks, k_blocks = blocks_of(q_chunks, block_size), blocks_of(k_chunks, block_size)
        out, lse = no_partial(q)                                      # (B, H, nq, D), (B, H, nq), fp32
        for (qr, qs, qn), (kr, ks, kn), masked in block_pairs(q_blocks, k_blocks, causal):
            o, l = attend_block(q[..., qr:qr + qn, :], k[..., kr:kr + kn, :], v[..., kr:kr + kn, :], qs, ks, masked)
            o, l = merge_partials(out[..., qr:qr + qn, :], lse[..., qr:qr + qn], o, l)
            out[..., qr:qr + qn, :], lse[..., qr:qr + qn] = o, l
            if counter is not None:
                counter.add_work(q.shape[0] * q.shape[1] * qn * kn)
        out = out.to(q.dtype)                                         # (no copy in fp32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = (q_blocks, k_blocks, causal)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        q_blocks, k_blocks, causal = ctx.layout
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)                  # D = rowsum(dO * O): (B, H, nq)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        for (qr, qs, qn), (kr, ks, kn), masked in block_pairs(q_blocks, k_blocks, causal):
            rows, cols = slice(qr, qr + qn), slice(kr, kr + kn)
            g = block_grads(q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :],
                            lse[..., rows], delta[..., rows], qs, ks, masked)
            dq[..., rows, :] += g[0]
            dk[..., cols, :] += g[1]
            dv[..., cols, :] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def blockwise_attention(q, k, v, causal: bool = True, block_size: int | None = None,
                        q_chunks: Chunks | None = None, k_chunks: Chunks | None = None, counter=None,
                        return_lse: bool = False):
    """Exact attention computed block by block with the online softmax (lesson 10; FlashAttention, Dao et al. 2022).

    q (B, H, nq, D), k and v (B, H, nk, D) -> (B, H, nq, D) (and the log-sum-exp (B, H, nq) with ``return_lse``).
    By default the rows are positions 0..n-1; `q_chunks` / `k_chunks` give other layouts (context parallelism).
    `block_size` rows per block (None: one block per chunk). `counter.add_work(n)` receives the score elements
    computed (skipped, fully masked blocks are not computed)."""
    q_chunks = [(0, q.shape[-2])] if q_chunks is None else q_chunks
    k_chunks = [(0, k.shape[-2])] if k_chunks is None else k_chunks
    out, lse = BlockwiseAttention.apply(q, k, v, q_chunks, k_chunks, causal, block_size, counter)
    return (out, lse) if return_lse else out
