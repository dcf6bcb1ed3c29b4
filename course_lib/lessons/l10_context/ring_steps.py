"""Lesson 10, section 3b: does one ring step's attention hide the next K/V chunk's transfer? Measured, then fitted.

A ring step (`course_lib.parallel.context_attention.ring_attention`) computes the attention of this rank's n queries
against the n keys it holds, while the next K/V chunk travels from its left neighbour. Per step, with the chunk's
pair fully visible (the steps after the first under the contiguous split, every step's two off-diagonal pairs under
the balanced one):

    compute  4 n^2 C / F          seconds (q k^T and P v: 2 matmuls of 2 n^2 C FLOPs, C = H D, F FLOP/s)
    transfer alpha + 2 n C b / BW  seconds (K and V: 2 n C elements of b bytes, a latency alpha, BW bytes/s one way)

The transfer hides when compute >= transfer. Without the latency this is n >= b F / (2 BW)
(`course_lib.theory.context.ring_hiding_tokens`); with it, the positive root of 4 C n^2 / F - 2 C b n / BW - alpha.

:func:`rank_ring_step_costs` measures both sides on every rank of a launch (2 ranks: each one sends right and
receives left at once, as the ring does), for several n: the full pair's attention (`attend_block`, no mask, fp32
scores as the ring computes them) and one K/V chunk exchanged (``batch_isend_irecv``), each the fastest of
``repeats`` after a barrier. :func:`fit_step_costs` fits c0, F (a line through compute time against FLOPs) and
alpha, BW (a line through transfer time against bytes) and returns the measured and the fitted crossover, so the
formula stands beside the measurement.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.parallel.block_attention import attend_block
from course_lib.theory.context import ring_hiding_tokens

__all__ = ["rank_ring_step_costs", "fit_step_costs", "crossover_tokens", "step_costs_table", "step_costs_figure"]


def _fastest(fn, repeats: int, clock) -> float:
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        t0 = clock.stamp()
        fn()
        t1 = clock.stamp()
        best = min(best, clock.seconds(t1) - clock.seconds(t0))
    return best


def rank_ring_step_costs(tokens=(16, 32, 64, 128, 256, 512), batch: int = 1, n_head: int = 4, head_dim: int = 64,
                         repeats: int = 5, dtype: torch.dtype = torch.float32) -> dict:
    """On every rank: per n in `tokens`, the seconds of one ring step's attention (a full n x n chunk pair) and of
    one K/V chunk (2, B, H, n, D) sent right while the next arrives from the left. Returns {"rows": [dict(n, flops,
    bytes, compute_s, transfer_s)], "hardware", "width"}; the transfer is the slowest rank's (all-reduced MAX)."""
    from course_lib.measure.hardware import hardware_label
    from course_lib.measure.speed import Stopwatch

    dev = cdist.device()
    cp, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % cp, (r - 1) % cp
    g = torch.Generator().manual_seed(3 + r)
    rows = []
    for n in tokens:
        q, k, v = (torch.randn(batch, n_head, n, head_dim, generator=g).to(dev, dtype) for _ in range(3))
        kv = torch.stack([k, v])                                      # (2, B, H, n, D): what a ring step sends
        nxt = torch.empty_like(kv)

        def exchange():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, right), dist.P2POp(dist.irecv, nxt, left)]):
                w.wait()

        attend_block(q, k, v)                                         # warm-up, outside the timing
        exchange()
        clock = Stopwatch(dev)
        compute = _fastest(lambda: attend_block(q, k, v), repeats, clock)
        transfer = torch.tensor([_fastest(exchange, repeats, clock)], dtype=torch.float64, device=dev)
        dist.all_reduce(transfer, op=dist.ReduceOp.MAX)               # a step waits for the slower link
        rows.append(dict(n=n, flops=4 * batch * n * n * n_head * head_dim, bytes=kv.numel() * kv.element_size(),
                         compute_s=compute, transfer_s=transfer.item()))
    return dict(rows=rows, hardware=hardware_label(cdist.backend(), dev), width=n_head * head_dim, batch=batch,
                dtype_bytes=torch.tensor([], dtype=dtype).element_size())


def crossover_tokens(rows: list[dict], key: str = "compute_s") -> float | None:
    """The n at which `key` first reaches the transfer time, interpolated in log-log between the measured sizes;
    None if it never does (below the smallest size: the smallest n)."""
    prev = None
    for row in rows:
        gap = math.log(row[key] / row["transfer_s"])
        if gap >= 0:
            if prev is None:
                return float(row["n"])
            (n0, g0), n1 = prev, row["n"]
            frac = -g0 / (gap - g0)
            return math.exp(math.log(n0) + frac * (math.log(n1) - math.log(n0)))
        prev = (row["n"], gap)
    return None


