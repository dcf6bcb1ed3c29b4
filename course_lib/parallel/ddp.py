"""Data parallelism, from naive gradient averaging to bucketed DDP that overlaps communication (lesson 02).

Every rank holds a full copy of the model and computes gradients on its own shard of the global batch.
Averaging the gradients over the ranks makes every copy take the same optimizer step as one process on
the whole batch, because the mean over the global batch is the mean of the per-shard means (equal shards).

* `average_gradients(model)`: the naive version, one all-reduce per parameter after backward.
* `BucketedDDP` / `apply_ddp(model, bucket_cap_mb=...)`: an `nn.Module` wrapping the model, used where
  `torch.nn.parallel.DistributedDataParallel` would go (forward, `parameters()`, `state_dict()` with the same
  `module.` names, `train()`/`eval()`, `no_sync()`). Gradients are packed into buckets of about
  `bucket_cap_mb` MB (optionally a smaller first one, `first_bucket_cap_mb`: PyTorch DDP uses 1 MB when
  its cap is left at the default, so that communication starts early), in the reverse order of the
  parameters (the order backward produces them). A post-accumulate-grad hook on every parameter counts
  the gradients that are ready; when a bucket is full its asynchronous all-reduce starts while backward
  is still computing earlier layers.
  `finish_gradient_synchronization()` waits for every bucket and copies the averages back into `.grad`.
  `no_sync()` skips communication for gradient-accumulation micro-steps.

This is the design of PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB), written small enough to read in one go.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from course_lib.reference import reference_for

__all__ = ["average_gradients", "broadcast_parameters", "Bucket", "BucketedDDP", "apply_ddp", "make_buckets"]


@reference_for("02-average-gradients")
@torch.no_grad()
def average_gradients(model: nn.Module, group=None) -> None:
    """Naive data parallelism: all-reduce (sum) every parameter's gradient, then divide by the world size.

    g_i <- (1/n) sum_r g_i^(r) for every parameter i: n is the number of ranks in `group` (default: all).
    """
    n = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
            p.grad.div_(n)


@torch.no_grad()
def broadcast_parameters(model: nn.Module, group=None, src: int = 0) -> None:
    """Copy rank `src`'s parameters and buffers to every rank of `group`, so all replicas start equal."""
    src_global = src if group is None else dist.get_global_rank(group, src)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src_global, group=group)


