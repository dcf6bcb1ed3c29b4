"""Lesson 01's figures and its widget. Every figure's title names the hardware and backend.

- Figures of the measurements (`experiments`): :func:`matmul_figure`, :func:`memory_figure`,
  :func:`roofline_figure`, :func:`collectives_figure`, :func:`step_breakdown_figure`. Each returns the
  ``Figure`` (shown inline by Jupyter).
- :func:`bottleneck_widget`: pick a model preset, a GPU and a cluster; see where the time and the memory of one
  data-parallel training step go, by formula (:func:`bottleneck_estimate`, which uses only `course_lib.theory`
  and the datasheet table `course_lib.measure.hardware.GPU_SPECS`), drawn by :func:`estimate_figure`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_lib.config import PRESETS, get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.lessons.display import COLORS
from course_lib.theory import comm, flops, memory
from course_lib.theory.comm import alpha_beta_time
from course_lib.theory.planner import Cluster
from course_lib.measure.units import fmt_bytes


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


def matmul_figure(rows: list[dict], peak_flop_s: float, hardware: str, peak_label: str = "peak"):
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


def memory_figure(columns: dict[str, dict], hardware: str, unit: float = 1e6, unit_name: str = "MB"):
    """Stacked bars of training memory: ``columns = {"predicted": {"params": b, ...}, "measured": {...}}``."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    names = list(columns)
    parts = []
    for col in columns.values():
        parts += [k for k in col if k not in parts]
    bottom = np.zeros(len(names))
    for part in parts:
        vals = np.array([columns[n].get(part, 0) / unit for n in names])
        ax.bar(names, vals, bottom=bottom, label=part, color=COLORS.get(part))
        bottom += vals
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f} {unit_name}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(unit_name)
    ax.set_title(f"Anatomy of training memory\n{hardware}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def roofline_figure(points: list[dict], peak_flop_s: float, peak_bw: float, hardware: str):
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


def collectives_figure(rows: list[dict], fits: dict | None, hardware: str):
    """Left: time vs message size (points) with the alpha-beta fit (lines). Right: bus bandwidth."""
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
        ax.set_xticks(ticks, [fmt_bytes(t, binary=True) for t in ticks], rotation=45, fontsize=7)
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


def step_breakdown_figure(bd: dict, hardware: str, title: str = "One data-parallel step"):
    """Top: timeline of compute and communication intervals. Bottom: stacked bar of the step's time."""
    fig, (ax_tl, ax_bar) = plt.subplots(2, 1, figsize=(9, 3.6), gridspec_kw=dict(height_ratios=[2, 1]))
    t0 = min([s for s, _ in bd["compute_intervals"] + bd["comm_intervals"]], default=0.0)
    for row, key, color in ((1, "compute_intervals", COLORS["compute"]), (0, "comm_intervals", COLORS["communication"])):
        ax_tl.broken_barh([((s - t0) * 1e3, (e - s) * 1e3) for s, e in bd[key]], (row - 0.4, 0.8), color=color)
    ax_tl.set_yticks([0, 1], ["communication", "compute"])
    ax_tl.set_xlabel("ms since the first op")
    left = 0.0
    for key, label in (("compute_only", "compute"), ("overlap", "overlap"), ("comm_only", "communication"),
                       ("idle", "idle")):
        width = bd[key] * 1e3
        ax_bar.barh([0], [width], left=left, color=COLORS[label], label=f"{label} {width:.1f} ms")
        left += width
    ax_bar.set_yticks([])
    ax_bar.set_xlabel("ms")
    ax_bar.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.6))
    fig.suptitle(f"{title}\n{hardware}", fontsize=9)
    fig.tight_layout()
    return fig


