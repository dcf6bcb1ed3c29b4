"""Loss-spike detection from the run's own statistics (lesson 09, "when a large run goes wrong").

    det = SpikeDetector(window=20, warmup=10, z=6.0)
    for step, loss in enumerate(losses):
        if det.update(loss):
            ...                     # rewind to the last checkpoint before it, skip the batches that caused it

A fixed threshold ("loss above 10") misses a spike from 2.1 to 3.5 late in a run and fires on every step early on.
The detector judges a value against the values it accepted last: its z-score

    z = (value - mean(window)) / std(window),      window = the last `window` accepted values,

above `z` is a spike. Before `warmup` accepted values it gives no verdict (False), a spike is not added to the
window (one bad value would widen the band and hide the next), and a non-finite value (inf, NaN) is always a
spike. The training script (`course_lib.training.train`) runs two, on the loss and on the global gradient norm, both fed
the values all-reduced over the ranks, so that every rank takes the same decision; their state goes into each
checkpoint (`state_dict`), so a resumed run judges as the uninterrupted one would.

A trend fools the plain window. A young run's loss falls step after step, so the window's mean lags above the
current value and its standard deviation measures the fall, not the noise: a spike's z-score shrinks as the window
grows (lesson 09, section 7.1, measures it on the same run). `DetrendedSpikeDetector` fits a straight line to the
window (least squares over the steps at which the values came), extrapolates it to the step judged, and takes the
z-score of the residual against the error of that extrapolation (the residuals' spread, widened for predicting a
value past the window). The training script uses the plain detector, with a short window (configs/tiny_spike.toml).

What large runs do on a spike (Chowdhery et al. 2022, PaLM, section 5.1): "we re-started training from a
checkpoint roughly 100 steps before the spike started, and skipped roughly 200–500 data batches, which cover the
batches that were seen before and during the spike."
"""

from __future__ import annotations

import math
from collections import deque

from course_lib.reference import reference_for

__all__ = ["SpikeDetector", "DetrendedSpikeDetector", "replay_zscores"]


def _positive_int(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"SpikeDetector: {name}={value!r} must be an int >= {low}")
    return value


@reference_for("09-spike-detector")
class SpikeDetector:
    """A z-score spike detector over a sliding window of accepted values.

    window: how many accepted values the mean and standard deviation are taken over (>= 2).
    warmup: accepted values needed before any verdict (2 <= warmup; at most `window`: the statistics of a
        full window are what it waits for, at least).
    z: how many standard deviations above the mean a spike is (> 0). Only upward moves count: a loss that
        falls fast is good news.
    """

    def __init__(self, window: int = 20, warmup: int = 10, z: float = 6.0):
        self.window = _positive_int("window", window, 2)
        self.warmup = _positive_int("warmup", warmup, 2)
        if self.warmup > self.window:
            raise ValueError(f"SpikeDetector: warmup={warmup} exceeds window={window}: the window holds at most "
                             f"{window} values; use warmup <= window")
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z <= 0:
            raise ValueError(f"SpikeDetector: z={z!r} must be a positive number of standard deviations, e.g. 6.0")
        self.z = float(z)
        self.values: deque[float] = deque(maxlen=self.window)
        self.last_z = 0.0           # the z-score of the last value judged (inf for a non-finite one, 0 in warm-up)

    def zscore(self, value: float) -> float:
        """The z-score of ``value`` against the window (0.0 before `warmup` values; inf when not finite)."""
        if not math.isfinite(value):
            return math.inf
        if len(self.values) < self.warmup:
            return 0.0
        return self._z(value)

    def _z(self, value: float) -> float:
        """The z-score of a finite ``value`` after the warm-up: about the window's mean."""
        n = len(self.values)
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / (n - 1))     # sample standard deviation
        if std == 0.0:
            return 0.0 if value <= mean else math.inf
        return (value - mean) / std

    def update(self, value: float) -> bool:
        """Judge ``value``; True when it is a spike (then it is left out of the window)."""
        value = float(value)
        self.last_z = self.zscore(value)
        spike = self.last_z > self.z
        if not spike:
            self.values.append(value)
        return spike

    def state_dict(self) -> dict:
        """JSON-ready state: the settings and the accepted values (a resumed run continues the same window)."""
        return {"window": self.window, "warmup": self.warmup, "z": self.z, "values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        if (state["window"], state["warmup"], state["z"]) != (self.window, self.warmup, self.z):
            raise ValueError(f"SpikeDetector: the state was saved with window={state['window']}, "
                             f"warmup={state['warmup']}, z={state['z']}, this detector has window={self.window}, "
                             f"warmup={self.warmup}, z={self.z}: build it with the same settings")
        self.values = deque((float(v) for v in state["values"]), maxlen=self.window)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, warmup={self.warmup}, z={self.z}, accepted={len(self.values)})"


