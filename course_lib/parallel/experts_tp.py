"""Expert tensor parallelism: every expert's SwiGLU MLP split over etp ranks as lesson 04 splits the MLP, alone or
under expert parallelism (EP x ETP) (lesson 11; Megatron-LM's ``--expert-tensor-parallel-size``).

    groups = ExpertTPGroups(ep=2, etp=2, n_experts=4, d_ff=32)              # 4 ranks
    model = apply_expert_tensor_parallel(apply_moe(build_model(cfg, 0), 4, 2, 32), groups)
    x, y = (shard_batch(t, groups.data_rank, groups.dp) for t in (x, y))    # an etp group reads the same rows
    loss = moe_loss(model, x, y); loss.backward(); sync_expert_tp_grads(model, groups)   # = one process

**One expert over etp ranks** (Megatron-LM, Shoeybi et al. 2019, section 3, applied to each expert): w1 and w3
(E, F, C) are split along F (column parallel): etp rank t holds hidden features t F/etp .. (t+1) F/etp - 1 of each
of its experts; w2 (E, C, F) is split along F too (row parallel): its outputs (R, C) are partial sums that one
all-reduce adds up. f enters (identity forward, all-reduce of the rows' gradient backward), g leaves (all-reduce
forward, identity backward): per MoE layer one all-reduce forward and one backward, each of the (R, C) rows this
rank's experts compute (`course_lib.theory.experts_tp.layer_comm`). With ep > 1 the all-to-alls of
`course_lib.parallel.experts` bring the rows first (`AllToAll`, reused): the etp ranks of a group, each in its own
ep group, do the same all-to-alls on the same rows. The router, the shared expert and the rest of the GPT are
replicated on the etp ranks here (Megatron-LM would run them tensor parallel: its etp defaults to tp).

**The 2D arrangement** (`expert_tp_layout`): rank = t + etp (j + ep e), t the etp rank, j the ep rank, e the
expert-data-parallel index: etp innermost, then ep, then edp, the order of Megatron-core's expert rank generator
(``RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")``, edp = world / (etp ep pp)). Megatron
"folds" the experts onto the same ranks as attention: a second generator (tp, cp, dp, pp) lays out the dense part,
and the two must give the same pipeline groups. On 4 ranks, ep 2 x etp 2:

    etp groups {0,1} {2,3}  (same tokens, one expert's matmuls split)       data_rank = rank // etp
    ep groups  {0,2} {1,3}  (experts 0-1 on ranks 0,1; experts 2-3 on ranks 2,3: all-to-all)
    dense dp   {0,2} {1,3}  (dp = world / etp: the ranks that read different rows; `ExpertGroups`' dp lines)
    edp groups {0} {1} {2} {3}   (edp = dp / ep = 1: each expert shard lives on one rank)

Megatron-LM's all-to-all dispatcher (``MoEAlltoAllTokenDispatcher``) differs in one place: after the all-to-all it
all-gathers the rows over the expert-TP group (with split sizes: its etp ranks bring different tokens) and
reduce-scatters the outputs before the reverse all-to-all; an all-gather plus a reduce-scatter send what one
all-reduce sends, and no all-to-all is repeated on the etp ranks. Not built here.
Shapes: C d_model, F an expert's hidden size, E experts, R rows this rank's experts compute. Dropout 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.config import check_positive_ints, divisors_hint
from course_lib.measure.collective_counter import LayerCounter
from course_lib.parallel.experts import (ExpertGroups, ExpertParallelMoE, sync_expert_parallel_grads,
                                         validate_expert_parallel)
from course_lib.parallel.moe import MoELayer, SwiGLUExperts

__all__ = ["validate_expert_tensor_parallel", "expert_tp_layout", "ExpertTPGroups", "expert_shard",
           "enter_experts", "leave_experts", "TensorParallelSwiGLUExperts", "ExpertTensorParallelMoE",
           "apply_expert_tensor_parallel", "sync_expert_tp_grads"]


def validate_expert_tensor_parallel(n_experts: int, d_ff: int, ep: int, etp: int, world_size: int) -> None:
    """Raise ValueError naming the field and the fix when (ep, etp) cannot split these experts over these ranks."""
    check_positive_ints(n_experts=n_experts, d_ff=d_ff, ep=ep, etp=etp, world_size=world_size)
    if d_ff % etp:
        raise ValueError(f"d_ff={d_ff} is not divisible by etp={etp} (each etp rank holds d_ff/etp hidden features "
                         f"of every expert): pick etp in {divisors_hint(d_ff, None)} or change d_ff")
    if world_size % (ep * etp):
        raise ValueError(f"world_size={world_size} is not divisible by ep x etp = {ep} x {etp} = {ep * etp}: "
                         f"pick ep and etp whose product divides {world_size}")
    validate_expert_parallel(n_experts, ep, world_size // etp)      # n_experts % ep; ep divides dp = world / etp


def expert_tp_layout(world_size: int, ep: int, etp: int) -> dict[str, list[list[int]]]:
    """Every group of the (etp, ep, edp) arrangement, rank = t + etp (j + ep e) (the module docstring):
    {"etp", "ep", "dp" (dense data-parallel: same t), "edp" (same t and j)}: lists of global ranks."""
    dp = world_size // etp
    return {"etp": [list(range(d * etp, (d + 1) * etp)) for d in range(dp)],
            "dp": [list(range(t, world_size, etp)) for t in range(etp)],
            "ep": [list(range(t + i * etp, t + (i + ep) * etp, etp)) for i in range(0, dp, ep) for t in range(etp)],
            "edp": [list(range(t + j * etp, world_size, etp * ep)) for j in range(ep) for t in range(etp)]}


class ExpertTPGroups:
    """The process groups of EP x ETP on all ranks (lesson 11): ``experts`` an `ExpertGroups` over the dense dp lines
    (ep, expert-dp and dp groups), ``etp_group`` this rank's expert-TP group; ``data_rank`` which of the ``dp``
    shards of a global batch this rank reads. Every rank creates every group in the same order."""

    def __init__(self, ep: int, etp: int, n_experts: int, d_ff: int):
        world, me = dist.get_world_size(), dist.get_rank()
        validate_expert_tensor_parallel(n_experts, d_ff, ep, etp, world)
        self.ep, self.etp, self.world = ep, etp, world
        self.dp, self.edp = world // etp, world // (etp * ep)
        self.layout = expert_tp_layout(world, ep, etp)
        self.experts = ExpertGroups(ep, self.layout["dp"], n_experts)
        for block in self.layout["etp"]:
            group = dist.new_group(block)
            if me in block:
                self.etp_group, self.etp_ranks = group, block
        self.etp_rank, self.data_rank = me % etp, me // etp
        self.ep_rank, self.ep_ranks = self.experts.ep_rank, self.experts.ep_ranks
        self.dp_ranks, self.edp_ranks = self.experts.dp_ranks, self.experts.edp_ranks


def expert_shard(full: SwiGLUExperts, first: int, n: int, t: int, etp: int):
    """Rank t's (w1, w3, w2) of experts first .. first+n-1: (n, F/etp, C), (n, F/etp, C), (n, C, F/etp) copies."""
    f = full.w1.shape[1] // etp
    cols = slice(t * f, (t + 1) * f)
    return (full.w1[first:first + n, cols].clone(), full.w3[first:first + n, cols].clone(),
            full.w2[first:first + n, :, cols].clone())


