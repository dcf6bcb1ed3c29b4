"""The experiments of lesson 06 (mixed precision), as plain functions (its graded exercises call `checks`).

- `scaler_trace`: drive a loss scaler (ours, the learner's or `torch.amp.GradScaler`) for N steps with injected
  inf/nan gradients; record the scale, whether the optimizer stepped and the final weights.
- `rank_scaler_agreement`: the same on every rank with rank-local gradients (as under tensor/pipeline parallelism or
  sharded gradients), overflow on one rank only: every rank must skip the same steps.
- `gradient_underflow`: a real fp16 training step of the course's GPT; share of gradient elements lost to zero.
- `autocast_dtypes`, `train_modes`, `speed_and_memory`: autocast, master weights and what low precision costs.
- `rank_deepspeed`: DeepSpeed's ``bf16`` block (and ``fp16`` where a GPU is present) next to fp32.
- `hysteresis_traces`: GradScaler's update kernel and DeepSpeed's fp16 `DynamicLossScaler` fed one overflow pattern.
Functions named ``rank_*`` run inside `course_lib.runtime.launch.run`.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.data import shard_batch
from course_lib.lessons.variants import train_variant
from course_lib.measure.speed import synchronize, time_fn
from course_lib.measure.memory_stats import SavedActivations, model_state_bytes
from course_lib.model import build_model
from course_lib.parallel.deepspeed_config import deepspeed_config, import_deepspeed
from course_lib.parallel.precision import DynamicLossScaler, MasterWeightOptimizer

__all__ = ["SCALER_KW", "overflow_steps", "inject_overflow", "scaler_trace", "rank_scaler_agreement",
           "gradient_underflow", "autocast_dtypes", "PrecisionMode", "PRECISION_MODES", "train_modes",
           "speed_and_memory", "rank_deepspeed", "hysteresis_traces"]

SCALER_KW = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=10)


def overflow_steps(steps: int = 200, seed: int = 0, rate: float = 0.08) -> dict[int, str]:
    """Steps whose gradients get an inf or nan (about `rate` of them, some back to back) -> 'inf' | 'nan'."""
    rng = random.Random(seed)
    out = {}
    for s in range(steps):
        if rng.random() < rate or (s - 1 in out and rng.random() < 0.4):
            out[s] = rng.choice(["inf", "nan", "-inf"])
    return out


def inject_overflow(params, kind: str, step: int) -> None:
    """Put an inf, -inf or nan (``kind``) into one element of one gradient, chosen by ``step``."""
    p = params[step % len(params)]
    p.grad.view(-1)[step % p.grad.numel()] = float(kind)


def scaler_trace(make_scaler, steps: int = 200, overflows: dict | None = None, seed: int = 0, lr: float = 0.1,
                 unscale_every: int = 5) -> dict:
    """Train a small fp32 MLP with SGD through `make_scaler()` (GradScaler's API: scale, unscale_, step, update,
    get_scale); inject `overflows` ({step: 'inf'|'nan'}) into one gradient after backward. Every
    `unscale_every`-th step calls ``unscale_`` before ``step``, as gradient clipping does (step must not unscale again).

    Returns {'scales': scale used at each step, 'stepped': whether optimizer.step ran, 'returned': what
    ``step`` returned, 'params': final weights}."""
    overflows = overflow_steps(steps, seed) if overflows is None else overflows
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    calls = []
    inner = opt.step
    opt.step = lambda *a, **k: (calls.append(True), inner(*a, **k))[1]     # count the steps really taken
    scaler = make_scaler()
    params = list(model.parameters())
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    scales, stepped, returned = [], [], []
    for s in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        scales.append(float(scaler.get_scale()))
        scaler.scale(loss).backward()
        if s in overflows:
            inject_overflow(params, overflows[s], s)
        n = len(calls)
        if unscale_every and s % unscale_every == unscale_every - 1:
            scaler.unscale_(opt)
        returned.append(scaler.step(opt))
        scaler.update()
        stepped.append(len(calls) > n)
        opt.zero_grad(set_to_none=True)
    return {"scales": scales, "stepped": stepped, "returned": returned,
            "params": [p.detach().clone() for p in params]}


def rank_scaler_agreement(make_scaler, steps: int = 30, overflow_rank: int = 1, every: int = 7) -> dict:
    """Every rank trains its own slice of a model (gradients are rank-local: no all-reduce of them, as in tensor or
    pipeline parallelism); rank `overflow_rank` alone sees an inf every `every` steps. Returns this rank's
    scales and stepped flags, and whether all ranks agree on them."""
    r = dist.get_rank()
    out = scaler_trace(make_scaler, steps, {s: "inf" for s in range(3, steps, every)} if r == overflow_rank else {},
                       seed=r)
    mine = torch.tensor(out["stepped"], dtype=torch.float32, device=cdist.device())
    every_rank = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, mine)
    return {"rank": r, "scales": out["scales"], "stepped": out["stepped"],
            "ranks_agree": all(torch.equal(t.cpu(), every_rank[0].cpu()) for t in every_rank)}


def _grads_fp32(model) -> torch.Tensor:
    return torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])


def gradient_underflow(cfg, x, y, accumulation: int = 64, scale: float = 2.0 ** 16, seed: int = 0) -> dict:
    """One real backward of the course's GPT in fp32 and in fp16 (weights, activations, gradients all fp16), the
    loss divided by `accumulation` as for one of that many micro-batches; the fp16 run without and with the
    loss multiplied by `scale` (the gradients divided by it in fp32 afterwards).

    Returns the fp32 gradient magnitudes (nonzero) and the share of nonzero fp32 gradient elements that are 0 in
    each fp16 run ('lost_unscaled', 'lost_scaled'), plus the share in fp16's subnormal range."""
    ref = build_model(cfg, seed)
    (ref.loss(x, y) / accumulation).backward()
    g32 = _grads_fp32(ref)
    out = {}
    for name, s in (("unscaled", 1.0), ("scaled", scale)):
        m = build_model(cfg, seed).half()
        (m.loss(x, y) / accumulation * s).backward()
        g16 = _grads_fp32(m) / s                                    # unscale in fp32
        nz = g32 != 0
        out[f"lost_{name}"] = ((g16 == 0) & nz).sum().item() / nz.sum().item()
        out[f"inf_{name}"] = (~torch.isfinite(g16)).sum().item()
    fi = torch.finfo(torch.float16)
    a = g32[g32 != 0].abs()
    out["subnormal_share"] = (a < fi.smallest_normal).float().mean().item()
    out["below_subnormal_share"] = (a < fi.smallest_normal * fi.eps / 2).float().mean().item()
    out["abs_grads"] = a
    return out


