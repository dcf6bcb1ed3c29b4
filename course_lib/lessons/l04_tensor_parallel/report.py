"""Lesson 04's figures: parameters and activations per rank, and the bytes one layer sends, under tensor and
sequence parallelism."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from course_lib.lessons.display import COLORS
from course_lib.theory.tensor import bytes_sent_per_rank, layer_collectives

__all__ = ["tp_memory_figure", "tp_comm_figure"]


def tp_memory_figure(rows: list[dict], hardware: str, unit: float = 1e3, unit_name: str = "KB"):
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
            color = COLORS["params"] if key == "param" else (COLORS["activations"] if not sp else COLORS["optimizer"])
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


def tp_comm_figure(rows: list[dict], cfg, batch: int, hardware: str, unit: float = 1e6, unit_name: str = "MB"):
    """Lesson 04: bytes one rank sends for one layer over a ring, forward and backward, measured (the counted
    collectives ``row["layer_comm"]``) next to :func:`course_lib.theory.tensor.layer_collectives`, for every tp > 1
    with and without sequence parallelism."""
    rows = [r for r in rows if r["tp"] > 1]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(rows))
    for k, (phase, color) in enumerate((("forward", COLORS["compute"]), ("backward", COLORS["communication"]))):
        measured, formula = [], []
        for r in rows:
            f = layer_collectives(cfg, batch, cfg.seq_len, r["tp"], r["sp"])
            measured.append(bytes_sent_per_rank({key: v for key, v in r["layer_comm"].items() if key[0] == phase},
                                                r["tp"]) / unit)
            formula.append(bytes_sent_per_rank({key: v for key, v in f.items() if key[0] == phase}, r["tp"]) / unit)
        off = (k - 0.5) * 0.38
        ax.bar(x + off, measured, width=0.36, color=color, label=f"measured, {phase}")
        ax.plot(x + off, formula, "k_", ms=20, mew=2, label="formula" if k == 0 else None)
    ax.set_xticks(x, [f"tp={r['tp']}" + (" + SP" if r["sp"] else "") for r in rows])
    ax.set_ylabel(f"{unit_name} sent per rank (ring)")
    ax.set_title(f"One layer's tensor-parallel communication, micro-batch {batch} x T={cfg.seq_len}\n{hardware}",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
