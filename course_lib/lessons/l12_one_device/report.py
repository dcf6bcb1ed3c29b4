"""The ladder of lesson 12 as text: a table with one line per rung, where each rung's time goes, and the one-line
summary that `benchmarks/bench_one_device.py` ends with."""

from __future__ import annotations

from course_lib.lessons.l12_one_device.profile import CATEGORIES
from course_lib.measure.units import fmt_bytes

__all__ = ["ladder_table", "breakdown_table", "fp8_speedup", "summary_line", "ladder_figure", "breakdown_figure",
           "outlier_figure", "loss_figure"]


def ladder_table(rows: list[dict]) -> str:
    """One line per row of `ladder.ladder`: tokens/s, step time, speed-up over the first rung, MFU (device peak and
    best matmul here), peak memory, first-step loss, compile time and kernels per step; a skipped rung with its
    reason. Notes (bf16 flagged, fused or foreach, ...) follow the table."""
    head = (f"{'rung':36s} {'B':>3s} {'tokens/s':>9s} {'step ms':>8s} {'x':>5s} {'MFU':>6s} {'MFU mm':>6s} "
            f"{'peak mem':>9s} {'loss0':>7s} {'compile':>7s} {'kernels':>7s}")
    lines, first, notes = [head, "-" * len(head)], None, []
    for r in rows:
        if r["status"] != "measured":
            lines.append(f"{r['rung']:36s} skipped: {r['note']}")
            continue
        first = first or r
        mem = fmt_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "n/a"
        lines.append(f"{r['rung']:36s} {r['batch']:3d} {r['tokens_per_s']:9,.0f} {r['step_s'] * 1e3:8.1f} "
                     f"{r['tokens_per_s'] / first['tokens_per_s']:5.2f} {r['mfu']:6.1%} {r['mfu_matmul']:6.1%} "
                     f"{mem:>9s} {r['loss0']:7.4f} {r['compile_s']:6.1f}s {r['kernels'] or 0:7d}")
        if r["note"]:
            notes.append(f"  {r['rung']}: {r['note']}")
    if first is not None:
        kernels = "kernels launched" if first["device"].startswith("cuda") else "ATen operators dispatched"
        lines += [f"x: tokens/s over the first rung. MFU: model FLOPs of the unpadded model / the peak "
                  f"({first['peak_source']}, {first['peak'] / 1e12:.3f} TFLOP/s); MFU mm: / the best "
                  f"matmul measured here in the rung's dtype.",
                  f"peak mem: {first['memory_source']}. compile: first step's time minus a timed step's. "
                  f"kernels: {kernels} per step."]
    return "\n".join(lines + notes)


def breakdown_table(rows: list[dict]) -> str:
    """Per measured row, the share of the step's profiled time in each kind (`profile.CATEGORIES`) and the kernel
    that took the most."""
    head = f"{'rung':36s} " + " ".join(f"{c:>11s}" for c in CATEGORIES) + "  top kernel"
    lines = [head, "-" * len(head)]
    for r in rows:
        prof = r.get("breakdown")
        if r["status"] != "measured" or not prof:
            continue
        top = prof["top"][0] if prof["top"] else {"name": "-", "self_s": 0.0}
        lines.append(f"{r['rung']:36s} " + " ".join(f"{prof['share'][c]:11.1%}" for c in CATEGORIES)
                     + f"  {top['name'][:40]} ({top['self_s'] * 1e3:.1f} ms)")
    return "\n".join(lines)


def fp8_speedup(rows: list[dict]) -> float | None:
    """tokens/s of the rung named 'fp8' over the measured course rung below it (its bf16 step); None while the
    ladder has no measured fp8 rung (it runs only on GPUs with FP8 tensor cores)."""
    course = [r for r in rows if r["library"] == "course"]
    for below, r in zip(course, course[1:]):
        if r["rung"] == "fp8" and r["status"] == "measured" and below["status"] == "measured":
            return r["tokens_per_s"] / below["tokens_per_s"]
    return None


