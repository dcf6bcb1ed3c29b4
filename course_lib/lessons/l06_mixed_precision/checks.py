"""What the graded exercises of lesson 06 call (solutions/06_mixed_precision.ipynb).

- `scaler_vs_gradscaler`: the learner's loss scaler and `torch.amp.GradScaler` driven side by side through the
  same steps and injected overflows (`experiments.scaler_trace`): the first step where they differ.
- `rank_scaler_groups`: on every rank, the scaler over all ranks (`experiments.rank_scaler_agreement`), then each
  rank's scaler over a process group of its own (only rank 1 overflows: rank 0 must skip nothing).
- `master_step_vs_reference`: the learner's master-weight update against `course_lib.parallel.precision.master_step`.
"""

from __future__ import annotations

import torch

from course_lib.config import small_config
from course_lib.data import random_batches
from course_lib.lessons.errors import max_abs_error
from course_lib.lessons.l06_mixed_precision.experiments import (SCALER_KW, inject_overflow, overflow_steps,
                                                                rank_scaler_agreement, scaler_trace)
from course_lib.model import build_model
from course_lib.parallel.precision import DynamicLossScaler, MasterWeightOptimizer, master_step

__all__ = ["scaler_vs_gradscaler", "rank_scaler_groups", "master_step_vs_reference"]


def scaler_vs_gradscaler(make_scaler, steps: int = 200, seed: int = 0) -> dict:
    """Run `make_scaler()` and `torch.amp.GradScaler("cpu")` with the same settings (`SCALER_KW`) over `steps`
    steps with the same injected overflows; what the graded test compares (lesson 06)."""
    overflows = overflow_steps(steps, seed)
    ref = scaler_trace(lambda: torch.amp.GradScaler("cpu", **SCALER_KW), steps, overflows, seed)
    own = scaler_trace(make_scaler, steps, overflows, seed)
    diff = [s for s in range(steps) if (own["scales"][s], own["stepped"][s]) != (ref["scales"][s], ref["stepped"][s])]
    wrong_return = [s for s in range(steps) if not _says(own["returned"][s], own["stepped"][s])]
    return {"own": own, "ref": ref, "first_difference": diff[0] if diff else None,
            "param_error": max_abs_error(own["params"], ref["params"]), "n_overflows": len(overflows),
            "first_wrong_return": wrong_return[0] if wrong_return else None,
            "second_unscale": _second_unscale(make_scaler)}


def _says(returned, stepped: bool) -> bool:
    """``returned`` is a truth value (bool, 0/1, a one-element tensor) equal to ``stepped``; None is not."""
    try:
        return returned is not None and bool(returned) == stepped
    except (TypeError, ValueError, RuntimeError):
        return False


