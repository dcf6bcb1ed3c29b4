"""Lesson 08's tables, figures and the planner's front-end.

    grid_figure(sizes, members, gpus_per_node=4)      # the ranks of a dp x pp x tp grid and their groups
    comm_table(rows, hw); comm_figure(rows, hw)       # payload bytes per dimension per rank: counted vs formula
    print(plan_table(rows, k=10)); frontier_figure(rows, title)
    planner_widget()                                  # ipywidgets over `course_lib.theory.planner.plan`
    throughput_figure(eff, rows)                      # published TFLOP/s per GPU: planner vs reported, and errors
    efficiency_figure(hidden, experts)                # matmul efficiency by shape (`efficiency`)
"""

from __future__ import annotations

import re

from course_lib.config import PRESETS
from course_lib.measure.hardware import GPU_SPECS
from course_lib.lessons.display import plain_log_ticks
from course_lib.lessons.l08_three_d.runs import CALIBRATION
from course_lib.theory.planner import Cluster, GiB, plan

__all__ = ["grid_figure", "comm_table", "comm_figure", "plan_table", "frontier", "frontier_figure", "planner_widget",
           "throughput_figure"]

DIMS = ("tp", "pp", "dp")
COLORS = {"tp": "#1f77b4", "pp": "#2ca02c", "dp": "#ff7f0e"}


def grid_figure(sizes: dict, members: list[dict], gpus_per_node: int, title: str = ""):
    """One box per rank at (pipeline stage, data-parallel replica, tensor-parallel index), shaded by node; a line
    joins the ranks of each TP group, each DP group and each PP group (``members``: per rank, its
    ``{"coords": ..., "groups": {dim: [ranks]}}``, as the ranks reported them)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tp, dp, pp = sizes["tp"], sizes["dp"], sizes["pp"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * pp * tp / 2, 1.2 + 1.1 * dp))
    where = {}
    for r, m in enumerate(members):
        c = m["coords"]
        x, y = c["pp"] * (tp + 0.8) + c["tp"], dp - 1 - c["dp"]
        where[r] = (x + 0.4, y + 0.35)
        node = r // gpus_per_node
        ax.add_patch(Rectangle((x, y), 0.8, 0.7, facecolor=("#eeeeee", "#cfcfe8")[node % 2], edgecolor="k"))
        ax.text(x + 0.4, y + 0.45, f"rank {r}", ha="center", va="center", fontsize=8)
        ax.text(x + 0.4, y + 0.18, f"node {node}", ha="center", va="center", fontsize=6, color="#555555")
    drawn, labelled = set(), set()
    for m in members:
        for dim, offset in (("tp", 0.0), ("dp", -0.12), ("pp", 0.12)):
            group = tuple(m["groups"][dim])
            if len(group) < 2 or (dim, group) in drawn:
                continue
            drawn.add((dim, group))
            xs = [where[r][0] + offset for r in group]
            ys = [where[r][1] + (0.22 if dim == "tp" else 0) for r in group]
            ax.plot(xs, ys, "-o", color=COLORS[dim], lw=2, ms=3, alpha=0.8,
                    label=None if dim in labelled else f"{dim.upper()} group")
            labelled.add(dim)
    for s in range(pp):
        ax.text(s * (tp + 0.8) + tp * 0.45, dp + 0.1, f"pipeline stage {s}", ha="center", fontsize=8)
    ax.set_xlim(-0.3, pp * (tp + 0.8))
    ax.set_ylim(-0.3, dp + 0.45)
    ax.set_yticks([dp - 1 - d + 0.35 for d in range(dp)], [f"replica {d}" for d in range(dp)], fontsize=8)
    ax.set_xticks([])
    ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, -0.32), ncol=3)
    ax.set_title(title or f"dp {dp} x pp {pp} x tp {tp}: TP innermost, PP outermost", fontsize=9)
    fig.tight_layout()
    return fig


def comm_table(rows: list[dict], hardware: str) -> str:
    """Per rank: its coordinates and, per dimension, the payload bytes of its calls (counted, and by formula) and
    the bytes it puts on the wire (payload x the collective's bus factor on a ring; a point-to-point message is its
    payload)."""
    head = (f"{'rank':>4s} {'pp dp tp':>9s}  "
            + "  ".join(f"{d + ' payload':>12s} {'formula':>10s} {'wire':>10s}" for d in DIMS))
    lines = [f"measured on {hardware} (bytes per rank for the whole run)", head, "-" * len(head)]
    for r, row in enumerate(rows):
        c = row["coords"]
        cells = "  ".join(f"{row['counted'][d]:>12,} {row['formula'][d]:>10,} {row['wire'][d]:>10,}" for d in DIMS)
        lines.append(f"{r:>4d} {c['pp']:>3d}{c['dp']:>3d}{c['tp']:>3d}  {cells}")
    return "\n".join(lines)


def comm_figure(rows: list[dict], hardware: str, title: str = ""):
    """Bars of the payload bytes of each rank's calls per dimension (counted), with the formula as a black tick."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.27
    for i, dim in enumerate(DIMS):
        xs = [r + (i - 1) * width for r in range(len(rows))]
        ax.bar(xs, [row["counted"][dim] / 1e3 for row in rows], width, color=COLORS[dim],
               label=f"{dim.upper()} counted")
        ax.plot(xs, [row["formula"][dim] / 1e3 for row in rows], "k_", ms=9, mew=2,
                label="formula" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))], fontsize=8)
    ax.set_ylabel("KB of payload per rank")
    ax.set_title(title or f"payload of each dimension's calls in the run ({hardware})", fontsize=9)
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    return fig


