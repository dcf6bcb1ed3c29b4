"""What the graded exercise 09-resume calls (solutions/09_training_in_practice.ipynb): a run stopped, saved by the
learner's ``save_checkpoint``, loaded by their ``load_checkpoint`` and continued must be the run never stopped.

`check_resume` trains one uninterrupted reference run and the interrupted one in the notebook's process, with dropout
on and a loader that draws from Python's, NumPy's and torch's random streams, and compares losses, parameters,
optimizer state, the schedule and every random stream; it raises ``course_lib.grading.check.CheckFailed`` (one line:
what, expected, got, a hint) at the first difference. tests/test_training_checks.py calls it on wrong variants.
The other exercises of lesson 09 are checked in `checks`.
"""

from __future__ import annotations

import copy
import math
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from course_lib.config import small_config
from course_lib.data import random_batches
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.lessons.errors import relative_error
from course_lib.model import build_model
from course_lib.one_process import params_of
from course_lib.parallel import schedules

__all__ = ["RESUME_CFG", "check_resume"]

# ------------------------------------------------------------------------------ 09-resume

RESUME_CFG = small_config(dropout=0.1)         # dropout on: torch's random stream decides the result
STEPS, STOP, ACCUM, MICRO, EXTRA = 6, 3, 2, 2, 4   # steps in all, stopped after, micro-batches per step, rows, crop
RESUME_LR = 1e-2
_POOL = random_batches(RESUME_CFG, 2 * MICRO, steps=STEPS * ACCUM, seed=5, seq_len=RESUME_CFG.seq_len + EXTRA)


def _micro_batch(position: int):
    """Micro-batch number ``position`` of the data: the rows Python's `random` picks out of its pool entry,
    cropped at an offset NumPy's generator draws (a loader's shuffling and augmentation)."""
    x, y = _POOL[position]                                    # (2 MICRO, T + EXTRA)
    rows = random.sample(range(2 * MICRO), MICRO)
    o = int(np.random.randint(0, EXTRA + 1))
    T = RESUME_CFG.seq_len
    return x[rows, o:o + T], y[rows, o:o + T]                 # (MICRO, T), (MICRO, T)


def _seed_process(seed: int) -> None:
    """The generators a new process starts with."""
    torch.manual_seed(seed)
    random.seed(seed + 1)
    np.random.seed(seed + 2)


def _build(init_seed: int):
    model = build_model(RESUME_CFG, init_seed)                # seeds torch: before _seed_process
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=RESUME_LR, weight_decay=0.1)
    sched = schedules.warmup_cosine_scheduler(opt, peak_lr=RESUME_LR, warmup_steps=4, total_steps=8,
                                              min_lr=RESUME_LR / 10)
    return model, opt, sched


def _train(model, opt, sched, step: int, position: int, stop: int) -> tuple[list[float], int, int]:
    """Optimizer steps ``step`` .. ``stop`` - 1, ACCUM micro-batches each from data position ``position``."""
    losses = []
    while step < stop:
        total = 0.0
        for _ in range(ACCUM):
            x, y = _micro_batch(position)
            position += 1
            loss = model.loss(x, y) / ACCUM
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(total)
        step += 1
    return losses, step, position


