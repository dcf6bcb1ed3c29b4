"""Lesson 07's tables, figures and the memory planner (lesson 05's ZeRO calculator + checkpointing + accumulation).

    rows = experiments.checkpoint_sweep(cfg, batch, everys)
    print(checkpoint_table(rows, hw)); checkpoint_figure(deep_rows, deep_cfg, deep_batch, rows, hw)
    attention_figure(experiments.attention_sweep(), hw)
    savers_planner()                                       # ipywidgets: course_lib.theory.savers.planner_bytes
"""

from __future__ import annotations

from course_lib.config import PRESETS
from course_lib.theory.memory import usable_offload
from course_lib.theory.savers import best_checkpoint_every, checkpointed_activation_bytes, planner_bytes
from course_lib.measure.units import fmt_bytes

__all__ = ["checkpoint_table", "selective_table", "checkpoint_figure", "attention_table", "attention_figure",
           "accumulation_table",
           "savers_planner"]


def _log_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def checkpoint_table(rows: list[dict], hardware: str) -> str:
    """Held / peak activation bytes measured vs formula, counted FLOPs and median step time per variant."""
    plain = rows[0]
    head = (f"{'variant':10s} {'held KB':>9s} {'formula':>9s} {'peak KB':>9s} {'formula':>9s} {'held/plain':>10s} "
            f"{'GFLOP':>7s} {'FLOP x':>7s} {'step ms':>8s} {'time x':>7s} {'max|dgrad|':>10s}")
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        if r["flops"] is None:                                  # a memory-only sweep
            cost = f"{'-':>7s} {'-':>7s} {'-':>8s} {'-':>7s}"
        else:
            cost = (f"{r['flops'] / 1e9:7.3f} {r['flops'] / plain['flops']:7.3f} {r['step_s'] * 1e3:8.1f} "
                    f"{r['step_s'] / plain['step_s']:7.2f}")
        lines.append(f"{r['label']:10s} {r['held'] / 1e3:9.1f} {r['est_held'] / 1e3:9.1f} {r['peak'] / 1e3:9.1f} "
                     f"{r['est_peak'] / 1e3:9.1f} {r['held'] / plain['held']:10.3f} {cost} {r['dgrad']:10.1e}")
    return "\n".join(lines)


def selective_table(rows: list[dict], hardware: str) -> str:
    """``experiments.selective_policies``: held / peak activation bytes and matmul FLOPs per attention and policy,
    relative to that attention's plain step."""
    plain = {r["attention"]: r for r in rows if r["policy"] == "none"}
    head = (f"{'attention':9s} {'selective':15s} {'held KB':>9s} {'peak KB':>9s} {'held/plain':>10s} "
            f"{'FLOP x':>7s} {'max|dgrad|':>10s}")
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        p = plain[r["attention"]]
        lines.append(f"{r['attention']:9s} {r['policy']:15s} {r['held'] / 1e3:9.1f} {r['peak'] / 1e3:9.1f} "
                     f"{r['held'] / p['held']:10.3f} {r['flops'] / p['flops']:7.3f} {r['dgrad']:10.1e}")
    return "\n".join(lines)


def checkpoint_figure(deep_rows: list[dict], deep_cfg, deep_batch: int, cost_rows: list[dict], hardware: str):
    """Left: activation memory of a deep model over k (held after the forward, peak in backward), measured
    and formula, with the formula's best k. Right: counted FLOPs and step time relative to no checkpointing."""
    import matplotlib.pyplot as plt

    full = [r for r in deep_rows if r["every"] is not None and not r["selective"]]
    L = deep_cfg.n_layer
    ks = list(range(1, L + 1))
    curve = [checkpointed_activation_bytes(deep_cfg, deep_batch, every=k) for k in ks]
    best = best_checkpoint_every(L, curve[0]["per_layer"], curve[0]["boundary"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.plot(ks, [c["held"] / 1e6 for c in curve], "k:", lw=1, label="held after forward, formula")
    a.plot(ks, [c["peak"] / 1e6 for c in curve], "k--", lw=1, label="peak in backward, formula")
    a.plot([r["every"] for r in full], [r["held"] / 1e6 for r in full], "o", color="#1f77b4", label="held, measured")
    a.plot([r["every"] for r in full], [r["peak"] / 1e6 for r in full], "s", color="#ff7f0e", label="peak, measured")
    a.axhline(deep_rows[0]["held"] / 1e6, color="#d62728", lw=1, label="no checkpointing")
    a.axvline(best["continuous"], color="#2ca02c", lw=1, label=f"sqrt(L s / A) = {best['continuous']:.2f}")
    _log_axes(a, "checkpoint every k blocks", "activation MB",
              f"{L} blocks, batch {deep_batch}, T={deep_cfg.seq_len}: best k = {best['every']}")
    plain = cost_rows[0]
    x = list(range(len(cost_rows)))
    b.bar([i - 0.2 for i in x], [r["flops"] / plain["flops"] for r in cost_rows], 0.4, label="FLOPs (counted)")
    b.bar([i + 0.2 for i in x], [r["step_s"] / plain["step_s"] for r in cost_rows], 0.4, label="step time (median)")
    b.axhline(4 / 3, color="k", ls=":", lw=1, label="one extra forward: 4/3")
    b.set_xticks(x, [r["label"] for r in cost_rows], fontsize=8)
    b.set_ylabel("relative to no checkpointing")
    b.set_title("What recomputation costs", fontsize=9)
    b.legend(fontsize=7)
    fig.suptitle(hardware, fontsize=9)
    fig.tight_layout()
    return fig


def attention_table(rows: list[dict], hardware: str) -> str:
    head = f"{'T':>6s} {'naive KB':>10s} {'formula':>10s} {'SDPA KB':>9s} {'formula':>9s} {'naive/SDPA':>10s} " \
           f"{'naive ms':>9s} {'SDPA ms':>8s}"
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['T']:6d} {r['naive'] / 1e3:10.1f} {r['naive_formula'] / 1e3:10.1f} {r['sdpa'] / 1e3:9.1f} "
                     f"{r['sdpa_formula'] / 1e3:9.1f} {r['naive'] / r['sdpa']:10.1f} {r['naive_s'] * 1e3:9.2f} "
                     f"{r['sdpa_s'] * 1e3:8.2f}")
    return "\n".join(lines)


