"""ZeRO stages 1, 2 and 3 applied to a plain model (lesson 05).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models":
data parallelism keeps a full copy of the model state on every rank; ZeRO shards it over the N ranks.

    stage 1 (P_os)     optimizer state sharded: rank r updates only its shard of every parameter,
                       then the parameters are all-gathered
    stage 2 (P_os+g)   + gradients sharded: each gradient is reduce-scattered as soon as backward has
                       produced it, and only the own shard is kept
    stage 3 (P_os+g+p) + parameters sharded: a layer's parameters are all-gathered just before its forward
                       (and again before its backward) and freed right after: `sharded_module.shard_module`,
                       which this optimizer uses (one implementation of stage 3)

Layout (as DeepSpeed's stage 3 partitions a parameter; FSDP2 instead cuts each tensor along dim 0 and keeps its
shape, a DTensor ``Shard(0)``): every parameter tensor is flattened, padded with zeros to a multiple of N and cut
into N equal chunks; rank r owns chunk r of every parameter. Its "shard" is the list of its chunks.
The optimizer (any ``torch.optim`` class, e.g. AdamW) is built over the chunks only, so its state is 1/N.
`ZeroOptimizer` is itself a ``torch.optim.Optimizer``: it takes parameters or parameter groups (stages 1-2; stage 3
hooks the module's forward, so it takes the module), an LR scheduler drives its ``param_groups`` (the inner
optimizer's own groups), and its state dict is this rank's shard (`course_lib.parallel.zero_state`, which also
gives `dist_checkpoint` a form that reshards to another world size).

    zero = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)   # default process group
    sched = torch.optim.lr_scheduler.LambdaLR(zero, lambda step: min(1.0, (step + 1) / 100))
    loss = model.loss(x_local, y_local); loss.backward()
    zero.step(); sched.step(); zero.zero_grad()
    zero3 = apply_zero(model, torch.optim.AdamW, stage=3, lr=1e-3)                   # the module: stage 3

On a bf16/fp16 model (``model.to(torch.bfloat16)``) the optimizer steps fp32 master copies of the chunks and the
gradient shards stay 16-bit: the measured state is the mixed-precision formula, 16P bytes sharded as ZeRO says.
(Stage 3, shaped like FSDP2, keeps fp32 master shards as the module's parameters and fp32 gradient shards:
4 + 4 + 8 bytes per parameter over N instead of 2 + 2 + 12, the same 16P/N.)

Every collective's payload is counted (``zero.bytes``): all-gather = its output, reduce-scatter = its input,
as in `course_lib.measure.collective_counter.CollectiveCounter`. A rank sends (N-1)/N of each payload over a ring.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.parallel import zero_state
from course_lib.parallel.sharded_module import (all_gather_flat, chunk_numel, fill_param, free_param, gather_chunk,
                                                reduce_scatter_flat, shard_module)
from course_lib.reference import reference_for

__all__ = ["ZeroOptimizer", "apply_zero", "all_gather_flat", "reduce_scatter_flat", "chunk_numel", "fill_param",
           "free_param"]


@reference_for("05-zero1", "05-zero2-grad")
class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1, 2 or 3 over `group` (see the module docstring): a ``torch.optim.Optimizer``.

    ``params``: parameters or parameter groups (dicts with their own lr, weight_decay, ...), as for any torch
    optimizer (stages 1-2), or the module itself (every stage; stage 3 needs it). ``optimizer_cls(groups of
    chunks, **defaults)`` is the inner optimizer; ``param_groups`` and ``state`` are its own, so what a scheduler
    or a learner sets there is what the sharded step uses. Call ``step()`` after ``backward()``, then
    ``zero_grad()``. Parameters are grouped in units (a module's default: each block of ``model.blocks``, and
    the model itself for the rest; bare parameters: one unit each; ``units``: modules or lists of parameters);
    each unit is communicated with one collective (one reduce-scatter of its gradients, one all-gather of its
    parameters), as FSDP does. Stage 3 is `sharded_module.shard_module(model, group, units=...)` (its
    parameters become the shards, gathered by hooks on each unit's forward) with the inner optimizer over
    ``model.parameters()``; ``gather_fn(param, chunk, group)`` (all-gather one parameter, one collective per
    tensor) and ``free_fn(param)`` go to it (the exercise plugs in its own).
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, stage: int = 1, group=None, *,
                 units: list | None = None, gather_fn: Callable | None = None, free_fn: Callable | None = None,
                 **defaults):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage}: ZeRO stages are 1, 2 or 3 (stage 0 is plain data parallelism)")
        model = params if isinstance(params, nn.Module) else None
        if model is None and stage == 3:
            raise ValueError("stage=3 gathers a unit's parameters in its module's forward hooks, so it needs the "
                             "module, not bare parameters: use apply_zero(model, optimizer_cls, stage=3, ...)")
        self.model, self.stage, self.group = model, stage, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if stage == 3:
            self._shard_module(optimizer_cls, units, gather_fn, free_fn, defaults)
            return
        if gather_fn is not None or free_fn is not None:
            raise ValueError(f"gather_fn / free_fn gather and free stage 3's parameters: stage {stage} keeps them")
        groups = _as_groups(model.parameters() if model is not None else params)
        self.bytes = collections.Counter()          # payload bytes per collective name
        self.calls = collections.Counter()
        self.params = list({id(p): p for g in groups for p in g["params"] if p.requires_grad}.values())  # tied: once
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for p in self.params:                       # every rank starts from rank 0's weights
            dist.broadcast(p.data, src=src, group=group)
        self._make_units(units)
        N, r = self.world, self.rank
        self.sizes = [chunk_numel(p.numel(), N) for p in self.params]      # c_i
        self.flat, self.chunks = [None] * len(self.params), [None] * len(self.params)
        # Mixed precision (a bf16/fp16 model): the optimizer steps fp32 master copies of the chunks; the model's
        # chunks (`views`) and gradient shards stay in the model's dtype. fp32: the views are the chunks.
        self.mixed = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)
        self.views, self.grad_shards = [None] * len(self.params), [None] * len(self.params)
        for k, ids in enumerate(self.units):
            for i in ids:
                p, c = self.params[i], self.sizes[i]
                flat = torch.zeros(N * c, dtype=p.dtype, device=p.device)          # (N*c,) padded
                flat[:p.numel()] = p.data.reshape(-1)
                p.data = flat[:p.numel()].view_as(p)    # the model parameter lives in the padded buffer
                self.flat[i] = flat
                mine = flat[r * c:(r + 1) * c]          # (c,) own chunk: a view, updated in place
                self.views[i] = mine
                self.chunks[i] = nn.Parameter(mine.float().clone() if self.mixed else mine)   # (c,) fp32
        index = {id(p): i for i, p in enumerate(self.params)}
        inner = [dict(g, params=[self.chunks[index[id(p)]] for p in g["params"] if p.requires_grad]) for g in groups]
        self.optimizer = optimizer_cls(inner, **defaults)
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state   # live: the same objects
        self._built = True
        self._ready = [0] * len(self.units)
        self._hooks = []
        if stage == 2:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))

    def _shard_module(self, optimizer_cls, units, gather_fn, free_fn, defaults) -> None:
        """Stage 3: the module's parameters become this rank's shards (`shard_module`); the inner optimizer steps
        them. What the optimizer reads of itself (params, chunks, sizes, units, bytes) is the sharded module's."""
        sh = shard_module(self.model, self.group, units=units, gather_fn=gather_fn, free_fn=free_fn).shards
        self.sharding, self.params, self.chunks, self.views = sh, sh.full, sh.shards, sh.shards
        self.sizes, self.units, self.bytes, self.calls = sh.sizes, sh.units, sh.bytes, sh.calls
        self.mixed, self.grad_shards, self._hooks = False, [None] * len(sh.shards), []
        self.optimizer = optimizer_cls(_as_groups(self.model.parameters()), **defaults)
        super().__init__(self.optimizer.param_groups, self.optimizer.defaults)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self._built = True

    def _make_units(self, units) -> None:
        if units is None:                           # bare parameters: one unit each
            units = (list(getattr(self.model, "blocks", [])) + [self.model] if self.model is not None
                     else [[p] for p in self.params])
        index = {id(p): i for i, p in enumerate(self.params)}
        self.units, self.unit_modules, self._unit_of, seen = [], [], {}, set()
        for u in units:                             # a parameter belongs to the first unit that holds it
            ps = u.parameters() if isinstance(u, nn.Module) else u
            ids = [index[id(p)] for p in ps if id(p) in index and id(p) not in seen]
            if not ids:
                continue
            seen.update(id(self.params[i]) for i in ids)
            for i in ids:
                self._unit_of[i] = len(self.units)
            self.units.append(ids)
            self.unit_modules.append(u)
        missing = [i for i in range(len(self.params)) if id(self.params[i]) not in seen]
        if missing:
            raise ValueError(f"{len(missing)} parameters are in no unit: pass units that cover the whole model")

    def _offsets(self, k: int) -> list[int]:
        out = [0]
        for i in self.units[k]:
            out.append(out[-1] + self.sizes[i])
        return out

    # ------------------------------------------------------------------------------ one unit, one collective

    @torch.no_grad()
    def _reduce_scatter_unit(self, k: int) -> None:
        """Every parameter's full gradient of unit k -> the own chunks of their mean over ranks (c_i,)."""
        ids, off, N = self.units[k], self._offsets(k), self.world
        p0 = self.params[ids[0]]
        send = torch.zeros(N, off[-1], dtype=p0.dtype, device=p0.device)     # (N, S_k): row r goes to rank r
        for j, i in enumerate(ids):
            g, c = self.params[i].grad, self.sizes[i]
            if g is not None:
                padded = torch.zeros(N * c, dtype=g.dtype, device=g.device)
                padded[:g.numel()] = g.reshape(-1)
                send[:, off[j]:off[j + 1]] = padded.view(N, c)                 # (N*c,) -> (N, c)
        out = torch.empty(off[-1], dtype=p0.dtype, device=p0.device)          # (S_k,)
        reduce_scatter_flat(out, send.view(-1), group=self.group)
        self.bytes["reduce_scatter"] += send.numel() * send.element_size()
        self.calls["reduce_scatter"] += 1
        out.div_(N)
        for j, i in enumerate(ids):
            mine, chunk = out[off[j]:off[j + 1]], self.chunks[i]
            if self.mixed:                          # kept in the model's dtype until the step
                g = self.grad_shards[i]
                self.grad_shards[i] = mine if g is None else g.add_(mine)
            else:
                chunk.grad = mine if chunk.grad is None else chunk.grad.add_(mine)   # accumulation adds, once
            if self.stage == 2:
                self.params[i].grad = None          # only the shard of the gradient stays
        self._ready[k] = 0

    @torch.no_grad()
    def _all_gather_unit(self, k: int) -> None:
        """Own chunks of unit k -> every parameter of the unit in full (its padded buffer)."""
        ids, off, N = self.units[k], self._offsets(k), self.world
        shard = torch.cat([self.views[i].detach() for i in ids])   # (S_k,) the chunks live in the params' buffers
        full = torch.empty(N, off[-1], dtype=shard.dtype, device=shard.device)   # (N, S_k)
        all_gather_flat(full.view(-1), shard, group=self.group)
        self.bytes["all_gather"] += full.numel() * full.element_size()
        self.calls["all_gather"] += 1
        for j, i in enumerate(ids):
            self.flat[i].copy_(full[:, off[j]:off[j + 1]].reshape(-1))         # (N, c) -> (N*c,)

    # ------------------------------------------------------------------------------ hooks

    def _make_grad_hook(self, i: int):
        k = self._unit_of[i]

        def hook(p: torch.Tensor) -> None:             # p.grad is complete for this backward
            self._ready[k] += 1
            if self._ready[k] == len(self.units[k]):    # the whole unit: one reduce-scatter
                self._reduce_scatter_unit(k)
        return hook

    # ------------------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Reduce-scatter what is not yet (stage 1: every unit), update the own chunks with the inner
        optimizer, then (stages 1-2) all-gather the parameters. Stage 3 (the sharded module's backward has put
        the gradient shards on its parameters) only steps; its units are gathered at the next forward.
        The gradient shards are used up (stage 1's full gradients stay on the parameters until `zero_grad`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 3:
            self.optimizer.step()
            return loss
        for k, ids in enumerate(self.units):
            if self.stage == 1 or self._ready[k]:       # stage 2: a unit some of whose gradients never came
                if any(self.params[i].grad is not None for i in ids):
                    self._reduce_scatter_unit(k)
        if self.mixed:
            for chunk, g in zip(self.chunks, self.grad_shards):
                chunk.grad = None if g is None else g.float()    # (c,) fp32 for the master step
            self.grad_shards = [None] * len(self.params)
        self.optimizer.step()
        for chunk, view in zip(self.chunks, self.views):
            chunk.grad = None                           # the gradient shard has been used
            if self.mixed:
                view.copy_(chunk.detach())              # fp32 master -> the model's dtype
        for k in range(len(self.units)):
            self._all_gather_unit(k)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient this rank holds (the parameters' full ones, the shards) set to None, or with
        ``set_to_none=False`` zeroed in place where it exists, as in torch."""
        for g in [p.grad for p in self.params] + [c.grad for c in self.chunks] + self.grad_shards:
            if g is not None and not set_to_none:
                g.zero_()
        if set_to_none:
            for t in self.params + self.chunks:
                t.grad = None
            self.grad_shards = [None] * len(self.params)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):          # torch's __init__ adds the constructor's groups through here
            raise NotImplementedError("ZeroOptimizer cuts its chunks once, when it is built: pass every parameter "
                                      "group to the constructor")
        super().add_param_group(param_group)

    # what it holds (course_lib/parallel/zero_state.py): this rank's shard as a state dict, the same as pieces of
    # full-length tensors for DCP (any world size), the bytes of model state
    state_dict = zero_state.shard_state_dict
    load_state_dict = zero_state.load_shard_state_dict
    dcp_state_dict = zero_state.dcp_state_dict
    load_dcp_state_dict = zero_state.load_dcp_state_dict
    state_bytes = zero_state.state_bytes

    def full_parameters(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Every parameter in full, by its name in `model` (`zero_state.param_names`; gathered from the chunks;
        collective: call on every rank)."""
        names = zero_state.param_names(self, model)
        return {names[i]: gather_chunk(self.views[i], p.shape, self.group) for i, p in enumerate(self.params)}

    def padded_numel(self) -> int:
        """N x sum of chunk sizes: the parameter count after padding each tensor to a multiple of N."""
        return self.world * sum(self.sizes)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.stage == 3:
            self.sharding.remove()


def _as_groups(params) -> list[dict]:
    """torch's rule: parameters are one group; dicts are one group each, with their own options."""
    groups = list(params)
    if not groups:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    return [dict(g, params=list(g["params"])) for g in groups] if isinstance(groups[0], dict) else [{"params": groups}]


def apply_zero(model: nn.Module, optimizer_cls=torch.optim.AdamW, stage: int = 1, group=None,
               **kwargs) -> ZeroOptimizer:
    """Shard `model`'s training state over `group` with ZeRO `stage` (1, 2, 3); returns the `ZeroOptimizer`
    (a ``torch.optim.Optimizer``) to call ``step()`` / ``zero_grad()`` on. kwargs: units, gather_fn, free_fn and
    the inner optimizer's defaults (lr=...)."""
    return ZeroOptimizer(model, optimizer_cls, stage, group, **kwargs)
