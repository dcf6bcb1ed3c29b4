"""Context parallelism: the sequence split across cp ranks, applied to a plain GPT (lesson 10).

Long sequences make activations, not weights, the problem: a layer's activations grow with s (and naive attention
with s^2). Context parallelism (CP) gives each of cp ranks s/cp tokens of every sequence; everything except
attention is per token and needs nothing else. Attention needs every earlier token's keys and values; the three
ways to get them are in `course_lib.parallel.context_attention` (ring, all-gather, Ulysses), built on the online
softmax of `course_lib.parallel.block_attention`.

    model = build_model(cfg, seed=0)                               # the same weights on every rank
    cp_model = apply_context_parallel(model, group, variant="ring")   # every block's attention swapped, in place
    idx_r, tgt_r = (split_sequence(t, group) for t in (idx, targets))  # (B, s) -> (B, s/cp): this rank's chunks
    loss = cp_model.loss(idx_r, tgt_r)                             # this rank's mean; the global loss is their mean
    loss.backward(); sync_context_parallel_grads(cp_model, group)  # every gradient = one process's

**Layout.** The sequence is cut into chunks. ``split="contiguous"``: cp chunks, rank i holds chunk i. With the
causal mask the last rank's queries see every key and the first rank's only its own: without balancing the last rank
does about cp times the first's attention work. ``split="balanced"`` (Megatron-LM's CP, Llama 3 section 3.3.2):
2cp chunks, rank i holds chunks i and 2cp-1-i, an early and a late one, so every rank computes 2cp+1 of the
(2cp)^2 chunk pairs' score blocks (`course_lib.theory.context.causal_work_per_rank`).

**Positions.** The GPT has learned position embeddings and computes ``pos = arange(T)`` for its T local tokens;
under the balanced split they are not 0..T-1. `apply_context_parallel` swaps ``model.pos_emb`` for
`ContextParallelPositions`, which maps local row i to its global position (same weight, same name), so model.py is
unchanged.

**Gradients.** Each rank's loss is the mean over its tokens; the global loss is the mean of those (equal token
counts). Every parameter's gradient is the sum over the ranks' tokens: `sync_context_parallel_grads` all-reduces
and divides by cp (Megatron folds the CP ranks into the data-parallel gradient all-reduce).

**PyTorch's own** ``torch.distributed.tensor.experimental.context_parallel`` (torch 2.14, the ring CP torchtitan
uses) does not run on gloo/CPU. It swaps ``F.scaled_dot_product_attention`` for a DTensor version whose custom
handlers cover only the CUDA kernels (``_scaled_dot_product_flash_attention``, ``_efficient_``, ``_cudnn_``); on the
CPU, SDPA is ``aten._scaled_dot_product_flash_attention_for_cpu`` and DTensor's sharding propagation refuses it:
``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered.`` Forcing the math kernel (``sdpa_kernel(SDPBackend.MATH)``) fails too: ``RuntimeError:
aten.add.Tensor got mixed torch.Tensor and DTensor`` (the causal mask is a plain tensor). tests/test_context.py
records the refusal, and compares it with one process should a later torch run it.

Dropout must be 0 (the comparisons with one process need it; no RNG tracking across ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.model import CausalSelfAttention
from course_lib.parallel import context_attention
from course_lib.parallel.block_attention import Chunks
from course_lib.parallel.context_attention import VARIANTS, ContextCounter, cp_rank
from course_lib.reference import reference_for

__all__ = ["SPLITS", "VARIANTS", "validate_context_parallel", "chunk_layout", "layouts", "sequence_positions",
           "split_sequence", "gather_sequence", "ContextParallelPositions", "ContextParallelAttention",
           "apply_context_parallel", "sync_context_parallel_grads", "context_parallel_loss", "ContextCounter"]

SPLITS = ("balanced", "contiguous")


def validate_context_parallel(seq_len: int, cp: int, n_head: int | None = None, variant: str = "ring",
                              split: str = "balanced") -> None:
    """Raise ValueError naming the field and the fix when cp ranks cannot split this sequence (lesson 10)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive int (the number of context-parallel ranks)")
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a context-parallel variant: use one of {', '.join(VARIANTS)}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use 'balanced' (2cp chunks, rank i holds i and 2cp-1-i) or 'contiguous'")
    chunks = 2 * cp if split == "balanced" else cp
    if chunks > seq_len:
        raise ValueError(f"cp={cp} is too large for seq_len={seq_len}: the {split} split needs {chunks} chunks of at "
                         f"least one token; use cp <= {seq_len // (chunks // cp)} or a longer sequence")
    if seq_len % chunks:
        raise ValueError(f"seq_len={seq_len} is not divisible by {'2*cp' if split == 'balanced' else 'cp'}={chunks} "
                         f"(the {split} split cuts the sequence into {chunks} equal chunks): use seq_len a multiple "
                         f"of {chunks}" + (" or split='contiguous'" if split == "balanced" else ""))
    if variant == "ulysses" and n_head is not None and n_head % cp:
        ok = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"n_head={n_head} is not divisible by cp={cp} (Ulysses gives each rank n_head/cp heads): "
                         f"pick cp in {{{', '.join(map(str, ok))}}} or variant='ring'")