def estimate_figure(est: dict, title: str = ""):
    """Two panels for the lesson-01 widget: step time (compute / communication) and memory per GPU."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3))
    t = est["time_s"]
    ax_t.barh(["step"], [t["compute"]], color=COLORS["compute"], label=f"compute {t['compute']:.3g} s")
    ax_t.barh(["step"], [t["communication"]], left=[t["compute"]], color=COLORS["communication"],
              label=f"gradient all-reduce {t['communication']:.3g} s")
    ax_t.set_xlabel("seconds per step (no overlap)")
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    m = est["memory_bytes"]
    left = 0.0
    for part in ("params", "grads", "master", "optimizer", "activations"):
        ax_m.barh(["per GPU"], [m[part] / 1e9], left=[left], color=COLORS[part], label=part)
        left += m[part] / 1e9
    ax_m.axvline(est["gpu_mem_bytes"] / 1e9, color="k", ls="--", label="GPU memory")
    ax_m.set_xlabel("GB")
    ax_m.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# The bottleneck widget (formula only)
# ---------------------------------------------------------------------------------------------


# (`theory.planner.Cluster`: latency ~10 us in a node, ~20-30 us across InfiniBand/Ethernet, orders of magnitude)
CLUSTERS = {c.name: c for c in [
    Cluster("1 GPU", 1, 1),
    Cluster("1 node x 8 GPUs (NVLink / PCIe of the GPU)", 1, 8),
    Cluster("4 nodes x 8 GPUs, InfiniBand 400 Gb/s per GPU", 4, 8, 50.0, inter_alpha_us=20.0),
    Cluster("32 nodes x 8 GPUs, InfiniBand 400 Gb/s per GPU", 32, 8, 50.0, inter_alpha_us=20.0),
    Cluster("4 nodes x 8 GPUs, Ethernet 100 Gb/s per node", 4, 8, 12.5 / 8, inter_alpha_us=30.0),
]}


def bottleneck_estimate(preset: str, gpu: str, cluster: str, micro_batch: int = 8, mfu: float = 0.4) -> dict:
    """Time and memory of one plain data-parallel step (bf16 mixed precision, Adam), by formula.

    - compute: ``flops_per_token x tokens per GPU / (peak x mfu)`` (lesson 01's 6N + attention);
    - communication: a ring all-reduce of the bf16 gradients, ``2(n-1) alpha + 2(n-1)/n x 2P / bandwidth``,
      the bandwidth being the GPU's link in one node, else the slower inter-node link per GPU;
    - memory per GPU: 16 bytes per parameter (mixed-precision Adam, ``theory.memory.mixed_precision_bytes``)
      plus activations of ``micro_batch`` sequences in bf16 (``theory.memory.activation_bytes``, derived for
      the course GPT; approximate for llama-style presets), no sharding, no checkpointing.
    """
    cfg = get_preset(preset)
    spec = GPU_SPECS[gpu]
    cl = CLUSTERS[cluster]
    n = cl.n_gpus
    P = cfg.num_params()
    tokens = micro_batch * cfg.seq_len
    compute = flops.flops_per_token(cfg) * tokens / (spec.bf16_tflops * 1e12 * mfu)
    bw = spec.link_gbs if cl.nodes == 1 else min(spec.link_gbs, cl.inter_gbs_per_gpu)
    alpha_us = cl.alpha_us if cl.nodes == 1 else cl.inter_alpha_us
    communication = comm.collective_time("all_reduce", 2 * P, n, alpha_us * 1e-6, bw * 1e9)
    mem = memory.mixed_precision_bytes(P)
    mem.pop("total")
    mem["activations"] = memory.activation_bytes(cfg, micro_batch, dtype=torch.bfloat16)["total"]
    mem["total"] = sum(mem.values())
    gpu_mem = spec.mem_gb * 1e9
    fits = mem["total"] <= gpu_mem
    step = compute + communication
    if not fits:
        bound = "memory: the replica does not fit (shard it: ZeRO/FSDP lesson 05, TP/PP lessons 03-04)"
    elif communication > compute:
        bound = "communication (bigger batch per GPU, overlap, faster links, gradient compression)"
    else:
        bound = "compute (raise MFU: bigger matmuls, bf16, fused kernels)"
    return dict(time_s=dict(compute=compute, communication=communication, total=step),
                memory_bytes=mem, gpu_mem_bytes=gpu_mem, fits=fits, bound=bound, n_gpus=n, params=P,
                tokens_per_s=n * tokens / step, link_gbs=bw)


def describe(est: dict, preset: str, gpu: str, cluster: str) -> str:
    """A few lines of text for one estimate."""
    t, m = est["time_s"], est["memory_bytes"]
    return (f"{preset} ({est['params'] / 1e9:.3g} B params) on {est['n_gpus']} x {GPU_SPECS[gpu].name}, {cluster}\n"
            f"  step: compute {t['compute'] * 1e3:.1f} ms + all-reduce {t['communication'] * 1e3:.1f} ms "
            f"({est['link_gbs']:.3g} GB/s per GPU) = {t['total'] * 1e3:.1f} ms, "
            f"{est['tokens_per_s']:.3g} tokens/s for the cluster\n"
            f"  memory per GPU: {m['total'] / 1e9:.1f} GB of {est['gpu_mem_bytes'] / 1e9:.0f} GB "
            f"(model state {(m['total'] - m['activations']) / 1e9:.1f} GB, activations {m['activations'] / 1e9:.1f} GB)\n"
            f"  bound: {est['bound']}  [formula, not a measurement]")


def bottleneck_widget():
    """Dropdowns for preset, GPU, cluster; sliders for micro-batch and MFU; text and bars update live."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display


    preset = w.Dropdown(options=list(PRESETS), value="gpt2-124m", description="model")
    gpu = w.Dropdown(options=list(GPU_SPECS), value="H100", description="GPU")
    cluster = w.Dropdown(options=list(CLUSTERS), value=list(CLUSTERS)[1], description="cluster",
                         layout=w.Layout(width="480px"))
    mb = w.IntSlider(value=8, min=1, max=64, description="micro-batch")
    mfu_s = w.FloatSlider(value=0.4, min=0.05, max=0.8, step=0.05, description="MFU")
    out = w.Output()

    def update(*_):
        est = bottleneck_estimate(preset.value, gpu.value, cluster.value, mb.value, mfu_s.value)
        with out:
            out.clear_output(wait=True)
            print(describe(est, preset.value, gpu.value, cluster.value))
            fig = estimate_figure(est, f"{preset.value} on {gpu.value}, {cluster.value} (formula)")
            display(fig)
            plt.close(fig)

    for c in (preset, gpu, cluster, mb, mfu_s):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, gpu]), cluster, w.HBox([mb, mfu_s]), out])