class _Enter(torch.autograd.Function):
    """f: identity forward; backward, the all-reduce of the rows' gradient (each etp rank holds the part its F/etp
    hidden features contribute)."""

    @staticmethod
    def forward(ctx, x, group, counter):
        ctx.group, ctx.counter = group, counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.counter.record("backward", "all_reduce", grad)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class _Leave(torch.autograd.Function):
    """g: all-reduce forward (the row-parallel w2's partial sums added up), identity backward."""

    @staticmethod
    def forward(ctx, y, group, counter):
        y = y.contiguous().clone()
        counter.record("forward", "all_reduce", y)
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def enter_experts(x: torch.Tensor, group, counter: LayerCounter) -> torch.Tensor:
    """f before the column-parallel w1, w3: (R, C) -> (R, C)."""
    return _Enter.apply(x, group, counter)


def leave_experts(y: torch.Tensor, group, counter: LayerCounter) -> torch.Tensor:
    """g after the row-parallel w2: partial (R, C) -> summed over the etp ranks (R, C)."""
    return _Leave.apply(y, group, counter)


class TensorParallelSwiGLUExperts(SwiGLUExperts):
    """This etp rank's slice of n experts (first .. first+n-1) of a full `SwiGLUExperts`: the same parameter names
    (w1, w3 (n, F/etp, C); w2 (n, C, F/etp)), the same call: rows (R, C) grouped by expert -> outputs (R, C), whole.
    ``counter`` records the two all-reduces (shared with the layer's all-to-alls under EP)."""

    def __init__(self, full: SwiGLUExperts, first: int, n: int, group, counter: LayerCounter | None = None):
        etp, t = dist.get_world_size(group), dist.get_rank(group)
        E, F, C = full.w1.shape
        super().__init__(n, C, F // etp, first)
        self.etp, self.etp_rank = etp, t
        with torch.no_grad():
            for p, w in zip((self.w1, self.w3, self.w2), expert_shard(full, first, n, t, etp)):
                p.copy_(w)                                  # a wrong shard's shape fails here
        self.to(full.w1.device)
        self.group, self.counter = group, counter if counter is not None else LayerCounter()

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.etp == 1 or x.shape[0] == 0:                # the etp ranks hold the same rows: all skip together
            return super().forward(x, counts)
        x = enter_experts(x, self.group, self.counter)      # (R, C), the same on every etp rank
        partial = super().forward(x, counts)                # (R, C) -> (R, F/etp) per expert -> (R, C) partial
        return leave_experts(partial, self.group, self.counter)   # (R, C), summed over the etp ranks


class ExpertTensorParallelMoE(ExpertParallelMoE):
    """An `ExpertParallelMoE` (all-to-all over the ep group, E/ep experts here) whose experts are also split over
    the etp group: `TensorParallelSwiGLUExperts` in place of the E/ep whole experts; `compute` unchanged."""

    def __init__(self, layer: MoELayer, groups: ExpertTPGroups):
        super().__init__(layer, groups.experts)
        self.experts = TensorParallelSwiGLUExperts(layer.experts, self.experts.first, self.local, groups.etp_group,
                                                   self.counter)


def apply_expert_tensor_parallel(model: nn.Module, groups: ExpertTPGroups) -> nn.Module:
    """Split the experts of every `MoELayer` over ``groups``, in place (lesson 11): ep > 1, an
    `ExpertTensorParallelMoE`; ep = 1, the layer stays and its experts become this etp rank's F/etp slice (no
    all-to-all). Every rank must hold the same full weights first (``apply_moe`` with the same seed)."""
    for block in model.blocks:
        m = block.mlp
        if not isinstance(m, MoELayer):
            continue
        validate_expert_tensor_parallel(m.n_experts, m.d_ff, groups.ep, groups.etp, groups.world)
        if m.groups != 1:
            raise ValueError(f"groups={m.groups}: under expert (tensor) parallelism each data rank is one group; "
                             f"build the layer with groups=1")
        if groups.ep > 1:
            block.mlp = ExpertTensorParallelMoE(m, groups)
        else:
            m.experts = TensorParallelSwiGLUExperts(m.experts, 0, m.n_experts, groups.etp_group)
    return model


@torch.no_grad()
def sync_expert_tp_grads(model: nn.Module, groups: ExpertTPGroups) -> None:
    """One process's gradients: dense ones averaged over the dense dp group (the etp ranks of a group already hold
    the same), expert shards summed over the expert-dp group and divided by dp (`sync_expert_parallel_grads`)."""
    sync_expert_parallel_grads(model, groups.experts)