def plan_table(rows, k: int = 10, infeasible: int = 5) -> str:
    """The ``k`` fastest feasible layouts of `planner.plan` (memory in GiB of the stage that needs the most, step
    time in seconds by part, MFU and HFU of the step), then ``infeasible`` rejected ones with their reason and one
    of the layouts the planner does not model."""
    head = (f"{'#':>3s} {'layout':38s} {'accum':>5s} {'GiB/GPU':>7s} {'states':>7s} {'acts':>6s} {'step s':>8s} "
            f"{'bubble':>7s} {'tp':>6s} {'pp':>6s} {'dp':>6s} {'MFU':>5s} {'HFU':>5s}")
    lines = [head, "-" * len(head)]
    ok = [r for r in rows if r.feasible]
    for i, r in enumerate(ok[:k], 1):
        t, m = r.time, r.memory
        lines.append(f"{i:>3d} {r.layout.label():38s} {r.accum:>5d} {m['total'] / GiB:>7.1f} "
                     f"{m['model_states'] / GiB:>7.1f} {m['activations'] / GiB:>6.1f} {t['total']:>8.2f} "
                     f"{t['bubble']:>7.2f} {t['tp']:>6.2f} {t['pp']:>6.3f} {t['dp']:>6.2f} {r.mfu:>5.1%} "
                     f"{r.hfu:>5.1%}")
    bad = [r for r in rows if r.status == "infeasible"]
    skipped = [r for r in rows if r.status == "not modelled"]
    lines.append(f"{len(ok)} feasible, {len(bad)} infeasible, {len(skipped)} not modelled; for example:")
    shown = set()
    for r in bad:
        reason = re.sub(r"[\d.]+", "#", r.why.split(";")[0])            # one line per kind of reason
        if reason in shown:
            continue
        shown.add(reason)
        lines.append(f"    {r.layout.label():38s} {r.why}")
        if len(shown) >= infeasible:
            break
    if skipped:
        lines.append(f"    {skipped[0].layout.label():38s} {skipped[0].not_modelled}")
    return "\n".join(lines)


def frontier(rows) -> list:
    """The feasible layouts no other feasible layout beats in both step time and memory per GPU."""
    best, out = float("inf"), []
    for r in sorted((r for r in rows if r.feasible), key=lambda r: (r.time["total"], r.memory["total"])):
        if r.memory["total"] < best:
            best = r.memory["total"]
            out.append(r)
    return out


