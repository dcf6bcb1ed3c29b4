"""Tests of lesson 03's V-shaped schedules: ZB-V (Qi et al. 2023, section 6) and DualPipeV (DeepSeek's DualPipe cut
in half), written in `course_lib.parallel.pipeline_v`.

Pure functions: each rank's order equals, op for op, what PyTorch's ScheduleZBVZeroBubble / ScheduleDualPipeV compute
for it (torch.distributed.pipelining, their ``_calculate_single_rank_operations``; an overlapped forward-backward pair
and a full backward flattened to F, then B, W) for p = 1..6 and every m up to 5 p; the V placement puts the first and
the last chunk on rank 0 and hands the bottom of the V over in memory; the orders hold
`theory.pipeline.v_shape_in_flight`
micro-batches at their peak, and with equal chunk F, B, W times their simulated idle fraction is
`theory.pipeline.v_shape_bubble_fraction`; their messages, replayed as NCCL runs them, never deadlock and count
4 (p - 1) per micro-batch; a step replayed from V timelines keeps the V; bad input is refused by name.
Distributed: one launch on 2 gloo ranks (m = 2, 4) and one on 4 (m = 8) run ours and PyTorch's on the same model and
micro-batches: loss and every gradient equal to one process (fp32, rtol 1e-5, atol 1e-6), PyTorch's losses equal ours
micro-batch by micro-batch, each rank ran exactly its order. Timings are never asserted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from course_lib import theory
from course_lib.data import random_batches
from course_lib.lessons.l03_pipeline_parallel import experiments as pipeline_lab
from course_lib.model import build_model
from course_lib.one_process import train_reference
from course_lib.parallel.pipeline import build_chunks, run_schedule
from course_lib.parallel.pipeline_messages import p2p_plan
from course_lib.parallel.pipeline_schedules import (bubble_of, neighbours, peak_in_flight, position, schedule_orders,
                                                    simulate, validate_order)
from course_lib.parallel.pipeline_v import dualpipev_order, zbv_order
from course_lib.runtime.nccl_rules import replay_pairs
from pipeline_runs import ATOL, RTOL, assert_equals_one_process, launch


def _torch_order(name: str, p: int, m: int, rank: int) -> list[tuple]:
    """PyTorch's op list for `rank`, in our notation: stage s -> chunk 0 if s == rank else 1; I -> B; a full
    backward -> B, W; an overlapped forward-backward pair -> its two actions in order."""
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, name)
    actions = cls._calculate_single_rank_operations(SimpleNamespace(pp_group_size=p, _n_microbatches=m,
                                                                    num_stages=2 * p), rank)
    out: list[tuple] = []

    def add(a):
        c = 0 if a.stage_index == rank else 1
        kind = a.computation_type
        if kind == S.OVERLAP_F_B:
            for sub in a.sub_actions:
                add(sub)
        elif kind == S.FULL_BACKWARD:
            out.extend([("B", a.microbatch_index, c), ("W", a.microbatch_index, c)])
        else:
            out.append(({S.FORWARD: "F", S.BACKWARD_INPUT: "B", S.BACKWARD_WEIGHT: "W"}[kind], a.microbatch_index, c))

    for a in actions:
        if a is not None:
            add(a)
    return out


# ------------------------------------------------------------------------------ pure functions

@pytest.mark.parametrize("p", range(1, 7))
def test_orders_equal_torch_op_for_op(p):
    for m in range(1, 5 * p + 1):
        for rank in range(p):
            assert zbv_order(p, m, rank) == _torch_order("ScheduleZBVZeroBubble", p, m, rank), (p, m, rank)
            if m >= 2 * p:
                assert dualpipev_order(p, m, rank) == _torch_order("ScheduleDualPipeV", p, m, rank), (p, m, rank)


def test_zbv_order_hand_written():
    """p = 2, m = 4, rank 0 (chunk 0 = position 0, chunk 1 = position 3), phase by phase as zbv_order's docstring
    says: 2 (p - 0) - 1 = 3 forwards of chunk 0; no (F1, F0) pair; p = 2 triples (F, B, W) of chunk 1; the steady
    (F0, B0, W0, F1, B1, W1), with F0 only while micro-batches are left; then p pairs (B0, W0)."""
    ops = "F0.0 F1.0 F2.0  F0.1 B0.1 W0.1 F1.1 B1.1 W1.1  F3.0 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 F3.1 B3.1 W3.1  " \
          "B2.0 W2.0 B3.0 W3.0"
    assert zbv_order(2, 4, 0) == [(op[0], int(op[1]), int(op[3])) for op in ops.split()]


def test_v_placement():
    for p in range(1, 6):
        positions = sorted(position(r, c, p, "v") for r in range(p) for c in (0, 1))
        assert positions == list(range(2 * p))
        assert {position(0, 0, p, "v"), position(0, 1, p, "v")} == {0, 2 * p - 1}     # rank 0: first and last
        if p > 1:   # the bottom of the V: rank p - 1's chunk 0 feeds its own chunk 1
            assert neighbours(p - 1, p, 0, 2, "v")[1] == (p - 1, 1)
            assert neighbours(0, p, 1, 2, "v") == ((1, 1), None)
    with pytest.raises(ValueError, match="two chunks"):
        position(0, 2, 4, "v")
    with pytest.raises(ValueError, match="placement='w'"):
        position(0, 0, 4, "w")


@pytest.mark.parametrize("kind", ["zb-v", "dualpipev"])
def test_memory_and_bubble_equal_the_formulas(kind):
    for p in range(1, 7):
        least = 2 * p - 1 if kind == "zb-v" else 2 * p
        for m in range(1 if kind == "zb-v" else 2 * p, 5 * p + 1):
            orders = schedule_orders(kind, p, m)
            for rank, order in enumerate(orders):
                validate_order(order, m, 2)
                assert {op[0] for op in order} == {"F", "B", "W"}
                for until in ("B", "W"):   # to the B or to the W: the same peaks
                    assert peak_in_flight(order, 2, until) == theory.pipeline.v_shape_in_flight(kind, p, m, rank), \
                        (p, m, rank, until)
            if m >= least:
                tl = simulate(orders, t_f=1.0, t_b=1.0, t_w=1.0, placement="v")
                assert bubble_of(tl) == pytest.approx(theory.pipeline.v_shape_bubble_fraction(kind, p, m), abs=1e-12)
                span = max(op["end"] for ops in tl for op in ops)
                assert span - 6 * m == pytest.approx(theory.pipeline.v_shape_idle_time(kind, p, m, 1.0))
    # the loop placement would make the same orders wait for inputs that come from elsewhere: the V is needed
    with pytest.raises(ValueError, match="deadlock"):
        simulate(schedule_orders(kind, 4, 8), placement="loop")


def test_v_schedules_beat_zb_h1_and_1f1b_at_equal_times():
    """p = 4, m = 8, every chunk's F, B and W one unit (a whole stage's two): ZB-V and DualPipeV idle (p - 1) units,
    ZB-H1 (p - 1)(T_F + T_B - T_W) = 2 (p - 1), 1F1B (p - 1)(T_F + T_B + T_W) = 6 (p - 1)."""
    p, m = 4, 8
    idle = {}
    for kind, v, t in (("1f1b", 1, 2.0), ("zb-h1", 1, 2.0), ("zb-v", 2, 1.0), ("dualpipev", 2, 1.0)):
        orders = schedule_orders(kind, p, m, v)
        split = kind != "1f1b"
        tl = simulate(orders, t_f=t, t_b=t if split else 2 * t, t_w=t if split else 0.0,
                      placement="v" if v == 2 else "loop")
        idle[kind] = max(op["end"] for ops in tl for op in ops) - 6 * m
    assert idle == {"1f1b": 6 * (p - 1), "zb-h1": 2 * (p - 1), "zb-v": p - 1, "dualpipev": p - 1}


def test_zbv_ranks_are_busy_from_first_op_to_last_dualpipev_rank_0_is_not():
    """The lesson's reading of Qi et al.'s "zero bubble": with equal chunk F, B, W times every ZB-V rank's own span
    (its first op to its last) is 6 m t, all work; the step's (p - 1) t of idle is the fill. DualPipeV's rank 0 idles
    inside its own span."""
    for p in range(2, 7):
        for m in range(2 * p, 4 * p + 1):
            for kind in ("zb-v", "dualpipev"):
                tl = simulate(schedule_orders(kind, p, m), t_f=1.0, t_b=1.0, t_w=1.0, placement="v")
                own = [ops[-1]["end"] - ops[0]["start"] for ops in tl]
                if kind == "zb-v":
                    assert own == [6.0 * m] * p, (p, m, own)
                else:
                    assert own[0] > 6.0 * m, (p, m, own)
                assert [ops[0]["start"] for ops in tl] == [float(r) for r in range(p)]   # rank r starts r t late


def test_messages_never_deadlock_and_count_4_p_minus_1():
    def posts(plan):
        return [[(kind, peer) for kind, peer, _ in batch] for batch in plan if batch]

    for kind in ("zb-v", "dualpipev"):
        for p in range(1, 6):
            for m in range(2 * p if kind == "dualpipev" else 1, 3 * p + 2):
                orders = schedule_orders(kind, p, m)
                plans = [p2p_plan(orders, r, "v") for r in range(p)]
                assert replay_pairs([posts(pl) for pl in plans]) == [], (kind, p, m)
                sends = sum(1 for pl in plans for b in pl for x in b if x[0] == "S")
                assert sends == m * theory.pipeline.p2p_messages_per_microbatch(p, 2, "v"), (kind, p, m)
    assert theory.pipeline.p2p_messages_per_microbatch(4, 2, "v") == 2 * theory.pipeline.p2p_messages_per_microbatch(4)


def test_replay_keeps_the_v():
    """`experiments.replayed` reads the placement from the ops' ring positions: a simulated V step replays to itself."""
    for kind in ("zb-v", "dualpipev"):
        ideal = simulate(schedule_orders(kind, 3, 6), t_f=1.0, t_b=2.0, t_w=1.0, placement="v")
        replay = pipeline_lab.replayed(ideal)
        assert [[(o["kind"], o["mb"], o["chunk"], o["pos"], o["start"], o["end"]) for o in ops] for ops in replay] == \
            [[(o["kind"], o["mb"], o["chunk"], o["pos"], o["start"], o["end"]) for o in ops] for ops in ideal]