# ---------------------------------------------------------------------------------------------
# FLOPs per token by convention (section 1.5)
# ---------------------------------------------------------------------------------------------


def flops_conventions_rows(presets: list[str], counted: dict[str, float] | None = None) -> list[dict]:
    """One row per preset: training FLOPs per token by every convention of ``theory.flops.FLOP_CONVENTIONS``,
    plus ``FlopCounterMode`` where ``counted`` has the preset (per token, from ``experiments.counted_flops``)."""
    counted = counted or {}
    rows = []
    for name in presets:
        cfg = get_preset(name)
        row = {"preset": name, "tied head": cfg.tie_embeddings}
        row.update({conv: fn(cfg) for conv, fn in flops.FLOP_CONVENTIONS.items()})
        row["FlopCounterMode"] = counted.get(name, float("nan"))
        rows.append(row)
    return rows


def flops_conventions_table(rows: list[dict]) -> str:
    """The rows of :func:`flops_conventions_rows` as text, a column per preset: training FLOPs per token (MFLOP
    below 1 GFLOP, else GFLOP) and the difference from the course's formula; ``-`` where nothing was measured."""
    base_key = next(iter(flops.FLOP_CONVENTIONS))
    scales = [(1e9, "GFLOP") if r[base_key] > 1e9 else (1e6, "MFLOP") for r in rows]
    head = f"{'FLOPs per token':26}" + "".join(f"{r['preset'] + ' (' + u + ')':>24}" for r, (_, u) in zip(rows, scales))
    lines = [head, f"{'':26}" + "".join(f"{'head ' + ('tied' if r['tied head'] else 'untied'):>24}" for r in rows)]
    for c in list(flops.FLOP_CONVENTIONS) + ["FlopCounterMode"]:
        cells = []
        for r, (scale, _) in zip(rows, scales):
            v = r[c]
            diff = round(v / r[base_key] - 1, 4) + 0.0                 # + 0.0: no "-0.0 %"
            cells.append(f"{'-':>24}" if v != v else f"{v / scale:>14,.2f} ({diff:+6.1%})")
        lines.append(f"{c:26}" + "".join(cells))
    return "\n".join(lines)