def frontier_figure(rows, title: str, gpu_gb: float, mark=None):
    """Memory per GPU against step time of every layout (infeasible ones grey), the frontier joined, the fastest
    ringed; ``mark``: a `Layout` to ring too (e.g. a published one)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    bad = [r for r in rows if r.status == "infeasible" and r.time["total"] > 0]
    ok = [r for r in rows if r.feasible]
    ax.scatter([r.time["total"] for r in bad], [r.memory["total"] / GiB for r in bad], s=6, color="#bbbbbb",
               label="infeasible")
    handle = None
    for ckpt, marker in (("none", "o"), ("selective", "s"), ("full", "^")):
        sel = [r for r in ok if r.layout.ckpt == ckpt]
        handle = ax.scatter([r.time["total"] for r in sel], [r.memory["total"] / GiB for r in sel], s=12, marker=marker,
                   c=[r.layout.pp for r in sel], cmap="viridis", vmin=1, vmax=max([r.layout.pp for r in ok] + [2]),
                   label=f"feasible, ckpt={ckpt}")
    if ok:
        fig.colorbar(handle, ax=ax, label="pipeline stages (pp)", pad=0.01)
    front = frontier(rows)
    ax.plot([r.time["total"] for r in front], [r.memory["total"] / GiB for r in front], "r-", lw=1.2,
            label="frontier")
    if ok:
        ax.scatter([ok[0].time["total"]], [ok[0].memory["total"] / GiB], s=120, facecolors="none",
                   edgecolors="r", label=f"fastest: {ok[0].layout.label()}")
    if mark is not None:
        hit = [r for r in rows if r.layout == mark]
        if hit:
            ax.scatter([hit[0].time["total"]], [hit[0].memory["total"] / GiB], s=160, marker="*",
                       facecolors="none", edgecolors="k", label=f"marked: {mark.label()}")
    ax.axhline(gpu_gb, color="#d62728", ls="--", lw=1, label=f"{gpu_gb:g} GiB per GPU")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.set_xlabel("step time, s (formula: no overlap, assumed kernel efficiency)")
    ax.set_ylabel("GiB per GPU (formula)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="upper right")
    fig.tight_layout()
    return fig


def planner_widget():
    """ipywidgets: model preset, GPU, nodes x GPUs per node, inter-node bandwidth, global batch, the assumed kernel
    efficiency (a hardware FLOPs utilisation); prints the ranked table and draws the frontier (formula only)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    big = [n for n in PRESETS if PRESETS[n].num_params() > 5e8]
    preset = w.Dropdown(options=big, value="gpt3-175b" if "gpt3-175b" in big else big[0], description="model")
    gpu = w.Dropdown(options=[g for g in GPU_SPECS if GPU_SPECS[g].mem_gb >= 40], value="A100", description="GPU")
    nodes = w.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=128, description="nodes")
    per_node = w.Dropdown(options=[4, 8], value=8, description="GPUs/node")
    inter = w.FloatText(value=25.0, description="inter GB/s")
    batch = w.IntText(value=1536, description="global batch")
    efficiency = w.FloatSlider(value=0.4, min=0.1, max=0.7, step=0.05, description="kernel eff.")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            cluster = Cluster(f"{nodes.value} x {per_node.value} {gpu.value}", nodes.value, per_node.value,
                              inter.value)
            rows = plan(PRESETS[preset.value], GPU_SPECS[gpu.value], cluster, batch.value,
                        kernel_efficiency=efficiency.value)
            print(f"{preset.value} on {cluster.name}, global batch {batch.value}, kernel efficiency (HFU) "
                  f"{efficiency.value:.0%} assumed (formula, no GPU involved)")
            print(plan_table(rows, k=8, infeasible=3))
            fig = frontier_figure(rows, f"{preset.value} on {cluster.name}", GPU_SPECS[gpu.value].mem_gb)
            display(fig)
            plt.close(fig)

    for widget in (preset, gpu, nodes, per_node, inter, batch, efficiency):
        widget.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, gpu, nodes]), w.HBox([per_node, inter, batch]), efficiency, out])


