"""Tests of lesson 03's pipeline parallelism (course_lib/parallel/pipeline*.py, course_lib/theory/pipeline.py).

Pure schedule functions are checked against hand-written orders and their invariants; the pipelined step on
2 and 4 gloo ranks is compared with one process on the same batch (loss and every gradient, fp32) for
m = 1..8, and with torch.distributed.pipelining. One launch per world size (each costs seconds of start-up).
Timings are never asserted here: benchmarks/bench_pipeline.py prints the measured bubble table.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from course_lib import theory
from course_lib.config import ConfigError
from course_lib.data import random_batches
from course_lib.runtime.launch import run
from course_lib.lessons.l03_pipeline_parallel import experiments as pipeline_lab
from course_lib.model import build_model
from course_lib.one_process import train_reference
from course_lib.parallel.pipeline import build_stage, sequential_loss, split_microbatches
from course_lib.parallel.pipeline_schedules import (bubble_of, gpipe_order, one_f_one_b_order, peak_in_flight,
                                                    schedule_orders, simulate, split_stages, validate_order)

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value

MS = range(1, 9)


# ------------------------------------------------------------------------------ pure functions

def test_split_stages_balanced_and_contiguous():
    assert split_stages(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_stages(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_stages(5, 1) == [(0, 5)]
    for n in range(1, 13):
        for p in range(1, n + 1):
            r = split_stages(n, p)
            assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="cannot split"):
        split_stages(2, 3)


def test_orders_match_hand_written():
    assert gpipe_order(2, 3, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    # p=4, m=6: rank 0 warms up with 3 forwards, rank 3 (last) alternates from the start
    assert one_f_one_b_order(4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                          ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b_order(4, 6, 3) == [x for i in range(6) for x in (("F", i), ("B", i))]
    assert one_f_one_b_order(4, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]   # warm-up capped at m


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_schedule_invariants(p):
    for m in MS:
        for kind in ("gpipe", "1f1b"):
            orders = schedule_orders(kind, p, m)
            for rank, order in enumerate(orders):
                validate_order(order, m)
                assert peak_in_flight(order) == theory.pipeline.peak_microbatches_in_flight(kind, p, m, rank)
            # ideal timeline with uniform stages: the bubble is exactly (p-1)/(m+p-1), for any t_b / t_f
            for t_b in (1.0, 2.0, 3.0):
                tl = simulate(orders, t_f=1.0, t_b=t_b)
                assert bubble_of(tl) == pytest.approx(theory.pipeline.bubble_fraction(p, m), abs=1e-12)
                assert max(op["end"] for r in tl for op in r) == pytest.approx(theory.pipeline.step_time(p, m, 1.0, t_b))


def test_simulate_detects_deadlock():
    bad = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError):
        validate_order(bad[0], 1)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


def test_theory_formulas():
    assert theory.pipeline.bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert theory.pipeline.bubble_ratio(4, 12) == pytest.approx(3 / 12)
    assert theory.pipeline.interleaved_bubble_fraction(4, 12, 1) == theory.pipeline.bubble_fraction(4, 12)
    assert theory.pipeline.interleaved_bubble_fraction(4, 12, 2) == pytest.approx(3 / 27)
    assert theory.pipeline.zero_bubble_idle_time(4, 1, 1, 1) == pytest.approx(theory.pipeline.one_f_one_b_idle_time(4, 1, 1, 1) / 3)
    assert theory.pipeline.bubble_fraction(1, 5) == 0.0


def test_stages_chained_equal_the_model():
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    x, y = random_batches(cfg, 4)[0]
    model = build_model(cfg)
    expected = model.loss(x, y)
    for p in (1, 2, 3, 4):
        torch.testing.assert_close(sequential_loss(model, x, y, p), expected, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        build_stage(build_model(pipeline_lab.pipeline_config(tie_embeddings=True)), 0, 2)
    with pytest.raises(ValueError, match="multiple of 3"):
        split_microbatches(x, 3)


# ------------------------------------------------------------------------------ distributed

def _rank_checks(cfg, torch_ms, mem_ms):
    out = {}
    for m in MS:   # a batch of 2m rows: every micro-batch has 2 rows
        out.update(pipeline_lab.rank_correctness(cfg, 2 * m, [m], torch_ms=[m] if m in torch_ms else ()))
    out["memory"] = pipeline_lab.rank_memory(cfg, 2, mem_ms)
    return out


def _check_against_reference(returns, cfg, p):
    refs = {}
    for key in [k for k in returns[0] if k != "memory"]:
        kind, m = key
        if m not in refs:
            refs[m] = train_reference(cfg, random_batches(cfg, 2 * m), optimizer=None)
        ref = refs[m]
        grads = {}
        for r in returns:
            assert not set(grads) & set(r[key]["grads"]), f"{key}: a parameter on two ranks"
            grads.update(r[key]["grads"])
        assert grads.keys() == ref["grads"].keys(), f"{key}: p={p} misses parameters"
        for name in grads:
            if torch.allclose(grads[name], ref["grads"][name], rtol=1e-5, atol=1e-7):
                continue
            torch.testing.assert_close(grads[name], ref["grads"][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda s: f"{key} p={p} grad {name}: {s}")
        losses = returns[-1][key]["losses"]
        assert len(losses) == m
        assert sum(losses) / m == pytest.approx(ref["losses"][0], rel=1e-6), f"{key} p={p}: loss differs"


def _check_memory(returns, p, mem_ms):
    for rank, r in enumerate(returns):
        mem = r["memory"]
        for m in mem_ms:
            g, f = mem[("gpipe", m)], mem[("1f1b", m)]
            assert g["peak"] == m * g["per_mb"], f"GPipe holds all {m} micro-batches on rank {rank}"
            assert f["peak"] == min(p - rank, m) * f["per_mb"], f"1F1B holds min(p-rank, m) on rank {rank}"
            assert f["peak"] <= g["peak"] * min(p, m) / m + 1e-9


@pytest.fixture(scope="module")
def two_ranks():
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    res = run(_rank_checks, nprocs=2, args=(cfg, (1, 2, 5, 8), (2, 4, 8)), timeout_s=180, stream=False,
              backend="gloo")
    return cfg, res.returns


@pytest.fixture(scope="module")
def four_ranks():
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    res = run(_rank_checks, nprocs=4, args=(cfg, (4, 7), (4, 8)), timeout_s=240, stream=False,
              backend="gloo")
    return cfg, res.returns


def test_two_ranks_equal_one_process(two_ranks):
    cfg, returns = two_ranks
    _check_against_reference(returns, cfg, 2)
    assert ("torch-1f1b", 8) in returns[0] and ("torch-gpipe", 1) in returns[0]


def test_two_ranks_activation_memory(two_ranks):
    _check_memory(two_ranks[1], 2, (2, 4, 8))


def test_four_ranks_equal_one_process(four_ranks):
    cfg, returns = four_ranks
    _check_against_reference(returns, cfg, 4)


def test_four_ranks_activation_memory(four_ranks):
    returns = four_ranks[1]
    _check_memory(returns, 4, (4, 8))
    g, f = returns[0]["memory"][("gpipe", 8)], returns[0]["memory"][("1f1b", 8)]
    assert f["peak"] / g["peak"] == pytest.approx(4 / 8)      # 1F1B: p/m of GPipe on the first stage