def test_bad_input_refused_before_launch():
    with pytest.raises(ValueError, match=r"at least 2 p = 8 micro-batches .* got m=6: use m >= 8, or ZB-V"):
        dualpipev_order(4, 6, 0)
    with pytest.raises(ValueError, match="m >= 8"):
        theory.pipeline.v_shape_bubble_fraction("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="pick 'zb-v' or 'dualpipev'"):
        theory.pipeline.v_shape_idle_time("zb-h1", 4, 8, 1.0)
    with pytest.raises(ValueError, match="2 chunks, not v=3"):
        theory.pipeline.p2p_messages_per_microbatch(4, 3, "v")
    with pytest.raises(ValueError, match="until='X'"):
        peak_in_flight(zbv_order(2, 3, 0), 2, "X")
    # an order's mistakes are named: the op that does not exist, the op that is missing
    with pytest.raises(ValueError, match=r"F of micro-batch 3 chunk 0, which does not exist: micro-batches are 0\.\.2"):
        validate_order(zbv_order(2, 3, 0) + [("F", 3, 0)], 3, 2)
    with pytest.raises(ValueError, match=r"F of micro-batch 2 chunk 1 is missing"):
        validate_order([op for op in zbv_order(2, 3, 0) if op[1:] != (2, 1)], 3, 2)   # no F, B, W of (2, 1)
    with pytest.raises(ValueError, match=r"W of micro-batch 0 chunk 1 is missing"):
        validate_order([op for op in zbv_order(2, 3, 0) if op != ("W", 0, 1)], 3, 2)
    model = build_model(pipeline_lab.pipeline_config(n_layer=6))
    with pytest.raises(ValueError, match="2 chunks, not v=3"):
        build_chunks(model, 0, 2, 3, "v")


def test_one_rank_equals_the_model():
    """p = 1 in this process: both chunks on rank 0, the B/W split, equal to the model's gradients."""
    cfg = pipeline_lab.pipeline_config(n_layer=4)
    x, y = random_batches(cfg, 4)[0]
    ref = train_reference(cfg, [(x, y)], optimizer=None)
    for order in (zbv_order(1, 2, 0), dualpipev_order(1, 2, 0)):
        model = build_model(cfg)
        out = run_schedule(build_chunks(model, 0, 1, 2, "v"), order, list(x.chunk(2)), list(y.chunk(2)),
                           plan=p2p_plan([order], 0, "v"), placement="v")
        assert sum(out["losses"]) / 2 == pytest.approx(ref["losses"][0], rel=1e-6)
        for name, q in model.named_parameters():
            torch.testing.assert_close(q.grad, ref["grads"][name], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------ distributed

@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, (2, 4), v_shaped=True)


@pytest.fixture(scope="module")
def four_ranks():
    return launch(4, (8,), v_shaped=True)


def _check(cfg, returns, p):
    ref = train_reference(cfg, random_batches(cfg, 8), optimizer=None)
    for m, runs in returns[0].items():
        expected = {"zb-v", "ScheduleZBVZeroBubble"} | ({"dualpipev", "ScheduleDualPipeV"} if m >= 2 * p else set())
        assert set(runs) == expected, (p, m)
        for key in runs:
            assert_equals_one_process(ref, returns, p, m, key)
            assert returns[0][m][key]["losses"], f"{key}: the loss is not on rank 0"
        for name in (n for n in pipeline_lab.TORCH_V_SHAPED if n in runs):
            ours = returns[0][m][pipeline_lab.TWIN[name]]["losses"]
            assert ours == pytest.approx(returns[0][m][name]["losses"], rel=1e-6, abs=0)   # micro-batch by micro-batch
        for kind in ("zb-v", "dualpipev"):
            if kind in runs:
                sent = sum(r[m][kind]["messages"] for r in returns)
                assert sent == m * theory.pipeline.p2p_messages_per_microbatch(p, 2, "v")
                for rank, r in enumerate(returns):
                    ran = [(op["kind"], op["mb"], op["chunk"]) for op in r[m][kind]["timeline"]]
                    assert ran == schedule_orders(kind, p, m)[rank]
                    assert {op["pos"] for op in r[m][kind]["timeline"]} == {rank, 2 * p - 1 - rank}


def test_two_ranks_equal_one_process_and_torch(two_ranks):
    _check(*two_ranks, 2)


def test_four_ranks_equal_one_process_and_torch(four_ranks):
    _check(*four_ranks, 4)