def throughput_figure(efficiency: float, rows: list, calibration: str = ""):
    """Left: each scored run's TFLOP/s per GPU, the planner's against the reported (``rows``:
    `published.throughput_table`'s), with the y = x line and the constant baseline; the calibration row ringed.
    Right: the error per run (runs out of the score hatched), the planner's beside the constant baseline's."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.6]})
    scored = [t for t in rows if t.run.scored]
    rep = [t.reported for t in scored]
    pred = [t.predicted for t in scored]
    lo, hi = 0.93 * min(rep + pred), 1.04 * max(rep + pred)
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="#e5e5e5", label="within 10 %")
    ax.axhline(scored[0].baseline, color="#888888", ls="--", lw=1, label="constant baseline")
    for t in scored:
        ax.plot(t.reported, t.predicted, "o", ms=6, color="#1f77b4")
        if t.run.name == calibration:
            ax.plot(t.reported, t.predicted, "o", ms=13, mfc="none", mec="k")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="reported TFLOP/s per GPU", ylabel="planner TFLOP/s per GPU",
           title=f"scored runs; matmuls at {efficiency:.0%} of peak (ringed: calibration)")
    ax.legend(fontsize=7, loc="upper left")
    names = [t.run.name.replace("Megatron-LM ", "").replace(" (table 1)", "") for t in rows]
    x = range(len(rows))
    bars = bx.bar([i - 0.2 for i in x], [100 * t.error for t in rows], 0.4, label="planner", color="#1f77b4")
    for bar, t in zip(bars, rows):
        if not t.run.scored:
            bar.set(hatch="//", facecolor="white", edgecolor="#1f77b4")
    bx.bar([i + 0.2 for i in x], [100 * t.baseline_error for t in rows], 0.4, label="constant baseline",
           color="#bbbbbb")
    bx.axhline(0, color="k", lw=0.8)
    for y in (-10, 10):
        bx.axhline(y, color="k", lw=0.6, ls=":")
    bx.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    bx.set(ylabel="error, % of reported", ylim=(-35, 25), title="error per run (dotted: +-10 %)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


def efficiency_figure(hidden: list[dict], experts: dict):
    """Left: each scored A100 run's implied efficiency (the flat constant that reproduces it alone) against its
    hidden size, beside the shapes model's (`efficiency.by_hidden_size`); the calibrated flat constant dashed.
    Right: DeepSeek-V3's expert GEMMs against the rows each expert receives (`efficiency.by_tokens_per_expert`),
    ep marked, the ridge point's rows dotted."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    h = [r["h"] for r in hidden]
    ax.plot(h, [r["implied"] for r in hidden], "o", color="#1f77b4", label="implied by the published row (flat)")
    ax.plot(h, [r["shapes"] for r in hidden], "s", mfc="none", color="#d62728",
            label="its layer's GEMMs: quantization + roofline")
    cal = next((r for r in hidden if r["name"] == CALIBRATION), None)
    if cal is not None:
        ax.axhline(cal["implied"], color="#888888", ls="--", lw=1, label=f"flat constant ({cal['name'].replace('Megatron-LM ', '').replace(' (table 1)', '')} row)")
    ax.set(xlabel="hidden size h", ylabel="fraction of bf16 peak", ylim=(0.45, 0.75),
           title="A100 runs: matmul efficiency against h")
    ax.legend(fontsize=7, loc="lower right")
    bx.plot(experts["rows"], experts["efficiency"], "o-", color="#2ca02c")
    for ep, m, e in zip(experts["eps"], experts["rows"], experts["efficiency"]):
        bx.annotate(f"ep {ep}", (m, e), textcoords="offset points", xytext=(0, -12 if ep % 2 else 6), fontsize=7,
                    ha="center", fontweight="bold" if ep == experts["published_ep"] else "normal")
    bx.axvline(experts["ridge_rows"], color="k", ls=":", lw=1, label="ridge point at full peak")
    bx.axvline(experts["ridge_rows_at_constant"], color="#888888", ls=":", lw=1,
               label=f"ridge point at {experts['constant']:.0%} of peak")
    bx.set(xscale="log", xlabel="rows (tokens) per expert", ylabel="fraction of bf16 peak", ylim=(0, 0.85),
           title=f"DeepSeek-V3's expert GEMMs on one {experts['gpu'].split()[0]}")
    bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