def _streams() -> dict:
    """The generators a run draws from: torch's (CPU), Python's, NumPy's and, where CUDA is present, torch's CUDA
    generators (one per GPU; dropout on a GPU draws from them). On a CPU machine there is no CUDA generator to
    save or compare, and the check leaves it out."""
    out = {"torch": torch.get_rng_state().clone(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        out["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return out


def _same_stream(kind: str, a, b) -> bool:
    if kind == "torch":
        return torch.equal(a, b)
    if kind == "cuda":
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    if kind == "python":
        return a == b
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def _optimizer_state(opt) -> dict:
    return copy.deepcopy(opt.state_dict()["state"])


def _same_optimizer_state(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        if set(a[k]) != set(b[k]):
            return False
        for name in a[k]:
            x, y = a[k][name], b[k][name]
            if not (torch.equal(torch.as_tensor(x), torch.as_tensor(y))):
                return False
    return True


STREAM_NAMES = {"torch": "torch's", "python": "Python's", "numpy": "NumPy's", "cuda": "the CUDA generators'"}
RESTORE_HINTS = {  # what to save and restore when a generator's state after load_checkpoint is not the saved one
    "torch": "torch's generator: read its state when saving, set it last when loading",
    "python": "Python's random module has its own generator: save and restore its state too",
    "numpy": "NumPy's global generator has its own state: save and restore it too",
    "cuda": "CUDA is present here: torch keeps one more generator per GPU (torch.cuda); save and restore them too",
}


def check_resume(save_fn: Callable, load_fn: Callable) -> dict:
    """A run of STEPS steps (the course's GPT with dropout, AdamW, a warm-up + cosine LambdaLR, gradient
    accumulation, micro-batches that Python's and NumPy's generators pick and crop; on the CPU, so the CUDA
    generators, where CUDA is present, are compared as states only) stopped after STOP steps with
    ``save_fn(folder, model=, optimizer=, scheduler=, step=, data_position=)`` and resumed in a fresh "process"
    (new model, optimizer and schedule, other seeds) with ``load_fn(folder, model=, optimizer=, scheduler=) ->
    (step, data_position)`` from a copy of the folder must give exactly (bit for bit) the uninterrupted run's
    losses and parameters. Each part of the state is compared first, so a failure names what was not restored."""
    model, opt, sched = _build(0)                             # the uninterrupted run
    _seed_process(0)
    ref_losses, _, _ = _train(model, opt, sched, 0, 0, STEPS)
    ref_params = params_of(model)

    root = Path(tempfile.mkdtemp(prefix="course-resume-"))
    try:
        model, opt, sched = _build(0)                         # the same run, saved after STOP steps
        _seed_process(0)
        losses, step, position = _train(model, opt, sched, 0, 0, STOP)
        saved = {"params": params_of(model), "optim": _optimizer_state(opt), "streams": _streams(),
                 "last_epoch": sched.last_epoch, "lr": opt.param_groups[0]["lr"]}
        save_fn(str(root / "ckpt"), model=model, optimizer=opt, scheduler=sched, step=step, data_position=position)
        check_true("the checkpoint folder exists after save_checkpoint", (root / "ckpt").is_dir(),
                   hint="create the folder you are given (os.makedirs) and write your files into it")
        for kind in saved["streams"]:
            check_true(f"saving leaves {STREAM_NAMES[kind]} random state as it was", _same_stream(
                kind, _streams()[kind], saved["streams"][kind]),
                hint="read the states; do not draw random numbers while saving")
        losses += _train(model, opt, sched, step, position, STEPS)[0]
        check_true("a run that saved after step 3 and went on equals the uninterrupted run",
                   losses == ref_losses and all(torch.equal(p, ref_params[k]) for k, p in params_of(model).items()),
                   hint="saving must not change the model, the optimizer, the schedule or the random streams")

        shutil.move(str(root / "ckpt"), str(root / "copied"))  # what a new job finds on disk, nothing else
        model, opt, sched = _build(1)                         # a new process: other weights, other streams
        _seed_process(1234)
        got = load_fn(str(root / "copied"), model=model, optimizer=opt, scheduler=sched)
        check_equal("(step, data_position) returned by load_checkpoint", tuple(got) if isinstance(
            got, (tuple, list)) else got, (STOP, STOP * ACCUM),
            hint=f"return what you saved: {STOP} steps done, and the data position ({ACCUM} micro-batches per step)")
        check_true("model parameters after load_checkpoint equal those saved",
                   all(torch.equal(p, saved["params"][k]) for k, p in params_of(model).items()),
                   hint="model.state_dict() / model.load_state_dict()")
        check_true("AdamW's state after load_checkpoint (step, exp_avg, exp_avg_sq) equals the one saved",
                   _same_optimizer_state(_optimizer_state(opt), saved["optim"]),
                   hint="optimizer.state_dict() / optimizer.load_state_dict(): Adam's moments are part of the run")
        check_equal("the schedule's position (scheduler.last_epoch) after load_checkpoint", sched.last_epoch,
                    saved["last_epoch"], hint="scheduler.state_dict() / scheduler.load_state_dict()")
        check_close("the learning rate after load_checkpoint", opt.param_groups[0]["lr"], saved["lr"], rtol=0,
                    atol=0, hint="restore the optimizer's param groups and the schedule")
        for kind in saved["streams"]:                      # 'cuda' only where CUDA is present
            check_true(f"{STREAM_NAMES[kind]} random state after load_checkpoint equals the one at save time",
                       _same_stream(kind, _streams()[kind], saved["streams"][kind]), hint=RESTORE_HINTS[kind])
        tail, step, position = _train(model, opt, sched, got[0], got[1], STEPS)
        diff = max((abs(a - b) for a, b in zip(tail, ref_losses[STOP:])), default=math.inf)
        check_true(f"losses of steps {STOP}-{STEPS - 1} after the resume equal the uninterrupted run's, bit for bit "
                   f"(largest difference {diff:.1e})", tail == ref_losses[STOP:],
                   hint="every part of the state: model, optimizer, schedule, the three random streams, the data "
                        "position")
        params = params_of(model)
        check_true(f"parameters after {STEPS} steps equal the uninterrupted run's, bit for bit (relative "
                   f"difference {relative_error(params, ref_params):.1e})",
                   all(torch.equal(p, ref_params[k]) for k, p in params.items()),
                   hint="every part of the state must be restored")
        files = sorted(p.name for p in (root / "copied").rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in (root / "copied").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"losses": ref_losses, "resumed": tail, "stopped_after": STOP, "files": files, "bytes": size}
