"""What the graded exercises of lesson 05 call (solutions/05_zero_fsdp_deepspeed.ipynb): a rank-side harness.

The exercises work on one flat vector: every parameter flattened and concatenated, zero-padded to N x S
elements, so that rank r owns elements [r*S, (r+1)*S) (its shard). `FlatZero` is the given machinery around
the learner's functions; the ``rank_try_*`` functions run inside `course_lib.runtime.launch.run` and return plain
numbers for the test cells to compare.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.data import shard_batch
from course_lib.dist import global_mean
from course_lib.model import build_model
from course_lib.one_process import params_of

__all__ = ["FlatZero", "rank_try_flat_zero", "rank_try_reduce_scatter", "rank_try_layer_gather"]


class FlatZero:
    """ZeRO-1/2 on one flat, padded vector (given code around the exercises).

    step(): flatten the gradients (N*S,), drop the full ones, then either
      - ``zero1_step(flat_grad, shard, optimizer, group) -> flat_params (N*S,)`` (exercise 05-zero1), or
      - ``shard.grad = grad_shard_fn(flat_grad, group)`` (exercise 05-zero2-grad), optimizer step on the
        shard, all-gather of the shards;
    and write the full vector back into the parameters.
    """

    def __init__(self, model: nn.Module, optimizer_cls=torch.optim.AdamW, group=None,
                 zero1_step: Callable | None = None, grad_shard_fn: Callable | None = None, **optimizer_kwargs):
        self.model, self.group = model, group
        self.zero1_step, self.grad_shard_fn = zero1_step, grad_shard_fn
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.S = math.ceil(self.numel / self.world)                        # shard size
        flat = self.flatten([p.data for p in self.params])                  # (N*S,)
        self.shard = nn.Parameter(flat[self.rank * self.S:(self.rank + 1) * self.S].clone())   # (S,) master
        self.optimizer = optimizer_cls([self.shard], **optimizer_kwargs)

    def flatten(self, tensors) -> torch.Tensor:
        flat = torch.zeros(self.world * self.S, dtype=tensors[0].dtype, device=tensors[0].device)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    @torch.no_grad()
    def step(self) -> None:
        flat_grad = self.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        for p in self.params:
            p.grad = None
        if self.zero1_step is not None:
            full = self.zero1_step(flat_grad, self.shard, self.optimizer, self.group)
        else:
            self.shard.grad = self.grad_shard_fn(flat_grad, self.group)
            self.optimizer.step()
            full = torch.empty(self.world * self.S, dtype=self.shard.dtype, device=self.shard.device)
            dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        self.shard.grad = None
        torch._foreach_copy_([p.data for p in self.params],
                             [v.view_as(p) for v, p in zip(full[:self.numel].split([p.numel() for p in self.params]),
                                                           self.params)])

    def optimizer_numel(self) -> int:
        return sum(v.numel() for s in self.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)


def rank_try_flat_zero(cfg, batches, optimizer: str = "adamw", lr: float = 1e-2, **fns) -> dict:
    """Train with `FlatZero` (the learner's function in ``fns``) on this rank's rows; return losses, parameters,
    the optimizer state's elements on this rank, the collectives called and whether the ranks agree."""
    r, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    model = build_model(cfg, 0).to(dev)
    opt_cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    zero = FlatZero(model, opt_cls, lr=lr, **fns)
    losses, counter = [], CollectiveCounter()
    for x, y in batches:
        loss = model.loss(shard_batch(x, r, n).to(dev), shard_batch(y, r, n).to(dev))
        loss.backward()
        with counter:                                                  # the collectives of the step only
            zero.step()
        losses.append(global_mean(loss))
    ops = sorted({op for _, op, _, _ in counter.records})
    return {"losses": losses, "params": params_of(model), "optimizer_numel": zero.optimizer_numel(),
            "shard_numel": zero.S, "ops": ops}


def rank_try_reduce_scatter(fn: Callable, sizes=(2, 6, 10)) -> list[dict]:
    """fn(flat (N*S,), group) -> (S,): the mean over ranks of chunk `rank`. Rank r contributes (r+1) x arange."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for S in sizes:
        base = torch.arange(n * S, dtype=torch.float32, device=cdist.device())
        flat = base * (r + 1)
        got = fn(flat, None)
        expected = base[r * S:(r + 1) * S] * (n + 1) / 2            # mean of 1..n = (n+1)/2
        out.append({"S": S, "shape": tuple(got.shape), "ok": got.shape == expected.shape and
                    torch.allclose(got, expected), "sum_instead_of_mean": got.shape == expected.shape and
                    torch.allclose(got, expected * n)})
    return out


def rank_try_layer_gather(gather_fn: Callable, free_fn: Callable) -> dict:
    """A Linear layer sharded over the ranks: gather its parameters with the learner's `gather_fn(param, chunk,
    group)`, run it, free them with `free_fn(param)`. Returns what the test compares."""
    r, n, dev = dist.get_rank(), dist.get_world_size(), cdist.device()
    torch.manual_seed(0)
    layer = nn.Linear(7, 5).to(dev)                                    # 35 + 5 elements: not divisible by n
    full = {k: v.detach().clone() for k, v in layer.named_parameters()}
    x = torch.randn(3, 7).to(dev)
    expected = layer(x).detach()
    chunks = []
    for p in layer.parameters():
        c = math.ceil(p.numel() / n)
        padded = torch.zeros(n * c, device=dev)
        padded[:p.numel()] = p.detach().reshape(-1)
        chunks.append(padded[r * c:(r + 1) * c].clone())               # (c,) this rank's chunk
        p.data.untyped_storage().resize_(0)                            # sharded: the full parameter is gone
    counter = CollectiveCounter()
    with counter:
        for p, c in zip(layer.parameters(), chunks):
            gather_fn(p, c, None)
    gathered = {k: v.detach().clone() for k, v in layer.named_parameters()}
    y = layer(x).detach()
    for p in layer.parameters():
        free_fn(p)
    freed = [p.data.untyped_storage().nbytes() for p in layer.parameters()]
    return {"gathered_ok": all(torch.equal(gathered[k], full[k]) for k in full),
            "output_ok": torch.allclose(y, expected, atol=1e-6), "freed_bytes": freed,
            "ops": [op for _, op, _, _ in counter.records]}
