"""What a skewed router costs under expert parallelism: the hot rank's memory and the step's time (lesson 11).

Expert parallelism (`course_lib.parallel.experts`) gives each of P ranks E/P experts. Rank r receives the R_r rows
routed to its experts (one row per (token, choice) assignment, A = sum_r R_r = P T k in all, T tokens a rank). Under a
skewed router R_r is not A/P: the rank holding the popular experts receives more rows, computes longer, keeps more
activations, and every other rank waits for it at the combine all-to-all (the straggler:
`course_lib.lessons.l11_experts.straggler`).

**Activations a SwiGLU expert keeps for backward, per routed row** (`course_lib.parallel.moe.SwiGLUExperts`:
``h = silu(x w1^T) * (x w3^T)``, ``y = h w2^T``), read op by op from what autograd saves:

    x w1^T   -> a      saves x (C), the row                  (w1 is a parameter: not an activation)
    silu(a)  -> s      saves a (F), its input
    x w3^T   -> b      saves x again (the same storage: counted once)
    s * b    -> h      saves s (F) and b (F), each for the other's gradient
    h w2^T   -> y      saves h (F)

so C + 4F elements of ``dtype_bytes`` per row: ``expert_activation_bytes(R, C, F, b) = R (C + 4F) b`` bytes on a
rank that received R rows (`course_lib.measure.memory_stats.SavedActivations` counts exactly this; tests/
test_moe_straggler.py). Under a skew that sends a fraction f of all assignments to one rank, that rank keeps
f A (C + 4F) b: P f times the balanced A/P rows' bytes. The peak of activation memory moves with the router, which is
why a dropless MoE can run out of memory on one rank only (Megatron-LM's MoE README, "OOM Caused by Token
Distribution Imbalance when Training From Scratch": "MoE suffers from a severe load imbalance issue when the router
is under-trained, leading to the model easily running out of memory (OOM), which typically occurs in the first
100~300 steps when training from scratch").

**The step time** (compute-bound model: expert time proportional to the rows, ``seconds_per_row`` the same on every
rank): the all-to-all that combines the outputs finishes when its last rank enters it, so the MoE layer's step is set
by the slowest rank,

    step     ~ other + max_r R_r s           (every rank waits for the hot one)
    balanced ~ other + mean_r R_r s          (the same rows spread evenly)
    wait_r   ~ (max_r R_r - R_r) s           (rank r's idle time in the combine all-to-all)
    ratio    = max_r R_r / mean_r R_r        (the expert part of the step, skewed over balanced)

With a fraction f >= 1/P of the assignments on rank 0 and the rest spread evenly, ratio = P f (P = 2, f = 0.9: 1.8).
The expert FLOPs per row are 6 C F forward (three C x F matmuls) and 12 C F backward.
"""

from __future__ import annotations

__all__ = ["expert_activation_bytes", "expert_flops", "skewed_loads", "straggler_step_time"]


def expert_activation_bytes(tokens_received: int, d_model: int, d_ff: int, dtype_bytes: int = 4) -> int:
    """Bytes a rank's SwiGLU experts save for backward: R (C + 4F) b for R received rows (the module docstring)."""
    for name, v in (("tokens_received", tokens_received), ("d_model", d_model), ("d_ff", d_ff),
                    ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    return tokens_received * (d_model + 4 * d_ff) * dtype_bytes


def expert_flops(tokens_received: int, d_model: int, d_ff: int, backward: bool = True) -> int:
    """FLOPs of the experts on R rows: 6 R C F forward (three C x F matmuls), 18 R C F with the backward."""
    return (18 if backward else 6) * tokens_received * d_model * d_ff


def skewed_loads(total_rows: int, fraction: float, ranks: int) -> list[float]:
    """Rows per rank when rank 0 receives ``fraction`` of ``total_rows`` and the others share the rest evenly."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    if not 0.0 <= fraction <= 1.0 or (ranks == 1 and fraction != 1.0):
        raise ValueError(f"fraction={fraction} must be in [0, 1] (1 with a single rank)")
    if ranks == 1:
        return [float(total_rows)]
    rest = total_rows * (1.0 - fraction) / (ranks - 1)
    return [total_rows * fraction] + [rest] * (ranks - 1)


def straggler_step_time(loads, seconds_per_row: float, other_s: float = 0.0) -> dict:
    """The MoE step under a compute-bound model, ``loads`` the rows each rank received: {"step": other + max load x
    s, "balanced": other + mean load x s, "ratio": max / mean load, "wait": [(max - load_r) x s per rank],
    "slowest": the rank that sets the step}."""
    loads = [float(v) for v in loads]
    if not loads or min(loads) < 0:
        raise ValueError(f"loads={loads}: one count >= 0 per rank")
    top, mean = max(loads), sum(loads) / len(loads)
    return dict(step=other_s + top * seconds_per_row, balanced=other_s + mean * seconds_per_row,
                ratio=top / mean if mean else 1.0, wait=[(top - v) * seconds_per_row for v in loads],
                slowest=loads.index(top))