@dataclasses.dataclass
class Bucket:
    """A group of parameters whose gradients travel in one all-reduce."""

    params: list[nn.Parameter]
    buffer: torch.Tensor          # (sum of numels,) flat gradient storage
    views: list[torch.Tensor] = dataclasses.field(default_factory=list)   # per parameter: its slice, its shape
    ready: int = 0                # gradients of this backward that have arrived
    work: object = None           # the async all-reduce handle while in flight

    @classmethod
    def of(cls, params: list[nn.Parameter]) -> "Bucket":
        """A bucket whose flat buffer has the parameters' dtype and device, with one view per parameter."""
        bucket = cls(params, torch.empty(0))
        bucket.allocate()
        return bucket

    def allocate(self) -> None:
        """(Re)make the flat buffer and the views where the parameters live now (also after `module.to(...)`)."""
        p0 = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device)
        views = torch.split(self.buffer, [p.numel() for p in self.params])          # (numel_i,) slices
        self.views = [v.view_as(p) for v, p in zip(views, self.params)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(params: list[nn.Parameter], bucket_cap_bytes: float,
                 first_bucket_cap_bytes: float | None = None) -> list[list[nn.Parameter]]:
    """Split `params` (in backward order) into consecutive groups of at most `bucket_cap_bytes`, the first
    group at most `first_bucket_cap_bytes` when given (a parameter bigger than the cap gets its own bucket)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cap = first_bucket_cap_bytes if first_bucket_cap_bytes is not None and not buckets else bucket_cap_bytes
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


@reference_for("02-bucketed-ddp")
class BucketedDDP(nn.Module):
    """Bucketed data parallelism with communication overlapped with backward (lesson 02).

    An `nn.Module` used like `torch.nn.parallel.DistributedDataParallel`:

        ddp = apply_ddp(model, bucket_cap_mb=1.0)    # broadcasts rank 0's weights, registers hooks
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        loss = lm_loss(ddp(x), y); loss.backward()    # forward is the model's; buckets all-reduce during backward
        ddp.finish_gradient_synchronization()         # wait; .grad now holds the average over ranks
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0); optimizer.step()

    One difference from PyTorch DDP: the wait is explicit (`finish_gradient_synchronization()`), where PyTorch
    queues it as an autograd callback at the end of backward. The hooks sit on the parameters, so a backward
    through `model.loss(x, y)` synchronises too. As in PyTorch DDP, the wrapped model is the submodule
    `module`: `state_dict()` keys are ``module.<name>`` (a plain model's state dict loads into `ddp.module`).

    Attributes: `module` (the plain model), `buckets`, `world_size`, and counters `num_all_reduces`,
    `bytes_all_reduced` (payload bytes handed to all-reduce since creation).
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float | None = None, broadcast: bool = True):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be positive (e.g. 25, PyTorch DDP's default)")
        super().__init__()
        self.module = module                      # a submodule: parameters and state_dict keys get 'module.'
        self.group, self.bucket_cap_mb = group, bucket_cap_mb
        self.world_size = dist.get_world_size(group)
        self.require_sync = True
        self.num_all_reduces = 0
        self.bytes_all_reduced = 0
        if broadcast:
            broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]   # tied weights appear once
        first = None if first_bucket_cap_mb is None else min(first_bucket_cap_mb, bucket_cap_mb) * 2**20
        groups = make_buckets(list(reversed(params)), bucket_cap_mb * 2**20, first)
        self.buckets = [Bucket.of(ps) for ps in groups]     # a plain list: bucket buffers are not state
        self._handles = []
        for bucket in self.buckets:
            for p in bucket.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(bucket)))

    def forward(self, *args, **kwargs):
        """The wrapped model's forward (its hooks and `train()`/`eval()` mode included)."""
        return self.module(*args, **kwargs)

    def _make_hook(self, bucket: Bucket):
        n_params = len(bucket.params)

        def hook(param: torch.Tensor) -> None:    # runs right after param.grad has been accumulated
            if not self.require_sync:
                return
            bucket.ready += 1
            if bucket.ready >= n_params:
                if bucket.ready > n_params or bucket.work is not None:
                    raise RuntimeError(
                        "a second backward reached a bucket whose all-reduce was not finished: call "
                        "finish_gradient_synchronization() after each synchronised backward, and run the first "
                        "k-1 backward passes of gradient accumulation inside ddp.no_sync()")
                self._launch(bucket)
        return hook

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        """Pack the bucket's gradients (zeros for a parameter without one), pre-divide by n as PyTorch DDP
        does, and start the asynchronous all-reduce (sum)."""
        p0 = bucket.params[0]
        if bucket.buffer.device != p0.device or bucket.buffer.dtype != p0.dtype:   # moved since (ddp.to(...))
            bucket.allocate()
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket.params]
        torch.cat(grads, out=bucket.buffer)                    # the bucket's gradients, flat: (numel,)
        bucket.buffer.mul_(1.0 / self.world_size)
        bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.num_all_reduces += 1
        self.bytes_all_reduced += bucket.nbytes

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients back into `.grad`.
        Call after backward and before the optimizer step; inside `no_sync()` it does nothing."""
        if not self.require_sync:
            return
        for bucket in self.buckets:
            if bucket.work is None:               # some gradients never arrived (unused parameters)
                self._launch(bucket)
            bucket.work.wait()
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
            torch._foreach_copy_([p.grad for p in bucket.params], bucket.views)   # one call, not one per param
            bucket.work, bucket.ready = None, 0

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context only accumulate local gradients (no communication);
        the first backward outside it all-reduces the accumulated sum (gradient accumulation)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def remove(self) -> None:
        """Remove the hooks: the model is a plain model again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def extra_repr(self) -> str:
        """The first line of ``repr(ddp)``, above the wrapped ``(module)``: the buckets, the cap, the world size."""
        sizes = ", ".join(f"{b.nbytes / 2**20:.2f}" for b in self.buckets)
        return f"{len(self.buckets)} buckets of [{sizes}] MB, cap {self.bucket_cap_mb} MB, world size {self.world_size}"


def apply_ddp(model: nn.Module, group=None, bucket_cap_mb: float = 25.0,
              first_bucket_cap_mb: float | None = None) -> BucketedDDP:
    """Make `model` data parallel over `group`: broadcast rank 0's weights, register the bucket hooks.
    Returns the `BucketedDDP` module wrapping `model` (call `finish_gradient_synchronization()` before each step)."""
    return BucketedDDP(model, group=group, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