def autocast_dtypes(model, x, dtype=torch.bfloat16) -> list[tuple[str, str, str]]:
    """(module name, type, output dtype) of every leaf module under `torch.autocast` (device of x)."""
    rows, hooks = [], []
    for name, mod in model.named_modules():
        if not list(mod.children()):
            hooks.append(mod.register_forward_hook(lambda mod, i, o, name=name: rows.append(
                (name, type(mod).__name__, str(o.dtype).replace("torch.", "")))))
    with torch.autocast(x.device.type, dtype=dtype):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
    for h in hooks:
        h.remove()
    rows.append(("cross_entropy", "loss", str(loss.dtype).replace("torch.", "")))
    return rows


@dataclasses.dataclass(frozen=True)
class PrecisionMode:
    """How `train_modes` trains: the dtype of the model's weights, matmuls under bf16 autocast, fp32 master weights,
    and a dynamic loss scaler."""

    weights: torch.dtype = torch.float32
    autocast: bool = False
    master: bool = False
    scaled: bool = False


PRECISION_MODES = {
    "fp32": PrecisionMode(),                                                     # the reference
    "bf16-autocast": PrecisionMode(autocast=True),                               # fp32 weights, bf16 matmuls
    "bf16-master": PrecisionMode(torch.bfloat16, master=True),                   # bf16 model + fp32 masters
    "bf16-pure": PrecisionMode(torch.bfloat16),                                  # bf16 weights updated in bf16
    "fp16-master-scaled": PrecisionMode(torch.float16, master=True, scaled=True),  # + `DynamicLossScaler`
}


def train_modes(cfg, batches, lr: float = 1e-3, seed: int = 0, modes=tuple(PRECISION_MODES)) -> dict:
    """Train the same model on the same batches with AdamW in several precisions (names of `PRECISION_MODES`);
    per mode the losses, the final weights (as fp32) and the number of skipped steps."""
    out = {}
    for name in modes:
        mode = PRECISION_MODES[name]
        model = build_model(cfg, seed).to(mode.weights)
        mp = MasterWeightOptimizer(model, torch.optim.AdamW, lr=lr) if mode.master else None
        opt = None if mp else torch.optim.AdamW(model.parameters(), lr=lr)
        scaler = DynamicLossScaler(growth_interval=2000) if mode.scaled else None
        losses = []
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode.autocast):
                loss = model.loss(x, y)
            (scaler.scale(loss) if scaler else loss).backward()
            if mp:
                mp.step(scaler)
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if scaler:
                scaler.update()
            losses.append(loss.item())
        out[name] = {"losses": losses, "params": [p.detach().float().clone() for p in model.parameters()],
                     "skipped": sum(not s for _, s in scaler.history) if scaler else 0}
    return out


