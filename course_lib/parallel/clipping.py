"""Global gradient-norm clipping when every rank holds only part of the gradient (lesson 09).

Clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural networks") rescales the *whole*
model's gradient g when its norm exceeds ``max_norm``:

    ||g||_p = (sum_i |g_i|^p)^(1/p)            (p = 2 by default; p = inf: max_i |g_i|)
    g <- g * min(1, max_norm / (||g|| + 1e-6))  (the same eps and clamp as `torch.nn.utils.clip_grad_norm_`)

In a parallel run each rank holds pieces of g, and each piece must be counted exactly once. Every gradient comes
paired with the process group(s) over which it is *sharded* (a `GradPart`):

* sharded over a group (ZeRO/FSDP chunks, Megatron column/row weight shards, the vocab-split embedding, a pipeline
  stage's parameters): the ranks hold disjoint slices, so ``sum |g_i|^p`` is all-reduced (SUM; MAX for inf) over
  that group (over each of several groups in turn: a TP shard that ZeRO also chunks over dp);
* ``None``: replicated, identical on every rank that holds it (data-parallel replicas after averaging, LayerNorm
  weights, row-parallel biases and position embeddings on every TP rank): counted once, never all-reduced.

The double-counting trap: summing a replicated gradient's squares over the group that replicates it counts it t
times (a TP group of t ranks) or sums dp identical replicas, the norm comes out sqrt(t) or sqrt(dp) too large and
every step is clipped too hard. Megatron-LM (Shoeybi et al. 2019) clips across model-parallel ranks this way: the
squares of shards are summed over the model-parallel group, those of duplicated parameters counted on one rank.

    parts = tensor_parallel_grad_parts(tp_model, grid.group("tp"))   # after the data-parallel averaging
    total = clip_grad_norm_(parts, max_norm=1.0)                        # the one-process norm, on every rank
    parts = zero_grad_parts(zero)                 # ZeRO-2/3: the own gradient chunks, after backward
    total = clip_model_grad_norm_(fsdp_model.parameters(), 1.0)         # DTensor (FSDP2, DTensor TP) or plain

A collective: every rank of a group calls with parts sharded over the same groups, in the same order.
With one process (every part ``None``) the norm and the clipped gradients equal `torch.nn.utils.clip_grad_norm_`'s
bit for bit.
"""

from __future__ import annotations

import math
from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from course_lib import dist as cdist
from course_lib.reference import reference_for

__all__ = ["GradPart", "ShardGroups", "global_grad_norm", "clip_grads_with_norm_", "clip_grad_norm_",
           "param_grad_parts", "tensor_parallel_grad_parts", "zero_grad_parts", "sharded_module_grad_parts",
           "model_grad_norm",
           "clip_model_grad_norm_"]

ShardGroups = Union[ProcessGroup, tuple[ProcessGroup, ...], None]   # sharded over these groups (None: replicated)
GradPart = tuple[torch.Tensor, ShardGroups]                          # (a gradient or this rank's slice of it, groups)
EPS = 1e-6                                                           # torch.nn.utils.clip_grad_norm_'s


def _as_tuple(spec: ShardGroups) -> tuple[ProcessGroup, ...]:
    return () if spec is None else spec if isinstance(spec, tuple) else (spec,)


def _groups(spec: ShardGroups) -> tuple[ProcessGroup, ...]:
    """The groups of a part that have something to add up (a group of one rank has not)."""
    return tuple(g for g in _as_tuple(spec) if dist.get_world_size(g) > 1)


