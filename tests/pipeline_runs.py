"""What lesson 03's distributed schedule tests share (tests/test_pipeline_interleaved.py, tests/test_pipeline_v.py):
one schedule's step on gloo ranks, held against one process. Not a test module."""

from __future__ import annotations

import pytest
import torch

RTOL, ATOL = 1e-5, 1e-6     # fp32: summation order only; a missing W or a chunk fed the wrong input is off by far more


def assert_equals_one_process(ref: dict, returns: list, p: int, m: int, key: str) -> list[float]:
    """Schedule ``key``'s step at m micro-batches, gathered from every rank's ``returns[rank][m][key]`` (grads and
    losses, as `experiments.rank_beyond_1f1b` returns them): every parameter on exactly one rank, each gradient and the
    mean loss equal to one process's (``ref``: `one_process.train_reference`). Returns the m losses, rank by rank."""
    assert "error" not in returns[0][m][key], f"{key} refused on gloo: {returns[0][m][key].get('error')}"
    grads = {}
    for r in returns:
        assert not set(grads) & set(r[m][key]["grads"]), f"{key}: a parameter on two ranks"
        grads.update(r[m][key]["grads"])
    assert grads.keys() == ref["grads"].keys(), f"{key} p={p} m={m}: misses parameters"
    for name, g in ref["grads"].items():
        torch.testing.assert_close(grads[name], g, rtol=RTOL, atol=ATOL,
                                   msg=lambda s: f"{key} p={p} m={m} grad {name}: {s}")
    losses = [x for r in returns for x in r[m][key]["losses"]]
    assert len(losses) == m
    assert sum(losses) / m == pytest.approx(ref["losses"][0], rel=1e-6), f"{key} p={p} m={m}"
    return losses


def _rank_all(cfg, batch: int, ms, v_shaped: bool) -> dict:
    from course_lib.lessons.l03_pipeline_parallel import experiments as pipeline_lab
    if v_shaped:
        return {m: pipeline_lab.rank_v_schedules(cfg, batch, m) for m in ms}
    return {m: pipeline_lab.rank_beyond_1f1b(cfg, batch, m, v=2) for m in ms}


def launch(p: int, ms, v_shaped: bool = False):
    """One gloo launch of p ranks running, for each m of ``ms``, lesson 03's schedules beyond 1F1B (ours and
    PyTorch's: `rank_beyond_1f1b`, v = 2) or the V-shaped ones (`rank_v_schedules`) on a model of 2 p blocks (2 p
    chunks of one block) and a batch of 8. Returns (config, every rank's returns)."""
    import sys

    import cloudpickle

    from course_lib.lessons.l03_pipeline_parallel import experiments as pipeline_lab
    from course_lib.runtime.launch import run

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = pipeline_lab.pipeline_config(n_layer=2 * p)
    res = run(_rank_all, nprocs=p, args=(cfg, 8, ms, v_shaped), timeout_s=240, stream=False, backend="gloo")
    return cfg, res.returns
