"""Matplotlib figures used by the lessons. Every figure's title names the hardware and backend.

Lesson 01: :func:`matmul_sweep`, :func:`memory_bars`, :func:`roofline`, :func:`collectives`,
:func:`step_breakdown`. Each returns the ``Figure`` (shown inline by Jupyter).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

_COLORS = dict(params="#4C72B0", grads="#DD8452", optimizer="#55A868", master="#8172B3",
               activations="#C44E52", compute="#4C72B0", communication="#DD8452", overlap="#8172B3",
               idle="#BBBBBB")


def _size_label(nbytes: float) -> str:
    for unit, scale in (("GB", 1024 ** 3), ("MB", 1024 ** 2), ("KB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def matmul_sweep(rows: list[dict], peak_flop_s: float, hardware: str, peak_label: str = "peak"):
    """Achieved FLOP/s of n x n matmuls against the device's peak (lesson 01)."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = [r["n"] for r in rows]
    ax.plot(n, [r["flop_s"] / 1e9 for r in rows], "o-", label="measured")
    ax.axhline(peak_flop_s / 1e9, color="k", ls="--", label=peak_label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("matrix size n (n x n @ n x n)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"Matmul throughput\n{hardware}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig


def memory_bars(columns: dict[str, dict], hardware: str, unit: float = 1e6, unit_name: str = "MB"):
    """Stacked bars of training memory: ``columns = {"predicted": {"params": b, ...}, "measured": {...}}``."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = list(columns)
    parts = []
    for col in columns.values():
        parts += [k for k in col if k not in parts]
    bottom = np.zeros(len(names))
    for part in parts:
        vals = np.array([columns[n].get(part, 0) / unit for n in names])
        ax.bar(names, vals, bottom=bottom, label=part, color=_COLORS.get(part))
        bottom += vals
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f} {unit_name}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(unit_name)
    ax.set_title(f"Anatomy of training memory\n{hardware}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def roofline(points: list[dict], peak_flop_s: float, peak_bw: float, hardware: str):
    """Roofline (Williams, Waterman & Patterson 2009): min(peak, intensity x bandwidth), with measured points."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = np.logspace(-2, 4, 200)
    ax.plot(xs, np.minimum(peak_flop_s, xs * peak_bw) / 1e9, "k-", lw=1.5, label="roofline (measured peaks)")
    ridge = peak_flop_s / peak_bw
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.text(ridge, peak_flop_s / 1e9 * 1.15, f"ridge {ridge:.1f} FLOP/B", fontsize=8, ha="center")
    markers = dict(matmul="o", elementwise="s", layernorm="^", attention="D")
    for p in points:
        ax.plot(p["intensity"], p["flop_s"] / 1e9, markers.get(p["kind"], "o"), ms=7, label=p["name"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"Roofline\n{hardware}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def collectives(rows: list[dict], fits: dict | None, hardware: str):
    """Left: time vs message size (points) with the alpha-beta fit (lines). Right: bus bandwidth."""
    from course_lib.theory.comm import alpha_beta_time

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted({(r["op"], r["world_size"]) for r in rows})
    cmap = plt.get_cmap("tab10")
    ops = sorted({k[0] for k in keys})
    for op, ws in keys:
        pts = [r for r in rows if (r["op"], r["world_size"]) == (op, ws)]
        x = np.array([r["bytes"] for r in pts])
        color = cmap(ops.index(op))
        ls = "-" if ws == min(k[1] for k in keys) else "--"
        ax_t.plot(x, [r["time_s"] * 1e3 for r in pts], "o", color=color, ms=3)
        if fits and (op, ws) in fits:
            a, bw = fits[(op, ws)]
            ax_t.plot(x, alpha_beta_time(x, a, bw) * 1e3, ls, color=color, lw=1,
                      label=f"{op} n={ws}: {a * 1e6:.0f} us + S / {bw / 1e9:.2f} GB/s")
        ax_b.plot(x, [r["busbw"] / 1e9 for r in pts], "o" + ls, color=color, ms=3, label=f"{op} n={ws}")
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size S")
        ticks = [t for t in [2 ** k for k in range(10, 31, 2)] if min(r["bytes"] for r in rows) <= t
                 <= max(r["bytes"] for r in rows)]
        ax.set_xticks(ticks, [_size_label(t) for t in ticks], rotation=45, fontsize=7)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time (ms)")
    ax_t.set_title("time and alpha-beta fit", fontsize=9)
    ax_t.legend(fontsize=6)
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    ax_b.set_title("bus bandwidth (nccl-tests definition)", fontsize=9)
    ax_b.legend(fontsize=6)
    fig.suptitle(f"Collectives\n{hardware}", fontsize=9)
    fig.tight_layout()
    return fig


def step_breakdown(bd: dict, hardware: str, title: str = "One data-parallel step"):
    """Top: timeline of compute and communication intervals. Bottom: stacked bar of the step's time."""
    fig, (ax_tl, ax_bar) = plt.subplots(2, 1, figsize=(9, 3.6), gridspec_kw=dict(height_ratios=[2, 1]))
    t0 = min([s for s, _ in bd["compute_intervals"] + bd["comm_intervals"]], default=0.0)
    for row, key, color in ((1, "compute_intervals", _COLORS["compute"]), (0, "comm_intervals", _COLORS["communication"])):
        ax_tl.broken_barh([((s - t0) * 1e3, (e - s) * 1e3) for s, e in bd[key]], (row - 0.4, 0.8), color=color)
    ax_tl.set_yticks([0, 1], ["communication", "compute"])
    ax_tl.set_xlabel("ms since the first op")
    left = 0.0
    for key, label in (("compute_only", "compute"), ("overlap", "overlap"), ("comm_only", "communication"),
                       ("idle", "idle")):
        width = bd[key] * 1e3
        ax_bar.barh([0], [width], left=left, color=_COLORS[label], label=f"{label} {width:.1f} ms")
        left += width
    ax_bar.set_yticks([])
    ax_bar.set_xlabel("ms")
    ax_bar.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    fig.suptitle(f"{title}\n{hardware}", fontsize=9)
    fig.tight_layout()
    return fig


def estimate_bars(est: dict, title: str = ""):
    """Two panels for the lesson-01 widget: step time (compute / communication) and memory per GPU."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3))
    t = est["time_s"]
    ax_t.barh(["step"], [t["compute"]], color=_COLORS["compute"], label=f"compute {t['compute']:.3g} s")
    ax_t.barh(["step"], [t["communication"]], left=[t["compute"]], color=_COLORS["communication"],
              label=f"gradient all-reduce {t['communication']:.3g} s")
    ax_t.set_xlabel("seconds per step (no overlap)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    m = est["memory_bytes"]
    left = 0.0
    for part in ("params", "grads", "master", "optimizer", "activations"):
        ax_m.barh(["per GPU"], [m[part] / 1e9], left=[left], color=_COLORS[part], label=part)
        left += m[part] / 1e9
    ax_m.axvline(est["gpu_mem_bytes"] / 1e9, color="k", ls="--", label="GPU memory")
    ax_m.set_xlabel("GB")
    ax_m.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def tp_memory(rows: list[dict], hardware: str, unit: float = 1e3, unit_name: str = "KB"):
    """Lesson 04: parameters and one layer's activations per rank for each tp, with and without sequence
    parallelism. ``rows``: dicts with tp, sp, param_bytes, act_bytes and the formulas param_formula, act_formula."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    tps = sorted({r["tp"] for r in rows})
    x = np.arange(len(tps))
    for ax, key, title in ((axes[0], "param", "parameters per rank"), (axes[1], "act", "activations of one layer per rank")):
        for k, sp in enumerate((False, True)):
            sel = [next(r for r in rows if r["tp"] == tp and r["sp"] == sp) for tp in tps]
            if key == "param" and sp:
                continue   # sequence parallelism does not change the parameters
            off = 0 if key == "param" else (k - 0.5) * 0.38
            color = _COLORS["params"] if key == "param" else (_COLORS["activations"] if not sp else _COLORS["optimizer"])
            label = "TP" if not sp else "TP + sequence parallel"
            ax.bar(x + off, [r[f"{key}_bytes"] / unit for r in sel], width=0.36, color=color,
                   label=f"measured, {label}" if key == "act" else "measured")
            ax.plot(x + off, [r[f"{key}_formula"] / unit for r in sel], "k_", ms=22, mew=2,
                    label="formula" if k == 0 else None)
        ax.set_xticks(x, [f"tp={t}" for t in tps])
        ax.set_ylabel(unit_name)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Memory per rank under tensor parallelism\n{hardware}", fontsize=9)
    fig.tight_layout()
    return fig


# ---- lesson 03: pipeline parallelism ---------------------------------------------------------------

def pipeline_gantt(timelines: list[list[dict]], hardware: str, title: str = "Pipeline timeline", ax=None,
                   xlabel: str = "time (s)"):
    """Gantt chart of one pipelined step: a row per rank, forward (blue) and backward (orange) boxes
    labelled with their micro-batch, idle time left blank (lesson 03). ``timelines[rank]`` holds dicts
    ``kind, mb, start, end`` (seconds or any unit) as returned by ``run_schedule`` or ``simulate``."""
    from course_lib.parallel.pipeline_schedules import bubble_of

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 0.55 * len(timelines) + 1.2))
    colors = {"F": _COLORS["compute"], "B": _COLORS["communication"]}
    t0 = min(op["start"] for ops in timelines for op in ops)
    span = max(op["end"] for ops in timelines for op in ops) - t0
    for rank, ops in enumerate(timelines):
        ax.barh(rank, span, left=0, color=_COLORS["idle"], alpha=0.35, height=0.8)
        for op in ops:
            w = op["end"] - op["start"]
            ax.barh(rank, w, left=op["start"] - t0, color=colors[op["kind"]], edgecolor="white", height=0.8)
            if w > span / 60:
                ax.text(op["start"] - t0 + w / 2, rank, f"{op['kind']}{op['mb']}", ha="center", va="center",
                        fontsize=7, color="white")
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title} (idle {bubble_of(timelines):.0%}: grey)\n{hardware}", fontsize=9)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def bubble_vs_m(rows: list[dict], p: int, hardware: str):
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


def activation_peaks(peaks: dict[str, list[float]], ms: list[int], hardware: str, unit: float = 1e6,
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
