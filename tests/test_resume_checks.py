"""Lesson 09's graded check of 09-resume (course_lib/lessons/l09_training/resume_checks.py): the course's own save and
load pass, and each typical wrong one fails with a one-line message naming what was lost (torch's, Python's, NumPy's
or the CUDA generators' state, the optimizer, the schedule, the data position). Everything runs in this process.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from course_lib.lessons.l09_training import resume_checks
from course_lib.parallel import dist_checkpoint as ckpt

from check_assertions import fails_check as _fails


# ------------------------------------------------------------------------------ 09-resume

def save_reference(folder, *, model, optimizer, scheduler, step, data_position):
    ckpt.save(folder, model=model, optimizer=optimizer, scheduler=scheduler, step=step, data_position=data_position)


def load_reference(folder, *, model, optimizer, scheduler):
    state = ckpt.load(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    return state.step, state.data_position


def _save(folder, *, model, optimizer, scheduler, step, data_position, rng=("torch", "python", "numpy", "cuda")):
    os.makedirs(folder, exist_ok=True)
    streams = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        streams["cuda"] = torch.cuda.get_rng_state_all()
    rng = [k for k in rng if k in streams]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "data_position": data_position, "rng": {k: streams[k] for k in rng}},
               os.path.join(folder, "state.pt"))


def _load(folder, *, model, optimizer, scheduler, parts=("optimizer", "scheduler")):
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    if "optimizer" in parts:
        optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in parts:
        scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    if "python" in rng:
        random.setstate(rng["python"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"], state["data_position"]


def save_without_cuda(folder, **kw):                 # right on a CPU machine, wrong where CUDA is present
    _save(folder, rng=("torch", "python", "numpy"), **kw)


def save_torch_rng_only(folder, **kw):
    _save(folder, rng=("torch",), **kw)


def load_no_optimizer(folder, **kw):
    return _load(folder, parts=("scheduler",), **kw)


def load_no_scheduler(folder, **kw):
    return _load(folder, parts=("optimizer",), **kw)


def load_step_as_position(folder, **kw):
    step, _ = _load(folder, **kw)
    return step, step


def save_draws_a_number(folder, **kw):             # e.g. a random file name: moves torch's stream
    torch.rand(1)
    _save(folder, **kw)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")      # dist_checkpoint on one process
def test_resume_references_pass():
    for save, load in ((save_reference, load_reference), (_save, _load)):
        out = resume_checks.check_resume(save, load)
        assert out["resumed"] == out["losses"][resume_checks.STOP:] and out["files"]


@pytest.mark.parametrize("save, load, where", [
    (save_torch_rng_only, _load, "Python's random state after load_checkpoint"),
    (_save, load_no_optimizer, "AdamW's state after load_checkpoint"),
    (_save, load_no_scheduler, "schedule's position"),
    (_save, load_step_as_position, r"\(step, data_position\) returned by load_checkpoint"),
    (save_draws_a_number, _load, "saving leaves torch's random state as it was")])
def test_wrong_resumes_fail_naming_what_was_lost(save, load, where):
    _fails(where, resume_checks.check_resume, save, load)


def test_a_load_that_draws_random_numbers_after_restoring_fails():
    def load_reseeding(folder, **kw):
        out = _load(folder, **kw)
        torch.manual_seed(0)
        return out
    _fails("torch's random state after load_checkpoint", resume_checks.check_resume, _save, load_reseeding)


@pytest.fixture
def cuda_present(monkeypatch):
    """CUDA present, as the checks and the answers see it, on a CPU machine: one GPU whose generator state is a small
    tensor, set by torch.manual_seed (through torch.cuda.manual_seed_all) and by set_rng_state_all."""
    gen = {"states": [torch.zeros(8, dtype=torch.uint8)]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)   # AdamW asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in gen["states"]])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: gen.update(states=[t.clone() for t in states]))
    monkeypatch.setattr(torch.cuda, "manual_seed_all",
                        lambda seed: gen.update(states=[torch.full((8,), int(seed) % 251, dtype=torch.uint8)]))
    return gen


def test_resume_check_leaves_the_cuda_generators_out_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: there the CUDA generators must be saved")
    out = resume_checks.check_resume(save_without_cuda, _load)        # nothing to save: the same answer passes
    assert out["resumed"] == out["losses"][resume_checks.STOP:]


def test_resume_check_compares_the_cuda_generators_where_cuda_is_present(cuda_present):
    """Where CUDA is present the table's CUDA row counts: an answer that saves torch's, Python's and NumPy's
    generators but not the CUDA ones fails, naming them; the solution's way passes. (dist_checkpoint's own save would
    open a CUDA stream, which this fake CUDA does not have.)"""
    resume_checks.check_resume(_save, _load)
    msg = _fails("the CUDA generators' random state after load_checkpoint", resume_checks.check_resume,
                 save_without_cuda, _load)
    assert "torch.cuda" in msg
