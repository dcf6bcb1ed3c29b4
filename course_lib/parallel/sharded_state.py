"""Shards as PyTorch Distributed Checkpoint (DCP) sees them: pieces of full-length tensors (lessons 05, 09).

The course's ZeRO layout (`course_lib.parallel.sharded_module`) gives rank r the chunk r of every flattened
parameter, c = ceil(numel / N) elements, the last ones zero padding. That is exactly DTensor's ``Shard(0)`` of
the flattened parameter (pieces of ceil(numel/N), the last ones shorter or empty), so a chunk, and every
per-element optimizer state tensor of it, is described to DCP as this rank's piece of a full-length (numel,)
DTensor (the padding is not saved). Each rank writes only its pieces and DCP reads, on 2 ranks, the pieces that
4 ranks wrote: a run resumes on another world size. Scalars (AdamW's step, the same on every rank) are saved once.

    module_dcp_state_dict(module.shards)          {name: DTensor (numel,)} + whole parameters as they are
    optimizer_dcp_state_dict(opt, chunks, ...)    {'state': {name: {key: DTensor (numel,) or scalar}},
                                                   'param_groups': [{..., 'params': [names]}]}

`course_lib.parallel.dist_checkpoint` calls these for a sharded module (any optimizer over its shards) and, through
`course_lib.parallel.zero_state`, for the course's `ZeroOptimizer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = ["own_numel", "optimizer_dcp_state_dict", "load_optimizer_dcp_state_dict", "init_optimizer_state",
           "module_dcp_state_dict", "load_module_dcp_state_dict"]


def own_numel(numel: int, chunk: int, rank: int) -> int:
    """Elements of rank `rank`'s chunk (of `chunk` elements) of a parameter of `numel` that are not padding."""
    return max(0, min(chunk, numel - rank * chunk))


def _mesh(group, device) -> DeviceMesh:
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)


def _piece(v: torch.Tensor, numel: int, mesh: DeviceMesh) -> DTensor:
    """(c,) chunk of this rank -> its piece of the full-length (numel,) tensor, a view (no copy)."""
    n = own_numel(numel, v.numel(), mesh.get_local_rank())
    return DTensor.from_local(v[:n], mesh, [Shard(0)], run_check=False, shape=(numel,), stride=(1,))


@torch.no_grad()
def _copy_piece(target: torch.Tensor, loaded: DTensor) -> None:
    piece = loaded.to_local()
    target[:piece.numel()].copy_(piece.reshape(-1))
    target[piece.numel():].zero_()                      # the padding: zero, as in a run that never stopped


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer, chunks: list) -> None:
    """Give the optimizer its state tensors, for DCP to load into: one step with zero gradients at lr 0 (what
    torch's ``get_optimizer_state_dict`` does), which leaves every parameter as it was."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [c.grad for c in chunks]
    for c in chunks:
        c.grad = torch.zeros_like(c)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for c, g in zip(chunks, grads):
        c.grad = g


def optimizer_dcp_state_dict(optimizer: torch.optim.Optimizer, chunks: list, numels: list[int], names: list[str],
                             group=None, for_load: bool = False, masters: bool = False) -> dict:
    """The optimizer's state over `chunks` (chunk i of a parameter of numels[i], named names[i]) as pieces of
    full-length DTensors (views of the state: DCP saves from them, or, ``for_load``, loads into them; then call
    `load_optimizer_dcp_state_dict`). masters: the chunks are fp32 master copies the model does not hold, saved
    as ``master``."""
    if for_load:
        init_optimizer_state(optimizer, chunks)
    mesh, state = _mesh(group, chunks[0].device), {}
    for i, chunk in enumerate(chunks):
        entry = dict(optimizer.state.get(chunk, {}), **({"master": chunk.detach()} if masters else {}))
        state[names[i]] = {k: _piece(v, numels[i], mesh) if isinstance(v, torch.Tensor) and v.shape == chunk.shape
                           else v for k, v in entry.items()}
    index = {id(c): i for i, c in enumerate(chunks)}
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[names[index[id(c)]] for c in g["params"]])
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_dcp_state_dict(optimizer: torch.optim.Optimizer, chunks: list, names: list[str],
                                  state: dict) -> None:
    """Put what DCP loaded into `optimizer_dcp_state_dict(..., for_load=True)`'s dict into the optimizer (and,
    for a ``master`` entry, into the chunk itself)."""
    for i, chunk in enumerate(chunks):
        own = optimizer.state[chunk]
        for k, v in state["state"][names[i]].items():
            if isinstance(v, DTensor):                  # this rank's piece of the full-length tensor
                _copy_piece(chunk.data if k == "master" else own[k], v)
            else:
                own[k] = v
    for g, saved in zip(optimizer.param_groups, state["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})


def module_dcp_state_dict(shards, for_load: bool = False) -> dict:
    """A sharded module's parameters for DCP, by name: each shard as a piece of its full-length flat DTensor,
    each whole parameter as it is (the same on every rank: DCP writes it once). Tied names appear once."""
    mesh = _mesh(shards.group, shards.shards[0].device) if shards.shards else None
    by_id = {id(s): i for i, s in enumerate(shards.shards)}
    out = {}
    for name, p in shards.module.named_parameters():
        i = by_id.get(id(p))
        out[name] = p.detach() if i is None else _piece(p.detach(), shards.params[i].numel(), mesh)
    return out


@torch.no_grad()
def load_module_dcp_state_dict(shards, state: dict) -> None:
    """Copy what DCP loaded into `module_dcp_state_dict(for_load=True)`'s dict into the shards and whole
    parameters (DCP has filled the whole ones in place already; the copy makes it explicit)."""
    for name, p in shards.module.named_parameters():
        v = state[name]
        if isinstance(v, DTensor):
            _copy_piece(p.data, v)
        elif v.data_ptr() != p.data_ptr():
            p.data.copy_(v)
