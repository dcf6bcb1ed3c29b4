"""Tests of lesson 03's schedules beyond 1F1B: interleaved 1F1B (Narayanan et al. 2021) and ZB-H1 (Qi et al. 2023).

Pure functions: the orders validate and simulate for many (p, v, m); the activations they hold equal
`theory.pipeline.interleaved_in_flight` / 1F1B's; the simulated bubble equals the formulas (assumptions: equal chunks,
free communication, t_f and t_b per chunk for interleaving; t_F = t_B = t_W and m >= p for ZB-H1); every rank's
messages, replayed as NCCL runs them, never deadlock, and count 2 (v p - 1) per micro-batch ((v p - 1) / (p - 1)
times 1F1B's: 3 at p = v = 2, not v); a measured step replayed from its op times ignores one stretched op; bad input
is refused by name.
Distributed: one launch on 2 gloo ranks and one on 4 (v = 2) run our 1F1B, interleaved 1F1B and ZB-H1 and PyTorch's
ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble on the same model and micro-batches (the V-shaped ZB-V and
DualPipeV, and PyTorch's twins of them: tests/test_pipeline_v.py):
loss and every gradient equal to one process (fp32, rtol 1e-5, atol 1e-6: summation order only; a missing W or a
chunk fed the wrong input is off by far more). Timings are never asserted.
"""

from __future__ import annotations


import pytest
import torch

from course_lib import theory
from course_lib.data import random_batches
from course_lib.lessons.l03_pipeline_parallel import experiments as pipeline_lab
from course_lib.model import build_model
from course_lib.runtime.nccl_rules import replay_pairs
from pipeline_runs import ATOL, RTOL, assert_equals_one_process, launch
from course_lib.one_process import train_reference
from course_lib.parallel.pipeline import build_chunks, run_schedule
from course_lib.parallel.pipeline_messages import adjacent_plan, p2p_plan
from course_lib.parallel.pipeline_schedules import (bubble_of, interleaved_order, one_f_one_b_order,
                                                    peak_in_flight, schedule_orders, simulate, validate_interleaving,
                                                    validate_order, zb_h1_order)


CASES = [(p, v, m) for p in range(1, 7) for v in (1, 2, 3, 4) for m in range(p, 4 * p + 1, p)]


# ------------------------------------------------------------------------------ pure functions

def test_interleaved_order_hand_written():
    # p=2, v=2, m=4, rank 0: warm-up 2(p-1) + (v-1)p = 4 chunk-forwards (micro-batches in groups of p per chunk)
    assert interleaved_order(2, 2, 4, 0) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1),
        ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    # v = 1 is not 1F1B: Megatron-LM's warm-up 2(p - rank - 1) is twice 1F1B's p - rank - 1
    assert interleaved_order(3, 1, 6, 0)[:5] == [("F", i, 0) for i in range(5)]
    assert interleaved_order(2, 2, 2, 0)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1)]  # m = p: all F


