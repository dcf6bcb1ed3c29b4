"""Pipeline parallelism by formula: bubble fractions and activation memory (lesson 03).

p stages, m micro-batches, t_f / t_b the forward / backward time of one micro-batch on one stage.

- GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021): a step lasts (m + p - 1)(t_f + t_b), of
  which each rank computes m (t_f + t_b), so the idle (bubble) fraction is (p - 1) / (m + p - 1).
  Megatron-LM states it relative to the ideal time instead: bubble / ideal = (p - 1) / m.
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2): each rank holds v model chunks, so a stage's
  forward costs t_f / v and the ramp-up shrinks v times: bubble / ideal = (p - 1) / (v m), i.e. a
  fraction (p - 1) / (v m + p - 1) of the step, at the price of more point-to-point messages: 2 (v p - 1) per
  micro-batch against 1F1B's 2 (p - 1), (v p - 1) / (p - 1) times as many (3 at p = v = 2; near v for large p).
- Zero-bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward splits into B (gradient
  w.r.t. the input, on the critical path) and W (gradient w.r.t. the weights, which nothing downstream
  waits for). Scheduling W into the idle slots, ZB-H1 leaves (p - 1)(t_F + t_B - t_W) of idle time per
  rank instead of 1F1B's (p - 1)(t_F + t_B + t_W), with 1F1B's memory; ZB-H2 removes the bubble almost
  entirely by holding more activations.
- V-shaped schedules (ZB-V, Qi et al. 2023 section 6; DualPipeV, DeepSeek's DualPipe cut in half, a procedure the
  DualPipe README credits to Sea AI Lab): two chunks per rank, rank r holding positions r and 2 p - 1 - r of the 2 p,
  the backward split into B and W. With every chunk's F, B and W lasting t (a stage's F lasts 2 t), a step that ends
  in a synchronized optimizer step lasts 6 m t + (p - 1) t for both (m >= 2 p - 1 for ZB-V, m >= 2 p for DualPipeV):
  (p - 1) t idle per rank, the fill (the last rank's first input needs p - 1 chunk forwards), an idle fraction
  (p - 1) / (6 m + p - 1), half ZB-H1's idle time and a sixth of 1F1B's. Every ZB-V rank is busy from its own first
  op to its last, Qi et al.'s "zero bubble" (their bubble rate counts each stage's own span, section 5.3, and they
  remove the optimizer step's synchronization, sections 2.2 and 4); DualPipeV's rank 0 is not. ZB-V holds at most
  2 p chunk activations on every rank (p micro-batches of a whole stage: 1F1B's rank-0 peak), DualPipeV 2 p + 1. A
  micro-batch crosses 2 p - 1 chunk boundaries each way, but the one at the bottom of the V stays on rank p - 1:
  4 (p - 1) messages, twice 1F1B's.
- Activation memory: GPipe holds all m micro-batches at its peak; 1F1B holds at most p - rank on rank
  `rank` (the first stage is the worst: p), so 1F1B's peak is min(p, m) / m of GPipe's.
"""

from __future__ import annotations
from course_lib.reference import reference_for

__all__ = ["bubble_fraction", "bubble_ratio", "interleaved_bubble_fraction", "zero_bubble_idle_time",
           "one_f_one_b_idle_time", "peak_microbatches_in_flight", "step_time", "interleaved_in_flight",
           "p2p_messages_per_microbatch", "zero_bubble_fraction", "v_shape_idle_time", "v_shape_bubble_fraction",
           "v_shape_in_flight"]


