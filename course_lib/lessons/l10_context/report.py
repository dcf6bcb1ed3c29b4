"""Tables and figures of lesson 10 (long sequences, context parallelism); every one names its hardware."""

from __future__ import annotations

from course_lib import theory
from course_lib.lessons.display import COLORS, plain_log_ticks
from course_lib.measure.units import fmt_bytes

__all__ = ["memory_table", "memory_figure", "long_sequence_lines", "equality_table", "work_figure", "critical_path_lines",
           "step_work_figure", "timeline_figure", "comm_rows", "comm_table", "comm_figure", "which_wins_table",
           "hiding_lines", "planner_error_line"]

VARIANT_COLORS = dict(ring="#4C72B0", all_gather="#DD8452", ulysses="#55A868")


def _mb(x):
    return "-" if x is None else f"{x / 1e6:10.2f}"


def memory_table(rows: list[dict], hardware: str) -> str:
    head = (f"{'s':>6s} {'naive MB':>10s} {'formula':>10s} {'SDPA MB':>10s} {'formula':>10s} {'blockwise MB':>12s} "
            f"{'max |out diff|':>14s}")
    lines = [f"one causal attention, bytes saved for backward; measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['s']:6d} {_mb(r['naive']):>10s} {_mb(r['naive_formula']):>10s} {_mb(r['sdpa']):>10s} "
                     f"{_mb(r['sdpa_formula']):>10s} {_mb(r['blockwise']):>12s} {r['max_diff']:14.1e}")
    return "\n".join(lines)