class DetrendedSpikeDetector(SpikeDetector):
    """A `SpikeDetector` whose z-score is taken about the window's straight-line trend (needs warmup >= 3).

    z = (value - line(t)) / se(t),   se(t) = s_r * sqrt(1 + 1/n + (t - t_mean)^2 / sum_i (t_i - t_mean)^2),

    with line the least-squares fit of the window's n values against the indices t_i of the `update` calls that
    brought them (a spike leaves a gap), t the index of this call, s_r the residuals' standard deviation with n - 2
    degrees of freedom (two fitted coefficients), and se(t) the standard error of predicting one new value at t from
    that line: the value's own noise (the 1) plus the fitted line's uncertainty, which grows with the distance from
    the window's middle. On pure noise this z follows Student's t with n - 2 degrees of freedom (standard deviation
    sqrt((n - 2) / (n - 4)): 1.41 at n = 6, 1.10 at n = 14; tests/test_spikes_trend.py replays it), near the plain
    window's; divided by s_r alone it would spread wider (se/s_r = 1.37 for the next step after a full window of 6).
    Same rules otherwise: no verdict during the warm-up, a spike or a non-finite value never enters the window, only
    upward moves count."""

    def __init__(self, window: int = 20, warmup: int = 10, z: float = 6.0):
        super().__init__(window, warmup, z)
        if self.warmup < 3:
            raise ValueError(f"DetrendedSpikeDetector: warmup={warmup}: a line through 2 values leaves no residual; "
                             f"use warmup >= 3")
        self.times: deque[int] = deque(maxlen=self.window)
        self.t = 0                  # the index of the next update() call

    def _z(self, value: float) -> float:
        n = len(self.values)
        t_mean, v_mean = sum(self.times) / n, sum(self.values) / n
        sxx = sum((t - t_mean) ** 2 for t in self.times)
        slope = sum((t - t_mean) * (v - v_mean) for t, v in zip(self.times, self.values)) / sxx
        s_r = math.sqrt(sum((v - v_mean - slope * (t - t_mean)) ** 2 for t, v in zip(self.times, self.values))
                        / (n - 2))
        residual = value - (v_mean + slope * (self.t - t_mean))
        se = s_r * math.sqrt(1 + 1 / n + (self.t - t_mean) ** 2 / sxx)     # one new value's prediction error
        if se == 0.0:
            return 0.0 if residual <= 0 else math.inf
        return residual / se

    def update(self, value: float) -> bool:
        spike = super().update(value)
        if not spike:
            self.times.append(self.t)
        self.t += 1
        return spike

    def state_dict(self) -> dict:
        return {**super().state_dict(), "times": list(self.times), "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.times, self.t = deque((int(t) for t in state["times"]), maxlen=self.window), int(state["t"])


def replay_zscores(values, detector: SpikeDetector) -> list[float]:
    """Feed ``values`` to ``detector`` one by one; the z-score it gave each (0.0 during its warm-up)."""
    out = []
    for v in values:
        detector.update(v)
        out.append(detector.last_z)
    return out