@reference_for("10-balanced-split")
def chunk_layout(seq_len: int, cp: int, rank: int, split: str = "balanced") -> Chunks:
    """The chunks of global positions rank `rank` holds, [(start, length), ...] in its row order."""
    if split == "contiguous":
        n = seq_len // cp
        return [(rank * n, n)]
    c = seq_len // (2 * cp)
    return [(rank * c, c), ((2 * cp - 1 - rank) * c, c)]


def layouts(seq_len: int, cp: int, split: str = "balanced") -> list[Chunks]:
    """`chunk_layout` of every rank of the cp group, in rank order."""
    return [chunk_layout(seq_len, cp, r, split) for r in range(cp)]


def sequence_positions(seq_len: int, cp: int, rank: int, split: str = "balanced", device=None) -> torch.Tensor:
    """Global positions of rank `rank`'s rows, (s/cp,) int64 (non-contiguous under the balanced split)."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in chunk_layout(seq_len, cp, rank, split)])


def split_sequence(x: torch.Tensor, group=None, split: str = "balanced", dim: int = 1) -> torch.Tensor:
    """This rank's rows of `x` along `dim` (the same full x on every rank): (B, s, ...) -> (B, s/cp, ...)."""
    cp, r = cp_rank(group)
    validate_context_parallel(x.shape[dim], cp, split=split)
    return torch.cat([x.narrow(dim, s, n) for s, n in chunk_layout(x.shape[dim], cp, r, split)], dim)


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group=None, split: str = "balanced", dim: int = 1) -> torch.Tensor:
    """Every rank's rows back in global order on every rank (no autograd): (B, s/cp, ...) -> (B, s, ...)."""
    cp, _ = cp_rank(group)
    if cp == 1:
        return x.clone()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=group)
    shape = list(x.shape)
    shape[dim] *= cp
    full = x.new_empty(shape)                                        # (B, s, ...)
    for part, layout in zip(parts, layouts(shape[dim], cp, split)):
        row = 0
        for s, n in layout:
            full.narrow(dim, s, n).copy_(part.narrow(dim, row, n))
            row += n
    return full


class ContextParallelPositions(nn.Module):
    """``model.pos_emb`` for a rank holding chunks of the sequence: the GPT asks for positions ``arange(n)`` of its n
    local rows; this returns the embeddings of their global positions. Holds the original weight (same name)."""

    def __init__(self, emb: nn.Embedding, group=None, split: str = "balanced"):
        super().__init__()
        self.weight = emb.weight                                     # (T_max, C), shared
        self.group, self.split = group, split
        self.cp, self.rank = cp_rank(group)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        glob = sequence_positions(pos.shape[0] * self.cp, self.cp, self.rank, self.split, pos.device)   # (n,)
        return F.embedding(glob[pos], self.weight)                   # (n,) -> (n, C)


class ContextParallelAttention(CausalSelfAttention):
    """A block's attention with its `attend` done across the cp ranks (ring, all-gather or Ulysses). Same
    parameters (qkv, proj) as the plain attention it replaces; ``counter`` holds this layer's bytes and work."""

    def __init__(self, attn: CausalSelfAttention, group=None, variant: str = "ring", split: str = "balanced"):
        nn.Module.__init__(self)
        self.n_head, self.head_dim, self.dropout = attn.n_head, attn.head_dim, attn.dropout
        self.qkv, self.proj, self.resid_drop = attn.qkv, attn.proj, attn.resid_drop
        self.qk_norm = attn.qk_norm
        if attn.qk_norm:                     # QK-norm acts on each rank's rows before the ring: keep the same norms
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.group, self.variant, self.split = group, variant, split
        self.counter = ContextCounter()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (B, H, n, D) of this rank's rows -> (B, H, n, D), attending over the whole sequence."""
        cp, _ = cp_rank(self.group)
        seq_len = q.shape[2] * cp
        validate_context_parallel(seq_len, cp, self.n_head, self.variant, self.split)
        fn = getattr(context_attention, f"{self.variant}_attention")
        return fn(q, k, v, self.group, layouts(seq_len, cp, self.split), True, self.counter)


def apply_context_parallel(model: nn.Module, group=None, variant: str = "ring", split: str = "balanced"):
    """Make a plain GPT context-parallel over `group` (default: all ranks), in place; returns it (lesson 10).

    Every block's attention becomes a `ContextParallelAttention`, ``pos_emb`` a `ContextParallelPositions`. The
    model then takes this rank's rows, ``split_sequence(idx, group, split)`` (B, s/cp), and returns their logits."""
    cfg = model.cfg
    cp, _ = cp_rank(group)
    validate_context_parallel(cfg.seq_len, cp, cfg.n_head, variant, split)
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: context parallelism here needs dropout=0 (no RNG tracking)")
    for block in model.blocks:
        block.attn = ContextParallelAttention(block.attn, group, variant, split)
    model.pos_emb = ContextParallelPositions(model.pos_emb, group, split)
    return model


@torch.no_grad()
def sync_context_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum every gradient over the cp ranks (each saw s/cp tokens) and divide by cp: one process's gradient of the
    mean loss. One all-reduce of all gradients flattened."""
    cp, _ = cp_rank(group)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if cp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= cp
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def context_parallel_loss(local_loss: torch.Tensor, group=None) -> float:
    """The global mean loss from each rank's mean over its s/cp tokens (one all-reduce of a number)."""
    cp, _ = cp_rank(group)
    if cp == 1:
        return local_loss.item()
    total = local_loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.item() / cp
