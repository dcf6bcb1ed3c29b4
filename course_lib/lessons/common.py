"""What several lessons share: small models, a rank's rows of a batch, one-process references, snapshots and
errors, and one training loop over the data-parallel and sharded variants of lessons 05-07.

Lesson 02 introduced most of it (a small GPT that trains in milliseconds, the global batch split by rows, the
single process that every parallel run must reproduce); lesson 05 the variants (PyTorch DDP, the course's
ZeRO-1/2/3, FSDP2, DeepSpeed). Data comes from `course_lib.data.random_batches`.

    cfg = small_config(n_head=4)
    batches = random_batches(cfg, global_batch=8, steps=3)
    ref = train_reference(cfg, batches, optimizer="sgd", lr=0.1)          # one process
    out = run(train_variant, 2, args=(cfg, batches, "zero2")).value      # two ranks
    relative_error(out["params"], ref["params"])
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.dist import pick_backend
from course_lib.measure import cpu_features, live_tensor_bytes, model_state_bytes, synchronize
from course_lib.model import build_model, lm_loss
from course_lib.parallel.zero import ZeroOptimizer

__all__ = ["COLORS", "plain_log_ticks",
           "small_config", "on_gpus", "by_device", "shard_batch", "params_of", "grads_of", "train_reference",
           "global_mean", "relative_error", "max_relative_error", "max_abs_error", "Variant", "VARIANTS",
           "import_deepspeed", "deepspeed_accepts_fp16", "deepspeed_config", "train_variant", "show", "source_lines",
           "after_prediction"]

# One colour per part of memory and of a step's time, in every lesson's figures.
COLORS = dict(params="#4C72B0", grads="#DD8452", optimizer="#55A868", master="#8172B3", activations="#C44E52",
              compute="#4C72B0", communication="#DD8452", overlap="#8172B3", idle="#BBBBBB")


# ----------------------------------------------------------------------------- reading the course's code

def source_lines(obj, start: str | None = None, end: str | None = None, docstring: bool = False) -> str:
    """The source of a function, method or class, dedented: from the first line that contains ``start`` to the
    first later line that contains ``end`` (both included; None: the whole definition), with the docstring left
    out unless ``docstring``. Raises ValueError naming the marker that is not in the source."""
    src = textwrap.dedent(inspect.getsource(obj))
    if not docstring:
        doc = inspect.getdoc(obj)
        body = _docstring_span(src) if doc else None
        if body:
            src = src[:body[0]] + src[body[1]:]
    lines = src.splitlines()
    first = 0 if start is None else next((i for i, ln in enumerate(lines) if start in ln), None)
    if first is None:
        raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)}")
    last = len(lines) - 1 if end is None else next((i for i in range(first, len(lines)) if end in lines[i]), None)
    if last is None:
        raise ValueError(f"{end!r} is not in the source of {getattr(obj, '__qualname__', obj)} after {start!r}")
    return textwrap.dedent("\n".join(lines[first:last + 1]))


def _docstring_span(src: str) -> tuple[int, int] | None:
    """Character span of the first definition's docstring line(s) in ``src`` (with their newline), or None."""
    import ast

    tree = ast.parse(src)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
        return None
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return None
    offsets = [0]
    for line in src.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    return offsets[first.lineno - 1], offsets[first.end_lineno]


def after_prediction(prediction, compare) -> bool:
    """Run ``compare()`` (the lines that read a measurement against the learner's prediction) only once there is a
    prediction: every lesson's predictions start as None, and until one is written the cell says so instead of
    giving the reading away. A dict of predictions counts as written when none of its values is None."""
    values = prediction.values() if isinstance(prediction, dict) else [prediction]
    if any(v is None for v in values):
        print("-> write your prediction in the cell above (it is still None), then run this cell again: the "
              "comparison with the measurement appears then")
        return False
    compare()
    return True


