"""Tensor parallelism: column- and row-parallel linear layers and the conjugate operators f and g (lesson 04).

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", section 3) splits every weight matrix of a transformer layer across the `tp` ranks of
a tensor-parallel group:

* column-parallel ``Y = X A`` with ``A = [A_1 ... A_t]`` split along its output columns: rank r computes
  ``Y_r = X A_r`` (its slice of the output features) from the full input X;
* row-parallel ``Z = Y B`` with ``B`` split along its input rows: rank r computes the partial sum
  ``Y_r B_r`` and the ranks add their partials with one all-reduce.

Two conjugate autograd operators put the communication in the right place:

    f  (`copy_to_tp`):     identity forward,   all-reduce backward   (enters a column-parallel layer)
    g  (`reduce_from_tp`): all-reduce forward, identity backward     (leaves a row-parallel layer)

so an MLP (column then row) costs one all-reduce forward and one backward.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2) also splits the regions between the layers (LayerNorm, dropout, residual) along
the sequence. An all-reduce is a reduce-scatter followed by an all-gather, so g becomes a reduce-scatter
(`scatter_to_sequence`) and f an all-gather (`SequenceParallelLinear`, which gathers its input again in
backward instead of keeping the full-length copy): the same bytes, and every activation divided by tp.
Those collectives live in `course_lib.parallel.sequence`; the layers below take ``sequence_parallel=True``.

`course_lib.parallel.tensor_model.apply_tensor_parallel` uses these layers on a plain GPT.
Shorthand: B batch, T sequence, C d_model, F d_ff, H heads, D head_dim, t = tp (ranks in the group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.sequence import SequenceParallelLinear, scatter_to_sequence
from course_lib.reference import reference_for

__all__ = ["shard", "copy_to_tp", "reduce_from_tp", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "ParallelAttention"]


def shard(t: torch.Tensor, dim: int, rank: int, tp: int, n_fused: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `t` along `dim` (a copy). A fused tensor (the qkv weight: q, k, v stacked,
    ``n_fused=3``) is sliced part by part, so that rank r gets [q_r; k_r; v_r], its own heads of each."""
    parts = t.chunk(n_fused, dim)
    return torch.cat([p.chunk(tp, dim)[rank] for p in parts], dim).clone()


# ------------------------------------------------------------------ the conjugate operators f and g

def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x                        # tp = 1: nothing to add up, no call (as Megatron-LM does)
    x = x.contiguous().clone()          # never reduce a tensor autograd may still read
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


@reference_for("04-column-parallel")
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank holds part of dL/dX; the full one is their sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


@reference_for("04-row-parallel")
class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward (dL/dZ is already replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@reference_for("04-column-parallel")
def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: enter a tensor-parallel region (identity forward, all-reduce of the gradient backward)."""
    return _CopyToTP.apply(x, group)


@reference_for("04-row-parallel")
def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: leave a tensor-parallel region (all-reduce forward, identity backward)."""
    return _ReduceFromTP.apply(x, group)


# ------------------------------------------------------------------ layers

@reference_for("04-column-parallel")
class ColumnParallelLinear(nn.Module):
    """``Y_r = X A_r^T + b_r``: this rank's slice of the output features (Megatron-LM section 3).

    Input X (B, T, C) replicated (or (B, T/t, C) with ``sequence_parallel``); output (B, T, out/t).
    Weight (out/t, in), bias (out/t). ``n_fused``: the output is n_fused stacked matrices (qkv: 3),
    each sliced separately. ``gather_output`` all-gathers the output features (not used by the GPT).
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 sequence_parallel: bool = False, n_fused: int = 1, gather_output: bool = False):
        super().__init__()
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if out_features % (self.tp * n_fused):
            raise ValueError(f"tp={self.tp} does not divide out_features={out_features // n_fused}")
        self.in_features, self.out_features, self.n_fused = in_features, out_features, n_fused
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        self.weight = nn.Parameter(torch.empty(out_features // self.tp, in_features))   # (out/t, in)
        self.bias = nn.Parameter(torch.zeros(out_features // self.tp)) if bias else None
        self.shard_dims = {"weight": (0, n_fused), "bias": (0, n_fused)}   # how full tensors map to ours

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "ColumnParallelLinear":
        """This rank's slice of a full `nn.Linear` (same weights on every rank: exact equality with one process)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, **kw)
        w = linear.weight
        layer.weight.data = shard(w, 0, layer.rank, layer.tp, layer.n_fused).to(w.device)
        if linear.bias is not None:
            layer.bias.data = shard(linear.bias, 0, layer.rank, layer.tp, layer.n_fused).to(w.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)   # (B, T/t, C) -> (B, T, out/t)
        else:
            y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)           # (B, T, C) -> (B, T, out/t)
        if self.gather_output:
            parts = [torch.empty_like(y) for _ in range(self.tp)]
            dist.all_gather(parts, y.contiguous(), group=self.group)
            y = torch.cat(parts, -1)                                                    # (B, T, out), no gradient
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}/{self.tp}, fused={self.n_fused}, "
                f"sequence_parallel={self.sequence_parallel}")


