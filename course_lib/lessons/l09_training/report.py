"""Lesson 09's tables, figures and the checkpoint-interval widget.

    lr_figure(lr_curves(...), hw); warmup_figure(warmup_runs(...), hw)
    print(rules_table(SEED_RULES)); waste_figure(checkpoint_s=60, mtbf_s=job_mtbf(...))
    print(cost_table(rows)); interval_widget()            # ipywidgets: course_lib.theory.practice
    print(spike_table(spike_rows(record))); spike_figure(clean, spiked, spike_rows(record), hw)   # section 7.1
    save_figure(async_save_timing(), hw); print(token_table(token_loss_runs(cfg)))                # 7.4, 7.5
"""

from __future__ import annotations

import math

from course_lib.lessons.display import COLORS, plain_log_ticks
from course_lib.theory import practice

__all__ = ["max_relative_difference", "loss_spike", "lr_figure", "warmup_figure", "clip_table", "rules_table",
           "waste_curve", "waste_figure", "cost_table", "interval_widget", "spike_table", "trend_table", "spike_figure",
           "save_figure", "token_table"]


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


# ----------------------------------------------------------------------------- 7. when a large run goes wrong

def spike_table(rows: list[dict]) -> str:
    """One line per spike the script saw (`experiments.spike_rows`): step, detector, values and z-scores, the
    checkpoint it rewound to, the batches skipped, the steps computed again, the learning rate after."""
    if not rows:
        return "no spike detected"
    head = (f"{'step':>4s} {'fired on':>9s} {'loss':>7s} {'z(loss)':>8s} {'grad norm':>9s} {'z(grad)':>8s} "
            f"{'rewound to':>10s} {'batches skipped':>16s} {'redone':>6s} {'lr after':>9s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        skipped = f"{r['skipped'][0]}..{r['skipped'][1] - 1}" if r["skipped"] else "-"
        back = f"step {r['rewound_to']}" if r["rewound_to"] is not None else "not rewound"
        lr = f"{r['lr']:.3g}" if r["lr"] is not None else "-"
        lines.append(f"{r['step']:4d} {r['metric']:>9s} {r['loss']:7.3f} {r['z_loss']:8.1f} {r['grad_norm']:9.3g} "
                     f"{r['z_grad_norm']:8.1f} {back:>10s} {skipped:>16s} {r['redone']:6d} {lr:>9s}")
    return "\n".join(lines)


def trend_table(rows: list[dict], step: int) -> str:
    """`experiments.trend_rows` as a table: per metric, window and detector, the spike's z-score and the clean run's
    largest."""
    head = (f"{'metric':>9s} {'window':>6s} {'detector':>13s} {f'z of the spike (step {step})':>26s} "
            f"{'largest z, clean run':>21s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['metric']:>9s} {r['window']:6d} {r['detector']:>13s} {r['z_spike']:26.2f} "
                     f"{r['z_clean_max']:13.2f} (step {r['z_clean_max_step']:2d})")
    return "\n".join(lines)


def spike_figure(clean: list[dict], spiked_passes: list[list[dict]], rows: list[dict], hardware: str,
                 unrecovered: list[dict] | None = None, metrics: tuple[str, str] = ("loss", "grad_norm")):
    """Loss (left) and gradient norm (right) per step: the clean run; the spiked run's steps kept (solid) and those
    a rewind threw away (dashed: a pass's steps from where the next pass starts again); the spikes (crosses, at
    the values the detectors judged); the stretches computed again (shaded); optionally the same spike left in
    (``unrecovered``)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, metric in zip(axes, metrics):
        ax.plot([r["step"] for r in clean], [r[metric] for r in clean], color="0.6", lw=2.5, alpha=0.7,
                label="clean run")
        if unrecovered is not None:
            ax.plot([r["step"] for r in unrecovered], [r[metric] for r in unrecovered], color=COLORS["activations"],
                    lw=1, ls=":", label="the spike left in (no rewind)")
        labels = {"kept": "spiked run, steps kept", "thrown": "steps thrown away by a rewind"}
        for i, p in enumerate(spiked_passes):
            restart = spiked_passes[i + 1][0]["step"] if i + 1 < len(spiked_passes) else math.inf
            for part, style in (("kept", dict(color="C0", lw=1.4)), ("thrown", dict(color="C1", lw=1.0, ls="--"))):
                pts = [r for r in p if (r["step"] < restart) == (part == "kept")]
                if pts:
                    ax.plot([r["step"] for r in pts], [r[metric] for r in pts], label=labels.pop(part, None), **style)
        for k, r in enumerate(rows):
            ax.plot([r["step"]], [r[metric]], "x", color="C3", ms=9, mew=2, label="spike detected" if k == 0 else None)
            if r["rewound_to"] is not None:
                ax.axvspan(r["rewound_to"] - 0.5, r["step"] + 0.5, color="C3", alpha=0.08)
        ax.set_xlabel("step")
        ax.set_ylabel({"loss": "training loss (nats)", "grad_norm": "global gradient norm"}.get(metric, metric))
        ax.set_yscale("log" if metric == "grad_norm" else "linear")
        ax.legend(fontsize=7)
    axes[0].set_title("a poisoned batch: detected, rewound, skipped", fontsize=9)
    axes[1].set_title("shaded: steps computed again after a rewind", fontsize=9)
    fig.suptitle(hardware, fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(timing: dict, hardware: str):
    """How long the training loop waits for a checkpoint: a synchronous DCP save, an asynchronous one (blocked:
    until `save` returns; total: until the write ended, before `handle.result()` publishes the folder), medians of
    `large_runs.async_save_timing`."""
    import matplotlib.pyplot as plt

    labels = ["sync save\n(loop blocked)", "async save\n(loop blocked)", "async save\n(until written)"]
    values = [timing["sync_s"], timing["async_blocked_s"], timing["async_total_s"]]
    fig, ax = plt.subplots(figsize=(6, 3))
    bars = ax.bar(labels, [v * 1e3 for v in values], color=[COLORS["activations"], COLORS["params"], "0.7"])
    for b, v in zip(bars, values):
        ax.annotate(f"{v * 1e3:.0f} ms", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"checkpoint of {timing['params'] / 1e6:.1f}M parameters + AdamW, {timing['state_bytes'] / 1e6:.0f} "
                 f"MB per rank, {timing['nprocs']} ranks ({hardware})", fontsize=8)
    fig.tight_layout()
    return fig


def token_table(out: dict) -> str:
    """The two ways of averaging a padded batch's loss against one process (`experiments.token_loss_runs`)."""
    ref = out["reference"]["losses"][0]
    head = f"{'loss of the global batch':52s} {'step 0':>9s} {'loss vs 1 process':>17s} {'gradients vs 1 process':>22s}"
    lines = [f"valid tokens per micro-batch, [rank][micro-batch]: {out['valid']} (of the first step)", head,
             "-" * len(head), f"{'one process: sum over valid tokens / their number':52s} {ref:9.5f} {'-':>17s} {'-':>22s}"]
    for norm, what in (("tokens", "summed loss / global valid tokens (ours)"),
                       ("mean", "mean of the micro-batch means, DDP mean over ranks")):
        lines.append(f"{what:52s} {out['runs'][norm]['losses'][0]:9.5f} {out['loss_err'][norm]:17.1e} "
                     f"{out['grad_err'][norm]:22.1e}")
    return "\n".join(lines)
