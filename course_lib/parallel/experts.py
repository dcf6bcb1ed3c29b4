"""Expert parallelism: the experts of every MoE layer sharded over ep ranks, tokens sent to them by all-to-all
(lesson 11; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSeek-V3, 2024).

    groups = ExpertGroups(ep=2)                            # ep groups {0,1},{2,3}; expert-dp groups {0,2},{1,3}
    model = apply_expert_parallel(apply_moe(build_model(cfg, 0), 4, 2), groups)   # this rank keeps E/ep experts
    loss = moe_loss(model, shard_batch(x, r, dp), shard_batch(y, r, dp))          # this rank's rows
    loss.backward(); sync_expert_parallel_grads(model, groups)                     # = one process's gradients

**One layer, forward** (`ExpertParallelMoE.compute`), on each rank of an ep group of size P holding experts
j E/P .. (j+1) E/P - 1: route its own tokens and sort them by expert (`course_lib.parallel.moe.dispatch_permutation`:
sorted by expert is sorted by destination rank); (1) an all-to-all of the counts (E,) tells every rank how many rows
it gets for each of its experts; (2) dispatch: ``all_to_all_single`` of the rows with split sizes; the received rows,
ordered (source rank, expert), are sorted by local expert, computed, and put back; (3) combine: the reverse
all-to-all returns each row to its token's rank, where the inverse permutation and the weighted sum finish as in
one process. Backward: `AllToAll` sends the gradients the reverse way (2 all-to-alls). Bytes per rank are recorded in
an `ExpertCounter` (an all-to-all counted by its input, as `ContextCounter` does), checked against
`course_lib.theory.experts.layer_comm`.

**Where EP sits in the mesh** (torchtitan, Megatron-LM): EP does not multiply the world size; it borrows ranks of the
data-parallel dimension. Dense parameters are data-parallel over all dp ranks (gradients averaged over dp); each
expert lives on the dp/ep ranks of its "expert-data-parallel" group (edp = dp/ep), which average its gradient. On 4
ranks: dp 4 for attention, router and embeddings; ep 2 x edp 2 for the experts. Rules (`validate_expert_parallel`):
n_experts divisible by ep; ep divides the dp (x cp) ranks. Here ep borrows from dp only (cp folding: not built).

**DeepSpeed's MoE** (``deepspeed.moe.layer.MoE``, 0.19.8) runs on CPU/gloo: on 2 ranks, ep 2, top-1, forward and
backward work and its ``l_aux`` equals the Switch loss on its own gate's counts (tests/test_experts.py). Its gate
differs from ours (capacity on the whole group's tokens with ``min_capacity``, random token selection ``use_rts``,
drops on its own order), so outputs are not compared.

Capacity is per rank (each rank is one GShard group): one process with ``groups = dp`` equals it.
Dropout must be 0. Devices follow `course_lib.dist.device()` (NCCL's rules are checked on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.config import check_positive_ints, divisors_hint
from course_lib.measure.collective_counter import LayerCounter
from course_lib.parallel.moe import MoELayer, SwiGLUExperts, moe_layers
from course_lib.reference import reference_for

__all__ = ["validate_expert_parallel", "ExpertGroups", "ExpertCounter", "AllToAll", "ExpertParallelMoE",
           "apply_expert_parallel", "sync_expert_parallel_grads", "expert_params"]


def validate_expert_parallel(n_experts: int, ep: int, dp: int, cp: int = 1) -> None:
    """Raise ValueError naming the field and the fix when ep cannot shard these experts over these ranks."""
    check_positive_ints(n_experts=n_experts, ep=ep, dp=dp, cp=cp)
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} is not divisible by ep={ep} (each ep rank holds n_experts/ep "
                         f"experts): pick ep in {divisors_hint(n_experts, None)}")
    if (dp * cp) % ep:
        raise ValueError(f"ep={ep} does not divide dp x cp = {dp} x {cp} = {dp * cp}: expert parallelism borrows "
                         f"data-parallel ranks and does not multiply the world size; pick ep dividing {dp * cp}")


class ExpertGroups:
    """The process groups of expert parallelism inside the data-parallel ranks (lesson 11).

    ``dp_lines``: every data-parallel group of the job (``ProcessGrid.lines("dp")``; default: all ranks, one line).
    Inside a line, ep groups are consecutive blocks of ep ranks (innermost, as Megatron-LM's "tp-cp-ep-dp-pp"), the
    expert-dp groups the ranks at the same place in their block. Every rank creates every group in the same order."""

    def __init__(self, ep: int, dp_lines: list[list[int]] | None = None, n_experts: int | None = None):
        world, me = dist.get_world_size(), dist.get_rank()
        lines = dp_lines or [list(range(world))]
        self.dp, self.ep = len(lines[0]), ep
        validate_expert_parallel(n_experts or ep, ep, self.dp)
        self.edp = self.dp // ep
        for line in lines:
            group = dist.new_group(line)
            if me in line:
                self.dp_group, self.dp_ranks = group, line
            for i in range(0, self.dp, ep):
                block = line[i:i + ep]
                group = dist.new_group(block)
                if me in block:
                    self.ep_group, self.ep_ranks = group, block
            for j in range(ep):
                column = line[j::ep]
                group = dist.new_group(column)
                if me in column:
                    self.edp_group, self.edp_ranks = group, column
        self.ep_rank = self.ep_ranks.index(me)


ExpertCounter = LayerCounter    # the all-to-alls one rank's MoE layer called, each counted by its input


@reference_for("11-all-to-all-combine")
class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes, differentiable: the backward sends the gradients back the reverse way
    (output splits and input splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, counter, op):
        ctx.splits, ctx.group, ctx.counter, ctx.op = (out_splits, in_splits), group, counter, op
        out = x.new_empty(sum(out_splits), *x.shape[1:])                 # (rows in, C) -> (rows out, C)
        counter.record("forward", op, x)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty(sum(in_splits), *grad.shape[1:])              # (rows out, C) -> (rows in, C)
        ctx.counter.record("backward", ctx.op, grad)
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None, None, None


class ExpertParallelMoE(MoELayer):
    """A `MoELayer` whose experts are sharded over an ep group: it holds experts ep_rank E/ep .. (ep_rank+1) E/ep - 1
    and exchanges rows by all-to-all (the module docstring). Same router, same results as the layer it replaces."""

    def __init__(self, layer: MoELayer, groups: ExpertGroups):
        nn.Module.__init__(self)
        self.router, self.shared = layer.router, layer.shared
        self.n_experts, self.top_k, self.d_ff = layer.n_experts, layer.top_k, layer.d_ff
        self.capacity_factor, self.alpha, self.groups = layer.capacity_factor, layer.alpha, 1
        self.ep, self.ep_group = groups.ep, groups.ep_group
        self.local = n = layer.n_experts // groups.ep
        first = groups.ep_rank * n
        full = layer.experts
        self.experts = SwiGLUExperts(n, full.w1.shape[2], full.w1.shape[1], first).to(full.w1.device)
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):                                 # (E, ...) -> (E/ep, ...): this rank's shard
                getattr(self.experts, name).copy_(getattr(full, name)[first:first + n])
        self.counter = ExpertCounter()

    @reference_for("11-all-to-all-combine")
    def compute(self, rows: torch.Tensor, d) -> torch.Tensor:
        """rows (A_kept, C) of this rank's tokens sorted by global expert -> their outputs, same order and shape."""
        P, n = self.ep, self.local
        counts = d.counts.to(torch.int64)                                   # (E,) rows this rank sends per expert
        self.sent = counts.tolist()
        got = torch.empty_like(counts)
        self.counter.record("forward", "counts", counts)
        dist.all_to_all_single(got, counts, group=self.ep_group)           # (E,) -> (P x E/ep): got[s, e] from rank s
        send = counts.view(P, n).sum(1).tolist()                           # rows to each ep rank
        got = got.view(P, n)
        recv = got.sum(1).tolist()                                         # rows from each ep rank
        x = AllToAll.apply(rows, recv, send, self.ep_group, self.counter, "dispatch")   # (A_kept, C) -> (R, C)
        local_ids = torch.arange(n, device=rows.device).repeat(P).repeat_interleave(got.reshape(-1))   # (R,)
        order = torch.argsort(local_ids, stable=True)                      # (source, expert) -> (expert, source)
        y = self.experts(x[order], got.sum(0).tolist())                    # (R, C)
        y = y[torch.argsort(order)]                                        # back to (source, expert) order
        return AllToAll.apply(y, send, recv, self.ep_group, self.counter, "combine")    # (R, C) -> (A_kept, C)


def apply_expert_parallel(model: nn.Module, groups: ExpertGroups) -> nn.Module:
    """Swap every `MoELayer` of a model for an `ExpertParallelMoE` over ``groups``, in place (lesson 11). Every rank
    must hold the same full weights first (``apply_moe`` with the same seed); each keeps its experts' shard."""
    for block in model.blocks:
        if isinstance(block.mlp, MoELayer):
            validate_expert_parallel(block.mlp.n_experts, groups.ep, groups.dp)
            if block.mlp.groups != 1:
                raise ValueError(f"groups={block.mlp.groups}: under expert parallelism each rank is one group; "
                                 f"build the layer with groups=1")
            block.mlp = ExpertParallelMoE(block.mlp, groups)
    return model


def expert_params(model: nn.Module) -> set[int]:
    """ids of the expert parameters (sharded by ep); every other parameter is dense (replicated over dp)."""
    return {id(p) for m in moe_layers(model) for p in m.experts.parameters()}


@torch.no_grad()
def sync_expert_parallel_grads(model: nn.Module, groups: ExpertGroups) -> None:
    """Average gradients: dense ones over the dp group; expert ones summed over the expert-dp group (the all-to-all's
    backward already summed the ep group's tokens) and divided by dp. Both are then one process's gradients of the
    mean loss over the global batch."""
    experts = expert_params(model)
    for which, group in ((False, groups.dp_group), (True, groups.edp_group)):
        grads = [p.grad for p in model.parameters() if p.grad is not None and (id(p) in experts) == which]
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= groups.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
