"""course_lib.lessons.l03_pipeline_parallel.checks: 03-interleaved-order is judged by its rules (all the work,
dependencies, interleaving's bubble, the memory cap), so every valid order passes and each broken rule fails."""

from __future__ import annotations

import pytest

from course_lib.grading.check import CheckFailed
from course_lib.lessons.l03_pipeline_parallel.checks import (HIDDEN_INTERLEAVED_CASES, INTERLEAVED_CASES,
                                                             check_interleaved_orders)
from course_lib.parallel import pipeline_schedules as schedules


def interleaved(warmup, forward=None, reverse=True):
    """An interleaved order with a given warm-up(p, v, m, rank) and (micro-batch, chunk) of forward number k."""
    def order(p, v, m, rank):
        def op(kind, k):
            i, c = forward(p, v, m, k) if forward else ((k // (p * v)) * p + k % p, (k % (p * v)) // p)
            return kind, i, (v - 1 - c if kind == "B" and reverse else c)
        total = v * m
        w = min(warmup(p, v, m, rank), total)
        ops = [op("F", k) for k in range(w)]
        for k in range(total - w):
            ops += [op("F", w + k), op("B", k)]
        return ops + [op("B", k) for k in range(total - w, total)]
    return order


megatron_core = interleaved(lambda p, v, m, r: 2 * (p - r - 1) + (v - 1) * p)   # no all-forwards case at m = p
free_messages = interleaved(lambda p, v, m, r: (p - r - 1) + (v - 1) * p)     # the least warm-up with free messages


def test_the_reference_and_megatron_core_today_both_pass():
    assert check_interleaved_orders(schedules.interleaved_order, HIDDEN_INTERLEAVED_CASES) == 80
    assert check_interleaved_orders(megatron_core, HIDDEN_INTERLEAVED_CASES) == 80
    # they differ (at m = p the older Megatron-LM runs every forward first), so one reference order would refuse one
    assert megatron_core(3, 2, 3, 2) != schedules.interleaved_order(3, 2, 3, 2)
    assert any(megatron_core(*c[:3], r) != schedules.interleaved_order(*c[:3], r)
               for c in INTERLEAVED_CASES for r in range(c[0]))


def test_other_valid_orders_pass():
    """A shorter warm-up (enough when messages are free), 1F1B's order with its chunk named (v = 1), and lists."""
    assert check_interleaved_orders(free_messages, HIDDEN_INTERLEAVED_CASES) == 80
    one_f_one_b = lambda p, v, m, rank: [(*op, 0) for op in schedules.one_f_one_b_order(p, m, rank)]  # noqa: E731
    assert check_interleaved_orders(one_f_one_b, [c for c in HIDDEN_INTERLEAVED_CASES if c[1] == 1]) == 20
    as_lists = lambda p, v, m, rank: [list(op) for op in schedules.interleaved_order(p, v, m, rank)]  # noqa: E731
    assert check_interleaved_orders(as_lists) == len(INTERLEAVED_CASES)


@pytest.mark.parametrize("order, match", [
    (interleaved(lambda p, v, m, r: 2 * (p - r - 1) + (v - 1) * p, reverse=False), "orders of all ranks run together"),
    (interleaved(lambda p, v, m, r: 2 * (p - 1) + (v - 1) * p), r"rank 1: activations in flight"),
    (interleaved(lambda p, v, m, r: 2 * (p - r - 1) + (v - 1) * p, forward=lambda p, v, m, k: (k // v, k % v)),
     "simulated bubble with t_b = 2 t_f"),
    (interleaved(lambda p, v, m, r: 2 * (p - r - 1) + (v - 1) * p + 2), "activations in flight"),
    (lambda p, v, m, rank: schedules.interleaved_order(p, v, m, rank)[:-1], r"every \(micro-batch, chunk\) once"),
    (lambda p, v, m, rank: [op[:2] for op in schedules.interleaved_order(p, v, m, rank)], "ops are"),
], ids=["backward chunks not reversed", "rank 0's warm-up everywhere", "no groups of p", "warm-up two too long",
        "a backward missing", "no chunk index"])
def test_each_broken_rule_fails_with_one_line(order, match):
    with pytest.raises(CheckFailed, match=match) as caught:
        check_interleaved_orders(order, HIDDEN_INTERLEAVED_CASES)
    assert "\n" not in str(caught.value) and len(str(caught.value)) <= 600


def test_the_bubble_bound_is_tight():
    """Megatron-LM's order meets the bound exactly, with chunk-backwards twice and once as long as chunk-forwards
    (the two ratios the check runs), so the bound leaves no room for a schedule that waits more."""
    p, v, m = 4, 2, 8
    orders = schedules.schedule_orders("interleaved", p, m, v)
    for ratio in (2.0, 1.0):
        bubble = schedules.bubble_of(schedules.simulate(orders, t_f=1.0, t_b=ratio))
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
