"""What the course's `ZeroOptimizer` holds (lesson 05), and how it is saved (lesson 09).

Its state dict is this rank's shard, as a torch optimizer's is its whole state:

    zero.state_dict() = {"state": {i: {"step": (), "exp_avg": (c_i,), "exp_avg_sq": (c_i,)}},   # AdamW, inner
                         "param_groups": [{"lr": ..., "weight_decay": ..., "params": [i, ...]}, ...],
                         "zero": {"stage", "world_size", "rank", "numels": [numel_i], "master": [(c_i,)] or None}}

``state`` and ``param_groups`` are the inner optimizer's over this rank's chunks (parameter i's chunk has
c_i = ceil(numel_i / N) elements, the last ones zero padding); ``master`` holds the fp32 master chunks of a
bf16/fp16 model (None in fp32: the chunks are views of the model's parameters, saved with the model). It loads
back only into the same rank of the same world size, which ``zero`` lets `load_shard_state_dict` check.

For another world size, `dcp_state_dict` describes the shard to PyTorch Distributed Checkpoint (DCP) the way
FSDP2's optimizer state already is: every per-element state tensor (c_i,) becomes this rank's piece of a
full-length flat tensor (numel_i,), a DTensor sharded on dim 0 over the group (`course_lib.parallel.sharded_state`),
so each rank writes only its pieces (memory stays 1/N, unlike gathering every state tensor in full as
``get_optimizer_state_dict(full_state_dict=True)`` does) and DCP reads, on 2 ranks, the pieces that 4 ranks wrote.
Keys are the parameters' names in the model (``state.<name>.exp_avg``); the inner optimizer must be of the same
class. `dist_checkpoint.save` and ``load`` use it for any optimizer with a ``dcp_state_dict`` method. At stage 3
the chunks are the sharded module's parameters, which the model's own DCP form saves (``module.shards``).

    dist_checkpoint.save(step_path(ckpt, 3), model=model, optimizer=zero, scheduler=sched, step=3, data_position=3)
    dist_checkpoint.load(latest(ckpt), model=model, optimizer=zero, scheduler=sched)     # on 4 ranks, or on 2
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.measure.memory_stats import unique_bytes
from course_lib.parallel import sharded_state

__all__ = ["param_names", "shard_state_dict", "load_shard_state_dict", "dcp_state_dict", "load_dcp_state_dict",
           "state_bytes"]


def param_names(zero, model: nn.Module | None = None) -> list[str]:
    """The name of each of ``zero.params`` in ``model`` (default: the module it was built from; stage 3: the name of
    its shard, which is the module's parameter), else its index."""
    model = model if model is not None else zero.model
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    return [names.get(id(p), names.get(id(c), str(i))) for i, (p, c) in enumerate(zip(zero.params, zero.chunks))]


def _layout(zero) -> dict:
    return {"world_size": zero.world, "rank": zero.rank, "numels": [p.numel() for p in zero.params]}


def shard_state_dict(zero) -> dict:
    """This rank's shard (module docstring): the inner optimizer's state dict, plus the layout and the masters."""
    out = zero.optimizer.state_dict()
    master = [c.detach().clone() for c in zero.chunks] if zero.mixed else None
    out["zero"] = dict(_layout(zero), stage=zero.stage, master=master)
    return out


def load_shard_state_dict(zero, state_dict: dict) -> None:
    """Load `shard_state_dict`'s output; refused unless saved by the same rank of the same world size."""
    saved, mine = state_dict["zero"], _layout(zero)
    if {k: saved[k] for k in mine} != mine:
        raise ValueError(f"this shard was saved by rank {saved['rank']} of {saved['world_size']} (or for other "
                         f"parameters): it cannot load into rank {zero.rank} of {zero.world}. To change the world "
                         "size, save and load with course_lib.parallel.dist_checkpoint (rank-count independent)")
    zero.optimizer.load_state_dict({k: state_dict[k] for k in ("state", "param_groups")})
    zero.param_groups, zero.state = zero.optimizer.param_groups, zero.optimizer.state   # torch made new ones
    for chunk, view, m in zip(zero.chunks, zero.views, saved["master"] or []):
        chunk.data.copy_(m)
        view.copy_(m)                                       # fp32 master -> the model's dtype


def dcp_state_dict(zero, model: nn.Module | None = None, for_load: bool = False) -> dict:
    """{'state': {name: {key: DTensor (numel,) or scalar}}, 'param_groups': [{..., 'params': [names]}]}: the shard
    as pieces of full-length tensors (`sharded_state.optimizer_dcp_state_dict`; with mixed precision the fp32
    master chunks too). ``for_load``: the state is created first, for DCP to load into; then call
    `load_dcp_state_dict`."""
    return sharded_state.optimizer_dcp_state_dict(zero.optimizer, zero.chunks, [p.numel() for p in zero.params],
                                                  param_names(zero, model), zero.group, for_load, zero.mixed)


@torch.no_grad()
def load_dcp_state_dict(zero, state: dict, model: nn.Module | None = None) -> None:
    """Put what DCP loaded into `dcp_state_dict(zero, for_load=True)`'s dict into the optimizer."""
    sharded_state.load_optimizer_dcp_state_dict(zero.optimizer, zero.chunks, param_names(zero, model), state)
    if zero.mixed:
        for chunk, view in zip(zero.chunks, zero.views):
            view.copy_(chunk.detach())                      # fp32 master -> the model's dtype


def state_bytes(zero) -> dict:
    """Bytes of model state this rank holds now, counted from the tensors (storages deduplicated):
    dict(params=, grads=, optimizer=, total=), like `course_lib.measure.memory_stats.model_state_bytes`; with mixed
    precision ``optimizer`` includes the fp32 master chunks (the formula's K = 12)."""
    seen: set = set()
    p_bytes = unique_bytes(list(zero.params) + list(zero.views), seen)
    g_bytes = unique_bytes([p.grad for p in zero.params] + [c.grad for c in zero.chunks] + zero.grad_shards, seen)
    o_bytes = unique_bytes(zero.chunks, seen)      # fp32 master chunks (mixed precision only; else seen)
    o_bytes += sum(unique_bytes([v], seen) for s in zero.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
    return dict(params=p_bytes, grads=g_bytes, optimizer=o_bytes, total=p_bytes + g_bytes + o_bytes)