def speed_and_memory(cfg, x, y, repeats: int = 3, device=None) -> list[dict]:
    """Per precision (fp32, bf16 autocast, fp16 autocast; on CUDA also a large matmul): median time of a training
    step (forward + backward + AdamW step), activation bytes saved for backward, and model-state bytes."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x, y = x.to(device), y.to(device)
    rows = []
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model = build_model(cfg, 0).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step_s = time_fn(step, warmup=1, repeats=repeats, device=device)
        with SavedActivations(model) as acts, torch.autocast(device.type, dtype=dtype or torch.float32,
                                                              enabled=dtype is not None):
            loss = model.loss(x, y)
        loss.backward()
        n = 4096 if device.type == "cuda" else 256
        a = torch.randn(n, n, device=device, dtype=dtype or torch.float32)
        mm_s = time_fn(lambda: a @ a, warmup=2, repeats=5, device=device)
        rows.append({"precision": name, "step_s": step_s, "activation_bytes": acts.bytes,
                     "state_bytes": model_state_bytes(model, opt)["total"], "matmul_n": n,
                     "matmul_tflops": 2 * n ** 3 / mm_s / 1e12})
        opt.zero_grad(set_to_none=True)
    synchronize(device)
    return rows


def rank_deepspeed(cfg, batches) -> dict:
    """DeepSpeed ZeRO-2 in fp32 and with the ``bf16`` block on the same data; ``fp16`` too where a GPU is present
    (on CPU, DeepSpeed's own refusal is caught and returned)."""
    out = {m: train_variant(cfg, batches, m, measure_live=False) for m in ("ds2", "ds2-bf16")}
    deepspeed = import_deepspeed()
    conf = deepspeed_config(2, batches[0][0].shape[0] // dist.get_world_size(), precision="bf16")
    conf["bf16"], conf["fp16"] = {"enabled": False}, {"enabled": True, "initial_scale_power": 16,
                                                      "loss_scale_window": 10, "hysteresis": 1, "min_loss_scale": 1}
    model = build_model(cfg, 0).to(cdist.device())
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=conf)
        losses, n, r = [], dist.get_world_size(), dist.get_rank()
        for x, y in batches:
            loss = engine.module.loss(shard_batch(x, r, n).to(engine.device), shard_batch(y, r, n).to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["ds2-fp16"] = {"losses": losses, "loss_scale": float(engine.optimizer.loss_scale)}
    except Exception as e:  # noqa: BLE001 - DeepSpeed refuses fp16 on its CPU accelerator
        out["ds2-fp16"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    out["backend"] = cdist.backend()
    return out


def hysteresis_traces(pattern: str, hysteresis: int = 2, window: int = 3, init_scale: float = 2.0 ** 16) -> dict:
    """The loss scale after each step of ``pattern`` ('x' an overflow, '.' a clean step) under three rules, all run
    by the libraries' own code: GradScaler (``torch._amp_update_scale_``, the kernel ``GradScaler.update`` calls:
    every overflow backs off), and DeepSpeed's fp16 ``DynamicLossScaler`` with ``hysteresis`` (``delayed_shift``),
    without and with ``consecutive_hysteresis``. ``window`` is GradScaler's ``growth_interval`` and DeepSpeed's
    ``loss_scale_window``. DeepSpeed asks for the rank only to log; it is given rank 0 here, no process group."""
    from unittest import mock

    import_deepspeed()
    from deepspeed.runtime.fp16 import loss_scaler

    if set(pattern) - {"x", "."}:
        raise ValueError(f"pattern={pattern!r}: use 'x' for an overflow and '.' for a clean step")
    scale, tracker = torch.tensor(float(init_scale)), torch.zeros((), dtype=torch.int32)
    grad_scaler = []
    for c in pattern:
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(c == "x")), 2.0, 0.5, window)
        grad_scaler.append(scale.item())
    out = {"GradScaler": grad_scaler}
    with mock.patch.object(loss_scaler.dist, "get_rank", return_value=0):
        for consecutive in (False, True):
            ds = loss_scaler.DynamicLossScaler(init_scale=init_scale, scale_window=window, min_scale=1,
                                               delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
            trace = []
            for c in pattern:
                ds.update_scale(c == "x")
                trace.append(float(ds.cur_scale))
            name = f"DeepSpeed hysteresis={hysteresis}" + (", consecutive" if consecutive else "")
            out[name] = trace
    return out
