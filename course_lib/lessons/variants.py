"""One training loop over the data-parallel and sharded variants of lessons 05-07: PyTorch DDP, the course's
ZeRO-1/2/3 (`course_lib.parallel.zero`), FSDP2 and DeepSpeed (`course_lib.parallel.deepspeed_config`), each a `Variant`
of `VARIANTS`, all trained by `train_variant` on every rank and compared with `course_lib.one_process.train_reference`.

    cfg = small_config(n_head=4)
    batches = random_batches(cfg, global_batch=8, steps=3)
    ref = train_reference(cfg, batches, optimizer="adamw", lr=LR)         # one process
    out = run(train_variant, 2, args=(cfg, batches, "zero2")).value      # two ranks
    relative_error(out["params"], ref["params"])
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.data import shard_batch
from course_lib.dist import global_mean
from course_lib.measure.speed import synchronize
from course_lib.measure.memory_stats import LiveTensors, live_tensor_bytes, model_state_bytes
from course_lib.model import build_model, lm_loss
from course_lib.one_process import params_of
from course_lib.parallel.deepspeed_config import deepspeed_config, import_deepspeed
from course_lib.parallel.zero import ZeroOptimizer

__all__ = ["Variant", "VARIANTS", "LR", "train_variant"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to train a model data-parallel (lessons 05-07): who implements it ('ddp': PyTorch DDP, 'own': the
    course's `ZeroOptimizer`, 'fsdp2': PyTorch ``fully_shard``, 'deepspeed': ``deepspeed.initialize``), which
    ZeRO stage, whether the optimizer state (and, at stage 3, the parameters) live in CPU memory, and whether it
    trains in bf16 mixed precision. `VARIANTS` names the ones the lessons run."""

    impl: str
    stage: int = 0
    offload: bool = False
    bf16: bool = False
    label: str = ""


VARIANTS: dict[str, Variant] = {
    "ddp": Variant("ddp", 0, label="PyTorch DDP"),
    "zero1": Variant("own", 1, label="own ZeRO-1"),
    "zero2": Variant("own", 2, label="own ZeRO-2"),
    "zero3": Variant("own", 3, label="own ZeRO-3"),
    "fsdp2": Variant("fsdp2", 3, label="FSDP2 fully_shard"),
    "ds0": Variant("deepspeed", 0, label="DeepSpeed stage 0"),
    "ds1": Variant("deepspeed", 1, label="DeepSpeed ZeRO-1"),
    "ds2": Variant("deepspeed", 2, label="DeepSpeed ZeRO-2"),
    "ds3": Variant("deepspeed", 3, label="DeepSpeed ZeRO-3"),
    "ds2-offload": Variant("deepspeed", 2, offload=True, label="DeepSpeed ZeRO-2 + offload"),
    "ds3-offload": Variant("deepspeed", 3, offload=True, label="DeepSpeed ZeRO-3 + offload"),
    "ds2-bf16": Variant("deepspeed", 2, bf16=True, label="DeepSpeed ZeRO-2 bf16"),
    "zero1-bf16": Variant("own", 1, bf16=True, label="own ZeRO-1 bf16"),
    "zero2-bf16": Variant("own", 2, bf16=True, label="own ZeRO-2 bf16"),
    "zero3-bf16": Variant("own", 3, bf16=True, label="own ZeRO-3 bf16"),
}
LR = 1e-2


@dataclasses.dataclass
class _Trainer:
    """What the training loop of `train_variant` needs from a variant."""

    loss: Callable                     # (x, y) -> loss on this rank's rows
    step: Callable                     # the optimizer step
    zero_grad: Callable
    state: Callable                    # -> model-state bytes {params, grads, optimizer, total}, or None
    full_params: Callable              # -> {name: full parameter on the CPU}
    backward: Callable = torch.Tensor.backward
    zero: ZeroOptimizer | None = None


def _state_of(model: nn.Module, opt) -> dict:
    """Model-state bytes {params, grads, optimizer, total} (`memory_stats.model_state_bytes`; FSDP2: local shards)."""
    return {k: v for k, v in model_state_bytes(model, opt).items() if k != "optimizer_scalars"}


def _ddp(model, variant, opt_cls, lr, group, **_) -> _Trainer:
    net = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = opt_cls(model.parameters(), lr=lr)
    return _Trainer(loss=lambda x, y: lm_loss(net(x), y), step=opt.step,       # through DDP's hooks
                    zero_grad=lambda: opt.zero_grad(set_to_none=True),
                    state=lambda: _state_of(model, opt),
                    full_params=lambda: params_of(model))


def _own_zero(model, variant, opt_cls, lr, group, zero_kwargs=None, zero_cls=None, **_) -> _Trainer:
    if variant.bf16:                                   # own ZeRO in mixed precision: a bf16 model
        model.to(torch.bfloat16)
    zero = (zero_cls or ZeroOptimizer)(model, opt_cls, variant.stage, group, lr=lr, **(zero_kwargs or {}))
    return _Trainer(loss=model.loss, step=zero.step, zero_grad=zero.zero_grad, state=zero.state_bytes,
                    full_params=lambda: {k: v.cpu() for k, v in zero.full_parameters().items()}, zero=zero)