@reference_for("04-row-parallel")
class RowParallelLinear(nn.Module):
    """``Z = sum_r Y_r B_r^T + b``: input features split, partial sums added by g (Megatron-LM section 3).

    Input Y_r (B, T, in/t); output (B, T, out) replicated, or (B, T/t, out) with ``sequence_parallel``
    (reduce-scatter instead of all-reduce). Weight (out, in/t); the bias is whole and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if in_features % self.tp:
            raise ValueError(f"tp={self.tp} does not divide in_features={in_features}")
        self.in_features, self.out_features, self.sequence_parallel = in_features, out_features, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp))   # (out, in/t)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True    # each rank sees T/t tokens: its gradient is partial
        self.shard_dims = {"weight": (1, 1)}

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group=None, **kw) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, **kw)
        layer.weight.data = shard(linear.weight, 1, layer.rank, layer.tp).to(linear.weight.device)
        if linear.bias is not None:
            layer.bias.data = linear.bias.detach().clone()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)                           # (B, T, in/t) -> (B, T, out), partial sum
        if self.sequence_parallel:
            z = scatter_to_sequence(partial, self.group)             # (B, T, out) -> (B, T/t, out)
        else:
            z = reduce_from_tp(partial, self.group)                  # (B, T, out), summed over ranks
        return z + self.bias if self.bias is not None else z

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.tp}, out={self.out_features}, sequence_parallel={self.sequence_parallel}"


@reference_for("04-parallel-mlp")
class ParallelMLP(nn.Module):
    """fc column-parallel, GELU on this rank's F/t hidden features, proj row-parallel: one all-reduce forward
    (in proj's g) and one backward (in fc's f). Built from a plain `course_lib.model.MLP` by `from_mlp`."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear, dropout: float = 0.0):
        super().__init__()
        self.fc, self.proj, self.drop = fc, proj, nn.Dropout(dropout)

    @classmethod
    def from_mlp(cls, mlp: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelMLP":
        return cls(ColumnParallelLinear.from_linear(mlp.fc, group, sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_linear(mlp.proj, group, sequence_parallel=sequence_parallel),
                   mlp.drop.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")                   # (B, T, C) -> (B, T, F/t)
        return self.drop(self.proj(h))                               # (B, T, F/t) -> (B, T, C)


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split across ranks: rank r computes heads r*H/t .. (r+1)*H/t - 1.

    qkv is column-parallel (fused: each rank holds its heads' rows of q, k and v), proj row-parallel.
    Attention itself needs no communication: every head is independent (Megatron-LM section 3, fig. 3b).
    """

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head: int, dropout: float = 0.0):
        super().__init__()
        tp = qkv.tp
        if n_head % tp:
            raise ValueError(f"tp={tp} does not divide n_head={n_head}")
        self.qkv, self.proj = qkv, proj
        self.n_local_heads, self.head_dim = n_head // tp, qkv.in_features // n_head
        self.dropout, self.resid_drop = dropout, nn.Dropout(dropout)

    @classmethod
    def from_attention(cls, attn: nn.Module, group=None, sequence_parallel: bool = False) -> "ParallelAttention":
        return cls(ColumnParallelLinear.from_linear(attn.qkv, group, sequence_parallel=sequence_parallel, n_fused=3),
                   RowParallelLinear.from_linear(attn.proj, group, sequence_parallel=sequence_parallel),
                   attn.n_head, attn.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                                 # (B, T(/t), C) -> (B, T, 3C/t)
        B, T, _ = qkv.shape
        h, D = self.n_local_heads, self.head_dim
        q, k, v = (u.view(B, T, h, D).transpose(1, 2) for u in qkv.split(h * D, dim=-1))   # 3 x (B, H/t, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)   # (B, H/t, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, h * D)              # (B, H/t, T, D) -> (B, T, C/t)
        return self.resid_drop(self.proj(y))                              # (B, T, C/t) -> (B, T(/t), C)