def summary_line(rows: list[dict], model: str) -> str:
    """``one device: <hardware>: <model> MFU X % (transformers baseline Y %), fp8/bf16 Z x``: the best course rung's
    MFU, the best transformers row's, and `fp8_speedup` (``n/a`` where the fp8 rung did not run)."""
    measured = [r for r in rows if r["status"] == "measured"]
    best = max((r["mfu"] for r in measured if r["library"] == "course"), default=float("nan"))
    base = max((r["mfu"] for r in measured if r["library"] == "transformers"), default=float("nan"))
    fp8 = fp8_speedup(rows)
    hw = rows[0]["hardware"] if rows else "?"
    return (f"one device: {hw}: {model} MFU {best * 100:.1f} % (transformers baseline {base * 100:.1f} %), "
            f"fp8/bf16 {'n/a' if fp8 is None else f'{fp8:.2f}'} x")


# ------------------------------------------------------------------------------ figures

def ladder_figure(rows: list[dict]):
    """Tokens/s of every measured row (left) and its MFU against the device peak and against the best matmul
    measured here in its dtype (right); skipped rungs are named with an empty bar."""
    import matplotlib.pyplot as plt

    names = [r["rung"] for r in rows]
    tps = [r.get("tokens_per_s", 0.0) for r in rows]
    colors = ["C0" if r["library"] == "course" else "C1" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.35 * len(rows) + 1.6), sharey=True)
    ax1.barh(names, tps, color=colors)
    for i, r in enumerate(rows):
        if r["status"] != "measured":
            ax1.text(0, i, "  skipped", va="center", fontsize=8, color="grey")
    ax1.invert_yaxis()
    ax1.set(xlabel="tokens/s (blue: the course's GPT, orange: transformers' GPT-2)", title="one training step")
    ax2.barh(names, [r.get("mfu", 0.0) * 100 for r in rows], color=colors, label="of the device peak")
    ax2.scatter([r.get("mfu_matmul", float("nan")) * 100 for r in rows], names, color="k", marker="|", s=200,
                label="of the best matmul here, same dtype")
    ax2.set(xlabel="MFU (%)", title="model FLOPs utilisation")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"the ladder [{rows[0]['hardware']}]", fontsize=10)
    fig.tight_layout()
    return fig


def breakdown_figure(rows: list[dict]):
    """Per measured row with a profile, its profiled seconds per step by kind (`profile.CATEGORIES`) as stacked
    bars, beside the step's wall time (a dot): the gap is time no operator's self time covers."""
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["status"] == "measured" and r.get("breakdown")]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.6))
    left = [0.0] * len(rows)
    for c, color in zip(CATEGORIES, ("C0", "C3", "C2", "C4", "C7")):
        ms = [r["breakdown"]["seconds"][c] * 1e3 for r in rows]
        ax.barh([r["rung"] for r in rows], ms, left=left, color=color, label=c)
        left = [a + b for a, b in zip(left, ms)]
    ax.scatter([r["step_s"] * 1e3 for r in rows], [r["rung"] for r in rows], color="k", zorder=3,
               label="step wall time (timed apart)")
    ax.invert_yaxis()
    clock = rows[0]["breakdown"]["clock"] if rows else ""
    ax.set(xlabel=f"ms per step ({clock}, under the profiler)", title=f"where a step's time goes [{rows[0]['hardware']}]"
           if rows else "")
    ax.legend(fontsize=8, ncol=3, loc="lower right")
    fig.tight_layout()
    return fig


def outlier_figure(rows: list[dict], hardware: str):
    """`fp8.outlier_sweep`: the round-trip error of the ordinary channels against the outlier factor, one line per
    scale granularity."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for g in dict.fromkeys(r["granularity"] for r in rows):
        pts = [(r["factor"], r["ordinary"]) for r in rows if r["granularity"] == g]
        ax.plot(*zip(*pts), marker="o", label=g)
    ax.set(xscale="log", yscale="log", xlabel="outlier channels' size / the others'",
           ylabel="relative error of the ordinary channels", title=f"e4m3 round trip by scale granularity\n[{hardware}]")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss_figure(curves: dict, hardware: str):
    """`fp8.loss_curves`: the training loss per step, one line per recipe."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for recipe, losses in curves.items():
        ax.plot(losses, label=recipe if recipe == "bf16" else f"fp8 {recipe}", lw=1.2)
    ax.set(xlabel="step", ylabel="training loss (bytes of text)", title=f"FP8 against bf16, same start\n[{hardware}]")
    ax.legend()
    fig.tight_layout()
    return fig
