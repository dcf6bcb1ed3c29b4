"""Hybrid context parallelism: Ulysses inside a group of u ranks, the ring across the groups (lesson 10).

The cp ranks of a context-parallel group form a u x r mesh, cp = u r: consecutive ranks are a *Ulysses group*
(u ranks, e.g. the GPUs of a node on NVLink), the ranks with the same place in their Ulysses groups a *ring group*
(r ranks, one per node). Rank i of the cp group has coordinates (g, j) = (i // u, i % u): member j of Ulysses group g
and member g of ring group j (`hybrid_coords`). Attention (`hybrid_attention`):

    q, k, v (B, H, n, D), n = s/cp, this rank's chunks of the sequence (`context.chunk_layout`)
    all-to-all in the Ulysses group   -> (B, H/u, u n, D): H/u heads of the rows of the group's u members
    ring attention over the ring group: K/V chunks of 2 B (u n) (C/u) b = 2 B n C b bytes travel r - 1 hops
    all-to-all back                   -> (B, H, n, D)

Ulysses' all-to-alls carry B n C b per call whatever u is, but need u | H (per TP rank: H/tp heads); the ring has no
such limit and hides its transfers behind compute, but sends r - 1 chunks. Mixing them keeps the all-to-alls on the
fast links and lets cp grow past the head count. The balanced split stays balanced: Ulysses group g holds chunks
g u + j and 2cp - 1 - g u - j for j < u, so its query chunks need u (2cp + 1) chunk pairs, the same for every g.

This is Megatron-LM's ``--cp-comm-type a2a+p2p`` with ``--hierarchical-context-parallel-sizes`` (Megatron-Core's
``ModelParallelConfig``: "the first value of the list indicates the group size of the a2a communication type, and the
second value indicates the group size of the p2p communication type"), and USP (Fang & Zhao 2024, "USP: A Unified
Sequence Parallelism Approach for Long Context Generative AI", arXiv 2405.07719), which combines DeepSpeed-Ulysses
and ring attention the same way. Positions, splitting, gathering and the gradient all-reduce are those of
`course_lib.parallel.context` over the whole cp group, unchanged:

    model = apply_hybrid_context_parallel(build_model(cfg, 0), ulysses=2)       # cp = world size = 2 x 2
    x_r = context.split_sequence(x, None)                                     # (B, s) -> (B, s/cp)
    loss = model.loss(x_r, y_r); loss.backward(); context.sync_context_parallel_grads(model, None)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.config import check_positive_ints, divisors_hint
from course_lib.model import CausalSelfAttention
from course_lib.parallel.block_attention import Chunks
from course_lib.parallel.context import (ContextParallelAttention, ContextParallelPositions, layouts,
                                         validate_context_parallel)
from course_lib.parallel.context_attention import _HeadsToSeq, _SeqToHeads, cp_rank, ring_attention

__all__ = ["validate_hybrid", "hybrid_coords", "hybrid_members", "hybrid_groups", "combined_layouts",
           "hybrid_attention", "HybridContextAttention", "apply_hybrid_context_parallel"]


def validate_hybrid(seq_len: int, cp: int, ulysses: int, n_head: int, tp: int = 1, split: str = "balanced") -> None:
    """Raise ValueError naming the field and the fix when a cp = ulysses x ring mesh cannot run this attention."""
    check_positive_ints(cp=cp, ulysses=ulysses, tp=tp)
    if cp % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide cp={cp} (cp = ulysses x ring): pick ulysses in "
                         f"{divisors_hint(cp, None)}")
    if n_head % tp:
        raise ValueError(f"tp={tp} does not divide n_head={n_head}: pick tp in {divisors_hint(n_head, None)}")
    heads = n_head // tp
    if heads % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide the heads per TP rank, n_head/tp = {n_head}/{tp} = "
                         f"{heads} (each Ulysses member takes heads/ulysses of them): pick ulysses in "
                         f"{divisors_hint(heads, None)} that also divides cp={cp}, and put the rest of cp in the ring")
    validate_context_parallel(seq_len, cp, None, "ring", split)     # seq_len divisible by 2cp (balanced) or cp


def hybrid_coords(rank: int, cp: int, ulysses: int) -> tuple[int, int]:
    """(g, j) of cp-rank `rank`: member j of Ulysses group g (consecutive ranks) and member g of ring group j."""
    if cp % ulysses or not 0 <= rank < cp:
        raise ValueError(f"rank={rank}, cp={cp}, ulysses={ulysses}: need 0 <= rank < cp and ulysses | cp")
    return rank // ulysses, rank % ulysses


def hybrid_members(cp: int, ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) as lists of cp-ranks, each in member order: group g = [g u .. g u + u - 1],
    ring j = [j, u + j, 2u + j, ...]."""
    ring = cp // ulysses
    return ([[g * ulysses + j for j in range(ulysses)] for g in range(ring)],
            [[g * ulysses + j for g in range(ring)] for j in range(ulysses)])


