"""ZeRO-3 shaped like FSDP2: a module whose parameters are this rank's shards (lesson 05).

    model = shard_module(build_model(cfg), compute_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # any optimizer: it steps the shards
    loss = model.loss(x_local, y_local); loss.backward()        # .grad of every shard: the mean over ranks
    opt.step(); opt.zero_grad()

Layout (the course's ZeRO; DeepSpeed's stage 3 partitions a parameter the same way, FSDP2 cuts it along dim 0 and
keeps its shape): every parameter tensor is flattened, padded with zeros to a multiple of N and cut into N equal
chunks; rank r owns chunk r, of c = ceil(numel / N) elements. `shard_module`
replaces each parameter of the module by an ``nn.Parameter`` of shape (c,), this rank's chunk, so
``module.parameters()`` are the shards and any ``torch.optim`` optimizer over them holds 1/N of the state.
The chunks of one unit (a block of ``module.blocks``, and the module itself for the rest) are views of one flat
buffer, so a unit is gathered with one all-gather and its gradients reduce-scattered with one reduce-scatter.

Just in time, by hooks on each unit's forward:
- before the unit's forward: all-gather its chunks into the full parameters (tensors of the original shapes,
  in ``compute_dtype``) and put them in the modules' places for the forward;
- after it: put the shards back and free the full parameters (``untyped_storage().resize_(0)``: the tensor, which
  autograd saved, stays; its memory goes). The root unit (embeddings, final norm, head) stays gathered until its
  backward, as in FSDP2;
- when backward reaches the unit (a hook on its output's gradient): gather them again;
- once every gradient of the unit has arrived (``register_post_accumulate_grad_hook``): cast them to
  ``reduce_dtype``, reduce-scatter them, divide by N, add the own chunk to each shard's ``.grad`` (in the shard's
  dtype) and free the full parameters. A callback at the end of backward finishes any unit whose gradients came
  only in part: a parameter the loss did not use keeps ``.grad`` None, as in one process. Every rank must use the
  same parameters (a static graph, as DDP's default assumes), or the ranks' collectives would not pair up.

Mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``): the shards, their gradients and the
optimizer state stay in fp32 (a bf16/fp16 module's parameters become fp32 master shards: the course's choice, FSDP2
keeps a bf16 module's shards in bf16); the gathered parameters
are cast to ``compute_dtype`` before the all-gather (default: the parameter's own dtype), the gradients are reduced
in ``reduce_dtype`` (default: ``compute_dtype``). ``keep_whole`` names parameters (or gives them) that stay whole on
every rank, in their own dtype, never gathered; their gradients are averaged over the ranks by an all-reduce as
backward produces them (FSDP2 leaves its ``ignored_params`` to the caller).

Every collective's payload is counted (``module.shards.bytes``: all-gather = its output, reduce-scatter = its
input, all-reduce = its tensor), as in `course_lib.measure.collective_counter.CollectiveCounter`.
`ModuleShards.full_state_dict` gathers the full parameters; `dcp_state_dict` describes the shards to PyTorch
Distributed Checkpoint as DTensors (`course_lib.parallel.dist_checkpoint` saves and reshards them).
"""

from __future__ import annotations

import collections
import difflib
import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from course_lib.parallel import sharded_state
from course_lib.reference import reference_for

__all__ = ["shard_module", "ModuleShards", "all_gather_flat", "reduce_scatter_flat", "chunk_numel", "fill_param",
           "free_param", "gather_chunk", "master_dtype"]


@reference_for("05-zero1", "05-zero3-gather")
def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """(c,) on every rank -> (N*c,) = rank 0's chunk, rank 1's, ... (all_gather_single from torch 2.14 on)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


@reference_for("05-zero2-grad")
def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """(N*c,) on every rank -> (c,) = the sum over ranks of chunk `rank` (reduce_scatter_single from 2.14 on)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


