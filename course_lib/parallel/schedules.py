"""Learning-rate schedules: linear warm-up, cosine decay, layer-wise rates (lesson 09).

One schedule, written four ways that lesson 09 checks against each other step by step:

    warmup_cosine(step, peak_lr=3e-4, warmup_steps=5, total_steps=100, min_lr=3e-5)   # pure Python, the formula
    warmup_cosine_scheduler(optimizer, peak_lr=..., ...)     # torch LambdaLR on that formula
    torch_warmup_cosine(optimizer, peak_lr=..., ...)         # torch's LinearLR + CosineAnnealingLR in SequentialLR
    deepspeed_scheduler_config("WarmupCosineLR", ...)        # DeepSpeed's "scheduler" JSON block

Step convention. ``step`` is the 0-based index of the optimizer update the rate is used for, which is also the
number of ``scheduler.step()`` calls made before that update (torch's: a ``LambdaLR`` built on ``f`` sets the rate
to ``f(0)`` at construction and to ``f(n)`` after ``n`` calls). With W = warmup_steps, T = total_steps and the
peak step e = max(W, 1) - 1:

    lr(s) = peak * (s + 1) / W                                               0 <= s <= e   (warm-up, W >= 2)
    lr(s) = min_lr + (peak - min_lr) * (1 + cos(pi * (s - e) / (T - e))) / 2  e <= s <= T   (cosine)
    lr(s) = min_lr                                                            s >= T

The first update already moves the weights (peak/W, not 0), the peak is used once, at step W - 1, and min_lr is
reached at step T (a run of T steps, s = 0..T-1, ends just above it). This is exactly torch's
``LinearLR(start_factor=1/W, end_factor=1, total_iters=W-1)`` followed at milestone W-1 by
``CosineAnnealingLR(T_max=T-(W-1), eta_min=min_lr)``. W = 0 and W = 1 both mean no warm-up.
Warm-up: Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (section 2.2);
cosine: Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts" (eq. 5, one cycle).

DeepSpeed (0.19, ``deepspeed/runtime/lr_schedules.py``): its schedulers hold ``last_batch_iteration`` i (-1 after
construction, +1 per ``step()``) and set the rate of iteration i. With ``warmup_type="linear"`` (what
`deepspeed_scheduler_config` writes; DeepSpeed's default is ``"log"``):
  - ``WarmupLR``: min + (max - min) * i / max(2, N) for i < max(2, N), then max. With warmup_min_lr = peak/W,
    warmup_max_lr = peak, warmup_num_steps = W - 1 it is ``warmup_constant`` exactly at i = s (W >= 3, or W <= 1).
  - ``WarmupCosineLR``: ratio r + (1 - r) * i / N for i < N (``ratio = self.last_batch_iteration /
    self.warmup_num_steps``), then a cosine with progress (i - N + 1) / (T - N) (``real_last_step =
    self.last_batch_iteration - self.warmup_num_steps + 1``). Its first cosine iteration already has progress
    1/(T - N) > 0 and its linear warm-up stops at (N - 1)/N: with ``warmup_type="linear"`` it never uses the peak
    rate, so no linear parameters make it equal to any warm-up that reaches the peak (ours, torch's, Hugging
    Face's). With N = W - 1, r = 1/W it equals ours in the warm-up (s < W - 1) and is ``one step ahead`` in the
    decay: DeepSpeed(s) = ours(s + 1) for s >= W - 1, a difference of at most
    (peak - min_lr) * sin(pi / (2 (T - W + 1))) per step.
  - ``warmup_type="log"`` (the default of both): the warm-up ratio is ``self.inverse_log_warm_up *
    math.log(self.last_batch_iteration + 1)`` = log(i + 1) / log(N), which is 1 at i = N - 1: the log warm-up does
    use the peak (to rounding), once, at iteration N - 1; the decay that follows is the same as the linear one's.
    The choice of warm-up, not DeepSpeed, decides whether the peak is used.
  - A DeepSpeed *engine* steps its scheduler after each applied optimizer step and never before the first
    (``engine.py``, ``_take_model_step``: ``if overflow: self.skipped_steps += 1`` ``else: ...
    self.lr_scheduler.step(**(lr_kwargs or {}))``): update k uses iteration k - 1, and update 0 the rate the
    constructor set at iteration -1 (``self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())``).
    ``WarmupLR.get_lr`` returns ``self.min_lrs`` there, so its updates 0 and 1 both use warmup_min_lr;
    ``WarmupCosineLR.get_lr`` returns ``[0.0 for _ in self.org_lrs]``, so its update 0 uses 0 (no move at all)
    and update 1 uses r * peak. On an fp16 overflow the engine skips the optimizer step and the scheduler step
    together: the schedule counts applied updates, not batches. tests/test_schedules.py pins these first updates
    on a real one-rank engine, for both schedulers and both warm-up types. To train with exactly this module's
    schedule under DeepSpeed, pass ``lr_scheduler=warmup_cosine_scheduler(optimizer, ...)`` to
    ``deepspeed.initialize`` instead of a JSON "scheduler" block.

Layer-wise learning-rate decay (`layerwise_param_groups`): Clark et al. 2020 (ELECTRA, appendix A) and
Bao et al. 2022 (BEiT, fine-tuning): layer l of L gets base_lr * decay**(L - l), the output layer the most.
"""

