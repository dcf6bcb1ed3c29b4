"""Cost of collectives: nccl-tests bandwidth definitions and the alpha-beta model (lessons 01, 02, 05, 08).

Bandwidths follow nccl-tests (NVIDIA, ``doc/PERFORMANCE.md``):

- algorithm bandwidth ``algbw = S / t``, where S is the buffer size in bytes: the whole tensor for
  all_reduce and broadcast, the *total* (gathered) output for all_gather, the *total* input for
  reduce_scatter (n chunks, one per rank);
- bus bandwidth ``busbw = algbw x factor``, the factor being the fraction of S that each rank must send
  over its link in an optimal (ring) algorithm, so that busbw can be compared with the link's speed
  whatever the number of ranks n:

      all_reduce                2 (n - 1) / n   (reduce-scatter then all-gather)
      all_gather, reduce_scatter    (n - 1) / n
      all_to_all                    (n - 1) / n
      broadcast, reduce             1

Alpha-beta model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005): sending m bytes costs
``alpha + m / bandwidth``; alpha is the latency of one message. A ring collective over n ranks takes
``steps x alpha + factor x S / bandwidth`` with ``steps = 2 (n - 1)`` for all_reduce and ``n - 1``
for the others. :func:`fit_alpha_beta` recovers alpha and the bandwidth from measured times.
"""

from __future__ import annotations

import numpy as np
from course_lib.reference import reference_for

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@reference_for("01-bus-bandwidth")
def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests bus-bandwidth factor of a collective over ``world_size`` ranks."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size={n} must be >= 1")
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}
    try:
        return factors[op]
    except KeyError:
        raise ValueError(f"unknown collective {op!r}: use one of {', '.join(factors)}") from None


def alg_bandwidth(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth (bytes/s): buffer size over time."""
    return nbytes / seconds


@reference_for("01-bus-bandwidth")
def bus_bandwidth(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth (bytes/s) as nccl-tests defines it: ``nbytes / seconds x bus_factor(op, n)``."""
    return nbytes / seconds * bus_factor(op, world_size)


def ring_steps(op: str, world_size: int) -> int:
    """Messages in sequence along a ring: 2 (n - 1) for all_reduce, n - 1 for the others."""
    n = world_size
    return 2 * (n - 1) if op == "all_reduce" else (n - 1)


def collective_time(op: str, nbytes: float, world_size: int, alpha_s: float, bandwidth: float) -> float:
    """Predicted time (s) of a ring collective: ``steps x alpha + bus_factor x nbytes / bandwidth``.

    ``bandwidth`` is the per-link bandwidth in bytes/s (comparable with measured bus bandwidth).
    """
    if world_size == 1:
        return 0.0
    return ring_steps(op, world_size) * alpha_s + bus_factor(op, world_size) * nbytes / bandwidth


def alpha_beta_time(nbytes, alpha_s: float, bandwidth: float):
    """``alpha + nbytes / bandwidth`` (works on numbers and numpy arrays)."""
    return alpha_s + np.asarray(nbytes, dtype=float) / bandwidth


def fit_alpha_beta(nbytes, seconds, relative: bool = True) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + nbytes / bandwidth``; returns ``(alpha_s, bandwidth_bytes_per_s)``.

    With ``relative=True`` (default) each point is weighted by 1/t, i.e. the *relative* error is
    minimised; otherwise the largest messages (largest times) would decide alpha alone, and alpha, a few
    microseconds, would come out as noise (even negative). alpha is clipped at 0. If the times do not
    grow with the size (all messages latency-bound, or noise), returns ``(median time, inf)``.
    """
    x = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise ValueError("need at least two (nbytes, seconds) points of equal length")
    A = np.stack([np.ones_like(x), x], axis=1)
    w = 1 / t if relative else np.ones_like(t)
    (alpha, inv_bw), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    if inv_bw <= 0:  # times do not grow with size (too small or too noisy): latency only
        return float(np.median(t)), float("inf")
    if alpha < 0:  # refit the slope alone through the origin
        alpha = 0.0
        inv_bw = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    return float(alpha), float(1 / inv_bw)