def chunk_numel(numel: int, world: int) -> int:
    """Elements of one rank's chunk of a parameter with `numel` elements: ceil(numel / world)."""
    return math.ceil(numel / world)


@reference_for("05-zero3-gather")
def fill_param(param: nn.Parameter, full: torch.Tensor) -> None:
    """ZeRO-3 just-in-time gather, second half: give `param` its storage back (freed by `free_param`) and
    copy the gathered values in. full: (N*c,) every rank's chunk in rank order, padded (N*c >= numel)."""
    storage = param.data.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(param.numel() * param.element_size())
    param.data.copy_(full[:param.numel()].view_as(param))                              # (N*c,) -> param shape


@reference_for("05-zero3-gather")
def free_param(param: nn.Parameter) -> None:
    """ZeRO-3 free: release the full parameter's memory; the tensor (and what autograd saved of it) stays,
    with an empty storage, until `fill_param` fills it again (the trick of FSDP1)."""
    param.data.untyped_storage().resize_(0)


def gather_chunk(chunk: torch.Tensor, shape: torch.Size, group=None) -> torch.Tensor:
    """Every rank's (c,) chunk of one parameter -> the parameter in full, in `shape` (a new tensor; collective)."""
    chunk = chunk.detach().contiguous()
    full = torch.empty(chunk.numel() * dist.get_world_size(group), dtype=chunk.dtype, device=chunk.device)
    all_gather_flat(full, chunk, group=group)
    return full[:math.prod(shape)].view(shape)                                 # (N*c,) -> shape, padding dropped


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a shard keeps: fp32 for a 16-bit parameter (the master copy), else the parameter's own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@reference_for("05-zero3-gather")
class ModuleShards:
    """What `shard_module` attaches to the module as ``module.shards``: the shards, the full parameters, the
    units and their hooks (module docstring). ``shards[i]`` is this rank's (c_i,) chunk of parameter i,
    ``full[i]`` the tensor its forward computes with (storage freed between uses), ``slots[i]`` the
    (submodule, name) places it has in the module (two for a tied weight)."""

    def __init__(self, module: nn.Module, group=None, *, units: list | None = None, compute_dtype=None,
                 reduce_dtype=None, keep_whole: Iterable = (), gather_fn: Callable | None = None,
                 free_fn: Callable | None = None):
        if hasattr(module, "shards"):
            raise ValueError("this module is sharded already (module.shards exists): shard it once")
        self.module, self.group = module, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.gather_fn, self.free_fn = gather_fn, free_fn or free_param
        self.bytes, self.calls = collections.Counter(), collections.Counter()
        params = list(module.parameters())                  # a tied weight once
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in params:                                # every rank starts from rank 0's weights
                dist.broadcast(p.data, src=src, group=group)
        self.whole = _resolve_whole(module, keep_whole)
        self.params = [p for p in params if id(p) not in self.whole]
        self.names = _names(module, self.params)
        self.slots = [[(m, n) for m in module.modules() for n, q in m._parameters.items() if q is p]
                      for p in self.params]
        self._make_units(units)
        N, r = self.world, self.rank
        self.sizes = [chunk_numel(p.numel(), N) for p in self.params]           # c_i
        self.shards, self.full, self.unit_flat = [None] * len(self.params), [None] * len(self.params), []
        for k, ids in enumerate(self.units):
            if not ids:                                     # a root whose parameters are all kept whole
                self.unit_flat.append(None)
                continue
            dtypes = {master_dtype(self.params[i].dtype) for i in ids}
            if len(dtypes) > 1:
                raise ValueError(f"unit {k} mixes parameter dtypes {sorted(map(str, dtypes))}: one dtype per unit")
            off, p0 = self._offsets(k), self.params[ids[0]]
            flat = torch.zeros(off[-1], dtype=dtypes.pop(), device=p0.device)       # (S_k,) this rank's chunks
            for j, i in enumerate(ids):
                p, c = self.params[i], self.sizes[i]
                padded = torch.zeros(N * c, dtype=flat.dtype, device=p.device)     # (N*c,)
                padded[:p.numel()] = p.detach().reshape(-1)
                flat[off[j]:off[j + 1]] = padded[r * c:(r + 1) * c]
                self.shards[i] = nn.Parameter(flat[off[j]:off[j + 1]], requires_grad=p.requires_grad)  # a view
                dtype = compute_dtype or p.dtype
                self.full[i] = p if dtype == p.dtype else nn.Parameter(torch.empty_like(p, dtype=dtype),
                                                                       requires_grad=p.requires_grad)
                free_param(self.full[i])
                self._place(i, self.shards[i])
            self.unit_flat.append(flat)
        self.params = self.full                             # the originals are dropped (same shapes)
        self._ready = [0] * len(self.units)
        self._gathered = [False] * len(self.units)
        self._final_queued = False
        self._hooks = []
        for i, p in enumerate(self.full):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
        for p in (q for q in params if id(q) in self.whole and q.requires_grad):
            self._hooks.append(p.register_hook(self._average))
        for k, u in enumerate(self.unit_modules):
            self._hooks.append(u.register_forward_pre_hook(lambda m, a, k=k: self._before_forward(k)))
            self._hooks.append(u.register_forward_hook(lambda m, a, out, k=k: self._after_forward(k, out)))

    def _make_units(self, units) -> None:
        units = list(units) if units is not None else list(getattr(self.module, "blocks", []))
        if any(not isinstance(u, nn.Module) for u in units):
            raise ValueError("units must be submodules: a unit is gathered in its forward's hooks")
        if self.module not in units:
            units.append(self.module)                       # the root takes what no other unit holds
        index = {id(p): i for i, p in enumerate(self.params)}
        self.units, self.unit_modules, self._unit_of = [], [], {}
        for u in units:                                     # a parameter belongs to the first unit that holds it
            ids = [index[id(p)] for p in u.parameters() if id(p) in index and index[id(p)] not in self._unit_of]
            if ids or u is self.module:
                for i in ids:
                    self._unit_of[i] = len(self.units)
                self.units.append(ids)
                self.unit_modules.append(u)

    def _offsets(self, k: int) -> list[int]:
        out = [0]
        for i in self.units[k]:
            out.append(out[-1] + self.sizes[i])
        return out

    def _place(self, i: int, tensor: nn.Parameter) -> None:
        """Put `tensor` in every place parameter i has in the module (the shard, or the full one for a forward)."""
        for m, name in self.slots[i]:
            m._parameters[name] = tensor

    # ------------------------------------------------------------------------------ one unit, one collective

    @torch.no_grad()
    def _all_gather_unit(self, k: int) -> None:
        """The own chunks of unit k -> every parameter of the unit in full, in its compute dtype."""
        ids, off, N = self.units[k], self._offsets(k), self.world
        if not ids:
            return
        dtype = self.full[ids[0]].dtype
        if self.gather_fn is not None:                      # one collective per parameter, by the given function
            for i in ids:
                self.gather_fn(self.full[i], self.shards[i].detach().to(dtype), self.group)
                self.bytes["all_gather"] += N * self.sizes[i] * self.full[i].element_size()
                self.calls["all_gather"] += 1
            return
        full = torch.empty(N, off[-1], dtype=dtype, device=self.unit_flat[k].device)     # (N, S_k)
        all_gather_flat(full.view(-1), self.unit_flat[k].to(dtype), group=self.group)  # cast, then gather
        self.bytes["all_gather"] += full.numel() * full.element_size()
        self.calls["all_gather"] += 1
        for j, i in enumerate(ids):
            fill_param(self.full[i], full[:, off[j]:off[j + 1]].reshape(-1))          # (N, c) -> (N*c,)

    @torch.no_grad()
    def _reduce_scatter_unit(self, k: int) -> None:
        """Every full gradient of unit k -> the own chunk of their mean over ranks, added to each shard's .grad."""
        ids, off, N = self.units[k], self._offsets(k), self.world
        ref = self.full[ids[0]]
        dtype = self.reduce_dtype or ref.dtype
        send = torch.zeros(N, off[-1], dtype=dtype, device=ref.device)        # (N, S_k): row r goes to rank r
        had = [self.full[i].grad is not None for i in ids]     # the same on every rank: a static graph
        for j, i in enumerate(ids):
            g, c = self.full[i].grad, self.sizes[i]
            if g is not None:
                padded = torch.zeros(N * c, dtype=dtype, device=g.device)
                padded[:g.numel()] = g.reshape(-1)                              # cast to the reduce dtype
                send[:, off[j]:off[j + 1]] = padded.view(N, c)                  # (N*c,) -> (N, c)
        out = torch.empty(off[-1], dtype=dtype, device=ref.device)             # (S_k,)
        reduce_scatter_flat(out, send.view(-1), group=self.group)
        self.bytes["reduce_scatter"] += send.numel() * send.element_size()
        self.calls["reduce_scatter"] += 1
        out.div_(N)
        for j, i in enumerate(ids):
            mine, shard = out[off[j]:off[j + 1]].to(self.shards[i].dtype), self.shards[i]
            if had[j]:
                shard.grad = mine if shard.grad is None else shard.grad.add_(mine)   # accumulation adds
            self.full[i].grad = None                        # only the shard of the gradient stays
        self._ready[k] = 0

    @torch.no_grad()
    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        """A whole parameter's gradient, as backward produces it -> its mean over the ranks (then accumulated)."""
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        self.bytes["all_reduce"] += grad.numel() * grad.element_size()
        self.calls["all_reduce"] += 1
        return grad.div_(self.world)

    # ------------------------------------------------------------------------------ hooks

    def _gather(self, k: int) -> None:
        if not self._gathered[k]:
            self._all_gather_unit(k)
            self._gathered[k] = True

    def _free(self, k: int) -> None:
        for i in self.units[k]:
            self.free_fn(self.full[i])
        self._gathered[k] = False

    def _before_forward(self, k: int) -> None:
        self._gather(k)
        for i in self.units[k]:
            self._place(i, self.full[i])

    def _after_forward(self, k: int, out) -> None:
        for i in self.units[k]:
            self._place(i, self.shards[i])
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_comes = torch.is_grad_enabled() and tensors
        root = self.unit_modules[k] is self.module
        if not (root and backward_comes):                   # the root stays gathered until its backward
            self._free(k)
        for t in tensors if backward_comes else ():
            t.register_hook(lambda g, k=k: self._before_backward(k, g))

    def _before_backward(self, k: int, grad: torch.Tensor) -> torch.Tensor:
        """Backward reached unit k's output: gather its parameters again (a no-op for the root, still gathered),
        and, once per backward, queue the callback that finishes what the hooks left."""
        self._gather(k)
        if not self._final_queued:
            self._final_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        return grad

    def _finish_backward(self) -> None:
        """End of backward: reduce-scatter a unit some of whose gradients never came; free every unit."""
        for k in range(len(self.units)):
            if self._ready[k]:
                self._reduce_scatter_unit(k)
            if self._gathered[k]:
                self._free(k)
        self._final_queued = False

    def _make_grad_hook(self, i: int):
        k = self._unit_of[i]
        needed = sum(self.full[j].requires_grad for j in self.units[k])

        def hook(p: torch.Tensor) -> None:                  # p.grad is complete for this backward
            self._ready[k] += 1
            if self._ready[k] == needed:                    # the whole unit: one reduce-scatter
                self._reduce_scatter_unit(k)
                self._free(k)
        return hook

    # ------------------------------------------------------------------------------ what it holds

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter in full, by its name in the module (shards gathered in their own dtype, whole
        parameters as they are). Collective: call on every rank."""
        full = {id(s): gather_chunk(s, p.shape, self.group) for s, p in zip(self.shards, self.params)}
        return {name: full[id(p)] if id(p) in full else p.detach().clone()       # a whole one: as it is
                for name, p in self.module.named_parameters()}

    def remove(self) -> None:
        """Take the hooks off (the shards stay the module's parameters)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def dcp_state_dict(self, for_load: bool = False) -> dict:
        """The module's state for DCP: each shard as this rank's piece of a full-length flat DTensor
        (`sharded_state.module_dcp_state_dict`), whole parameters as they are."""
        return sharded_state.module_dcp_state_dict(self, for_load)

    def load_dcp_state_dict(self, state: dict) -> None:
        """Copy what DCP loaded into `dcp_state_dict(for_load=True)`'s dict into the shards."""
        sharded_state.load_module_dcp_state_dict(self, state)

    def optimizer_dcp_state_dict(self, optimizer: torch.optim.Optimizer, for_load: bool = False) -> dict:
        """The state of any optimizer over the shards for DCP, as pieces of full-length flat DTensors by the
        parameters' names (`sharded_state.optimizer_dcp_state_dict`)."""
        return sharded_state.optimizer_dcp_state_dict(optimizer, self.shards, [p.numel() for p in self.params],
                                                      self.names, self.group, for_load)

    def load_optimizer_dcp_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Put what DCP loaded into `optimizer_dcp_state_dict(for_load=True)`'s dict into the optimizer."""
        sharded_state.load_optimizer_dcp_state_dict(optimizer, self.shards, self.names, state)


def _resolve_whole(module: nn.Module, keep_whole) -> set[int]:
    """keep_whole: names of parameters (as in ``named_parameters()``) or the parameters -> their ids."""
    by_name = dict(module.named_parameters(remove_duplicate=False))
    ids = {id(p) for p in module.parameters()}
    out = set()
    for item in keep_whole:
        if isinstance(item, str):
            if item not in by_name:
                close = difflib.get_close_matches(item, by_name, n=3) or list(by_name)[:3]
                raise ValueError(f"keep_whole: no parameter named {item!r} in the module (did you mean "
                                 f"{' or '.join(map(repr, close))}? names as in module.named_parameters())")
            out.add(id(by_name[item]))
        elif isinstance(item, torch.Tensor) and id(item) in ids:
            out.add(id(item))
        else:
            raise ValueError(f"keep_whole takes parameter names or the module's own parameters, not {type(item)}")
    return out


def _names(module: nn.Module, params: list) -> list[str]:
    first = {}
    for n, p in module.named_parameters():
        first.setdefault(id(p), n)
    return [first[id(p)] for p in params]


def shard_module(module: nn.Module, group=None, *, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, keep_whole: Iterable = (), units: list | None = None,
                 gather_fn: Callable | None = None, free_fn: Callable | None = None) -> nn.Module:
    """Shard `module`'s parameters over `group` (ZeRO-3, in place; module docstring) and return it: its
    ``parameters()`` are then this rank's (c,) shards, which any optimizer steps; ``module.shards`` is the
    `ModuleShards`. compute_dtype / reduce_dtype: the mixed-precision policy; keep_whole: parameter names (or
    parameters) left whole on every rank; units: submodules gathered as one (default: each of ``module.blocks``,
    then the module for the rest); gather_fn(param, chunk, group) / free_fn(param): replace the built-in gather
    (one collective per parameter) and free (lesson 05's exercise plugs its own in)."""
    shards = ModuleShards(module, group, units=units, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
                          keep_whole=keep_whole, gather_fn=gather_fn, free_fn=free_fn)
    module.shards = shards                                  # a plain attribute: not a submodule, not a parameter
    return module
