"""A run's metrics: written to TensorBoard and to a JSON-lines file, read back, plotted live (lesson 09).

    with MetricsWriter(out / "tb", enabled=(rank == 0)) as writer:       # only rank 0 writes
        writer.write(step, {"loss": 3.1, "lr": 3e-4, "grad_norm": 0.8, "tokens_per_s": 5.2e4})
    read_scalars(out / "tb")["loss"]          # [(step, value), ...] through TensorBoard's own reader

    plot, offset = LivePlot(), 0                                          # in a notebook, another process
    while running:
        records, offset = follow(out / "tb" / "metrics.jsonl", offset)
        plot.update(records)                                              # redraws the figure in place

`MetricsWriter` writes real TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``; open them with
``tensorboard --logdir``) and one JSON object per step, ``{"step": s, "time": unix seconds, metric: value, ...}``, to
``log_dir/metrics.jsonl``, each line flushed as it is written so that another process can `follow` the run.
Every rank computes its metrics but only rank 0 writes them: pass ``enabled=(rank == 0)``; a disabled writer
creates no file and does nothing. Units go in the metric names (``tokens_per_s``, ``sync_time_s``).
"""

from __future__ import annotations

import json
import math
import time as _time
from pathlib import Path
from typing import Iterable, Mapping

__all__ = ["MetricsWriter", "read_scalars", "follow", "LivePlot", "JSONL_NAME"]

JSONL_NAME = "metrics.jsonl"


class MetricsWriter:
    """Scalars per step to TensorBoard event files and ``log_dir/metrics.jsonl`` (lesson 09)."""

    def __init__(self, log_dir: str | Path, enabled: bool = True):
        self.log_dir, self.enabled = Path(log_dir), bool(enabled)
        self._tb = self._jsonl = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(self.log_dir))
            self._jsonl = open(self.log_dir / JSONL_NAME, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float], time: float | None = None) -> None:
        """Record ``metrics`` (name -> number; 0-d tensors allowed) at ``step``; ``time`` in unix seconds
        (default now). Non-finite values are written as they are (JSON ``NaN``/``Infinity``, which Python reads)."""
        if not self.enabled:
            return
        if self._tb is None:
            raise ValueError(f"MetricsWriter({self.log_dir}) is closed")
        for key in ("step", "time"):
            if key in metrics:
                raise ValueError(f"metric name {key!r} is reserved for the record's own {key}: rename it")
        wall = _time.time() if time is None else float(time)
        values = {name: float(v) for name, v in metrics.items()}
        for name, v in values.items():
            self._tb.add_scalar(name, v, global_step=int(step), walltime=wall)
        self._jsonl.write(json.dumps({"step": int(step), "time": wall, **values}) + "\n")
        self._jsonl.flush()                                   # a complete line for `follow`, now

    def flush(self) -> None:
        """Write buffered TensorBoard events to disk (the JSON lines are flushed on every write)."""
        if self._tb is not None:
            self._tb.flush()
            self._jsonl.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._jsonl.close()
            self._tb = self._jsonl = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files in ``log_dir``, read with TensorBoard's own
    ``EventAccumulator`` (all events kept; values are stored as float32). When a resumed run wrote a step again,
    TensorBoard drops the events it superseded (``purge_orphaned_data``)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    if not Path(log_dir).is_dir():
        raise FileNotFoundError(f"no TensorBoard log folder {log_dir}")
    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: [(int(e.step), float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()[SCALARS]}


def follow(path: str | Path, offset: int = 0) -> tuple[list[dict], int]:
    """The complete JSON lines of ``path`` after byte ``offset``, and the offset to pass next time.

    A last line without its newline is being written (torn): it is left for the next call. A missing file gives
    ([], offset); a file now shorter than ``offset`` (a new run wrote it again) is read from the start."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], offset
    if size < offset:
        offset = 0
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1                               # bytes up to the last complete line
    records = []
    for line in data[:end].splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line after byte {offset} is not JSON ({err}): {line[:80]!r}") from None
    return records, offset + end


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class LivePlot:
    """One small panel per metric against the step, redrawn by `update` (lesson 09).

    ``update(records)`` takes new records (dicts with "step", as `follow` returns them) and appends their points;
    a record whose step is not after the last one plotted (a resumed run, or the same records again) first drops
    that metric's points from that step on, as TensorBoard does. In Jupyter the figure is shown once and then
    updated in place (``IPython.display`` with a ``display_id``); elsewhere nothing is shown (``figure`` holds it)."""

    def __init__(self, metrics: Iterable[str] = ("loss", "lr", "grad_norm", "tokens_per_s"),
                 title: str = "training run", ncols: int = 4):
        from matplotlib.figure import Figure

        self.metrics = tuple(metrics)
        if not self.metrics:
            raise ValueError("LivePlot needs at least one metric")
        ncols = min(ncols, len(self.metrics))
        nrows = math.ceil(len(self.metrics) / ncols)
        self._fig = Figure(figsize=(3.2 * ncols, 2.4 * nrows), layout="constrained")
        self._fig.suptitle(title, fontsize=9)
        axes = self._fig.subplots(nrows, ncols, squeeze=False).ravel()
        self._axes = dict(zip(self.metrics, axes))
        for ax in axes[len(self.metrics):]:
            ax.set_visible(False)
        self._lines = {}
        for name, ax in self._axes.items():
            (self._lines[name],) = ax.plot([], [], lw=1.2)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
        self._data: dict[str, tuple[list[int], list[float]]] = {m: ([], []) for m in self.metrics}
        self._handle = None

    @property
    def figure(self):
        return self._fig

    def data(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) plotted for ``metric``."""
        return self._data[metric]

    def update(self, records: Iterable[Mapping]) -> None:
        for rec in records:
            step = int(rec["step"])
            for name in self.metrics:
                if name not in rec or rec[name] is None:
                    continue
                steps, values = self._data[name]
                if steps and step <= steps[-1]:
                    keep = next(i for i, s in enumerate(steps) if s >= step)
                    del steps[keep:], values[keep:]
                steps.append(step)
                values.append(float(rec[name]))
        for name, ax in self._axes.items():
            self._lines[name].set_data(*self._data[name])
            ax.relim()
            ax.autoscale_view()
        self._show()

    def _show(self) -> None:
        if not _in_notebook():
            return
        import io

        from IPython.display import Image, display

        buf = io.BytesIO()
        self._fig.savefig(buf, format="png", dpi=80)
        image = Image(data=buf.getvalue(), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
