"""Mixed-precision training from scratch (lesson 06): number formats, a dynamic loss scaler, fp32 master weights.

Micikevicius et al. 2018, "Mixed Precision Training": keep the weights' master copy in fp32, run forward and
backward in fp16, and multiply the loss by a scale S so that small gradients do not underflow to zero in fp16;
divide the gradients by S before the update. Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning
Training": bf16 has fp32's exponent range, so it needs no loss scaling.

    scaler = DynamicLossScaler(init_scale=2**16, growth_interval=2000)     # the API of torch.amp.GradScaler
    scaler.scale(loss).backward()         # gradients of S * loss
    scaler.step(optimizer)                # unscale (g / S), skip the step if any rank saw inf/nan
    scaler.update()                       # overflow: S *= backoff; growth_interval clean steps: S *= growth

    mp = MasterWeightOptimizer(model.to(torch.float16), torch.optim.AdamW, lr=1e-3)
    scaler.scale(model.loss(x, y)).backward()
    mp.step(scaler); scaler.update()     # fp32 masters step; fp16 weights are copied back from them
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from course_lib.reference import reference_for

__all__ = ["FORMATS", "format_info", "spacing", "add_in", "DynamicLossScaler", "MasterWeightOptimizer",
           "master_step", "any_rank_true"]

# name -> dtype; fp8 as in the OCP FP8 spec (Micikevicius et al. 2022): e4m3 for weights/activations, e5m2 for grads
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8 e4m3": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}


def format_info(dtype: torch.dtype) -> dict:
    """Range and precision of a floating-point dtype, from `torch.finfo`.

    mantissa bits m (stored, without the implicit leading 1) give eps = 2^-m: the gap between 1 and the next
    number, i.e. the relative precision; exponent bits give the range [smallest subnormal, max].
    Smallest subnormal = smallest normal * eps (every format here has subnormals)."""
    fi = torch.finfo(dtype)
    m = round(-math.log2(fi.eps))
    return {"dtype": str(dtype).replace("torch.", ""), "bits": fi.bits, "exponent_bits": fi.bits - 1 - m,
            "mantissa_bits": m, "max": fi.max, "smallest_normal": fi.smallest_normal,
            "smallest_subnormal": fi.smallest_normal * fi.eps, "eps": fi.eps,
            "decimal_digits": m * math.log10(2)}


def spacing(x: float, dtype: torch.dtype) -> float:
    """Gap between |x| (a normal number of `dtype`) and the next representable number: eps * 2^floor(log2|x|).
    An update smaller than half of it is rounded away."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(x)))


def add_in(w: float, dw: float, dtype: torch.dtype) -> float:
    """w + dw computed and stored in `dtype` (what an optimizer step does to a low-precision weight)."""
    return (torch.tensor(w, dtype=dtype) + torch.tensor(dw, dtype=dtype)).item()


def any_rank_true(flag: bool | torch.Tensor, group=None, device=None) -> bool:
    """True on every rank if `flag` is true on any rank (one all-reduce with MAX); plain bool without dist."""
    t = torch.as_tensor(flag, dtype=torch.float32, device=device).reshape(())
    if dist.is_available() and dist.is_initialized():
        t = t.to("cuda") if dist.get_backend(group) == "nccl" else t.clone()   # NCCL reduces GPU tensors only
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


@reference_for("06-loss-scaler")
class DynamicLossScaler:
    """A dynamic loss scaler with the decisions of `torch.amp.GradScaler` (lesson 06).

    scale(loss)      loss * S
    unscale_(opt)    g *= 1/S for every gradient of opt (1/S computed in fp64, as GradScaler does); found_inf =
                     any element inf/nan on ANY rank (all-reduce MAX over `group` when torch.distributed is up:
                     with sharded gradients or model parallelism, a rank must not step when another skips)
    step(opt)        unscale_ if not done yet; skip optimizer.step() if found_inf; returns True if it stepped
    update()         found_inf: S *= backoff_factor, clean-step counter = 0; else counter += 1 and when it
                     reaches growth_interval: S *= growth_factor (if still finite), counter = 0
    `history` holds (scale used, stepped) per step.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"growth_factor={growth_factor} must be > 1, backoff_factor={backoff_factor} in (0, 1), "
                             f"growth_interval={growth_interval} >= 1")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group, self.growth_tracker = group, 0
        self._unscaled = False
        self._found_inf: bool | None = None
        self.history: list[tuple[float, bool]] = []

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._unscaled:
            raise RuntimeError("unscale_() was already called since the last update(): gradients would be "
                               "divided by S twice")
        inv = torch.tensor(self._scale, dtype=torch.float64).reciprocal().float()   # as GradScaler
        grads = _grads(optimizer)
        local = False
        for g in grads:
            local = local or not bool(torch.isfinite(g).all())
            g.mul_(inv.to(g.device))
        self._found_inf = any_rank_true(local, self.group, device=grads[0].device if grads else None)
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self._unscaled:
            self.unscale_(optimizer)
        stepped = not self._found_inf
        if stepped:
            optimizer.step()
        self.history.append((self._scale, stepped))
        return stepped

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() without a step(): nothing to update from")
        if self._found_inf:
            self._scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                grown = self._scale * self.growth_factor
                if math.isfinite(torch.tensor(grown, dtype=torch.float32).item()):  # GradScaler keeps S in fp32
                    self._scale = grown
                self.growth_tracker = 0
        self._unscaled, self._found_inf = False, None


@reference_for("06-master-weights")
@torch.no_grad()
def master_step(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                optimizer: torch.optim.Optimizer, scaler=None) -> bool:
    """One mixed-precision update (lesson 06). model_params: the fp16/bf16 parameters holding .grad;
    master_params: their fp32 copies, which `optimizer` was built over.

    master.grad = model.grad in fp32; step the masters (through `scaler.step`, which unscales and may skip, or
    `optimizer.step()`); copy every master back into its model parameter (rounded to low precision); clear
    both gradients. Returns whether the optimizer stepped: a step post-hook says it, since
    `torch.amp.GradScaler.step` returns `optimizer.step()`'s value (None without a closure) or None when it skips
    (torch 2.14.1, `_maybe_opt_step`). Fused optimizers, which skip inside their kernel, are not covered."""
    for p, m in zip(model_params, master_params):
        m.grad = None if p.grad is None else p.grad.float()
    ran = []
    hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: ran.append(True))
    try:
        scaler.step(optimizer) if scaler is not None else optimizer.step()
    finally:
        hook.remove()
    for p, m in zip(model_params, master_params):
        p.copy_(m)                                       # fp32 -> bf16/fp16: round to nearest
        p.grad = m.grad = None
    return bool(ran)


@reference_for("06-master-weights")
class MasterWeightOptimizer:
    """fp32 master weights for a low-precision model: `optimizer_cls` is built over fp32 copies of the model's
    parameters; `step(scaler)` is `master_step` (or the learner's `step_fn`). Model state per parameter with
    Adam: 2 (bf16 weight) + 2 (bf16 grad) + 4 (master) + 8 (moments) = 16 bytes."""

    def __init__(self, model: nn.Module, optimizer_cls=torch.optim.AdamW, step_fn: Callable = master_step,
                 **optimizer_kwargs):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = optimizer_cls(self.masters, **optimizer_kwargs)
        self.step_fn = step_fn

    def step(self, scaler=None) -> bool:
        return self.step_fn(self.params, self.masters, self.optimizer, scaler)

    def state_tensors(self) -> Iterable[torch.Tensor]:
        yield from self.masters
        for s in self.optimizer.state.values():
            yield from (v for v in s.values() if isinstance(v, torch.Tensor))
