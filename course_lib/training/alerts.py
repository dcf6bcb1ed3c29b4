"""A small alert-rule engine for a training run's metrics (lesson 09).

A rule fires when its condition has held for a duration, as Prometheus' alerting rules do (``expr`` with
``for:``): one noisy sample does not page anyone, a condition that lasts does, once.

One difference from Prometheus, on purpose: Prometheus checks that the alert "continues to be active during each
evaluation" (its documentation of ``for``), and an evaluation in which ``expr`` returns nothing for the series ends
the pending alert, so that ``for:`` starts over. A NaN sample does that (a comparison with NaN is false, so the
series drops out of the result), and so does a missing sample (the series went stale: no sample for 5 minutes, or
a failed scrape). This engine ignores a NaN or a missing metric instead: the episode neither ends nor advances.
A run logs NaN exactly when it is in trouble, and a run that logs every ``logging.interval`` steps has no sample
in between; neither should restart a 10-minute clock.

    engine = AlertEngine(SEED_RULES, scale=1 / 60)        # the rules' minutes become seconds
    for alert in engine.observe(time.time(), {"loss": 11.2, "grad_norm": 3.1}):
        print(alert)
    evaluate(records, SEED_RULES)                          # a recorded stream: dicts with a "time" key (s)

Semantics of `AlertEngine.observe` at time t, for each rule:
  - the metric is missing (or NaN for a '>'/'<' rule: NaN compares false with every threshold, so it says
    nothing about the threshold): nothing changes, neither a reset nor a trigger;
  - the condition holds: an episode starts at the first such observation (``since``); the rule fires once, at
    the first observation with t - since >= for_s * scale, and stays in the alarm state (``engine.firing``);
  - the condition does not hold: the episode ends (and the alarm clears); a later episode may fire again.
The engine judges by the samples it is given: a condition is "held continuously" when no observation in
between contradicted it. ``scale`` multiplies every duration: 1.0 is the rules as written (production); a test or a
CPU lesson compresses 5 minutes into 5 seconds with scale = 1/60. Times are seconds; t must not go backwards.

The seed course's production rules (`SEED_RULES`) and their units:
    gpu_utilization    fraction of time the GPU is busy, 0-1         < 0.80   for 5 min
    memory_fraction    memory in use / memory available, 0-1        > 0.90   for 2 min
    loss               training loss (nats)                          > 10     for 10 min
    throughput         samples/s for the whole job (the seed's 500 is a rate of sequences, not tokens:
                       a GPT-2 job at 500 tokens/s would be stalled) < 500    for 10 min
    grad_norm          global gradient norm before clipping          > 100    for 5 min
    comm_fraction      communication (waiting) time / step time, 0-1 > 0.30   for 10 min
    sync_time_s        time in a step's synchronisation, seconds     > 5      for 5 min
    node_failure_rate  nodes (ranks) that failed in the last hour / nodes, 0-1: a windowed rate
                       (`node_failure_rate`), back to 0 an hour after a failure   > 0.05   for 1 min
plus ``loss_nan``: the loss is NaN or infinite, at once (for 0 s); it is the one rule a NaN can trigger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping
from course_lib.reference import reference_for

__all__ = ["Rule", "Alert", "AlertEngine", "SEED_RULES", "evaluate", "FAILURE_WINDOW_S", "node_failure_rate"]

_OPS = (">", "<", "nonfinite")


@dataclass(frozen=True)
class Rule:
    """Fire when ``metric op threshold`` has held for ``for_s`` seconds (times the engine's scale).

    op: '>' or '<' (a NaN value is ignored), or 'nonfinite' (NaN or +-inf; the threshold is not used)."""

    name: str
    metric: str
    op: str
    threshold: float
    for_s: float
    message: str

    def __post_init__(self):
        if self.op not in _OPS:
            raise ValueError(f"rule {self.name!r}: op={self.op!r}, choose one of {_OPS}")
        if not self.for_s >= 0:
            raise ValueError(f"rule {self.name!r}: for_s={self.for_s} must be >= 0 seconds")

    def holds(self, value: float) -> bool | None:
        """Whether the condition holds for ``value``; None when the value says nothing (NaN for '>'/'<')."""
        value = float(value)
        if self.op == "nonfinite":
            return not math.isfinite(value)
        if math.isnan(value):
            return None
        return value > self.threshold if self.op == ">" else value < self.threshold


SEED_RULES: tuple[Rule, ...] = (
    Rule("gpu_utilization_low", "gpu_utilization", "<", 0.80, 5 * 60, "GPU utilization below 80%"),
    Rule("memory_high", "memory_fraction", ">", 0.90, 2 * 60, "memory above 90%"),
    Rule("loss_high", "loss", ">", 10.0, 10 * 60, "loss above 10"),
    Rule("throughput_low", "throughput", "<", 500.0, 10 * 60, "throughput below 500 samples/s"),
    Rule("grad_norm_high", "grad_norm", ">", 100.0, 5 * 60, "gradient norm above 100"),
    Rule("comm_overhead_high", "comm_fraction", ">", 0.30, 10 * 60, "communication overhead above 30%"),
    Rule("sync_time_high", "sync_time_s", ">", 5.0, 5 * 60, "synchronisation time above 5 s"),
    Rule("node_failure_rate_high", "node_failure_rate", ">", 0.05, 1 * 60, "node failure rate above 5%"),
    Rule("loss_nan", "loss", "nonfinite", math.inf, 0.0, "loss is NaN or infinite"),
)


@dataclass
class Alert:
    """A rule that fired at time ``t`` (s); its condition had held since ``since`` (s); ``value`` at ``t``."""

    rule: Rule
    t: float
    since: float
    value: float

    def __str__(self) -> str:
        r = self.rule
        cond = "is not finite" if r.op == "nonfinite" else f"{r.op} {r.threshold:g}"
        return (f"ALERT {r.name}: {r.metric} = {self.value:.4g} {cond} for {self.t - self.since:.1f} s "
                f"(since t={self.since:.1f} s): {r.message}")


@dataclass
class _State:
    since: float | None = None     # first observation of the current episode; None: condition not holding
    fired: bool = False


@reference_for("09-alert-rule")
@dataclass
class AlertEngine:
    """Evaluates ``rules`` on each observation; see the module docstring for the semantics (lesson 09).

    scale: multiplies every rule's for_s (1.0: as written; 1/60: minutes become seconds)."""

    rules: Iterable[Rule]
    scale: float = 1.0
    _states: dict = field(init=False, repr=False)
    _last_t: float = field(init=False, default=-math.inf, repr=False)

    def __post_init__(self):
        self.rules = tuple(self.rules)
        if len({r.name for r in self.rules}) != len(self.rules):
            raise ValueError("rule names must be unique")
        if not self.scale >= 0:
            raise ValueError(f"scale={self.scale} must be >= 0")
        self._states = {r.name: _State() for r in self.rules}

    def observe(self, t: float, metrics: Mapping[str, float]) -> list[Alert]:
        """Feed the metrics observed at time ``t`` (s); returns the alerts that fire now."""
        if t < self._last_t:
            raise ValueError(f"t={t} is before the previous observation t={self._last_t}: times must not go back")
        self._last_t = t
        fired = []
        for rule in self.rules:
            if rule.metric not in metrics or metrics[rule.metric] is None:
                continue
            value = float(metrics[rule.metric])
            holds = rule.holds(value)
            state = self._states[rule.name]
            if holds is None:
                continue
            if not holds:
                state.since, state.fired = None, False
                continue
            if state.since is None:
                state.since = t
            need = rule.for_s * self.scale
            # 1e-9 relative slack: a duration summed from float sample intervals (0.1 + 0.2 ...) still counts
            if not state.fired and t - state.since >= need - 1e-9 * max(need, 1.0):
                state.fired = True
                fired.append(Alert(rule, t, state.since, value))
        return fired

    @property
    def firing(self) -> list[Rule]:
        """The rules in the alarm state now (fired, condition not yet seen to stop holding)."""
        return [r for r in self.rules if self._states[r.name].fired]

    def reset(self) -> None:
        """Forget every episode (a new run)."""
        self._states = {r.name: _State() for r in self.rules}
        self._last_t = -math.inf


def evaluate(records: Iterable[Mapping[str, float]], rules: Iterable[Rule] = SEED_RULES,
             scale: float = 1.0) -> list[Alert]:
    """Run a recorded stream (dicts with a "time" key in seconds and metrics) through a fresh `AlertEngine`."""
    engine = AlertEngine(rules, scale)
    alerts = []
    for i, rec in enumerate(records):
        if "time" not in rec:
            raise ValueError(f"record {i} has no 'time' key (seconds): {sorted(rec)}")
        alerts += engine.observe(float(rec["time"]), {k: v for k, v in rec.items() if k != "time"})
    return alerts


FAILURE_WINDOW_S = 3600.0      # the window of `node_failure_rate`: one hour


def node_failure_rate(failure_times: Iterable[float], t: float, nodes: int,
                      window_s: float = FAILURE_WINDOW_S) -> float:
    """Nodes that failed in the window (t - window_s, t], per node (lesson 09): a windowed rate, as Prometheus'
    ``increase(node_failures_total[1h]) / nodes``. ``failure_times``: when each failure happened, in seconds of
    the same clock as ``t`` (one entry per failed node; the training script records the clock at each restart).

    A count since the job began would only grow: after one failure the seed's rule (> 5 % for 1 min) would stay
    in the alarm state for the rest of the run and never fire again. The windowed rate falls back to 0 one window
    after the last failure, which clears the alarm and re-arms the rule."""
    if not (isinstance(nodes, int) and nodes >= 1):
        raise ValueError(f"nodes={nodes!r}: need an int >= 1 (the job's ranks or nodes)")
    if not window_s > 0:
        raise ValueError(f"window_s={window_s}: the window must be > 0 seconds")
    return min(1.0, sum(t - window_s < f <= t for f in failure_times) / nodes)
