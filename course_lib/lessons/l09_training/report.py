"""Lesson 09's tables, figures and the checkpoint-interval widget.

    lr_figure(lr_curves(...), hw); warmup_figure(warmup_runs(...), hw)
    print(rules_table(SEED_RULES)); waste_figure(checkpoint_s=60, mtbf_s=job_mtbf(...))
    print(cost_table(rows)); interval_widget()            # ipywidgets: course_lib.theory.practice
"""

from __future__ import annotations

import math

from course_lib.lessons.display import COLORS, plain_log_ticks
from course_lib.theory import practice

__all__ = ["max_relative_difference", "loss_spike", "lr_figure", "warmup_figure", "clip_table", "rules_table",
           "waste_curve", "waste_figure", "cost_table", "interval_widget"]


def max_relative_difference(actual: list[float], expected: list[float]) -> float:
    """max |a - e| / |e| over two equally long lists of rates (an expected 0 must be an exact 0, else inf)."""
    if len(actual) != len(expected):
        raise ValueError(f"{len(actual)} rates against {len(expected)}: compare the same steps")
    return max(((abs(a - e) / abs(e)) if e else (math.inf if a else 0.0) for a, e in zip(actual, expected)),
               default=0.0)


def loss_spike(losses: list[float]) -> float:
    """The largest loss after the first step over the first step's loss: above 1 the run got worse than where it
    started (a spike; inf when a loss is not finite), below 1 it never did."""
    later = losses[1:]
    if not later:
        raise ValueError("need at least two losses")
    if not all(math.isfinite(v) for v in later):
        return math.inf
    return max(later) / losses[0]


def lr_figure(curves: dict, hardware: str, title: str = ""):
    """Left: the warm-up + cosine rate of every update, ours and its twins. Right: each twin minus ours."""
    import matplotlib.pyplot as plt

    fig, (ax, diff) = plt.subplots(1, 2, figsize=(10, 3.2))
    steps = range(len(curves["ours"]))
    ax.plot(steps, curves["ours"], "k-", lw=3, alpha=0.35, label="ours (closed form)")
    styles = {"lambda": ("C0", "--", "torch LambdaLR"), "torch": ("C1", ":", "torch LinearLR + CosineAnnealingLR"),
              "ds_cosine": ("C3", "-", "DeepSpeed WarmupCosineLR, linear warm-up"),
              "ds_cosine_log": ("C4", "-.", "DeepSpeed WarmupCosineLR, log warm-up (its default)"),
              "ds_warmup": ("C2", "-", "DeepSpeed WarmupLR")}
    for key, (color, ls, label) in styles.items():
        if key in curves:
            ax.plot(steps, curves[key], color=color, ls=ls, lw=1.2, label=label)
            if key not in ("ds_warmup", "ds_cosine_log"):      # the right panel: twins of ours that differ by a step
                diff.plot(steps, [a - b for a, b in zip(curves[key], curves["ours"])], color=color, ls=ls, lw=1.2,
                          label=label)
    ax.set_xlabel("optimizer update s")
    ax.set_ylabel("learning rate")
    ax.set_title(title or "warm-up + cosine, five ways", fontsize=9)
    ax.legend(fontsize=7)
    diff.axhline(0, color="k", lw=0.5)
    diff.set_xlabel("optimizer update s")
    diff.set_ylabel("rate - ours")
    diff.set_title(f"difference from ours ({hardware})", fontsize=9)
    diff.legend(fontsize=7)
    fig.tight_layout()
    return fig