@pytest.mark.parametrize("p", range(1, 7))
def test_interleaved_invariants(p):
    for pp, v, m in [c for c in CASES if c[0] == p]:
        orders = schedule_orders("interleaved", p, m, v)
        for rank, order in enumerate(orders):
            validate_order(order, m, v)
            assert peak_in_flight(order, v) == pytest.approx(theory.pipeline.interleaved_in_flight(p, v, m, rank),
                                                             abs=1e-12), (p, v, m, rank)
        for t_b in (1.0, 2.0, 3.0):   # t_f, t_b of one chunk: equal chunks, free communication
            tl = simulate(orders, t_f=1.0, t_b=t_b)
            assert bubble_of(tl) == pytest.approx(theory.pipeline.interleaved_bubble_fraction(p, m, v), abs=1e-12)
    if p > 1:   # interleaving holds more than 1F1B on the first rank
        assert peak_in_flight(interleaved_order(p, 2, 2 * p, 0)) > peak_in_flight(one_f_one_b_order(p, 2 * p, 0))


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_h1_invariants(p):
    for m in range(1, 3 * p + 2):
        orders = schedule_orders("zb-h1", p, m)
        for rank, order in enumerate(orders):
            validate_order(order, m)
            assert [op for op in order if op[0] != "W"] == one_f_one_b_order(p, m, rank)   # 1F1B's F and B
            assert peak_in_flight(order) == theory.pipeline.peak_microbatches_in_flight("zb-h1", p, m, rank)
            live = peak = 0                                                                 # F..W at most p
            for kind, _ in order:
                live += {"F": 1, "B": 0, "W": -1}[kind]
                peak = max(peak, live)
            assert peak <= p
        if m < p:
            continue           # the formula assumes a full pipeline (m >= p)
        for t_f, t_b, t_w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.0, 0.5)):
            tl = simulate(orders, t_f=t_f, t_b=t_b, t_w=t_w)
            idle = max(op["end"] for ops in tl for op in ops) - m * (t_f + t_b + t_w)
            assert idle == pytest.approx(theory.pipeline.zero_bubble_idle_time(p, t_f, t_b, t_w), abs=1e-9)
            assert bubble_of(tl) == pytest.approx(theory.pipeline.zero_bubble_fraction(p, m, t_f, t_b, t_w))
        # 1F1B with B and W as one backward of t_B + t_W waits (p-1)(t_F + t_B + t_W)
        tl = simulate(schedule_orders("1f1b", p, m), 1.0, 2.0)
        assert max(op["end"] for ops in tl for op in ops) - 3 * m == pytest.approx(
            theory.pipeline.one_f_one_b_idle_time(p, 1.0, 1.0, 1.0))


