"""What the graded exercises of lesson 05 call (solutions/05_zero_fsdp_deepspeed.ipynb): a rank-side harness.

The exercises work on one flat vector: every parameter flattened and concatenated, zero-padded to N x S
elements, so that rank r owns elements [r*S, (r+1)*S) (its shard). `FlatZero` is the given machinery around
the learner's functions; the ``rank_try_*`` functions run inside `course_lib.runtime.launch.run` and return plain
numbers for the test cells to compare.

A learner's exception must read as one line, not as a rank's traceback: each test cell's rank function runs its
parts through `guarded` (the first part that raises is recorded: which part, the exception's type and message, and
the training step when there is one), and the cell launches through `launch`, which turns that record, or a run
that failed or hung, into one `CheckFailed` naming the rank.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.grading.check import CheckFailed
from course_lib.lessons.rank_records import one_line
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.data import shard_batch
from course_lib.dist import global_mean
from course_lib.model import build_model
from course_lib.one_process import params_of

__all__ = ["FlatZero", "rank_try_flat_zero", "rank_try_reduce_scatter", "rank_try_layer_gather", "guarded",
           "launch"]

_STUB_HINT = "the message says which rank and which part failed; NotImplementedError means the exercise is still a stub"


class StepError(Exception):
    """A learner's exception inside a training loop, with the step it happened in."""

    def __init__(self, where: str, exc: BaseException):
        super().__init__(where)
        self.where, self.exc = where, exc


def guarded(parts: dict) -> dict:
    """On a rank: call each ``parts[name]()`` in order and keep its result under ``name``. The first one that
    raises stops the rest (their collectives would no longer pair up) and is recorded in 'error' as
    {'rank', 'part', 'message'}; 'error' is None when every part ran."""
    out = {"error": None}
    for name, call in parts.items():
        try:
            out[name] = call()
        except StepError as exc:
            out["error"] = {"rank": dist.get_rank(), "part": f"{name}, {exc.where}", "message": one_line(exc.exc)}
            break
        except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check, not a traceback
            out["error"] = {"rank": dist.get_rank(), "part": name, "message": one_line(exc)}
            break
    return out


def _raise_first_error(returns, exercise: str) -> None:
    for ret in returns:
        err = ret.get("error") if isinstance(ret, dict) else None
        if err:
            raise CheckFailed(f"{exercise}: your code runs on every rank",
                              f"rank {err['rank']} raised in {err['part']}: {err['message']}", _STUB_HINT)


def launch(rank_fn: Callable, exercise: str, args=(), nprocs: int = 4, timeout_s: float = 150) -> list[dict]:
    """In the kernel: ``run(rank_fn, nprocs, args)`` on gloo; every rank's result (a `guarded` dict). A part that
    raised on a rank, a rank that failed outside `guarded`, or a run that timed out (a rank left waiting in a
    collective that another rank never called) raises one `CheckFailed` line."""
    from course_lib.runtime.launch import DistributedRunError, RunTimeout, run
    try:
        res = run(rank_fn, nprocs=nprocs, args=args, backend="gloo", timeout_s=timeout_s, stream=False)
    except DistributedRunError as exc:
        partial = getattr(getattr(exc, "partial", None), "returns", None) or []
        _raise_first_error([r for r in partial if r is not None], exercise)
        last = [line for line in str(exc).splitlines() if line.strip()][-1:] or [type(exc).__name__]
        what = (f"the ranks did not finish within {timeout_s:g} s (a rank waiting in a collective the others never "
                f"called?)" if isinstance(exc, RunTimeout) else f"rank {exc.rank} failed: {last[0]}")
        raise CheckFailed(f"{exercise}: your code runs on every rank", what, _STUB_HINT) from None
    _raise_first_error(res.returns, exercise)
    return res.returns


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
    for i, (x, y) in enumerate(batches):
        loss = model.loss(shard_batch(x, r, n).to(dev), shard_batch(y, r, n).to(dev))
        loss.backward()
        try:
            with counter:                                              # the collectives of the step only
                zero.step()
        except Exception as exc:  # noqa: BLE001 - `guarded` reports it with the step
            raise StepError(f"training step {i + 1} of {len(batches)}", exc) from exc
        losses.append(global_mean(loss))
    ops = sorted({op for _, op, _, _ in counter.records})
    return {"losses": losses, "params": params_of(model), "optimizer_numel": zero.optimizer_numel(),
            "shard_numel": zero.S, "ops": ops}


def rank_try_reduce_scatter(fn: Callable, sizes=(2, 6, 10)) -> list[dict]:
    """fn(flat (N*S,), group) -> (S,): the mean over ranks of chunk `rank`. Rank r contributes (r+1) x arange.
    'scale': c when the result is c x the expected chunk (None when it is not a multiple of it)."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = []
    for S in sizes:
        base = torch.arange(n * S, dtype=torch.float32, device=cdist.device())
        flat = base * (r + 1)
        got = fn(flat, None)
        expected = base[r * S:(r + 1) * S] * (n + 1) / 2            # mean of 1..n = (n+1)/2
        same = got.shape == expected.shape
        scale = float(got.double() @ expected.double() / (expected.double() @ expected.double())) if same else None
        out.append({"S": S, "shape": tuple(got.shape), "ok": same and torch.allclose(got, expected),
                    "sum_instead_of_mean": same and torch.allclose(got, expected * n),
                    "scale": scale if same and torch.allclose(got, expected * scale) else None})
    return out


def rank_try_layer_gather(gather_fn: Callable, free_fn: Callable) -> dict:
    """A Linear layer sharded over the ranks: gather its parameters with the learner's `gather_fn(param, chunk,
    group)`, run it, free them with `free_fn(param)`; then gather another layer, different on every rank, over a
    group of one rank (each rank alone): a gather that ignores `group` takes rank 0's values. Returns what the test
    compares."""
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
    alone = [dist.new_group([k]) for k in range(n)]                    # every rank creates every group
    torch.manual_seed(100 + r)                                         # other values on every rank
    mine = nn.Linear(7, 5).to(dev)
    own = [p.detach().reshape(-1).clone() for p in mine.parameters()]  # a group of one: the chunk is the whole
    for p in mine.parameters():
        p.data.untyped_storage().resize_(0)
    for p, c in zip(mine.parameters(), own):
        gather_fn(p, c, alone[r])
    subgroup_ok = all(torch.equal(p.detach().reshape(-1), c) for p, c in zip(mine.parameters(), own))
    return {"gathered_ok": all(torch.equal(gathered[k], full[k]) for k in full), "subgroup_ok": subgroup_ok,
            "output_ok": torch.allclose(y, expected, atol=1e-6), "freed_bytes": freed,
            "ops": [op for _, op, _, _ in counter.records]}