from __future__ import annotations

import math

import torch
from course_lib.reference import reference_for

__all__ = ["warmup_cosine", "warmup_constant", "warmup_cosine_scheduler", "warmup_constant_scheduler",
           "torch_warmup_cosine", "deepspeed_scheduler_config", "layerwise_param_groups"]


def _check(peak_lr: float, warmup_steps: int, total_steps: int | None = None, min_lr: float = 0.0) -> None:
    if not peak_lr > 0:
        raise ValueError(f"peak_lr={peak_lr}: the peak learning rate must be > 0")
    if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
        raise ValueError(f"warmup_steps={warmup_steps!r}: need an int >= 0 (0 or 1: no warm-up)")
    if total_steps is not None:
        if not (isinstance(total_steps, int) and total_steps >= max(warmup_steps, 1)):
            raise ValueError(f"total_steps={total_steps!r}: need an int >= max(warmup_steps, 1) = "
                             f"{max(warmup_steps, 1)}; lower warmup_steps or raise total_steps")
        if not 0 <= min_lr <= peak_lr:
            raise ValueError(f"min_lr={min_lr}: need 0 <= min_lr <= peak_lr={peak_lr}")


def _peak_step(warmup_steps: int) -> int:
    """e = max(W, 1) - 1: the step that uses the peak rate (0 without warm-up)."""
    return max(warmup_steps, 1) - 1


