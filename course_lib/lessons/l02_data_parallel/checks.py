"""What the graded exercises of lesson 02 call (solutions/02_data_parallel.ipynb): a rank-side harness.

The test cells run these functions on gloo ranks with `launch.run`, passing the learner's function, and
compare what comes back with a single-process reference. Two instruments make wrong answers visible:

* `count_p2p_bytes()`: counts the bytes a rank hands to ``send``/``isend``/``batch_isend_irecv``, notes the peer
  of every send and receive, and refuses collectives (a ring all-reduce must be built from point-to-point messages);
* `deferred_all_reduce()`: an asynchronous ``dist.all_reduce`` only reduces when its handle is waited on,
  so a DDP that forgets ``wait()`` gets un-reduced gradients every time, not just when it loses a race; it also
  counts the all-reduces started after backward and the handles waited on during it (either one loses the overlap).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.measure.collective_counter import COUNTED_COLLECTIVES
from course_lib.lessons.l02_data_parallel.experiments import rank_train
from course_lib.model import build_model
from course_lib.parallel.ddp import BucketedDDP, make_buckets

__all__ = ["scale_vs", "count_p2p_bytes", "deferred_all_reduce", "tracking_backward", "rank_try_ring",
           "rank_try_ddp_class", "rank_try_accumulation", "expected_buckets"]

_COLLECTIVES = (*COUNTED_COLLECTIVES, "reduce", "all_to_all", "gather", "scatter")


_BACKWARDS_RUNNING = [0]      # backward passes started through torch.autograd.backward and not yet returned


def _in_backward() -> bool:
    """True while a backward pass started under `tracking_backward` runs (its gradient hooks included, on any
    thread autograd runs them on)."""
    return _BACKWARDS_RUNNING[0] > 0


@contextlib.contextmanager
def tracking_backward():
    """Make `_in_backward` see every backward pass: ``torch.autograd.backward`` is wrapped so that a counter is
    up from its call to its return. ``Tensor.backward`` calls it by that name (torch 2.14.1, _tensor.py:
    ``torch.autograd.backward(``), so ``loss.backward()`` is seen too; nothing private of autograd's engine is
    read."""
    real = torch.autograd.backward

    def backward(*args, **kwargs):
        _BACKWARDS_RUNNING[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _BACKWARDS_RUNNING[0] -= 1

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = real


def scale_vs(actual: dict, expected: dict) -> float:
    """The best factor s with actual ~ s x expected: 2.00 for a sum over 2 ranks instead of the mean."""
    if actual is None or set(actual) != set(expected):
        return float("nan")
    a, e = (torch.cat([d[k].reshape(-1).double() for k in sorted(expected)]) for d in (actual, expected))
    return float(a @ e / (e @ e))


@contextlib.contextmanager
def count_p2p_bytes():
    """Count bytes sent with send/isend (batch_isend_irecv included) and the peers of every send and receive;
    any collective raises. Yields a dict {'bytes_sent', 'sent_to', 'received_from'}."""
    from torch.distributed import distributed_c10d as c10d

    stats = {"bytes_sent": 0, "sent_to": set(), "received_from": set()}     # peers as ranks of the message's group
    real = {"send": c10d.send, "isend": c10d.isend, "recv": c10d.recv, "irecv": c10d.irecv}

    def peer(a, k, key):                # (dst or src, group, tag, group_dst or group_src), positional or not
        group = a[1] if len(a) > 1 else k.get("group")
        local = k.get(f"group_{key}", a[3] if len(a) > 3 else None)
        if local is not None:
            return local
        glob = a[0] if a else k.get(key)
        return glob if group is None or glob is None else dist.get_group_rank(group, glob)

    def counting(name):
        def fn(tensor, *a, **k):
            if name in ("send", "isend"):
                stats["bytes_sent"] += tensor.numel() * tensor.element_size()
                stats["sent_to"].add(peer(a, k, "dst"))
            else:
                stats["received_from"].add(peer(a, k, "src"))
            return real[name](tensor, *a, **k)
        return fn
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def refuse(name):
        def fn(*a, **k):
            raise RuntimeError(f"ring_all_reduce called dist.{name}: build it from send/recv (isend/irecv) only")
        return fn

    patched = {name: counting(name) for name in real}
    for mod in (dist, c10d):            # c10d too: batch_isend_irecv checks P2POp.op against c10d.isend
        for name, fn in patched.items():
            setattr(mod, name, fn)
    for name in _COLLECTIVES:
        setattr(dist, name, refuse(name))
    try:
        yield stats
    finally:
        for mod in (dist, c10d):
            for name, fn in real.items():
                setattr(mod, name, fn)
        for name, fn in saved.items():
            setattr(dist, name, fn)


def rank_try_ring(ring_fn, sizes, n_list=(None,)) -> list[dict]:
    """Run ``ring_fn(tensor, group)`` on integer-valued tensors (sums are exact) for every size in `sizes`
    and every group size in `n_list` (None: all ranks; k: ranks 0..k-1). Returns one record per call:
    world size, numel, whether the result equals dist.all_reduce's, bytes sent, whether every message went to the
    next rank and came from the previous one, and an error if any."""
    r, dev = dist.get_rank(), cdist.device()
    groups = {k: (None if k is None else dist.new_group(list(range(k)))) for k in n_list}  # all ranks create
    out = []
    for k, group in groups.items():
        n = dist.get_world_size() if k is None else k
        if r >= n:
            continue
        for numel in sizes:
            shape = (numel,) if numel % 3 or numel == 0 else (3, numel // 3)
            t = (torch.arange(numel, dtype=torch.float32, device=dev).reshape(shape) % 97) * (r + 1) + r
            expected = t.clone()
            dist.all_reduce(expected, group=group)
            rec = {"world_size": n, "numel": numel, "rank": dist.get_rank(group), "error": None}
            try:
                with count_p2p_bytes() as stats:
                    result = ring_fn(t, group)
                rec["bytes_sent"] = stats["bytes_sent"]
                me = dist.get_rank(group)          # the ring's rules: send to r+1 only, receive from r-1 only
                rec["neighbours_only"] = (stats["sent_to"] <= {(me + 1) % n}
                                          and stats["received_from"] <= {(me - 1) % n})
                rec["correct"] = bool(torch.equal(t, expected))
                rec["returned_tensor"] = result is t or (isinstance(result, torch.Tensor) and torch.equal(result, t))
                rec["max_error"] = float((t - expected).abs().max()) if numel else 0.0
            except Exception as exc:  # noqa: BLE001 - reported to the test cell
                rec["error"] = f"{type(exc).__name__}: {exc}"
                return out + [rec]        # the ring is broken: stop before the next call hangs
            out.append(rec)
    return out


class _DeferredWork:
    def __init__(self, real_all_reduce, tensor, kwargs, stats):
        self._fn, self._tensor, self._kwargs, self._done = real_all_reduce, tensor, kwargs, False
        self._stats = stats

    def wait(self, *a, **k):
        if _in_backward():
            self._stats["waited_in_backward"] += 1
        if not self._done:
            self._fn(self._tensor, **self._kwargs)
            self._done = True
        return True

    def is_completed(self):
        return self._done


@contextlib.contextmanager
def deferred_all_reduce():
    """Make ``dist.all_reduce(..., async_op=True)`` reduce only when the handle is waited on; count the
    asynchronous and synchronous calls, the asynchronous ones started outside backward (they overlap nothing)
    and the waits during backward (a hook that waits blocks backward). Yields a dict {'async_calls',
    'sync_calls', 'started_outside_backward', 'waited_in_backward'}."""
    stats = {"async_calls": 0, "sync_calls": 0, "started_outside_backward": 0, "waited_in_backward": 0}
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            stats["async_calls"] += 1
            stats["started_outside_backward"] += not _in_backward()
            return _DeferredWork(real, tensor, {"op": op, "group": group}, stats)
        stats["sync_calls"] += 1
        return real(tensor, op=op, group=group)

    dist.all_reduce = all_reduce
    try:
        with tracking_backward():
            yield stats
    finally:
        dist.all_reduce = real


def expected_buckets(cfg, bucket_cap_mb: float) -> int:
    """How many buckets `make_buckets` (and `BucketedDDP` without a first-bucket cap) makes for a model of
    `cfg` with this cap."""
    params = list(build_model(cfg).parameters())
    return len(make_buckets(list(reversed(params)), bucket_cap_mb * 2**20))


def rank_try_ddp_class(ddp_cls, cfg, batches, bucket_cap_mb: float) -> dict:
    """Train with the learner's DDP class twice: with the real asynchronous all-reduce, and with
    `deferred_all_reduce` (a missing wait then always shows). Returns both results and the counts of the
    deferred run (`deferred_all_reduce`'s); the loss all-reduce of `rank_train` (synchronous, one per step) is
    included in 'sync_calls'."""
    real = rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=bucket_cap_mb, ddp_cls=ddp_cls)
    with deferred_all_reduce() as stats:
        deferred = rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=bucket_cap_mb, ddp_cls=ddp_cls)
    return {"real": real, "deferred": deferred, **stats}


class _LaunchProbe(BucketedDDP):
    """The course's BucketedDDP, counting the bucket all-reduces launched outside backward: those that
    `finish_gradient_synchronization` starts because no synchronised backward's hooks did."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launched_outside_backward = 0

    def _launch(self, bucket) -> None:
        self.launched_outside_backward += not _in_backward()
        super()._launch(bucket)


def rank_try_accumulation(accum_fn, cfg, batches, bucket_cap_mb: float, accum_steps: int) -> dict:
    """`rank_train` with gradient accumulation by the learner's ``accum_fn(ddp, model, optimizer, micro_batches)``
    on the course's BucketedDDP; adds 'launched_outside_backward': bucket all-reduces that no backward's hooks
    started (the last micro-batch's backward ran inside ``no_sync`` too, so nothing overlapped it). The loss
    ``accum_fn`` returns may be a float or a 0-d tensor, as the exercise allows."""
    probes = []

    def probed(*args, **kwargs):
        probes.append(_LaunchProbe(*args, **kwargs))
        return probes[-1]

    def step(*args):
        loss = accum_fn(*args)
        return loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss), device=cdist.device())

    with tracking_backward():
        out = rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=bucket_cap_mb, accum_steps=accum_steps,
                         accum_fn=step, ddp_cls=probed)
    out["launched_outside_backward"] = sum(p.launched_outside_backward for p in probes)
    return out
