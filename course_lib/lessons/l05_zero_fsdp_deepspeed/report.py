"""Lesson 05's table and chart of the side-by-side comparison, and the ZeRO memory calculator.

    rows, hw = experiments.compare(cfg, nprocs=2, steps=5)
    print(format_table(rows, hw)); comparison_chart(rows, hw)
    zero_calculator()                                # ipywidgets: preset, N, stage, offload, precision

The calculator is `course_lib.theory.memory.per_rank_bytes`: formula, not measured.
"""

from __future__ import annotations

from course_lib.config import PRESETS
from course_lib.theory.memory import per_rank_bytes, usable_offload

__all__ = ["format_table", "comparison_chart", "zero_calculator"]


def format_table(rows: list[dict], hardware: str) -> str:
    """The comparison as a fixed-width text table; bytes per rank in KB."""
    head = (f"{'variant':28s} {'stage':>5s} {'formula KB':>10s} {'state KB':>9s} {'live KB':>9s} "
            f"{'live/DDP':>8s} {'step ms':>8s} {'loss':>8s} {'max|dp| vs DDP':>14s}")
    ddp_live = next(r["live"] for r in rows if r["variant"] == "ddp")
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        state = f"{r['measured'] / 1e3:9.1f}" if r["measured"] is not None else f"{'-':>9s}"
        lines.append(f"{r['label']:28s} {r['stage']:5d} {r['predicted'] / 1e3:10.1f} {state} {r['live'] / 1e3:9.1f} "
                     f"{r['live'] / ddp_live:8.2f} {r['step_s'] * 1e3:8.1f} {r['loss']:8.4f} {r['dparam']:14.1e}")
    return "\n".join(lines)


def comparison_chart(rows: list[dict], hardware: str):
    """Two panels: per-rank memory (formula vs state counted vs every live tensor) and median step time."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(rows))
    a.bar(x - 0.27, [r["predicted"] / 1e3 for r in rows], 0.27, label="formula (fp32 Adam)", color="#bbbbbb")
    a.bar(x, [(r["measured"] or 0) / 1e3 for r in rows], 0.27, label="model state counted", color="#1f77b4")
    a.bar(x + 0.27, [r["live"] / 1e3 for r in rows], 0.27, label="all live tensors", color="#ff7f0e")
    a.set_xticks(x, [r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
    a.set_ylabel("KB per rank")
    a.set_title("Memory per rank")
    a.legend(fontsize=8)
    b.bar(x, [r["step_s"] * 1e3 for r in rows], color="#2ca02c")
    b.set_xticks(x, [r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
    b.set_ylabel("ms (median)")
    b.set_title("Step time")
    fig.suptitle(hardware, fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ the calculator

def zero_calculator():
    """ipywidgets: model preset, N, stage, offload, precision, micro-batch; stacked bars for stages 0-3."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    preset = w.Dropdown(options=list(PRESETS), value="llama-7b", description="model")
    n = w.IntSlider(value=8, min=1, max=1024, description="ranks N")
    stage = w.Dropdown(options=[0, 1, 2, 3], value=2, description="stage")
    # ipywidgets shows a value of None as no selection at all: "none" and 0 stand for it
    offload = w.Dropdown(options=["none", "optimizer", "param"], value="none", description="offload")
    mixed = w.Dropdown(options=[("bf16 mixed", True), ("fp32", False)], value=True, description="precision")
    mb = w.IntSlider(value=1, min=1, max=32, description="micro-batch")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            off, note = usable_offload(stage.value, None if offload.value == "none" else offload.value)
            cur = per_rank_bytes(PRESETS[preset.value], n.value, stage.value, off, mixed.value, mb.value)
            print(f"{preset.value}, N={n.value}, stage {stage.value}, offload {off}: "
                  f"{cur['device_total'] / 1e9:.2f} GB per rank on the device "
                  f"(+{cur['cpu'] / 1e9:.2f} GB in CPU memory); formula, not measured" + (f" ({note})" if note else ""))
            fig, ax = plt.subplots(figsize=(7, 3.2))
            parts = ("params", "grads", "optimizer", "activations")
            for s in range(4):
                b = per_rank_bytes(PRESETS[preset.value], n.value, s, None, mixed.value, mb.value)
                bottom = 0.0
                for k, color in zip(parts, ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")):
                    ax.bar(f"stage {s}", b[k] / 1e9, bottom=bottom, color=color, label=k if s == 0 else None,
                           edgecolor="k" if s == stage.value else None)
                    bottom += b[k] / 1e9
            ax.set_ylabel("GB per rank")
            ax.set_title(f"{preset.value} on {n.value} ranks (formula)")
            ax.legend(fontsize=8)
            display(fig)
            plt.close(fig)

    for c in (preset, n, stage, offload, mixed, mb):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, n]), w.HBox([stage, offload, mixed]), mb, out])