def warmup_figure(runs: dict, hardware: str, peak_lr: float):
    """Loss per step for each warm-up length (left) and the rates that produced it (right)."""
    import matplotlib.pyplot as plt

    fig, (ax, lr) = plt.subplots(1, 2, figsize=(10, 3.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, (warm, rec) in enumerate(sorted(runs.items())):
        label = f"warm-up {warm} steps" if warm > 1 else "no warm-up"
        color = COLORS["activations"] if warm <= 1 else COLORS["params"]
        ax.plot(rec["losses"], color=color, lw=1.5, label=label)
        lr.plot(rec["lrs"], color=color, lw=1.5, label=label)
    first = next(iter(runs.values()))["losses"][0]
    ax.axhline(first, color="k", lw=0.6, ls=":", label="loss at step 0")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"AdamW at peak lr {peak_lr:g}, the course's GPT ({hardware})", fontsize=9)
    ax.legend(fontsize=7)
    lr.set_xlabel("step")
    lr.set_ylabel("learning rate")
    lr.set_title("the schedules", fontsize=9)
    fig.tight_layout()
    return fig


def clip_table(rows: list[dict], reference: float, hardware: str) -> str:
    """Per rank of DP x TP: the right global norm and the wrong ones, each against one process's norm."""
    head = (f"{'rank':>4s} {'dp,tp':>5s} {'global norm':>12s} {'rel. err':>9s} {'counted on every tp rank':>25s} "
            f"{'summed over dp':>15s} {'own shards only':>16s} {'clipped grads err':>17s}")
    lines = [f"one process (clip_grad_norm_ on the global batch): {reference:.6f}; measured on {hardware}", head,
             "-" * len(head)]
    for r, o in enumerate(rows):
        rel = abs(o["norm"] - reference) / reference
        lines.append(f"{r:4d} {o['coords']['dp']:>2d},{o['coords']['tp']:<2d} {o['norm']:12.6f} {rel:9.1e} "
                     f"{o['every_tp_rank']:14.6f} ({o['every_tp_rank'] / reference:4.2f}x) "
                     f"{o['summed_over_dp']:8.6f} ({o['summed_over_dp'] / reference:4.2f}x) "
                     f"{o['local_only']:9.6f} ({o['local_only'] / reference:4.2f}x) {o['clip_err']:17.1e}")
    return "\n".join(lines)


def rules_table(rules) -> str:
    """The alert rules: name, condition, duration, and what the seed's text says."""
    head = f"{'rule':24s} {'condition':30s} {'for':>7s}  what it means"
    lines = [head, "-" * len(head)]
    for r in rules:
        cond = f"{r.metric} is NaN or inf" if r.op == "nonfinite" else f"{r.metric} {r.op} {r.threshold:g}"
        dur = f"{r.for_s / 60:g} min" if r.for_s else "at once"
        lines.append(f"{r.name:24s} {cond:30s} {dur:>7s}  {r.message}")
    return "\n".join(lines)


def waste_curve(intervals_s, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> list[float]:
    """`practice.waste_fraction` at each interval (first order: checkpoints + half an interval + restart per
    failure)."""
    return [practice.waste_fraction(t, checkpoint_s, mtbf_s, restart_s) for t in intervals_s]


def waste_figure(checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0, title: str = "", ax=None):
    """Fraction of a job's time lost vs checkpoint interval: writing checkpoints (delta / tau), recomputing after
    failures ((tau / 2 + R) / M), their sum, and Young's and Daly's optima."""
    import matplotlib.pyplot as plt
    import numpy as np

    young = practice.young_daly_interval(checkpoint_s, mtbf_s)
    daly = practice.daly_interval(checkpoint_s, mtbf_s)
    taus = np.geomspace(young / 30, young * 30, 200)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(taus / 60, [100 * checkpoint_s / t for t in taus], color=COLORS["communication"], ls="--",
            label="writing checkpoints, delta / tau")
    ax.plot(taus / 60, [100 * (t / 2 + restart_s) / mtbf_s for t in taus], color=COLORS["activations"], ls="--",
            label="recomputing after failures, (tau/2 + R) / M")
    ax.plot(taus / 60, [100 * w for w in waste_curve(taus, checkpoint_s, mtbf_s, restart_s)], "k-", lw=1.8,
            label="time lost (sum)")
    best = 100 * practice.waste_fraction(young, checkpoint_s, mtbf_s, restart_s)
    ax.plot([young / 60], [best], "o", color=COLORS["optimizer"], ms=8,
            label=f"Young: sqrt(2 delta M) = {young / 60:.1f} min, {best:.1f} % lost")
    ax.axvline(daly / 60, color=COLORS["master"], lw=1, ls=":", label=f"Daly (higher order): {daly / 60:.1f} min")
    ax.set_xscale("log")
    plain_log_ticks(ax, "x")
    ax.set_ylim(0, 4 * best)
    ax.set_xlabel("checkpoint interval tau (minutes of work)")
    ax.set_ylabel("% of the job's time lost")
    ax.set_title(title or f"checkpoint every tau: delta = {checkpoint_s:g} s, job MTBF M = {mtbf_s / 3600:.1f} h, "
                          f"restart R = {restart_s:g} s (formula)", fontsize=9)
    ax.legend(fontsize=7)
    if fig is not None:
        fig.tight_layout()
    return fig


def cost_table(rows: list[dict]) -> str:
    """One line per assumption: GPU, MFU, GPU-hours, days on the cluster, dollars."""
    head = f"{'GPU':10s} {'peak TFLOP/s':>12s} {'MFU':>5s} {'GPU-hours':>12s} {'days on 1,024':>13s} {'US$':>14s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['gpu']:10s} {r['peak'] / 1e12:12.0f} {r['mfu']:5.0%} {r['gpu_hours']:12,.0f} "
                     f"{r['gpu_hours'] / 1024 / 24:13.1f} {r['usd']:14,.0f}")
    return "\n".join(lines)


def interval_widget():
    """ipywidgets: GPUs in the job, MTBF of one GPU, checkpoint cost and restart time; prints Young's and Daly's
    optimum and the time lost there, and draws `waste_figure` (formula only)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    gpus = w.Dropdown(options=[8, 64, 512, 1024, 4096, 16384], value=1024, description="GPUs")
    mtbf = w.Dropdown(options=[10_000, 50_000, 100_000, 500_000], value=50_000, description="GPU-h / int.")
    delta = w.FloatSlider(value=60.0, min=5.0, max=600.0, step=5.0, description="ckpt s")
    restart = w.FloatSlider(value=300.0, min=0.0, max=1800.0, step=30.0, description="restart s")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            m = practice.job_mtbf(mtbf.value * 3600, gpus.value)
            tau = practice.young_daly_interval(delta.value, m)
            lost = practice.waste_fraction(tau, delta.value, m, restart.value)
            print(f"{gpus.value:,} GPUs, one interruption (any cause) per {mtbf.value:,} GPU-hours -> the job "
                  f"stops every {m / 3600:.1f} h; checkpoint every {tau / 60:.1f} min (Young; Daly "
                  f"{practice.daly_interval(delta.value, m) / 60:.1f} min): {lost:.1%} of the time lost (formula)")
            fig = waste_figure(delta.value, m, restart.value)
            display(fig)
            plt.close(fig)

    for widget in (gpus, mtbf, delta, restart):
        widget.observe(update, names="value")
    update()
    return w.VBox([w.HBox([gpus, mtbf]), w.HBox([delta, restart]), out])
