"""The experiments of lesson 05 (ZeRO and sharded data parallelism), as functions that run on every rank.

One training loop, `rank_train`, runs every variant on the same data so that tests, the lesson and the
benchmark compare like with like:

    'ddp'            PyTorch DistributedDataParallel + AdamW (the reference of every rank)
    'zero1/2/3'      the course's `ZeroOptimizer` (course_lib/parallel/zero.py)
    'fsdp2'          PyTorch FSDP2, ``fully_shard`` on every block and on the model
    'ds0' .. 'ds3'   DeepSpeed ZeRO stage 0-3 (``deepspeed.initialize``), fp32; 'ds2-offload', 'ds3-offload'
                     move the optimizer state (and for stage 3 the parameters) to CPU memory; 'ds2-bf16' is
                     ZeRO-2 in bf16 mixed precision (what DeepSpeed supports on a CPU; fp16 needs a GPU)

Each returns the global loss per step, the parameters after the last step, the model-state bytes this rank
holds (counted from tensors on CPU, the allocator on CUDA), the median step time and the collective bytes.
Functions named ``rank_*`` run inside `course_lib.launch.run`; the others in a single process.
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.measure import _unique_bytes, synchronize
from course_lib.model import build_model
from course_lib.parallel.ddp_experiments import make_batches, params_of, shard, small_config
from course_lib.parallel.zero import ZeroOptimizer

__all__ = ["small_config", "make_batches", "train_reference", "rank_train", "live_tensor_bytes",
           "import_deepspeed", "deepspeed_config", "MODES"]

MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "ds0", "ds1", "ds2", "ds3", "ds2-offload", "ds3-offload",
         "ds2-bf16", "zero1-bf16", "zero2-bf16", "zero3-bf16")
LR = 1e-2


def train_reference(cfg, batches, lr: float = LR, seed: int = 0, optimizer: str = "adamw") -> dict:
    """One process, AdamW (or SGD) on the whole global batch: what every variant must reproduce."""
    model = build_model(cfg, seed)
    opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer](model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": params_of(model)}


def live_tensor_bytes(device: torch.device | None = None) -> int:
    """Bytes of every tensor alive in this process (storages deduplicated; CUDA: allocated bytes).
    The one measurement that treats every library alike: whatever it keeps, it keeps in tensors."""
    device = device or cdist.device()
    if device.type == "cuda":
        synchronize(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    seen: set = set()
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                tensors.append(obj.to_local() if hasattr(obj, "to_local") else obj)
        except Exception:  # noqa: BLE001 - objects half torn down by gc
            continue
    return _unique_bytes(tensors, seen)


def import_deepspeed():
    """Import DeepSpeed for this machine: the CPU accelerator when there is no GPU, and no compiled ops.

    On CPU DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce kernel with ninja
    (minutes, and a compiler the learner may not have); the course uses plain torch.distributed (gloo)
    instead, so that build is switched off here. The optimizer is torch's AdamW, never DeepSpeed's compiled
    CPUAdam."""
    if not cdist.is_cuda():                           # gloo ranks compute on the CPU, even on a GPU machine
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # (deepspeed.comm.torch is torch itself)
    return deepspeed


def deepspeed_config(stage: int, micro_batch: int, offload: bool = False, precision: str = "fp32",
                     bucket_numel: int = 2 ** 16) -> dict:
    """A DeepSpeed config in the syllabus's style: ZeRO stage, optional CPU offload, precision.

    precision: 'fp32', 'bf16' or 'fp16' (fp16 needs a GPU: DeepSpeed's CPU accelerator refuses it).
    Two settings differ from DeepSpeed's defaults, so that it trains exactly what the others train:
    ``gradient_clipping`` 0 (DeepSpeed 0.19 clips the global gradient norm at 1.0 unless told otherwise)
    and ``stage3_param_persistence_threshold`` 0 (by default parameters under 1e5 elements are not
    partitioned at all). Bucket sizes (elements) are ``bucket_numel`` instead of 5e8: DeepSpeed allocates
    its stage-3 buffers at that size, 2 GB in fp32, whatever the model."""
    if precision == "fp16" and not torch.cuda.is_available():
        raise ValueError("fp16 is refused by DeepSpeed on CPU ('Type fp16 is not supported on your device'): "
                         "use precision='bf16' or 'fp32' here, fp16 on a GPU")
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket_numel, "allgather_bucket_size": bucket_numel}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_numel, stage3_param_persistence_threshold=0,
                    stage3_max_live_parameters=bucket_numel, stage3_max_reuse_distance=bucket_numel)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,     # torch AdamW with offload: no compiled CPUAdam
        "steps_per_print": 10 ** 9,
    }


def _global_mean(loss: torch.Tensor, group=None) -> float:
    t = loss.detach().float().clone()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _fsdp2_state_bytes(model: nn.Module, opt) -> dict:
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    seen: set = set()
    params = list(model.parameters())
    p = _unique_bytes([local(q) for q in params], seen)
    g = _unique_bytes([local(q.grad) for q in params if q.grad is not None], seen)
    o = sum(_unique_bytes([local(v)], seen) for s in opt.state.values() for v in s.values()
            if isinstance(v, torch.Tensor))
    return dict(params=p, grads=g, optimizer=o, total=p + g + o)


def rank_train(cfg, batches, mode: str = "zero1", lr: float = LR, seed: int = 0, group=None,
               zero_kwargs: dict | None = None, full_params: bool = True, optimizer: str = "adamw",
               zero_cls=None, measure_live: bool = True) -> dict:
    """Train `mode` on this rank's rows of every global batch with AdamW(lr). See the module docstring.

    optimizer='sgd' uses plain SGD: a doubled gradient doubles its step, while Adam's step barely changes
    (m / sqrt(v) does not depend on the gradient's scale), so tests of gradient averaging use SGD.
    zero_cls replaces `ZeroOptimizer` (a test's broken variant, an exercise's own class).
    measure_live=False skips `live_tensor_bytes` (a walk over every Python object: about 0.3 s on a CPU).

    Returns {'losses', 'params' (full, after the last step; None when full_params=False), 'state' (model-state
    bytes: params/grads/optimizer/total, measured after the last backward, before its step),
    'live_bytes' (every live tensor minus the bytes alive before the model was built), 'step_s' (median,
    first step excluded), 'comm' (payload bytes per collective, own ZeRO only), 'padded_numel', 'mode'}.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(MODES)}")
    r, n = dist.get_rank(group), dist.get_world_size(group)
    dev = cdist.device()
    opt_cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    batches = [(x, y) for x, y in batches]
    base = live_tensor_bytes(dev) if measure_live else 0
    model = build_model(cfg, seed).to(dev)
    if mode.startswith("zero") and mode.endswith("bf16"):   # own ZeRO in mixed precision: a bf16 model
        model = model.to(torch.bfloat16)
    zero = engine = opt = None
    if mode == "ddp":
        net = nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = opt_cls(model.parameters(), lr=lr)
        fwd = lambda x, y: _ddp_loss(net, x, y)  # noqa: E731
    elif mode.startswith("zero"):
        zero = (zero_cls or ZeroOptimizer)(model, opt_cls, int(mode[4]), group, lr=lr, **(zero_kwargs or {}))
        fwd = model.loss
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(dev.type, (n,)) if group is None else DeviceMesh.from_group(group, dev.type)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = opt_cls(model.parameters(), lr=lr)
        fwd = model.loss
    else:
        deepspeed = import_deepspeed()
        stage = int(mode[2])
        conf = deepspeed_config(stage, batches[0][0].shape[0] // n, offload=mode.endswith("offload"),
                                precision="bf16" if mode.endswith("bf16") else "fp32")
        opt = opt_cls(model.parameters(), lr=lr)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
        fwd = engine.module.loss
    losses, times, state = [], [], None
    for step, (x, y) in enumerate(batches):
        x, y = shard(x, r, n).to(dev), shard(y, r, n).to(dev)
        synchronize(dev)
        t0 = time.perf_counter()
        loss = fwd(x, y)
        (engine.backward if engine is not None else torch.Tensor.backward)(loss)
        if step == len(batches) - 1:                   # the peak of model state: gradients and optimizer state
            synchronize(dev)
            t_pause = time.perf_counter()
            state = _state_bytes(mode, model, zero, opt, engine)
            live = live_tensor_bytes(dev) - base if measure_live else None
            t0 += time.perf_counter() - t_pause         # measuring is not part of the step
        (engine or zero or opt).step()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
        if engine is None:
            zero.zero_grad() if zero is not None else opt.zero_grad(set_to_none=True)
        losses.append(_global_mean(loss, group))
    params = None
    if full_params:
        if zero is not None:
            params = {k: v.cpu() for k, v in zero.full_parameters().items()}
        elif mode == "fsdp2":
            params = {k: v.full_tensor().detach().cpu().clone() for k, v in model.named_parameters()}
        elif engine is not None and int(mode[2]) == 3:
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters
            with GatheredParameters(list(model.parameters())):
                params = params_of(model)
        else:
            params = params_of(model)
    return {"mode": mode, "losses": losses, "params": params, "state": state, "live_bytes": live,
            "step_s": statistics.median(times[1:] or times), "times": times,
            "comm": dict(zero.bytes) if zero is not None else None,
            "calls": dict(zero.calls) if zero is not None else None,
            "padded_numel": zero.padded_numel() if zero is not None else None,
            "world_size": n, "backend": cdist.backend()}


def _ddp_loss(net, x, y):
    logits = net(x)                                                       # (B, T, V) through DDP's hooks
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())   # as GPT.loss


def _state_bytes(mode, model, zero, opt, engine) -> dict:
    from course_lib.measure import model_state_bytes
    if zero is not None:
        return zero.state_bytes()
    if mode == "fsdp2":
        return _fsdp2_state_bytes(model, opt)
    if engine is None:
        s = model_state_bytes(model, opt)
        return {k: s[k] for k in ("params", "grads", "optimizer", "total")}
    return None                                         # DeepSpeed: only the live-tensor measurement
