"""Lesson 09's alert rules: each seed rule fires on its injected fault exactly when its duration has elapsed (not one
observation earlier), a healthy run fires nothing, an interrupted condition starts over, a recovered rule re-arms,
a NaN loss fires at once. Synthetic metric streams, pure Python."""

from __future__ import annotations

import math

import pytest

from course_lib.training.alerts import SEED_RULES, Alert, AlertEngine, Rule, evaluate

DT = 10.0                      # seconds between two observations (a logging interval)
T0 = 1000.0                    # when the fault starts
HEALTHY = dict(gpu_utilization=0.95, memory_fraction=0.60, loss=3.2, throughput=800.0, grad_norm=1.5,
               comm_fraction=0.10, sync_time_s=0.2, node_failure_rate=0.0)
RULES = {r.name: r for r in SEED_RULES}

# fault name -> (the metrics it changes, the one rule it must fire)
FAULTS = {
    "loss blow-up": (dict(loss=12.5), "loss_high"),
    "slow rank, short steps (waits 0.45 s of 1 s)": (dict(comm_fraction=0.45, sync_time_s=0.45), "comm_overhead_high"),
    "slow rank, long steps (waits 6 s of 30 s)": (dict(comm_fraction=0.20, sync_time_s=6.0), "sync_time_high"),
    "memory pressure": (dict(memory_fraction=0.95), "memory_high"),
    "input pipeline stall (low utilisation)": (dict(gpu_utilization=0.55), "gpu_utilization_low"),
    "throughput drop": (dict(throughput=320.0), "throughput_low"),
    "grad-norm spike": (dict(grad_norm=250.0), "grad_norm_high"),
    "node failures (1 of 8)": (dict(node_failure_rate=0.125), "node_failure_rate_high"),
}


def stream(fault: dict, until: float, start: float = 0.0, dt: float = DT, t0: float = T0, healthy_at=()):
    """Observations every dt from start to until (inclusive): healthy before t0, with the fault from t0 on, except
    at the times in healthy_at."""
    recs, i = [], 0
    while start + i * dt <= until:
        t = start + i * dt
        rec = dict(HEALTHY, time=t)
        rec["loss"] = 3.2 - 1e-4 * i                       # a loss that slowly goes down
        if t >= t0 and t not in healthy_at:
            rec.update(fault)
        recs.append(rec)
        i += 1
    return recs


def test_seed_rules_are_the_courses():
    got = {(r.name, r.metric, r.op, r.threshold, r.for_s) for r in SEED_RULES}
    assert got == {
        ("gpu_utilization_low", "gpu_utilization", "<", 0.80, 300), ("memory_high", "memory_fraction", ">", 0.90, 120),
        ("loss_high", "loss", ">", 10, 600), ("throughput_low", "throughput", "<", 500, 600),
        ("grad_norm_high", "grad_norm", ">", 100, 300), ("comm_overhead_high", "comm_fraction", ">", 0.30, 600),
        ("sync_time_high", "sync_time_s", ">", 5, 300), ("node_failure_rate_high", "node_failure_rate", ">", 0.05, 60),
        ("loss_nan", "loss", "nonfinite", math.inf, 0),
    }


def test_a_healthy_run_fires_nothing():
    assert evaluate(stream({}, until=10_000.0)) == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_fires_its_rule_after_its_duration_and_not_before(fault):
    change, name = FAULTS[fault]
    due = T0 + RULES[name].for_s
    alerts = evaluate(stream(change, until=due + 20 * DT))
    assert [a.rule.name for a in alerts] == [name], f"{fault}: {[str(a) for a in alerts]}"
    assert (alerts[0].t, alerts[0].since) == (due, T0)
    assert evaluate(stream(change, until=due - DT)) == [], "fired one observation before its duration"


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_condition_broken_one_sample_before_the_end_starts_over(fault):
    change, name = FAULTS[fault]
    due = T0 + RULES[name].for_s
    recs = stream(change, until=due + RULES[name].for_s + 5 * DT, healthy_at={due - DT})
    alerts = evaluate(recs)
    assert [(a.rule.name, a.since, a.t) for a in alerts] == [(name, due, due + RULES[name].for_s)]


def test_compressed_durations_with_scale():
    """scale = 1/60: five minutes become five seconds; float sample times (sums of 0.1) still fire on time."""
    change, name = FAULTS["grad-norm spike"]
    engine = AlertEngine(SEED_RULES, scale=1 / 60)
    t, fired_at = 0.0, []
    for i in range(200):                                  # t = 0.1 + 0.1 + ...: not exact multiples
        metrics = dict(HEALTHY, **(change if i >= 50 else {}))
        fired_at += [(i, a.rule.name) for a in engine.observe(t, metrics)]
        t += 0.1
    assert fired_at == [(50 + 50, name)]                  # 5 s after sample 50, at 0.1 s per sample