def hybrid_groups(cp: int, ulysses: int, ranks: list[int] | None = None):
    """This rank's (ulysses_group, ring_group, (g, j)) of a cp = ulysses x ring mesh.

    `ranks` (default: the world), ascending, is cut into consecutive cp groups (a dp x cp grid's cp groups); every
    rank of the world must call this with the same arguments (``new_group`` is collective: every group is created on
    every rank, in the same order). A rank outside `ranks` gets None. One process, cp = 1: (None, None, (0, 0))."""
    if not (dist.is_available() and dist.is_initialized()):
        if cp != 1:
            raise ValueError(f"cp={cp} needs a distributed run (torch.distributed is not initialised)")
        return None, None, (0, 0)
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if ranks != sorted(set(ranks)) or len(ranks) % cp:
        raise ValueError(f"ranks={ranks} must be ascending, without repeats, a multiple of cp={cp} long")
    uly_members, ring_members = hybrid_members(cp, ulysses)
    me, mine = dist.get_rank(), None
    for base in range(0, len(ranks), cp):                            # every cp group, on every rank
        block = ranks[base:base + cp]
        uly = [dist.new_group([block[i] for i in m]) for m in uly_members]
        ring = [dist.new_group([block[i] for i in m]) for m in ring_members]
        if me in block:
            g, j = hybrid_coords(block.index(me), cp, ulysses)
            mine = (uly[g], ring[j], (g, j))
    return mine


def combined_layouts(cp_layouts: list[Chunks], ulysses: int) -> list[Chunks]:
    """The ring's layouts: Ulysses group g's rows after the all-to-all, its members' chunks in member order."""
    return [[c for j in range(ulysses) for c in cp_layouts[g * ulysses + j]]
            for g in range(len(cp_layouts) // ulysses)]


def hybrid_attention(q, k, v, ulysses_group, ring_group, layouts: list[Chunks], causal: bool = True,
                     counter=None) -> torch.Tensor:
    """Ulysses all-to-all in `ulysses_group`, ring attention over `ring_group`, all-to-all back.
    q, k, v (B, H, n, D) of this rank's rows -> (B, H, n, D). `layouts`: every cp-rank's chunks, cp-rank g u + j at
    index g u + j (`context.layouts`); the groups as `hybrid_groups` makes them."""
    u, r = cp_rank(ulysses_group)[0], cp_rank(ring_group)[0]
    if len(layouts) != u * r:
        raise ValueError(f"{len(layouts)} layouts for a mesh of ulysses={u} x ring={r}: pass the cp group's layouts")
    if q.shape[1] % u:
        raise ValueError(f"{q.shape[1]} heads do not split over ulysses={u} ranks: pick ulysses dividing them")
    if u > 1:
        q, k, v = (_SeqToHeads.apply(x, ulysses_group, counter) for x in (q, k, v))   # -> (B, H/u, u n, D)
    out = ring_attention(q, k, v, ring_group, combined_layouts(layouts, u), causal, counter)   # (B, H/u, u n, D)
    if u > 1:
        out = _HeadsToSeq.apply(out, ulysses_group, counter)                            # -> (B, H, n, D)
    return out


class HybridContextAttention(ContextParallelAttention):
    """A block's attention with `attend` = `hybrid_attention`; the same parameters as the attention it replaces,
    ``counter`` holds this layer's bytes (all-to-alls and sends) and work. `group`: the whole cp group."""

    def __init__(self, attn: CausalSelfAttention, ulysses_group, ring_group, group=None, split: str = "balanced"):
        super().__init__(attn, group, "ring", split)
        self.variant = "ulysses+ring"
        self.ulysses_group, self.ring_group = ulysses_group, ring_group

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, _ = cp_rank(self.group)
        lay = layouts(q.shape[2] * cp, cp, self.split)                # (B, H, n, D): s = n cp
        return hybrid_attention(q, k, v, self.ulysses_group, self.ring_group, lay, True, self.counter)


def apply_hybrid_context_parallel(model: nn.Module, ulysses: int, group=None, split: str = "balanced",
                                  groups: tuple | None = None) -> nn.Module:
    """Make a plain GPT context-parallel over `group` (default: every rank) as a ulysses x (cp/ulysses) mesh, in
    place; returns it (lesson 10). `groups`: (ulysses_group, ring_group) made beforehand (else `hybrid_groups`,
    which cuts the world into consecutive cp groups: call it on every rank). Positions follow the standard
    `context.chunk_layout` of this rank in `group`: `split_sequence`, `gather_sequence`,
    `sync_context_parallel_grads` and `context_parallel_loss` of `course_lib.parallel.context` work unchanged."""
    cfg = model.cfg
    cp, _ = cp_rank(group)
    validate_hybrid(cfg.seq_len, cp, ulysses, cfg.n_head, split=split)
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: context parallelism here needs dropout=0 (no RNG tracking)")
    if groups is None:
        uly, ring, _ = hybrid_groups(cp, ulysses)
        if cp > 1 and group is not None:
            me, ranks = dist.get_rank(), dist.get_process_group_ranks(group)
            if ranks != list(range(me // cp * cp, me // cp * cp + cp)):
                raise ValueError(f"group={ranks} is not a block of cp={cp} consecutive ranks: pass groups= made "
                                 "by hybrid_groups(cp, ulysses, ranks) on every rank")
    else:
        uly, ring = groups
    if cp_rank(uly)[0] * cp_rank(ring)[0] != cp:
        raise ValueError(f"groups of {cp_rank(uly)[0]} x {cp_rank(ring)[0]} ranks for cp={cp}: "
                         f"need ulysses x ring = cp")
    for block in model.blocks:
        block.attn = HybridContextAttention(block.attn, uly, ring, group, split)
    model.pos_emb = ContextParallelPositions(model.pos_emb, group, split)
    return model