def memory_figure(rows: list[dict], hardware: str):
    """Bytes saved for backward over s, log-log: naive grows as s^2, SDPA and blockwise as s."""
    import matplotlib.pyplot as plt

    s = [r["s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.2, 3.8))
    naive = [(r["s"], r["naive"]) for r in rows if r["naive"] is not None]
    ax.plot(*zip(*naive), "o", color="#C44E52", label="naive, measured")
    ax.plot(s, [r["naive_formula"] for r in rows], ":", color="#C44E52", label="naive, formula (s^2 scores)")
    ax.plot(s, [r["sdpa"] for r in rows], "s", color="#55A868", label="SDPA, measured")
    ax.plot(s, [r["blockwise"] for r in rows], "x", color="#4C72B0", ms=9, label="blockwise (ours), measured")
    ax.plot(s, [r["sdpa_formula"] for r in rows], ":", color="#55A868", label="SDPA formula (O(s))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax, "x")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("bytes saved for backward")
    ax.set_title(f"One causal attention (B=1, H=1, D=16, fp32)\n{hardware}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def long_sequence_lines(names=("llama-7b", "llama3-70b"), seq_len: int = 131072, gpu: str = "H100") -> str:
    """Per model, one sequence of `seq_len` tokens in bf16 (formula, lesson 07's `theory.savers`): what one block
    and all blocks keep without recomputation, and with every block recomputed (`checkpointed_activation_bytes`,
    every=1): the blocks' inputs held, and backward's peak with what it adds over what is held (the loss's
    backward for these models: its two fp32 (B, s, V) gradients outweigh one recomputed block)."""
    import torch

    from course_lib.config import get_preset
    from course_lib.measure.hardware import GPU_SPECS

    lines = [f"one sequence of {seq_len:,} tokens, batch 1, bf16, activations only (formula); one {gpu}: "
             f"{GPU_SPECS[gpu].mem_gb:g} GB"]
    for name in names:
        cfg = get_preset(name)
        plain = theory.savers.model_activation_bytes(cfg, 1, seq_len, dtype=torch.bfloat16)
        full = theory.savers.checkpointed_activation_bytes(cfg, 1, seq_len, every=1, dtype=torch.bfloat16)
        lines.append(f"{name:11s} no recomputation: {fmt_bytes(plain['per_layer'])} per block, "
                     f"{fmt_bytes(plain['total'])} in all | every block recomputed: the {cfg.n_layer} block inputs "
                     f"{fmt_bytes(full['segments'] * full['boundary'])}, peak {fmt_bytes(full['peak'])}, of it "
                     f"{fmt_bytes(full['peak'] - full['held'])} the loss's fp32 gradients")
    return "\n".join(lines)


def equality_table(results: dict, reference: dict, hardware: str) -> tuple[str, dict]:
    """{cp: every rank's `rank_context_lab` result} vs the one-process reference: a table and
    {"loss": worst |loss difference|, "grad": worst max |gradient difference|} over every rank, variant and cp."""
    head = f"{'cp':>3s} {'variant/split':18s} {'loss':>10s} {'|loss diff|':>11s} {'max |grad diff|':>15s}"
    lines = [f"one forward + backward of the GPT with CP in every block vs one process; {hardware}", head,
             "-" * len(head)]
    worst = dict(loss=0.0, grad=0.0)
    for cp, returns in results.items():
        for key in returns[0]["cases"]:
            dl = max(abs(res["cases"][key]["loss"] - reference["losses"][0]) for res in returns)
            dg = max((res["cases"][key]["grads"][k] - g).abs().max().item()
                     for res in returns for k, g in reference["first_grads"].items())
            worst = dict(loss=max(worst["loss"], dl), grad=max(worst["grad"], dg))
            lines.append(f"{cp:3d} {key:18s} {returns[0]['cases'][key]['loss']:10.6f} {dl:11.1e} {dg:15.1e}")
    return "\n".join(lines), worst


def work_figure(returns: list, seq_len: int, batch: int, n_head: int, hardware: str):
    """Left: attention work per rank (score elements of layer 0), contiguous vs balanced split, counted (bars) and
    formula (dots). Right: measured compute time per rank of the timed ring forward."""
    import matplotlib.pyplot as plt

    cp = len(returns)
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    width = 0.38
    for i, (split, color) in enumerate((("contiguous", "#C44E52"), ("balanced", "#4C72B0"))):
        xs = [r + (i - 0.5) * width for r in range(cp)]
        counted = [res["cases"][f"ring/{split}"]["work"] for res in returns]
        formula = theory.context.causal_work_per_rank(seq_len, cp, split, batch, n_head)
        axes[0].bar(xs, counted, width, color=color, label=f"{split}, counted")
        axes[0].plot(xs, formula, "k.", label="formula" if i else None)
        if "timeline" in returns[0]:
            axes[1].bar(xs, [res["timeline"][split]["compute_s"] * 1e3 for res in returns], width, color=color,
                        label=split)
    axes[0].set_ylabel("score elements computed")
    axes[0].set_title(f"attention work per rank, cp={cp}, s={seq_len}", fontsize=9)
    axes[1].set_ylabel("compute ms (ring forward)")
    axes[1].set_title(f"measured compute per rank\n{hardware}", fontsize=8)
    for ax in axes:
        ax.set_xticks(range(cp))
        ax.set_xlabel("rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def critical_path_lines(seq_len: int, cp: int) -> str:
    """Per diagonal convention: the busiest over the least busy rank (contiguous split) and the per-step critical
    path (`theory.context.ring_critical_path`) of both splits, in score elements of one sequence and head."""
    lines = [f"ring forward, cp={cp}, s={seq_len}, one sequence and head: score elements (formula)"]
    for diagonal, what in (("whole", "diagonal pair computed whole (this course's attend_block)"),
                           ("half", "diagonal pair half computed (a causal flash kernel)")):
        per_rank = [sum(col) for col in zip(*theory.context.ring_step_work(seq_len, cp, "contiguous", diagonal))]
        path = {split: theory.context.ring_critical_path(seq_len, cp, split, diagonal)
                for split in ("contiguous", "balanced")}
        lines.append(f"  {what}: contiguous busiest / least busy {max(per_rank) / min(per_rank):g}; per-step "
                     f"critical path contiguous {path['contiguous']:g}, balanced {path['balanced']:g}: "
                     f"{path['contiguous'] / path['balanced']:.3f}x")
    return "\n".join(lines)


def step_work_figure(seq_len: int, cp: int, diagonal: str = "whole"):
    """The ring forward's steps from `theory.context.ring_step_work` (formula, not a measurement): every step lasts
    as long as its slowest rank; each rank's bar is its work, the rest of the step it waits (grey)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 1.2 + 1.1 * cp), sharex=True)
    for ax, split in zip(axes, ("contiguous", "balanced")):
        steps, t0 = theory.context.ring_step_work(seq_len, cp, split, diagonal), 0.0
        for t, work in enumerate(steps):
            length = max(work)
            for r, w in enumerate(work):
                ax.broken_barh([(t0, length)], (r - 0.35, 0.7), color="#DDDDDD", edgecolor="white")
                if w:
                    ax.broken_barh([(t0, w)], (r - 0.35, 0.7), color=COLORS["compute"], edgecolor="white")
                    ax.text(t0 + w / 2, r, str(t), fontsize=7, color="white", ha="center", va="center")
            t0 += length
        ax.set_yticks(range(cp), [f"rank {r}" for r in range(cp)])
        ax.invert_yaxis()
        ax.set_title(f"{split} split: {t0:g} score elements along the steps (compute blue with its step, "
                     f"waiting grey)", fontsize=8)
    axes[-1].set_xlabel(f"score elements (one sequence and head, s={seq_len}, cp={cp}, diagonal computed "
                        f"{diagonal}): formula, theory.context.ring_step_work")
    fig.tight_layout()
    return fig


def timeline_figure(returns: list, hardware: str, seq_len: int):
    """A Gantt chart of the timed ring forward: per rank, compute (blue) and K/V transfers in flight (orange) per
    step, for the contiguous and the balanced split."""
    import matplotlib.pyplot as plt

    splits = list(returns[0]["timeline"])
    cp = len(returns)
    fig, axes = plt.subplots(len(splits), 1, figsize=(9, 1.1 + 0.55 * cp * len(splits)), sharex=True)
    for ax, split in zip(axes, splits):
        t0 = min(e["start"] for res in returns for e in res["timeline"][split]["events"])
        for r, res in enumerate(returns):
            for e in res["timeline"][split]["events"]:
                y, h = (r - 0.3, 0.32) if e["kind"] == "compute" else (r + 0.05, 0.25)
                color = COLORS["compute"] if e["kind"] == "compute" else COLORS["communication"]
                ax.broken_barh([((e["start"] - t0) * 1e3, max((e["end"] - e["start"]) * 1e3, 0.05))], (y, h),
                               color=color)
                if e["kind"] == "compute":
                    ax.text((e["start"] - t0) * 1e3, r - 0.14, str(e["step"]), fontsize=6, color="white", va="center")
        ax.set_yticks(range(cp), [f"rank {r}" for r in range(cp)])
        ax.invert_yaxis()
        ax.set_title(f"ring forward, {split} split, s={seq_len}: compute (blue, step number) and K/V transfer "
                     f"(orange)", fontsize=8)
    axes[-1].set_xlabel(f"ms since the first rank started   [{hardware}]")
    fig.tight_layout()
    return fig


def comm_rows(results: dict, batch: int, seq_len: int, d_model: int) -> list[dict]:
    """Bytes one rank's layer 0 moved, counted, vs `theory.context.layer_comm`, per cp and variant (balanced split):
    payload per (phase, op) and what the rank puts on the wire (`theory.context.bytes_sent_per_rank`)."""
    rows = []
    for cp, returns in results.items():
        for variant in ("ring", "all_gather", "ulysses"):
            counted = {tuple(k.split("/")): v for k, v in returns[0]["cases"][f"{variant}/balanced"]["comm"].items()}
            formula = theory.context.layer_comm(variant, batch, seq_len, d_model, cp)
            same_on_every_rank = all({tuple(k.split("/")): v for k, v in
                                      res["cases"][f"{variant}/balanced"]["comm"].items()} == counted
                                     for res in returns)
            rows.append(dict(cp=cp, variant=variant, counted=counted, formula=formula,
                             equal=counted == formula and same_on_every_rank,
                             wire=theory.context.bytes_sent_per_rank(counted, cp),
                             wire_formula=theory.context.bytes_sent_per_rank(formula, cp),
                             activation=batch * seq_len * d_model * 4))
    return rows


def comm_table(rows: list[dict], hardware: str) -> str:
    head = f"{'cp':>3s} {'variant':10s} {'phase/op: calls x bytes (counted)':46s} {'on the wire':>11s} {'formula':>9s} equal"
    lines = [f"one layer's attention, one rank, fp32; counted on {hardware}", head, "-" * len(head)]
    for r in rows:
        ops = ", ".join(f"{ph[:3]}/{op}: {v['calls']} x {fmt_bytes(v['bytes'] / v['calls'])}"
                        for (ph, op), v in sorted(r["counted"].items()))
        lines.append(f"{r['cp']:3d} {r['variant']:10s} {ops:46s} {fmt_bytes(r['wire']):>11s} "
                     f"{fmt_bytes(r['wire_formula']):>9s} {r['equal']}")
    return "\n".join(lines)


def comm_figure(rows: list[dict], hardware: str, cps=(2, 4, 8, 16, 32)):
    """Bytes a rank puts on the wire per layer (forward + backward) in units of one activation B s C b, over cp:
    formula lines (the same for every model and s) and the counted points."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    for variant, color in VARIANT_COLORS.items():
        ys = [theory.context.bytes_sent_per_rank(theory.context.layer_comm(variant, 1, 64 * cp, 1, cp), cp) / (64 * cp)
              for cp in cps]
        ax.plot(cps, ys, "-", color=color, label=f"{variant}, formula")
        pts = [(r["cp"], r["wire"] / r["activation"]) for r in rows if r["variant"] == variant]
        ax.plot(*zip(*pts), "o", color=color, mfc="none", ms=9, label=f"{variant}, counted")
    ax.set_xscale("log", base=2)
    plain_log_ticks(ax, "x")
    ax.set_xlabel("cp (context-parallel ranks)")
    ax.set_ylabel("bytes sent per rank per layer\n/ one activation (B s C b)")
    ax.set_title(f"Communication per layer, forward + backward (MHA)\n{hardware}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def which_wins_table(d_model: int, n_head: int, n_kv_head: int, seq_lens=(32768, 131072), cps=(2, 4, 8, 16),
                     dtype_bytes: int = 2) -> str:
    """Forward bytes on the wire per rank per layer, B = 1, from `theory.context.layer_comm` with grouped-query
    attention: K and V are n_kv_head heads wide (kv_dim = d_model n_kv_head / n_head), which shrinks the ring's and
    all-gather's payloads (K/V only) and two of Ulysses' four all-to-alls (q and the output keep d_model). Ulysses
    needs cp | H (and cp | n_kv_head, else K/V heads are replicated); all-gather also keeps the whole sequence's K/V."""
    kv_dim = d_model * n_kv_head // n_head
    head = (f"{'s':>7s} {'cp':>3s} {'ring':>10s} {'all-gather':>10s} {'Ulysses':>10s}  {'gathered K/V':>12s}  Ulysses possible")
    lines = [f"bf16, d_model {d_model}, {n_head} query heads, {n_kv_head} K/V heads (formula)", head, "-" * len(head)]
    for s in seq_lens:
        for cp in cps:
            wire = {v: theory.context.bytes_sent_per_rank(
                theory.context.layer_comm(v, 1, s, d_model, cp, dtype_bytes, kv_dim=kv_dim), cp, "forward")
                for v in theory.context.VARIANTS}
            ok = "yes" if n_head % cp == 0 and n_kv_head % cp == 0 else (
                "K/V heads replicated" if n_head % cp == 0 else "no (cp > heads)")
            lines.append(f"{s:7d} {cp:3d} {fmt_bytes(wire['ring']):>10s} {fmt_bytes(wire['all_gather']):>10s} "
                         f"{fmt_bytes(wire['ulysses']):>10s}  {fmt_bytes(2 * s * kv_dim * dtype_bytes):>12s}  {ok}")
    return "\n".join(lines)


def hiding_lines(gpu: str = "H100", inter_node_gbs: float = 50.0, kv_fraction: float = 1.0) -> str:
    """Tokens per rank above which one ring step's attention hides the next K/V transfer
    (`theory.context.ring_hiding_tokens`) at `gpu`'s bf16 peak, over its node's link and over an inter-node link of
    `inter_node_gbs` GB/s per GPU (formula)."""
    from course_lib.measure.hardware import GPU_SPECS

    spec = GPU_SPECS[gpu]
    lines = [f"{spec.name}, bf16 peak {spec.bf16_tflops:g} TFLOP/s (formula; a kernel below peak needs fewer tokens)"]
    for link, gbs in ((spec.link, spec.link_gbs), ("inter-node", inter_node_gbs)):
        full = theory.context.ring_hiding_tokens(spec.bf16_tflops * 1e12, gbs * 1e9, 2, kv_fraction)
        lines.append(f"  {link}, {gbs:g} GB/s one way: s/cp >= {full:,.0f} tokens (a full chunk pair per step), "
                     f"{2 * full:,.0f} (a balanced causal step, which computes half a full pair)")
    return "\n".join(lines)


def planner_error_line(out: dict) -> str:
    """The planner's error on a published row (`published.long_context`'s result): its TFLOP/s per GPU for the
    published layout against the reported, the yardstick of any "x faster" it finds."""
    r = out["run"]
    predicted = out["predicted_tflops"]
    return (f"the planner's error on the published row itself: {predicted:.0f} TFLOP/s per GPU predicted vs "
            f"{r.reported_tflops:g} reported ({predicted / r.reported_tflops - 1:+.1%}); its best layout's "
            f"{out['facts']['speedup']:.2f}x is over its own {predicted:.0f}, not over the measured {r.reported_tflops:g}")