def test_rearms_after_recovery_and_firing_lists_the_alarm_state():
    rule = RULES["memory_high"]
    engine = AlertEngine(SEED_RULES)
    out = []
    for i in range(100):
        t = i * DT
        episode = 10 <= i < 30 or 50 <= i < 70            # two episodes of 200 s, 120 s needed
        out += [(t, a.rule.name) for a in engine.observe(t, dict(HEALTHY, memory_fraction=0.97 if episode else 0.5))]
        if i in (25, 65):
            assert engine.firing == [rule]
        if i in (35, 99):
            assert engine.firing == []
    assert out == [(100 + 120.0, "memory_high"), (500 + 120.0, "memory_high")]   # once per episode


def test_missing_metrics_neither_reset_nor_trigger():
    change, name = FAULTS["loss blow-up"]
    recs = stream(change, until=T0 + 700)
    for rec in recs:                                       # the loss is not logged for 5 minutes mid-episode
        if T0 + 100 <= rec["time"] <= T0 + 400:
            del rec["loss"]
    alerts = evaluate(recs)
    assert [(a.rule.name, a.t) for a in alerts] == [(name, T0 + 600)]
    assert evaluate([{"time": float(t)} for t in range(0, 5000, 10)]) == []


def test_nan_loss_fires_at_once_and_does_not_reset_the_loss_rule():
    recs = stream(dict(loss=12.0), until=T0 + 700)
    for rec in recs:
        if rec["time"] in (T0 + 200, T0 + 210):
            rec["loss"] = float("nan")                     # NaN > 10 is False: the loss rule must not reset on it
    alerts = evaluate(recs)
    assert [(a.rule.name, a.t) for a in alerts] == [("loss_nan", T0 + 200), ("loss_high", T0 + 600)]
    assert math.isnan(alerts[0].value)
    inf = evaluate([{"time": 0.0, "loss": math.inf}])
    assert [a.rule.name for a in inf] == ["loss_nan"]     # inf > 10 too, but the loss rule needs 10 minutes


def test_alert_reads_in_one_line_and_engine_checks_its_input():
    a = Alert(RULES["sync_time_high"], t=700.0, since=400.0, value=6.25)
    text = str(a)
    assert "\n" not in text and "sync_time_high" in text and "6.25" in text and "300.0 s" in text
    with pytest.raises(ValueError, match="op"):
        Rule("bad", "loss", ">=", 1.0, 0, "")
    engine = AlertEngine(SEED_RULES)
    engine.observe(10.0, HEALTHY)
    with pytest.raises(ValueError, match="go back"):
        engine.observe(5.0, HEALTHY)
    with pytest.raises(ValueError, match="time"):
        evaluate([{"loss": 1.0}])


def test_node_failure_rate_is_a_windowed_rate_and_the_rule_rearms():
    """`node_failure_rate` counts the failures of the last hour only (a count since the job began would only grow):
    one of 8 ranks failed at t = 1000 s -> 1/8 until t = 4600 s, then 0; the seed rule (> 5 % for 1 min) fires a
    minute after each failure, clears when the window has passed, and fires again on a later failure."""
    from course_lib.training.alerts import FAILURE_WINDOW_S, node_failure_rate

    assert FAILURE_WINDOW_S == 3600.0
    assert node_failure_rate([], 5000.0, 8) == 0.0
    assert node_failure_rate([1000.0], 999.0, 8) == 0.0                          # not yet
    assert node_failure_rate([1000.0], 1000.0, 8) == node_failure_rate([1000.0], 4599.0, 8) == 1 / 8
    assert node_failure_rate([1000.0], 4600.0, 8) == 0.0                         # an hour later: out of the window
    assert node_failure_rate([1000.0, 2000.0, 2500.0], 4000.0, 8) == 3 / 8
    assert node_failure_rate([0.0] * 20, 10.0, 8) == 1.0                          # a fraction of the nodes: at most 1
    assert node_failure_rate([1000.0], 1100.0, 8, window_s=60.0) == 0.0
    with pytest.raises(ValueError, match="nodes"):
        node_failure_rate([], 0.0, 0)
    with pytest.raises(ValueError, match="window"):
        node_failure_rate([], 0.0, 8, window_s=0.0)
    failures, engine, fired = [1000.0, 9000.0], AlertEngine(SEED_RULES), []
    for t in range(0, 14000, 30):
        metrics = dict(HEALTHY, node_failure_rate=node_failure_rate([f for f in failures if f <= t], t, 8))
        fired += [(t, a.rule.name) for a in engine.observe(float(t), metrics)]
        if t == 5000:
            assert engine.firing == [], "the alarm must clear once the failure has left the window"
    assert fired == [(1080, "node_failure_rate_high"), (9060, "node_failure_rate_high")]