def warmup_constant(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Linear warm-up then constant (DeepSpeed's ``WarmupLR`` shape; lesson 09).

    lr(s) = peak_lr * min(s + 1, W) / W for W >= 1 (peak_lr for W = 0): peak_lr/W at step 0, peak_lr from step
    W - 1 on. ``step`` is the 0-based index of the optimizer update (see the module docstring)."""
    _check(peak_lr, warmup_steps)
    if step < 0:
        raise ValueError(f"step={step}: steps count from 0")
    if warmup_steps <= 1:
        return float(peak_lr)
    return peak_lr * min(step + 1, warmup_steps) / warmup_steps


@reference_for("09-schedule")
def warmup_cosine(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> float:
    """Linear warm-up (Goyal et al. 2017), then one cosine from peak_lr to min_lr (Loshchilov & Hutter 2017, SGDR
    eq. 5), then min_lr (lesson 09). With W = warmup_steps, T = total_steps, e = max(W, 1) - 1:

        lr(s) = peak_lr * (s + 1) / W                                                s <= e
        lr(s) = min_lr + (peak_lr - min_lr) * (1 + cos(pi * (s - e) / (T - e))) / 2  e <= s <= T
        lr(s) = min_lr                                                               s >= T

    ``step`` s is the 0-based index of the optimizer update (torch's LambdaLR convention)."""
    _check(peak_lr, warmup_steps, total_steps, min_lr)
    if step < 0:
        raise ValueError(f"step={step}: steps count from 0")
    e = _peak_step(warmup_steps)
    if step < e:
        return peak_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return float(min_lr)
    progress = (step - e) / (total_steps - e)                         # 0 at the peak, 1 at total_steps
    return min_lr + (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0


@reference_for("09-schedule")
def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, *, peak_lr: float, warmup_steps: int,
                            total_steps: int, min_lr: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` multiplying each param group's initial lr by warmup_cosine(s) / peak_lr (lesson 09).

    A group whose lr is peak_lr follows `warmup_cosine` exactly; a group with another lr (layer-wise rates) is
    scaled by the same factor, so its floor is its lr * min_lr / peak_lr (DeepSpeed's ``cos_min_ratio``)."""
    _check(peak_lr, warmup_steps, total_steps, min_lr)
    kw = dict(peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr=min_lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, **kw) / peak_lr)


def warmup_constant_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int
                              ) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` multiplying each group's initial lr by warmup_constant(s, 1, warmup_steps) (lesson 09)."""
    _check(1.0, warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_constant(s, 1.0, warmup_steps))


@reference_for("09-schedule")
def torch_warmup_cosine(optimizer: torch.optim.Optimizer, *, peak_lr: float, warmup_steps: int,
                        total_steps: int, min_lr: float = 0.0) -> torch.optim.lr_scheduler.SequentialLR:
    """The same schedule from torch's own parts (lesson 09): ``LinearLR(start_factor=1/W, end_factor=1,
    total_iters=W-1)`` (W >= 2), then at milestone e = max(W, 1) - 1 ``CosineAnnealingLR(T_max=T-e,
    eta_min=min_lr)``, then at milestone T ``ConstantLR(factor=min_lr/peak_lr)`` (CosineAnnealingLR alone would
    rise again after T_max). Sets every group's lr to peak_lr first; eta_min is absolute, so with several
    groups only min_lr = 0 keeps them proportional. torch updates the rate recursively (lr_new from lr_old),
    ours in closed form: they agree to rounding."""
    _check(peak_lr, warmup_steps, total_steps, min_lr)
    for group in optimizer.param_groups:
        group["lr"] = peak_lr
        group.pop("initial_lr", None)
    sched = torch.optim.lr_scheduler
    e = _peak_step(warmup_steps)
    parts, milestones = [], []
    if e > 0:
        parts.append(sched.LinearLR(optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=e))
        milestones.append(e)
    parts.append(sched.CosineAnnealingLR(optimizer, T_max=total_steps - e, eta_min=min_lr))
    milestones.append(total_steps)
    parts.append(sched.ConstantLR(optimizer, factor=min_lr / peak_lr, total_iters=2 ** 62))
    return sched.SequentialLR(optimizer, parts, milestones)


def deepspeed_scheduler_config(name: str, *, peak_lr: float, warmup_steps: int, total_steps: int | None = None,
                               min_lr: float = 0.0) -> dict:
    """DeepSpeed's ``"scheduler"`` config block closest to this module's schedule (lesson 09).

    name 'WarmupLR': equals ``warmup_constant(s, peak_lr, W)`` at ``last_batch_iteration`` s, exactly.
    name 'WarmupCosineLR': equals ``warmup_cosine`` for s < W - 1 and ``warmup_cosine(s + 1)`` after (its linear
    warm-up never uses the peak; see the module docstring); the optimizer's lr must be peak_lr (DeepSpeed's rates are
    ratios of it). DeepSpeed warms up over at least 2 iterations, so W = 2 (WarmupLR) and W < 3
    (WarmupCosineLR) have no twin and raise ValueError. ``warmup_type`` is 'linear' (DeepSpeed's default is
    'log', which reaches the peak at iteration N - 1 and is no twin of ours either)."""
    if name == "WarmupLR":
        _check(peak_lr, warmup_steps)
        if warmup_steps == 2:
            raise ValueError("warmup_steps=2 has no DeepSpeed WarmupLR twin (it warms up over max(2, N) "
                             "iterations from warmup_min_lr): use warmup_steps >= 3, or 0 for none")
        n, low = (warmup_steps - 1, peak_lr / warmup_steps) if warmup_steps >= 3 else (1, peak_lr)
        return {"type": "WarmupLR", "params": {"warmup_min_lr": low, "warmup_max_lr": peak_lr,
                                               "warmup_num_steps": n, "warmup_type": "linear"}}
    if name == "WarmupCosineLR":
        if total_steps is None:
            raise ValueError("WarmupCosineLR needs total_steps")
        _check(peak_lr, warmup_steps, total_steps, min_lr)
        if warmup_steps < 3:
            raise ValueError(f"warmup_steps={warmup_steps} has no DeepSpeed WarmupCosineLR twin (it warms up over "
                             f"max(2, N) iterations): use warmup_steps >= 3")
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total_steps, "warmup_num_steps": warmup_steps - 1,
            "warmup_min_ratio": 1.0 / warmup_steps, "cos_min_ratio": min_lr / peak_lr, "warmup_type": "linear"}}
    raise ValueError(f"name={name!r}: choose 'WarmupLR' or 'WarmupCosineLR'")


def layerwise_param_groups(model: torch.nn.Module, base_lr: float, decay: float) -> list[dict]:
    """Param groups with layer-wise learning-rate decay for a `course_lib.model.GPT` (lesson 09; ELECTRA, BEiT).

    Layer ids l: 0 the embeddings (tok_emb, pos_emb), 1..n_layer the blocks (blocks[i] is l = i + 1), and
    L = n_layer + 1 the final norm and head. Group l has lr = base_lr * decay**(L - l): the head base_lr, the
    embeddings base_lr * decay**(n_layer + 1). A tied head (``head.weight is tok_emb.weight``) is one parameter,
    listed once by ``named_parameters()`` as ``tok_emb.weight``: it is in the embeddings' group.
    Each group: {"params", "lr", "layer_id", "layer"} (layer: 'embeddings', 'blocks.i' or 'head'); empty groups
    are left out. Pass to any torch optimizer; `warmup_cosine_scheduler` then scales every group alike."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay={decay}: need 0 < decay <= 1 (1: the same lr everywhere)")
    n_layer = len(model.blocks)
    top = n_layer + 1
    names = ["embeddings"] + [f"blocks.{i}" for i in range(n_layer)] + ["head"]
    params: list[list[torch.nn.Parameter]] = [[] for _ in names]
    for name, p in model.named_parameters():
        if name.startswith(("tok_emb.", "pos_emb.")):
            layer = 0
        elif name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        elif name.startswith(("ln_f.", "head.")):
            layer = top
        else:
            raise ValueError(f"parameter {name!r} is in no layer of a course GPT (tok_emb, pos_emb, blocks.i, "
                             f"ln_f, head)")
        params[layer].append(p)
    return [{"params": ps, "lr": base_lr * decay ** (top - layer), "layer_id": layer, "layer": names[layer]}
            for layer, ps in enumerate(params) if ps]
