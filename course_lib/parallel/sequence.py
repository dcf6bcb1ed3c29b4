"""Sequence parallelism: collectives along the sequence dimension (lesson 04).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.2) split
the regions between the tensor-parallel layers (LayerNorm, dropout, residual adds) along the sequence: there the
activations are (B, T/t, C) on each rank. An all-reduce is a reduce-scatter followed by an all-gather, so

    g (all-reduce forward)  becomes  `scatter_to_sequence`: reduce-scatter forward, all-gather backward
    f (all-reduce backward) becomes  `gather_from_sequence`: all-gather forward, reduce-scatter backward

`SequenceParallelLinear` fuses the all-gather with the column-parallel matmul and gathers its input *again* in
backward instead of keeping the (B, T, C) copy: only the (B, T/t, C) shard is saved, so every activation of a
layer is divided by t. Sequences are batch-first here, (B, T, C), so gathering along T (dim 1) transposes to
(T, B, C) around the collective (Megatron-LM keeps activations sequence-first for this reason).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["all_gather_sequence", "reduce_scatter_sequence", "gather_from_sequence", "scatter_to_sequence",
           "split_to_sequence", "gather_to_replicated", "SequenceParallelLinear"]


def _validate_seq(T: int, tp: int) -> None:
    if T % tp:
        raise ValueError(f"sequence parallelism splits the sequence across the tp={tp} ranks: sequence length "
                         f"T={T} is not divisible by tp={tp}; use T in multiples of {tp}")


def all_gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T/t, C) on every rank -> (B, T, C): the ranks' sequence shards in rank order (no autograd)."""
    tp = dist.get_world_size(group)
    if tp == 1:
        return x
    xs = x.transpose(0, 1).contiguous()                              # (T/t, B, C)
    out = xs.new_empty((tp * xs.shape[0], *xs.shape[1:]))            # (T, B, C)
    dist.all_gather_into_tensor(out, xs, group=group)
    return out.transpose(0, 1)                                       # (T, B, C) -> (B, T, C)


def reduce_scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T, C) partial sums on every rank -> (B, T/t, C): rank r gets the sum of sequence shard r."""
    tp = dist.get_world_size(group)
    _validate_seq(x.shape[1], tp)
    if tp == 1:
        return x
    xs = x.transpose(0, 1).contiguous()                              # (T, B, C)
    out = xs.new_empty((xs.shape[0] // tp, *xs.shape[1:]))           # (T/t, B, C)
    dist.reduce_scatter_tensor(out, xs, op=dist.ReduceOp.SUM, group=group)
    return out.transpose(0, 1)                                       # (T/t, B, C) -> (B, T/t, C)


class _GatherFromSequence(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward (the sequence-parallel form of f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward (the sequence-parallel form of g)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


def gather_from_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T/t, C) -> (B, T, C): all-gather forward, reduce-scatter backward."""
    return _GatherFromSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T, C) partial -> (B, T/t, C) summed: reduce-scatter forward, all-gather backward."""
    return _ScatterToSequence.apply(x, group)


def _own_shard(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) -> this rank's (B, T/t, C), no communication."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    _validate_seq(x.shape[1], tp)
    n = x.shape[1] // tp
    return x[:, r * n:(r + 1) * n].contiguous()


class _SplitToSequence(torch.autograd.Function):
    """Keep this rank's sequence shard forward, all-gather the gradient backward: entering the sequence-parallel
    region from a replicated one (the same (B, T, C) on every rank, e.g. a pipeline stage's embeddings)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_shard(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad.contiguous(), ctx.group), None


class _GatherToReplicated(torch.autograd.Function):
    """All-gather forward, keep this rank's shard of the gradient backward: leaving the sequence-parallel region
    into a replicated one (every rank computes the same thing on the whole sequence, so its gradient is already
    the full one on every rank, e.g. a last stage's final LayerNorm and head)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_shard(grad, ctx.group), None


def split_to_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T, C), the same on every rank -> this rank's (B, T/t, C): no communication forward, all-gather backward."""
    return _SplitToSequence.apply(x, group)


def gather_to_replicated(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, T/t, C) -> (B, T, C) on every rank, for replicated layers after it: all-gather forward, no communication
    backward."""
    return _GatherToReplicated.apply(x, group)


class SequenceParallelLinear(torch.autograd.Function):
    """All-gather the input along the sequence, then ``x W^T + b``. Backward gathers the input again rather
    than keeping the (B, T, C) copy: only the (B, T/t, C) shard is saved (Korthikanti et al. 2022, 4.2.2)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_sequence(x, group), weight, bias)    # (B, T/t, C) -> (B, T, C) -> (B, T, out/t)

    @staticmethod
    def backward(ctx, grad):                                             # grad (B, T, out/t)
        x, weight = ctx.saved_tensors
        full = all_gather_sequence(x, ctx.group)                         # re-gather: (B, T, C)
        grad_x = reduce_scatter_sequence(grad @ weight, ctx.group)       # partial (B, T, C) -> (B, T/t, C)
        g2 = grad.reshape(-1, grad.shape[-1])                            # (B*T, out/t)
        grad_w = g2.t() @ full.reshape(-1, full.shape[-1])               # (out/t, C)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None