def attention_figure(rows: list[dict], hardware: str):
    """Bytes kept for backward over sequence length, log-log: naive grows as T^2, SDPA as T."""
    import matplotlib.pyplot as plt

    T = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for kind, color in (("naive", "#d62728"), ("sdpa", "#2ca02c")):
        ax.plot(T, [r[kind] / 1e6 for r in rows], "o", color=color, label=f"{kind} measured")
        ax.plot(T, [r[f"{kind}_formula"] / 1e6 for r in rows], ":", color=color, label=f"{kind} formula")
    _log_axes(ax, "sequence length T", "MB kept for backward", f"One attention layer\n{hardware}")
    fig.tight_layout()
    return fig


def accumulation_table(rows: list[dict], hardware: str) -> str:
    head = (f"{'micro-batch':>11s} {'steps':>6s} {'act held KB':>11s} {'formula':>9s} {'act peak KB':>11s} "
            f"{'params+grads KB':>15s} {'step ms':>8s} {'max|dgrad| vs full batch':>24s}")
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['micro_batch']:11d} {r['accum_steps']:6d} {r['held'] / 1e3:11.1f} {r['est_held'] / 1e3:9.1f} "
                     f"{r['peak'] / 1e3:11.1f} {r['state'] / 1e3:15.1f} {r['step_s'] * 1e3:8.1f} {r['dgrad']:24.1e}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the planner

def savers_planner():
    """ipywidgets: lesson 05's calculator (model, ranks, ZeRO stage, offload, precision) plus micro-batch,
    checkpointing and global batch; bars for no checkpointing and every k = 1, 2, 4."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    preset = w.Dropdown(options=list(PRESETS), value="gpt2-1.5b" if "gpt2-1.5b" in PRESETS else list(PRESETS)[0],
                        description="model")
    n = w.IntSlider(value=8, min=1, max=1024, description="ranks N")
    stage = w.Dropdown(options=[0, 1, 2, 3], value=2, description="ZeRO stage")
    # ipywidgets shows a value of None as no selection at all: "none" and 0 stand for it
    offload = w.Dropdown(options=["none", "optimizer", "param"], value="none", description="offload")
    mixed = w.Dropdown(options=[("bf16 mixed", True), ("fp32", False)], value=True, description="precision")
    mb = w.IntSlider(value=4, min=1, max=64, description="micro-batch")
    every = w.Dropdown(options=[("none", 0)] + [(str(k), k) for k in (1, 2, 4, 8)], value=0, description="ckpt every")
    gb = w.IntSlider(value=512, min=1, max=4096, description="global batch")
    budget = w.FloatText(value=80.0, description="budget GB")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            off, note = usable_offload(stage.value, None if offload.value == "none" else offload.value)
            args = (PRESETS[preset.value], n.value, stage.value, off, mixed.value, mb.value)
            cur = planner_bytes(*args, every=every.value or None, global_batch=gb.value)
            fits = "fits" if cur["device_total"] <= budget.value * 1e9 else "does NOT fit"
            print(f"{fmt_bytes(cur['device_total'])} per device ({fits} in {budget.value:g} GB), "
                  f"+{fmt_bytes(cur['cpu'])} in CPU memory; {cur['accum_steps']} accumulation steps "
                  f"per optimizer step. Formula, not measured." + (f" ({note})" if note else ""))
            fig, ax = plt.subplots(figsize=(7, 3.2))
            for i, k in enumerate((None, 1, 2, 4)):
                b = planner_bytes(*args, every=k, global_batch=gb.value)
                bottom = 0.0
                for part, color in zip(("params", "grads", "optimizer", "activations"),
                                       ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")):
                    ax.bar("no ckpt" if k is None else f"every {k}", b[part] / 1e9, bottom=bottom, color=color,
                           label=part if i == 0 else None, edgecolor="k" if k == (every.value or None) else None)
                    bottom += b[part] / 1e9
            ax.axhline(budget.value, color="#d62728", ls="--", lw=1, label="budget")
            ax.set_ylabel("GB per device")
            ax.set_title(f"{preset.value}, N={n.value}, stage {stage.value}, micro-batch {mb.value} (formula)")
            ax.legend(fontsize=8)
            display(fig)
            plt.close(fig)

    controls = (preset, n, stage, offload, mixed, mb, every, gb, budget)
    for c in controls:
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, n, budget]), w.HBox([stage, offload, mixed]), w.HBox([mb, every, gb]), out])