def test_validate_order_refuses_wrong_orders():
    with pytest.raises(ValueError, match="before its B"):
        validate_order([("F", 0), ("W", 0), ("B", 0)], 1)
    with pytest.raises(ValueError, match="W after the B of every"):
        validate_order([("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1)], 2)
    with pytest.raises(ValueError, match="chunk 1"):
        validate_order([("F", 0, 0), ("B", 0, 1), ("F", 0, 1), ("B", 0, 0)], 1)
    validate_order(one_f_one_b_order(3, 4, 0), 4)           # 2-tuples still mean chunk 0
    # a backward of the wrong chunk first deadlocks the pipeline
    orders = schedule_orders("interleaved", 2, 2, 2)
    bad = [list(o) for o in orders]
    k = next(k for k, op in enumerate(bad[0]) if op[0] == "B")
    j = next(j for j in range(k + 1, len(bad[0])) if bad[0][j][0] == "B" and bad[0][j][2] != bad[0][k][2])
    bad[0][k], bad[0][j] = bad[0][j], bad[0][k]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


def test_messages_never_deadlock_and_count_2_vp_minus_1_per_microbatch():
    def posts(plan):
        return [[(kind, peer) for kind, peer, _ in batch] for batch in plan if batch]

    for kind in ("gpipe", "1f1b", "zb-h1", "interleaved"):
        for p in range(1, 6):
            for v in ((1, 2, 3) if kind == "interleaved" else (1,)):
                for m in (range(p, 3 * p + 1, p) if kind == "interleaved" else range(1, 2 * p + 2)):
                    orders = schedule_orders(kind, p, m, v)
                    plans = [p2p_plan(orders, r) for r in range(p)]
                    assert replay_pairs([posts(pl) for pl in plans]) == [], (kind, p, v, m)
                    sends = sum(1 for pl in plans for b in pl for x in b if x[0] == "S")
                    if p > 1:   # on one rank the chunks hand over in memory
                        assert sends == m * theory.pipeline.p2p_messages_per_microbatch(p, v)
                    if v == 1:   # the runner's default posts, from one rank's order alone
                        assert replay_pairs([posts(adjacent_plan(o, r, p)) for r, o in enumerate(orders)]) == []
    # the runner's default on p = 2 interleaved would deadlock on NCCL: why p2p_plan exists
    orders = schedule_orders("interleaved", 2, 4, 2)
    naive = [[[(k, 1 - r) for k, _, _ in b] for b in _adjacent_like(o, r)] for r, o in enumerate(orders)]
    assert replay_pairs([[b for b in pl if b] for pl in naive]) != []


def test_interleaving_sends_three_times_1f1b_at_p_2_v_2():
    """Lesson 03's "(vp - 1)/(p - 1) times as many": counted from the sends of the course's own schedules, 3 at p = v = 2
    (6 messages per micro-batch against 2), 7/3 at p = 4, v = 2."""
    def sends(kind, p, v, m):
        orders = schedule_orders(kind, p, m, v)
        return sum(1 for r in range(p) for b in p2p_plan(orders, r) for x in b if x[0] == "S")

    assert sends("interleaved", 2, 2, 4) == 6 * 4 and sends("1f1b", 2, 1, 4) == 2 * 4
    assert sends("interleaved", 2, 2, 4) == 3 * sends("1f1b", 2, 1, 4)
    assert sends("interleaved", 4, 2, 8) * 3 == 7 * sends("1f1b", 4, 1, 8)


def test_replay_of_a_measured_step_ignores_one_stretched_op():
    """`experiments.replayed`: an ideal timeline replays to itself; one op stretched 5x (the scheduler, not the schedule)
    leaves the replay unchanged, while the raw bubble moves."""
    for kind, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        ideal = simulate(schedule_orders(kind, 4, 8, v), t_f=1.0, t_b=2.0, t_w=1.0)
        measured = [[dict(op) for op in ops] for ops in ideal]
        op = measured[3][5]
        op["end"] = op["start"] + 5 * (op["end"] - op["start"])
        for tl in (ideal, measured):
            replay = pipeline_lab.replayed(tl)
            assert [[(o["kind"], o["mb"], o["chunk"], o["start"], o["end"]) for o in ops] for ops in replay] == \
                [[(o["kind"], o["mb"], o["chunk"], o["start"], o["end"]) for o in ops] for ops in ideal], kind
        assert bubble_of(measured) != bubble_of(ideal)
        assert pipeline_lab.span_of(pipeline_lab.replayed(measured)) == pipeline_lab.span_of(ideal)


def test_a_measured_step_is_drawn_replayed_and_raw_only_with_a_core_per_rank():
    """Lesson 03's charts: the replay always, labelled and naming the hardware; the raw timeline only when own_cores."""
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.lessons.l03_pipeline_parallel import report

    tl = simulate(schedule_orders("interleaved", 2, 4, 2), t_f=1.0, t_b=2.0)
    for own, panels in ((False, 1), (True, 2)):
        fig = report.step_gantt(tl, "CPU: test, gloo", "interleaved, p=2", own)
        titles = [ax.get_title() for ax in fig.axes]
        assert len(titles) == panels
        assert "replayed from measured per-op times" in titles[0] and "CPU: test, gloo" in titles[0]
        assert own == any("measured (idle" in t and "CPU: test, gloo" in t for t in titles[1:])
        matplotlib.pyplot.close(fig)


def _adjacent_like(order, rank, p=2, v=2):
    """'previous output with next input' for chunks: the rule p2p_plan replaces."""
    from course_lib.parallel.pipeline_schedules import neighbours, op_parts
    plan, send = [], None
    for op in order + [None]:
        batch = [("S", send, None)] if send is not None else []
        if op is not None:
            kind, i, c = op_parts(op)
            prev, nxt = neighbours(rank, p, c, v)
            src, dst = (prev, nxt) if kind == "F" else (nxt, prev)
            if src:
                batch.append(("R", src[0], None))
            send = dst[0] if dst else None
        plan.append(batch)
    return plan


def test_bad_input_refused_before_launch():
    with pytest.raises(ValueError, match=r"m=3 .*multiple of 2"):
        validate_interleaving(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"v=3 .*n_layers=8 must be a multiple of p\*v=6"):
        validate_interleaving(2, 3, 2, 8)
    with pytest.raises(ValueError, match=r"p=5 stages is more than the model's n_layers=4"):
        validate_interleaving(5, 1, 5, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        interleaved_order(4, 2, 6, 0)
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    model = build_model(cfg)
    with pytest.raises(ValueError, match=r"p\*v=8"):
        build_chunks(model, 0, 2, 4)
    x, y = random_batches(cfg, 2)[0]
    with pytest.raises(ValueError, match="p2p_plan"):
        run_schedule(build_chunks(model, 0, 1, 2), interleaved_order(1, 2, 1, 0), [x], [y])
    with pytest.raises(ValueError, match="zb-h1"):
        schedule_orders("zb-h2", 2, 2)


def test_one_rank_chunks_and_split_backward_equal_the_model():
    """p = 1 in this process: v = 2 chunks, and the B/W split, give the model's gradients; without W they do not."""
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    x, y = random_batches(cfg, 4)[0]
    ref = train_reference(cfg, [(x, y)], optimizer=None)
    for order, v in ((interleaved_order(1, 2, 2, 0), 2), (zb_h1_order(1, 2, 0), 1)):
        model = build_model(cfg)
        stage = build_chunks(model, 0, 1, v) if v > 1 else build_chunks(model, 0, 1, 1)[0]
        out = run_schedule(stage, order, list(x.chunk(2)), list(y.chunk(2)),
                           plan=p2p_plan([order], 0) if v > 1 else None)
        assert sum(out["losses"]) / 2 == pytest.approx(ref["losses"][0], rel=1e-6)
        for name, q in model.named_parameters():
            torch.testing.assert_close(q.grad, ref["grads"][name], rtol=RTOL, atol=ATOL)
        assert {op["kind"] for op in out["timeline"]} == ({"F", "B"} if v > 1 else {"F", "B", "W"})


def test_a_split_backward_without_its_w_fails(monkeypatch):
    """The comparison can fail: W that computes nothing leaves the weights without gradients."""
    from course_lib.parallel import pipeline
    monkeypatch.setattr(pipeline, "backward_weight", lambda outputs, grads: None)
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    x, y = random_batches(cfg, 4)[0]
    model = build_model(cfg)
    run_schedule(build_chunks(model, 0, 1, 1)[0], zb_h1_order(1, 2, 0), list(x.chunk(2)), list(y.chunk(2)))
    assert all(q.grad is None for q in model.parameters())


# ------------------------------------------------------------------------------ distributed

@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, (2, 4))


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, (4,))


def _check(cfg, returns, p):
    ref = train_reference(cfg, random_batches(cfg, 8), optimizer=None)
    for m, runs in returns[0].items():
        for key in runs:
            assert_equals_one_process(ref, returns, p, m, key)
        ours = [x for r in returns for x in r[m]["interleaved"]["losses"]]
        torch_losses = [x for r in returns for x in r[m]["ScheduleInterleaved1F1B"]["losses"]]
        assert ours == pytest.approx(torch_losses, rel=1e-6, abs=0)     # micro-batch by micro-batch
        for kind, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
            sent = sum(r[m][kind]["messages"] for r in returns)
            assert sent == m * theory.pipeline.p2p_messages_per_microbatch(p, v)
        for rank, r in enumerate(returns):
            tl = r[m]["zb-h1"]["timeline"]
            assert [op["kind"] for op in tl] == [op[0] for op in zb_h1_order(p, m, rank)]
            tl = r[m]["interleaved"]["timeline"]
            assert [(op["kind"], op["mb"], op["chunk"]) for op in tl] == interleaved_order(p, 2, m, rank)


def test_two_ranks_equal_one_process_and_torch(two_ranks):
    _check(*two_ranks, 2)


def test_four_ranks_equal_one_process_and_torch(four_ranks):
    _check(*four_ranks, 4)