def _second_unscale(make_scaler) -> str:
    """What a second ``unscale_`` before ``update()`` does: 'RuntimeError' (the rule), 'nothing' or another error."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = make_scaler()
    w.grad = torch.ones(3)
    scaler.unscale_(opt)
    try:
        scaler.unscale_(opt)
    except RuntimeError:
        return "RuntimeError"
    except Exception as e:  # noqa: BLE001 - reported, not raised: the check names what happened
        return type(e).__name__
    return "nothing"


def rank_scaler_groups(make_scaler, steps: int = 30) -> dict:
    """On every rank (inside `runtime.run`): `rank_scaler_agreement` with ``make_scaler()`` (all ranks in one
    group), then the same training with ``make_scaler(group=own)``, each rank alone in its own process group: rank 1
    overflows, rank 0 must not skip. Returns {'world': ..., 'own_group_skipped': the steps this rank skipped}."""
    import torch.distributed as dist

    world = rank_scaler_agreement(make_scaler, steps)
    r = dist.get_rank()
    groups = [dist.new_group([q]) for q in range(dist.get_world_size())]    # every rank creates every group
    out = scaler_trace(lambda: make_scaler(group=groups[r]), steps,
                       {s: "inf" for s in range(3, steps, 7)} if r == 1 else {}, seed=r)
    return {"world": world, "own_group_skipped": [s for s, ok in enumerate(out["stepped"]) if not ok]}


def master_step_vs_reference(step_fn, steps: int = 5, seed: int = 0) -> dict:
    """The learner's `step_fn(model_params, master_params, optimizer, scaler)` against `master_step` (lesson 06).

    'tiny_update': one bf16 weight 1.0, SGD lr 1e-3, gradient 1, 10 steps: the master must reach 0.99 and the model
    weight bf16(0.99) (bf16 alone would stay at 1.0: its spacing at 1 is 2^-7). 'bf16': a bf16 GPT trained `steps`
    steps with AdamW, masters and weights vs the reference. 'fp16': an fp16 GPT with GradScaler and an inf
    injected at step 1 (that step must leave masters and weights unchanged); each model's 'returned' holds what
    ``step_fn`` returned at each step, to compare with 'stepped' (whether its masters changed). 'returned': what
    ``step_fn`` returned through each scaler (`_returns`)."""
    out = {}
    w = torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
    m = w.detach().float().clone().requires_grad_(True)
    opt = torch.optim.SGD([m], lr=1e-3)
    for _ in range(10):
        w.grad = torch.ones_like(w)
        step_fn([w], [m], opt, None)
    out["tiny_update"] = {"master": m.item(), "model": w.item(), "grad_cleared": w.grad is None}
    try:
        out["returned"] = _returns(step_fn)
    except Exception as e:  # noqa: BLE001 - reported by the check, not raised
        out["returned"] = {k: f"{type(e).__name__}: {e}"[:120] for k in ("DynamicLossScaler", "GradScaler")}
    cfg = small_config()
    batches = random_batches(cfg, 4, steps, seed)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        ref = _train_master(master_step, cfg, batches, dtype, seed)
        try:
            own = _train_master(step_fn, cfg, batches, dtype, seed)
        except Exception as e:  # noqa: BLE001 - a wrong step (e.g. the scaler never stepped): report, do not crash
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        out[name] = {"error": None, "master_error": max_abs_error(own["masters"], ref["masters"]),
                     "param_error": max_abs_error(own["params"], ref["params"]), "stepped": own["stepped"],
                     "ref_stepped": ref["stepped"], "grads_left": own["grads_left"], "copied_back": own["copied_back"],
                     "master_grads_left": own["master_grads_left"], "returned": own["returned"]}
    return out


def _returns(step_fn) -> dict:
    """What ``step_fn`` returns for an fp16 weight: 3 steps through a scaler with an inf in the second step's
    gradient, then one step without a scaler; the rule: [True, False, True, True]. Two scalers: the course's
    `DynamicLossScaler`, whose ``step`` returns whether it stepped, and ``torch.amp.GradScaler``, whose ``step``
    returns what ``optimizer.step()`` returned, or None when it skipped (torch 2.14.1, grad_scaler.py
    ``_maybe_opt_step``: ``retval: float | None = None`` ... ``retval = optimizer.step(*args, **kwargs)``); SGD's
    ``step()`` without a closure returns None, so its return value cannot tell."""
    out = {}
    for name, make in (("DynamicLossScaler", lambda: DynamicLossScaler(**SCALER_KW)),
                       ("GradScaler", lambda: torch.amp.GradScaler("cpu", **SCALER_KW))):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        m = w.detach().float().clone().requires_grad_(True)
        opt = torch.optim.SGD([m], lr=1e-3)
        scaler = make()
        got = []
        for g in (1.0, float("inf"), 1.0):
            scaler.scale(torch.ones(()))                # GradScaler needs its scale made in the iteration
            w.grad = torch.full_like(w, g)
            got.append(step_fn([w], [m], opt, scaler))
            scaler.update()
        w.grad = torch.ones_like(w)
        got.append(step_fn([w], [m], opt, None))
        out[name] = [r if r is None else bool(r) for r in got]
    return out


def _train_master(fn, cfg, batches, dtype, seed) -> dict:
    """Train a `dtype` GPT with `MasterWeightOptimizer(step_fn=fn)`, AdamW lr 1e-2; fp16 with GradScaler and an
    inf injected at step 1."""
    model = build_model(cfg, seed).to(dtype)
    mp = MasterWeightOptimizer(model, torch.optim.AdamW, step_fn=fn, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KW) if dtype == torch.float16 else None
    stepped, returned = [], []
    for i, (x, y) in enumerate(batches):
        loss = model.loss(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler and i == 1:
            inject_overflow(mp.params, "inf", i)
        before = [q.detach().clone() for q in mp.masters]
        r = mp.step(scaler)
        returned.append(r if r is None else bool(r))
        stepped.append(not all(torch.equal(b, q) for b, q in zip(before, mp.masters)))
        if scaler:
            scaler.update()
    return {"masters": [q.detach().clone() for q in mp.masters],
            "params": [p.detach().float().clone() for p in mp.params], "stepped": stepped, "returned": returned,
            "grads_left": sum(p.grad is not None for p in mp.params),
            "master_grads_left": sum(q.grad is not None for q in mp.masters),
            "copied_back": all(torch.equal(p.detach(), q.detach().to(dtype)) for p, q in zip(mp.params, mp.masters))}