def _line(xs, ys) -> tuple[float, float]:
    """(a, b) of y = a + b x by least squares of the relative error (weights 1/y^2): every size counts, not only the
    largest; a kept >= 0."""
    w = [1 / (y * y) for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    if a < 0:                                                         # through the origin instead
        a, b = 0.0, sxy / sxx
    return a, b


def fit_step_costs(result: dict) -> dict:
    """The formula's constants from the measurement, each a line fitted through every size: compute = c0 + FLOPs / F
    (c0: a call's fixed cost, Python and dispatch, which a GPU kernel launch has too) and transfer = alpha + bytes /
    BW. With them: the crossover predicted (where c0 + 4 C B n^2 / F first reaches alpha + 2 C B b n / BW), the one
    without fixed costs (`ring_hiding_tokens(F, BW, b)`: the formula at peak) and the one measured
    (`crossover_tokens`)."""
    rows = result["rows"]
    c0, per_flop = _line([row["flops"] for row in rows], [row["compute_s"] for row in rows])
    alpha, per_byte = _line([row["bytes"] for row in rows], [row["transfer_s"] for row in rows])
    flops, bw = 1 / per_flop, 1 / per_byte
    c, b, B = result["width"], result["dtype_bytes"], result["batch"]
    a2, a1 = 4 * c * B / flops, 2 * c * B * b / bw                    # a2 n^2 + c0 = alpha + a1 n
    disc = a1 * a1 - 4 * a2 * (c0 - alpha)
    predicted = 0.0 if disc < 0 else (a1 + math.sqrt(disc)) / (2 * a2)   # no root: compute always the longer
    for row in rows:
        row["model_s"] = c0 + row["flops"] / flops
        row["model_transfer_s"] = alpha + row["bytes"] / bw
    return dict(flops=flops, c0=c0, alpha=alpha, bandwidth=bw, predicted=predicted,
                no_latency=ring_hiding_tokens(flops, bw, b), measured=crossover_tokens(rows))


def step_costs_table(result: dict, fit: dict) -> str:
    head = (f"{'n':>6s} {'chunk':>9s} {'attention ms':>13s} {'formula':>8s} {'transfer ms':>12s} {'formula':>8s} "
            f"{'hidden?':>8s}")
    lines = [f"one ring step on 2 ranks, B={result['batch']}, C={result['width']}, fp32 [{result['hardware']}]",
             head, "-" * len(head)]
    for row in result["rows"]:
        lines.append(f"{row['n']:6d} {row['bytes'] / 1e3:7.0f}kB {row['compute_s'] * 1e3:13.3f} "
                     f"{row['model_s'] * 1e3:8.3f} {row['transfer_s'] * 1e3:12.3f} "
                     f"{row['model_transfer_s'] * 1e3:8.3f} "
                     f"{'yes' if row['compute_s'] >= row['transfer_s'] else 'no':>8s}")
    measured = "-" if fit["measured"] is None else f"{fit['measured']:.0f}"
    lines.append(f"fitted: F = {fit['flops'] / 1e9:.1f} GFLOP/s, c0 = {fit['c0'] * 1e6:.0f} us, "
                 f"alpha = {fit['alpha'] * 1e6:.0f} us, BW = {fit['bandwidth'] / 1e9:.2f} GB/s | crossover n: "
                 f"measured {measured}, formula with c0 and alpha "
                 f"{fit['predicted']:.0f}, b F / (2 BW) without them {fit['no_latency']:.0f}")
    return "\n".join(lines)


def step_costs_figure(result: dict, fit: dict):
    """Per ring step, attention and K/V transfer time over n (log-log), measured points and fitted lines."""
    import matplotlib.pyplot as plt

    from course_lib.lessons.display import plain_log_ticks

    rows = result["rows"]
    n = [row["n"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.2, 3.8))
    ax.plot(n, [row["compute_s"] * 1e3 for row in rows], "o", color="#4C72B0",
            label="attention of one chunk pair, measured")
    ax.plot(n, [row["model_s"] * 1e3 for row in rows], ":", color="#4C72B0", label="c0 + 4 n² C / F (fitted)")
    ax.plot(n, [row["transfer_s"] * 1e3 for row in rows], "s", color="#DD8452",
            label="one K/V chunk's transfer, measured")
    ax.plot(n, [row["model_transfer_s"] * 1e3 for row in rows], ":", color="#DD8452",
            label="alpha + 2 n C b / BW (fitted)")
    if fit["measured"] is not None:
        ax.axvline(fit["measured"], color="gray", lw=0.8)
        ax.text(fit["measured"], ax.get_ylim()[1], f" hides from n ≈ {fit['measured']:.0f}", fontsize=7, va="top")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain_log_ticks(ax, "x")
    ax.set_xlabel("tokens per rank n (one chunk)")
    ax.set_ylabel("ms per ring step")
    ax.set_title(f"A ring step: compute vs transfer, 2 ranks\n{result['hardware']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