def show(obj, start: str | None = None, end: str | None = None, docstring: bool = False):
    """Show the course's own code in a lesson, highlighted: ``show(ZeroOptimizer._make_grad_hook)``, or the lines
    of ``obj`` from ``start`` to ``end`` (see :func:`source_lines`). The title line names the file and the line, so
    the learner can open the whole of it. Returns an ``IPython.display.Code`` (plain text outside a notebook)."""
    from IPython.display import Code

    plain = inspect.unwrap(obj)                 # a decorated function (@torch.no_grad()): the function itself
    path = inspect.getsourcefile(plain) or "?"
    line = inspect.getsourcelines(plain)[1]
    where = path[path.rfind("course_lib"):] if "course_lib" in path else path
    title = f"# {where}, line {line}: {getattr(obj, '__qualname__', obj)}"
    return Code(title + "\n" + source_lines(obj, start, end, docstring), language="python")


# ----------------------------------------------------------------------------- models, batches, references

def small_config(**overrides) -> ModelConfig:
    """The 'tiny' preset made smaller still (vocabulary 64, T 16, 2 layers, 2 heads, d_model 32), so that a few
    training steps take milliseconds on a CPU; ``overrides`` change any field (lessons 02-07)."""
    base = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, name="small")
    base.update(overrides)
    return ModelConfig(**base)