@reference_for("09-global-norm")
@torch.no_grad()
def global_grad_norm(parts: Iterable[GradPart], norm_type: float = 2.0) -> torch.Tensor:
    """The p-norm of the whole gradient, of which each rank holds ``parts``: [(g, groups g is sharded over), ...].

    Parts are bucketed by their groups; per bucket the local norm n_b = ||{g}||_p (`torch.nn.utils.get_total_norm`),
    then n_b^p is all-reduced (SUM) over each of its groups (inf: n_b, MAX), and the result is
    ``||(n_1, n_2, ...)||_p``. One all-reduce of one number per bucket and group. Returns a 0-dim fp32 tensor (fp64
    for fp64 gradients), the same on every rank, on the first gradient's device."""
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type={norm_type!r}: use a p-norm with p > 0 (2.0, 1.0, or float('inf'))")
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for g, spec in parts:
        buckets.setdefault(_groups(spec), []).append(g)
    if not buckets:
        return torch.tensor(0.0)
    home = next(iter(buckets.values()))[0].device
    norms = []
    for groups, grads in buckets.items():
        n = torch.nn.utils.get_total_norm(grads, p)                    # this rank's part of the bucket
        n = n if n.dtype == torch.float64 else n.float()
        if groups:
            x = n.to(cdist.device()) if math.isinf(p) else n.to(cdist.device()) ** p
            for group in groups:                                       # disjoint slices: add them up
                dist.all_reduce(x, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
            n = x if math.isinf(p) else x.sqrt() if p == 2 else x ** (1.0 / p)
        norms.append(n.to(home))
    return torch.linalg.vector_norm(torch.stack(norms), p)            # one bucket: n itself, bit for bit


@reference_for("09-global-norm")
@torch.no_grad()
def clip_grads_with_norm_(parts: Iterable[GradPart | torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor) -> torch.Tensor:
    """Scale every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))`` and return that coefficient
    (a 0-dim tensor; < 1 when clipping happened). No communication: ``total_norm`` is already global."""
    coef = torch.clamp(float(max_norm) / (total_norm + EPS), max=1.0)  # as torch: no `if`, no device sync
    for part in parts:
        g = part[0] if isinstance(part, tuple) else part
        g.mul_(coef.to(g.device))
    return coef


@reference_for("09-global-norm")
def clip_grad_norm_(parts: Iterable[GradPart], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`global_grad_norm` of ``parts``, then `clip_grads_with_norm_`; returns the norm before clipping (a collective,
    like `torch.nn.utils.clip_grad_norm_` on one process)."""
    parts = list(parts)
    total = global_grad_norm(parts, norm_type)
    clip_grads_with_norm_(parts, max_norm, total)
    return total


# ------------------------------------------------------------------------------ parts of the course's models

def _dtensor_part(grad) -> GradPart:
    """A DTensor gradient's local shard, sharded over the mesh dimensions whose placement is Shard."""
    from torch.distributed.tensor import DTensor

    if not isinstance(grad, DTensor):
        return grad, None
    groups = []
    for d, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient with placement {grad.placements} is a pending sum (Partial on mesh "
                             f"dimension {d}): reduce it (e.g. grad.redistribute to Replicate) before its norm")
        if placement.is_shard():
            groups.append(grad.device_mesh.get_group(d))
    with torch.no_grad():
        local = grad.to_local()              # the DTensor's own local tensor: clipping it in place clips the DTensor
    return local, tuple(groups) or None


def param_grad_parts(params: Iterable[torch.Tensor]) -> list[GradPart]:
    """Parts of parameters whose ``.grad`` is a DTensor (FSDP2 ``fully_shard``, DTensor TP: its local shard, sharded
    over the mesh dimensions where the placement is ``Shard``, not where ``Replicate``) or a plain tensor (replicated:
    DDP, or a parameter that no plan touched). Parameters without a gradient are skipped."""
    return [_dtensor_part(p.grad) for p in params if p.grad is not None]


def tensor_parallel_grad_parts(model: nn.Module, group: ProcessGroup | None = None,
                               pp_group: ProcessGroup | None = None) -> list[GradPart]:
    """Parts of a model made tensor-parallel by `tensor_model.apply_tensor_parallel` (or a 3D stage of
    `three_d.parallelize_3d`), after the data-parallel averaging (and `sync_sequence_parallel_grads` with sequence
    parallelism: before it the replicated gradients are partial sums).

    A parameter named in its module's ``shard_dims`` (column/row-parallel weights, column biases, the vocab-split
    embedding and tied head) is sharded over ``group``, the tensor-parallel group (default ``model.group``, as in
    `tensor_model.shard_like`); every other one (LayerNorms, row-parallel biases, the position embedding) is
    replicated on the TP ranks and counted once. ``pp_group``: a pipeline stage's parameters are disjoint from the
    other stages', so every part is also sharded over it. A tied weight counts once; DTensor gradients follow their
    placements (`param_grad_parts`)."""
    if group is None:
        if not hasattr(model, "group"):
            raise ValueError("tensor_parallel_grad_parts: this model names no tensor-parallel group (a 3D stage): "
                             "pass it, e.g. group=grid.group('tp')")
        group = model.group if model.group is not None else dist.group.WORLD
    pp = (pp_group,) if pp_group is not None else ()
    parts, seen = [], set()
    for module in model.modules():
        sharded = getattr(module, "shard_dims", {})
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or p.grad is None:
                continue
            seen.add(id(p))
            g, spec = _dtensor_part(p.grad)
            groups = _as_tuple(spec) or ((group,) if name in sharded else ())
            parts.append((g, groups + pp or None))
    return parts


def zero_grad_parts(zero) -> list[GradPart]:
    """The gradient chunks a `zero.ZeroOptimizer` (stage 2 or 3) owns after backward: chunk r of every parameter's
    mean gradient (zero padding included, which adds nothing), sharded over ``zero.group``. Call between backward and
    ``zero.step()``; clipping them in place clips what the step uses. Stage 1 reduce-scatters inside ``step()``: its
    gradients are still every rank's own full, un-averaged ones, so there is no global norm to take yet."""
    pending = zero.stage == 1 or any(p.grad is not None for p in zero.params)
    if pending:
        raise ValueError(f"ZeRO stage {zero.stage}: the gradients are not reduce-scattered yet (stage 1 does it in "
                         "step(); stages 2-3 after each unit's backward): take the norm after a full backward at "
                         "stage 2 or 3")
    group = zero.group if zero.group is not None else dist.group.WORLD
    grads = zero.grad_shards if zero.mixed else [c.grad for c in zero.chunks]
    return [(g, group) for g in grads if g is not None]


def sharded_module_grad_parts(model: nn.Module) -> list[GradPart]:
    """The gradients a module sharded by `sharded_module.shard_module` holds after backward: each shard's (the
    own chunk of the mean gradient, padding included, which adds nothing) sharded over ``model.shards.group``, each
    parameter kept whole replicated (counted once). Clipping them in place clips what any optimizer steps."""
    sh = model.shards
    group = sh.group if sh.group is not None else dist.group.WORLD
    shards = {id(s) for s in sh.shards}
    return [(p.grad, (group,) if id(p) in shards else None) for p in model.parameters() if p.grad is not None]


def model_grad_norm(params: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm of ``params`` (DDP replicas, or FSDP2 / DTensor parameters): `param_grad_parts`."""
    return global_grad_norm(param_grad_parts(params), norm_type)


@reference_for("09-global-norm")
def clip_model_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`clip_grad_norm_` of `param_grad_parts`: the drop-in for ``torch.nn.utils.clip_grad_norm_(params, max_norm)``
    under DDP or FSDP2; returns the norm before clipping."""
    return clip_grad_norm_(param_grad_parts(params), max_norm, norm_type)