def _fsdp2(model, variant, opt_cls, lr, group, dev, **_) -> _Trainer:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = dist.get_world_size(group)
    mesh = init_device_mesh(dev.type, (n,)) if group is None else DeviceMesh.from_group(group, dev.type)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = opt_cls(model.parameters(), lr=lr)
    full = lambda: {k: v.full_tensor().detach().cpu().clone() for k, v in model.named_parameters()}  # noqa: E731
    return _Trainer(loss=model.loss, step=opt.step, zero_grad=lambda: opt.zero_grad(set_to_none=True),
                    state=lambda: _state_of(model, opt), full_params=full)


def _deepspeed(model, variant, opt_cls, lr, micro_batch, **_) -> _Trainer:
    deepspeed = import_deepspeed()
    conf = deepspeed_config(variant.stage, micro_batch, offload=variant.offload,
                            precision="bf16" if variant.bf16 else "fp32")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt_cls(model.parameters(), lr=lr), config=conf)

    def full_params():
        if variant.stage != 3:
            return params_of(model)
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        with GatheredParameters(list(model.parameters())):
            return params_of(model)

    return _Trainer(loss=engine.module.loss, backward=engine.backward, step=engine.step,
                    zero_grad=lambda: None,                # the engine clears its gradients in step()
                    state=lambda: None,                    # DeepSpeed: only the live-tensor measurement
                    full_params=full_params)


_BUILDERS = {"ddp": _ddp, "own": _own_zero, "fsdp2": _fsdp2, "deepspeed": _deepspeed}


def train_variant(cfg, batches, variant: str | Variant = "zero1", lr: float = LR, seed: int = 0, group=None,
                  zero_kwargs: dict | None = None, full_params: bool = True, optimizer: str = "adamw",
                  zero_cls=None, measure_live: bool = True) -> dict:
    """Runs on every rank: train `variant` (a name of `VARIANTS` or a `Variant`) on this rank's rows of every
    global batch with AdamW(lr), as lesson 05 compares them (lessons 06 and 07 reuse the DeepSpeed ones).

    optimizer='sgd' uses plain SGD: a doubled gradient doubles its step, while Adam's step barely changes
    (m / sqrt(v) does not depend on the gradient's scale), so tests of gradient averaging use SGD.
    zero_cls replaces `ZeroOptimizer` (a test's broken variant, an exercise's own class), zero_kwargs go to it.
    measure_live=False skips `live_tensor_bytes` (a walk over every Python object: about 0.3 s on a CPU).

    Returns {'variant', 'losses', 'params' (full, after the last step; None when full_params=False), 'state'
    (model-state bytes: params/grads/optimizer/total, measured after the last backward, before its step; None
    for DeepSpeed), 'live_bytes' (the storages of every live tensor created since before the model was built),
    'step_s' (median, first step excluded), 'times', 'comm' / 'calls' (payload bytes and calls per collective,
    own ZeRO only), 'padded_numel', 'world_size', 'backend'}.
    """
    name = variant if isinstance(variant, str) else variant.label
    if isinstance(variant, str):
        if variant not in VARIANTS:
            raise ValueError(f"variant={variant!r}: use one of {', '.join(VARIANTS)}")
        variant = VARIANTS[variant]
    r, n = dist.get_rank(group), dist.get_world_size(group)
    dev = cdist.device()
    opt_cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    batches = list(batches)
    base = LiveTensors(dev) if measure_live else None
    model = build_model(cfg, seed).to(dev)
    trainer = _BUILDERS[variant.impl](model, variant, opt_cls=opt_cls, lr=lr, group=group, dev=dev,
                                      zero_kwargs=zero_kwargs, zero_cls=zero_cls,
                                      micro_batch=batches[0][0].shape[0] // n)
    losses, times, state, live = [], [], None, None
    for step, (x, y) in enumerate(batches):
        x, y = shard_batch(x, r, n).to(dev), shard_batch(y, r, n).to(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        loss = trainer.loss(x, y)
        trainer.backward(loss)
        if step == len(batches) - 1:                   # the peak of model state: gradients and optimizer state
            synchronize(dev)
            t_pause = time.perf_counter()
            state = trainer.state()
            live = live_tensor_bytes(dev, since=base) if measure_live else None
            t0 += time.perf_counter() - t_pause         # measuring is not part of the step
        trainer.step()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
        trainer.zero_grad()
        losses.append(global_mean(loss, group))
    zero = trainer.zero
    return {"variant": name, "losses": losses, "params": trainer.full_params() if full_params else None,
            "state": state, "live_bytes": live, "step_s": statistics.median(times[1:] or times), "times": times,
            "comm": dict(zero.bytes) if zero is not None else None,
            "calls": dict(zero.calls) if zero is not None else None,
            "padded_numel": zero.padded_numel() if zero is not None else None,
            "world_size": n, "backend": cdist.backend()}