def _validate(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need p >= 1 stages and m >= 1 micro-batches; got p={p}, m={m}")


@reference_for("03-bubble")
def bubble_fraction(p: int, m: int) -> float:
    """Fraction of a GPipe / 1F1B step that a rank is idle: (p - 1) / (m + p - 1)."""
    _validate(p, m)
    return (p - 1) / (m + p - 1)


def bubble_ratio(p: int, m: int) -> float:
    """Bubble time over ideal compute time, as Megatron-LM writes it: (p - 1) / m."""
    _validate(p, m)
    return (p - 1) / m


def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
    """Interleaved 1F1B with v model chunks per rank: (p - 1) / (v m + p - 1) of the step is idle."""
    _validate(p, m)
    if v < 1:
        raise ValueError(f"v={v} model chunks per rank must be >= 1")
    return (p - 1) / (v * m + p - 1)


def step_time(p: int, m: int, t_f: float, t_b: float) -> float:
    """Duration of a GPipe / 1F1B step with uniform stages and free communication: (m + p - 1)(t_f + t_b)."""
    _validate(p, m)
    return (m + p - 1) * (t_f + t_b)


def one_f_one_b_idle_time(p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time per rank of 1F1B when the backward is B (input grad, t_b) + W (weight grad, t_w)."""
    return (p - 1) * (t_f + t_b + t_w)


def zero_bubble_idle_time(p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time per rank of the ZB-H1 schedule (Qi et al. 2023): (p - 1)(t_F + t_B - t_W), never below 0."""
    return max(0.0, (p - 1) * (t_f + t_b - t_w))


def zero_bubble_fraction(p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle fraction of a ZB-H1 step (m >= p): the idle time (p - 1)(t_F + t_B - t_W) over the step
    m (t_F + t_B + t_W) + idle. With t_F = t_B = t_W: (p - 1) / (3 m + p - 1)."""
    _validate(p, m)
    idle = zero_bubble_idle_time(p, t_f, t_b, t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


def interleaved_in_flight(p: int, v: int, m: int, rank: int = 0) -> float:
    """Activations rank `rank` holds at its peak under interleaved 1F1B, in micro-batches of a whole stage.

    Megatron-LM's interleaved schedule runs ``2 (p - rank - 1) + (v - 1) p`` warm-up forwards of model chunks (all
    ``v m`` of them when m = p, as Megatron-LM did until November 2024; today it caps the warm-up at v m), then one
    more forward before its first backward; a chunk holds 1/v of the stage's
    layers, so the peak is ``min(2 (p - rank - 1) + (v - 1) p + 1, v m) / v`` stage micro-batches. On the first rank
    that is ``p + (p - 1) / v`` (Korthikanti et al. 2022, section 4.2: "p (1 + (p - 1) / (p v))"), more than 1F1B's p.
    """
    _validate(p, m)
    if v < 1 or not 0 <= rank < p:
        raise ValueError(f"need v >= 1 model chunks and 0 <= rank < p; got v={v}, rank={rank}, p={p}")
    warmup = v * m if m == p else 2 * (p - rank - 1) + (v - 1) * p
    return min(warmup + 1, v * m) / v


def p2p_messages_per_microbatch(p: int, v: int = 1, placement: str = "loop") -> int:
    """Point-to-point messages one micro-batch causes in a step: it crosses ``v p - 1`` chunk boundaries forward
    (activations) and as many backward (their gradients); 1F1B and ZB-H1 are v = 1: ``2 (p - 1)``. In the V
    placement (v = 2) the boundary at the bottom of the V joins two chunks of rank p - 1, which hands it over in
    memory: ``4 (p - 1)``."""
    if p < 1 or v < 1:
        raise ValueError(f"need p >= 1 stages and v >= 1 chunks; got p={p}, v={v}")
    if placement == "v":
        if v != 2:
            raise ValueError(f"the V placement gives each rank 2 chunks, not v={v}")
        return 4 * (p - 1)
    return 2 * (v * p - 1)


def _check_v(kind: str, p: int, m: int) -> None:
    _validate(p, m)
    least = {"zb-v": 2 * p - 1, "dualpipev": 2 * p}.get(kind)
    if least is None:
        raise ValueError(f"unknown V-shaped schedule {kind!r}: pick 'zb-v' or 'dualpipev'")
    if m < least:
        raise ValueError(f"{kind} with p={p}: the formula holds for m >= {least} micro-batches, got m={m}")


def v_shape_idle_time(kind: str, p: int, m: int, t: float) -> float:
    """Idle time per rank of one ZB-V (m >= 2 p - 1) or DualPipeV (m >= 2 p) step, from the first op of any rank to the
    last, when every chunk's F, B and W last t: (p - 1) t, the fill. (Unequal F, B, W times can leave more;
    `pipeline_schedules.simulate` gives it for any times.)"""
    _check_v(kind, p, m)
    return (p - 1) * t


def v_shape_bubble_fraction(kind: str, p: int, m: int) -> float:
    """Idle fraction of a ZB-V or DualPipeV step with equal chunk F, B, W times: (p - 1) / (6 m + p - 1) (each
    rank computes 2 chunks x m micro-batches x 3 ops)."""
    _check_v(kind, p, m)
    return (p - 1) / (6 * m + p - 1)


def v_shape_in_flight(kind: str, p: int, m: int, rank: int = 0) -> float:
    """Micro-batches of a whole stage whose activations rank `rank` holds at its peak, a chunk counting 1/2 from its F
    to its W (what the course's runner holds: it keeps a split backward's graph until W; counted to the B instead,
    the peaks are the same): ZB-V min(2 p, m + rank + 1, 2 m) / 2 (p from m >= 2 p - 1 on, on every rank), DualPipeV
    (2 p + 1) / 2 (m >= 2 p)."""
    _validate(p, m)
    if not 0 <= rank < p:
        raise ValueError(f"need 0 <= rank < p; got rank={rank}, p={p}")
    if kind == "zb-v":
        return min(2 * p, m + rank + 1, 2 * m) / 2
    _check_v(kind, p, m)
    return (2 * p + 1) / 2


def peak_microbatches_in_flight(schedule: str, p: int, m: int, rank: int = 0, v: int = 1) -> float:
    """Micro-batches (of a whole stage) whose activations rank `rank` holds at its peak: m (GPipe),
    min(p - rank, m) (1F1B, and ZB-H1, which defers only W and so keeps 1F1B's memory),
    `interleaved_in_flight` (interleaved 1F1B with v chunks), `v_shape_in_flight` (ZB-V, DualPipeV)."""
    _validate(p, m)
    if schedule == "gpipe":
        return m
    if schedule in ("1f1b", "zb-h1"):
        return min(p - rank, m)
    if schedule == "interleaved":
        return interleaved_in_flight(p, v, m, rank)
    if schedule in ("zb-v", "dualpipev"):
        return v_shape_in_flight(schedule, p, m, rank)
    raise ValueError(f"unknown schedule {schedule!r}: pick 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v' or "
                     "'dualpipev'")
