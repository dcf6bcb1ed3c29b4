"""Vocab-parallel embedding and cross-entropy: no rank ever holds the full (B, T, V) logits (lesson 04).

The vocabulary is the largest dimension of a language model (50257 for GPT-2, 128k+ for recent models), so
Megatron-LM (Shoeybi et al. 2019, section 3) splits the token embedding along the vocabulary: rank r owns
rows [r V/t, (r+1) V/t). With tied embeddings the output head is the same (V/t, C) matrix, a column-parallel
layer whose output is this rank's slice of the logits, (B, T, V/t).

Cross-entropy needs ``log sum_v exp(z_v) - z_target`` over the *whole* vocabulary. Three all-reduces of
(B, T) numbers, instead of gathering (B, T, V) logits, give it exactly:

    m = max_r max_v z            (all-reduce MAX; subtracted for numerical stability, a constant for autograd)
    S = sum_r sum_v exp(z - m)   (all-reduce SUM)
    z_target - m                 (all-reduce SUM: only the rank that owns the target contributes)

and the gradient is local: dL/dz_v = softmax_v - [v = target], this rank's columns only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.sequence import scatter_to_sequence
from course_lib.parallel.tensor import reduce_from_tp, shard
from course_lib.reference import reference_for

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy", "vocab_range"]


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """[start, end) of the token ids rank `rank` owns."""
    per = vocab_size // tp
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """Token embedding with rows split across ranks: weight (V/t, C).

    Each rank looks up the tokens it owns (zeros for the others); the sum over ranks (g, an all-reduce) is the
    full embedding, (B, T) -> (B, T, C). With ``sequence_parallel`` the sum is a reduce-scatter instead:
    (B, T) -> (B, T/t, C), this rank's part of the sequence.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if num_embeddings % self.tp:
            raise ValueError(f"tp={self.tp} does not divide vocab_size={num_embeddings}")
        self.num_embeddings, self.sequence_parallel = num_embeddings, sequence_parallel
        self.start, self.end = vocab_range(num_embeddings, self.rank, self.tp)
        self.weight = nn.Parameter(torch.empty(num_embeddings // self.tp, embedding_dim))   # (V/t, C)
        self.shard_dims = {"weight": (0, 1)}

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, emb: nn.Embedding, group=None, **kw) -> "VocabParallelEmbedding":
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, **kw)
        layer.weight.data = shard(emb.weight, 0, layer.rank, layer.tp).to(emb.weight.device)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)                   # (B, T) tokens another rank owns
        local = (idx - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)   # (B, T) -> (B, T, C), partial
        if self.sequence_parallel:
            return scatter_to_sequence(x, self.group)                      # (B, T, C) -> (B, T/t, C)
        return reduce_from_tp(x, self.group)                               # (B, T, C), summed over ranks

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.end}) of {self.num_embeddings}, sequence_parallel={self.sequence_parallel}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocabulary; backward is local (no communication)."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        z = logits.float().reshape(-1, logits.shape[-1])                   # (N, V/t), N = B*T tokens
        t = targets.reshape(-1)                                            # (N,)
        start, end = vocab_range(z.shape[-1] * tp, rank, tp)
        m = z.max(dim=-1).values                                           # (N,) local max
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)          # global max
        z = z - m.unsqueeze(-1)
        mine = (t >= start) & (t < end)                                    # this rank owns the target
        local_t = (t - start).masked_fill(~mine, 0)
        target_z = z.gather(1, local_t.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)   # (N,)
        exp = z.exp()                                                      # (N, V/t)
        sums = torch.stack([exp.sum(-1), target_z])                        # (2, N): one all-reduce for both
        if tp > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target_z = sums
        loss = (sum_exp.log() - target_z).mean()
        softmax = exp.div_(sum_exp.unsqueeze(-1))                          # (N, V/t) saved for backward
        ctx.save_for_backward(softmax, mine, local_t)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local_t = ctx.saved_tensors
        g = softmax.clone()                                                # dL/dz = softmax - onehot(target)
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[mine], local_t[mine]] -= 1.0
        g.mul_(grad / g.shape[0])                                          # mean over the N tokens
        return g.view(ctx.shape).to(ctx.dtype), None, None


@reference_for("04-vocab-ce")
def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Mean cross-entropy (nats) of logits split along the vocabulary across the ranks of `group`.

    local_logits (B, T, V/t): this rank's columns [r V/t, (r+1) V/t) of the logits; targets (B, T) global ids.
    Equals ``F.cross_entropy(full_logits.flatten(0, 1), targets.flatten())`` on every rank. Two all-reduces of
    (B*T,) numbers forward (the max, then the sum of exponentials and the target logit in one), none backward.
    """
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group)
