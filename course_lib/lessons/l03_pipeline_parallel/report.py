"""Lesson 03's figures: the Gantt chart of a pipelined step, the bubble over m, activation peaks.

Each returns the ``Figure``; titles name the hardware and backend. A measured step is drawn as replayed from its
measured per-op times (`experiments.replayed`), and the raw measurement beside it only where every rank had a core
(or a GPU) of its own: with more ranks than cores the raw timeline shows the operating system's scheduler, not the
pipeline's schedule.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from course_lib.lessons.display import COLORS
from course_lib.lessons.l03_pipeline_parallel.experiments import replayed
from course_lib.parallel.pipeline_schedules import bubble_of

__all__ = ["pipeline_gantt", "step_gantt", "schedules_gantt", "schedules_gantt_simulated", "bubble_figure",
           "activation_peaks_figure"]

REPLAYED = "replayed from measured per-op times"


def _replay_label(hardware: str) -> str:
    return f"op times measured on {hardware}; messages instant"


def pipeline_gantt(timelines: list[list[dict]], hardware: str, title: str = "Pipeline timeline", ax=None,
                   xlabel: str = "time (s)"):
    """Gantt chart of one pipelined step: a row per rank, forward (blue), backward (orange) and weight-gradient W
    (green, zero-bubble schedules) boxes labelled with their micro-batch (and chunk as ``F3.1`` when ranks hold
    several; later chunks drawn lighter), idle time left blank (lesson 03). ``timelines[rank]`` holds dicts
    ``kind, mb, start, end`` (optionally ``chunk``; seconds or any unit) as returned by ``run_schedule`` or
    ``simulate``."""
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 0.55 * len(timelines) + 1.2))
    colors = {"F": COLORS["compute"], "B": COLORS["communication"], "W": COLORS["optimizer"]}
    chunked = any(op.get("chunk", 0) for ops in timelines for op in ops)
    t0 = min(op["start"] for ops in timelines for op in ops)
    span = max(op["end"] for ops in timelines for op in ops) - t0
    fontsize = 7 if not chunked else 6
    char_px = 0.6 * fontsize * ax.figure.dpi / 72                   # a label character's width, about
    px_per_unit = ax.get_window_extent().width / span
    for rank, ops in enumerate(timelines):
        ax.barh(rank, span, left=0, color=COLORS["idle"], alpha=0.35, height=0.8)
        for op in ops:
            w, c = op["end"] - op["start"], op.get("chunk", 0)
            ax.barh(rank, w, left=op["start"] - t0, color=colors[op["kind"]], alpha=1.0 if c == 0 else 0.6,
                    edgecolor="white", height=0.8)
            label = f"{op['kind']}{op['mb']}" + (f".{c}" if chunked else "")
            if w * px_per_unit > (len(label) + 1) * char_px:           # only where the label fits in its box
                ax.text(op["start"] - t0 + w / 2, rank, label, ha="center", va="center", fontsize=fontsize,
                        color="white")
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title} (idle {bubble_of(timelines):.0%}: grey)\n{hardware}", fontsize=9)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def step_gantt(measured: list[list[dict]], hardware: str, title: str, own_cores: bool):
    """One measured step (``measured[rank]``: run_schedule's timeline): on top its replay (`experiments.replayed`,
    labelled "replayed from measured per-op times"); below it the raw measurement, labelled as measured, only when
    ``own_cores`` (every rank had its own core or GPU). Returns the ``Figure``."""
    return schedules_gantt({title: measured}, hardware, own_cores)


def schedules_gantt(measured: dict[str, list[list[dict]]], hardware: str, own_cores: bool, xlabel: str = "time (s)"):
    """Per schedule (``measured[name]``: all ranks' measured timelines of one step), its replay from the measured
    per-op times, followed by the raw measurement when ``own_cores`` (every rank had its own core or GPU), all on a
    common time axis (lesson 03, sections 2-9)."""
    panels = []
    for name, tl in measured.items():
        panels.append((f"{name}, {REPLAYED}", replayed(tl), _replay_label(hardware)))
        if own_cores:
            panels.append((f"{name}, measured", tl, hardware))
    return _panels(panels, xlabel)


def schedules_gantt_simulated(timelines: dict[str, list[list[dict]]], unit: str):
    """Ideal timelines from `simulate` (``timelines[name]``: all ranks), one panel each on a common axis in `unit`,
    each title saying it is simulated: op times chosen, messages free, no hardware (lesson 03, section 10)."""
    return _panels([(name, tl, "simulated: chosen op times, free messages, no hardware")
                    for name, tl in timelines.items()], unit)


def _panels(panels: list[tuple[str, list[list[dict]], str]], xlabel: str):
    """One `pipeline_gantt` per ``(title, timelines, label)``, stacked on a common x axis, each as tall as its ranks."""
    rows = sum(len(tl) for _, tl, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.45 * rows + 0.9 * len(panels) + 0.3), sharex=True,
                             gridspec_kw=dict(height_ratios=[len(tl) for _, tl, _ in panels]))
    axes = np.atleast_1d(axes)
    for k, (ax, (name, tl, label)) in enumerate(zip(axes, panels)):
        pipeline_gantt(tl, label, title=name, ax=ax, xlabel=xlabel if k == len(panels) - 1 else "")
    fig.tight_layout()
    return fig


def bubble_figure(rows: list[dict], p: int, hardware: str):
    """Measured bubble fraction against (p-1)/(m+p-1) over the number of micro-batches m (lesson 03).
    ``rows``: dicts ``kind, m, bubble`` (measured)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ms = sorted({r["m"] for r in rows})
    grid = np.linspace(min(ms), max(ms), 100)
    ax.plot(grid, (p - 1) / (grid + p - 1), "k--", label=f"formula (p-1)/(m+p-1), p={p}")
    for kind, marker in (("gpipe", "o"), ("1f1b", "s"), ("naive", "^")):
        pts = sorted((r["m"], r["bubble"]) for r in rows if r["kind"] == kind)
        if pts:
            ax.plot(*zip(*pts), marker, label=f"measured, {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle fraction)")
    ax.set_title(f"Pipeline bubble over m\n{hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def activation_peaks_figure(peaks: dict[str, list[float]], ms: list[int], hardware: str, unit: float = 1e6,
                     unit_name: str = "MB"):
    """Peak saved-activation memory on one rank over m, one line per schedule (lesson 03)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in peaks.items():
        ax.plot(ms, [v / unit for v in values], "o-", label=name)
    ax.set_xlabel("micro-batches m (fixed micro-batch size)")
    ax.set_ylabel(f"peak activations ({unit_name})")
    ax.set_title(f"Activation memory held at the peak\n{hardware}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