def shard_batch(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s rows of a global batch: (B, ...) -> (B/world, ...). B must divide evenly (lesson 02)."""
    if t.shape[0] % world:
        raise ValueError(f"global batch {t.shape[0]} does not split evenly over {world} ranks: "
                         f"use a multiple of {world}")
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: a CPU copy of the parameter}: a snapshot that later steps do not change."""
    return {k: p.detach().clone().cpu() for k, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: a CPU copy of the gradient} of every parameter that has one."""
    return {k: p.grad.detach().clone().cpu() for k, p in model.named_parameters() if p.grad is not None}


def train_reference(cfg: ModelConfig, batches, optimizer: str | None = "sgd", lr: float = 0.1, seed: int = 0,
                    device: torch.device | str = "cpu") -> dict:
    """One process on the whole global batch: what every parallel run must reproduce.

    optimizer: 'sgd', 'adamw' or None (forward and backward only: gradients accumulate over the batches).
    Returns {'losses': [...], 'params' (after the last step), 'grads' (of the last batch), 'first_grads' (of
    the first), 'logits' (of the last batch)}."""
    model = build_model(cfg, seed).to(device)
    opt = None
    if optimizer is not None:
        opt = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](model.parameters(), lr=lr)
    losses, grads, first_grads, logits = [], None, None, None
    for x, y in batches:
        logits = model(x.to(device))                                   # (B, T, V)
        loss = lm_loss(logits, y.to(device))
        loss.backward()
        grads = grads_of(model)
        first_grads = first_grads or grads
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": params_of(model), "grads": grads, "first_grads": first_grads,
            "logits": logits.detach() if logits is not None else None}


def global_mean(value: torch.Tensor, group=None) -> float:
    """The mean over the ranks of `group` of a scalar (a rank's loss on its rows): the loss of the global batch
    when every rank has as many rows."""
    t = value.detach().float().clone()
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def on_gpus(nprocs: int = 1) -> bool:
    """Whether `nprocs` ranks get one GPU each on this machine (`course_lib.dist.pick_backend`)."""
    return pick_backend(nprocs, announce=False) == "nccl"


def quick_run() -> bool:
    """Whether this kernel runs the reduced CPU sizes (``COURSE_QUICK=1``: ``course lab-report --quick`` and CI)."""
    return os.environ.get("COURSE_QUICK", "") == "1"


def by_device(cpu, gpu, nprocs: int = 1, quick=None):
    """``gpu`` when `nprocs` ranks get a GPU each here, else ``cpu``. Every experiment has a CPU size (a lesson runs in
    minutes on a 2-core laptop) and a GPU size (large enough that the GPU computes instead of waiting for kernel
    launches: GPT-2 124M where memory allows); the lesson prints which ran. ``quick``: a smaller CPU size for
    ``course lab-report --quick`` (the whole course in minutes, to check that it runs); GPUs keep their size."""
    if on_gpus(nprocs):
        return gpu
    return quick if quick is not None and quick_run() else cpu


def sizes_label(nprocs: int = 1) -> str:
    """Which sizes `by_device` picks here: ``GPU sizes``, ``CPU sizes`` or ``quick CPU sizes``."""
    return "GPU sizes" if on_gpus(nprocs) else "quick CPU sizes" if quick_run() else "CPU sizes"


# ----------------------------------------------------------------------------- errors between two runs

def _flat(d: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for _, v in sorted(d.items())])


def relative_error(actual, expected) -> float:
    """||a - e|| / ||e|| of two tensors, or over all tensors of two {name: tensor} dicts together (one number a
    message can show). inf when `actual` is None or the shapes / names differ."""
    if isinstance(expected, dict):
        if actual is None or set(actual) != set(expected):
            return float("inf")
        actual, expected = _flat(actual), _flat(expected)
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def max_relative_error(actual: dict, expected: dict) -> float:
    """The largest `relative_error` of one tensor over two {name: tensor} dicts (inf when the names differ)."""
    if set(actual) != set(expected):
        return float("inf")
    return max(relative_error(actual[k], expected[k]) for k in expected)


def max_abs_error(actual, expected) -> float:
    """Largest |a - e| over two lists (or dicts) of tensors; inf if a shape differs or anything is inf/nan."""
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            return float("inf")
        actual, expected = [actual[k] for k in expected], list(expected.values())
    errs = [(a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
            for a, b in zip(actual, expected)]
    return max((e if e == e else float("inf") for e in errs), default=0.0)


def plain_log_ticks(ax, which: str = "xy") -> None:
    """Log-scale tick labels as plain numbers (1, 2, 5, 10, 20, ...) instead of matplotlib's mathtext $10^{x}$: a
    figure redrawn by an ipywidget in JupyterLab has failed to parse its own mathtext tick labels (pyparsing's
    ``ParseException: exception raised in parse action``; lessons 08 and 09, in the browser test)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axis in [a for name, a in (("x", ax.xaxis), ("y", ax.yaxis)) if name in which]:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


# ----------------------------------------------------------------------------- variants of sharded training

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


def deepspeed_accepts_fp16() -> bool:
    """Whether DeepSpeed trains with ``"fp16"`` here: on a GPU, or on a CPU with native fp16 kernels (its CPU
    accelerator asks `torch.ops.mkldnn._is_mkldnn_fp16_supported`, as `course_lib.measure.cpu_features` does)."""
    return torch.cuda.is_available() or cpu_features()["fp16"]


def deepspeed_config(stage: int, micro_batch: int, offload: bool = False, precision: str = "fp32",
                     bucket_numel: int = 2 ** 16) -> dict:
    """A DeepSpeed config in the syllabus's style: ZeRO stage, optional CPU offload, precision.

    precision: 'fp32', 'bf16' or 'fp16'. fp16 needs a GPU or a CPU with native fp16 kernels (AVX512-FP16 / AMX-FP16:
    `course_lib.measure.cpu_features`); elsewhere DeepSpeed's CPU accelerator refuses it, and so does this function.
    Two settings differ from DeepSpeed's defaults, so that it trains exactly what the others train:
    ``gradient_clipping`` 0 (DeepSpeed 0.19 clips the global gradient norm at 1.0 unless told otherwise)
    and ``stage3_param_persistence_threshold`` 0 (by default parameters under 1e5 elements are not
    partitioned at all). Bucket sizes (elements) are ``bucket_numel`` instead of 5e8: DeepSpeed allocates
    its stage-3 buffers at that size, 2 GB in fp32, whatever the model."""
    if precision == "fp16" and not deepspeed_accepts_fp16():
        raise ValueError("fp16 is refused by DeepSpeed on this CPU, which has no native fp16 kernels ('Type fp16 is "
                         "not supported on your device'): use precision='bf16' or 'fp32' here, fp16 on a GPU")
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
    """Model-state bytes {params, grads, optimizer, total} (`measure.model_state_bytes`; FSDP2: local shards)."""
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
    for DeepSpeed), 'live_bytes' (every live tensor minus the bytes alive before the model was built),
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
    base = live_tensor_bytes(dev) if measure_live else 0
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
            live = live_tensor_bytes(dev) - base if measure_live else None
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
