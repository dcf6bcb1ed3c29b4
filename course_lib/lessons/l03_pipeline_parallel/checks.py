"""What the graded exercises 03-interleaved-order and 03-v-order call (solutions/03_pipeline_parallel.ipynb).

The learner writes ``interleaved_order(p, v, m, rank) -> [("F" | "B", micro_batch, chunk), ...]``. There is more
than one right answer (Megatron-LM's order has changed between releases: older ones ran every forward first when
m = p, Megatron-core today does not), so the order is judged by the exercise's rules, not against one reference:

1. all the work: every (micro-batch, chunk) of the rank once forward and once backward, the forward first;
2. the dependencies: the orders of all p ranks run together without deadlock (`pipeline_schedules.simulate`);
3. interleaving's bubble: the simulated idle fraction is at most (p - 1) / (v m + p - 1)
   (`theory.pipeline.interleaved_bubble_fraction`), with chunk-backwards twice and once as long as chunk-forwards;
4. the memory cap: rank ``rank`` holds at most `theory.pipeline.interleaved_in_flight` micro-batches of a whole
   stage (a chunk counts 1/v), Megatron-LM's (Korthikanti et al. 2022, section 4.2, on rank 0).

The learner also writes ``v_order(p, m, rank) -> [("F" | "B" | "W", micro_batch, chunk), ...]``, a V-shaped
zero-bubble order (chunk 0 of rank r at ring position r, chunk 1 at 2 p - 1 - r), judged by its own four rules:
all the work (F, B and W of every (micro-batch, chunk), in that order), the dependencies in the V placement, idle time
per rank at most (p - 1) t when every chunk's F, B and W last t (`theory.pipeline.v_shape_idle_time`: only the
pipeline fill), and at most 2 p chunk activations held, each from its F to its W (p micro-batches of a whole stage,
1F1B's rank-0 peak; the course's runner keeps a split backward's graph until W).

Each failure raises `CheckFailed` with a one-line message naming the case.
"""

from __future__ import annotations

from course_lib import theory
from course_lib.grading.check import CheckFailed
from course_lib.parallel import pipeline_schedules as schedules

__all__ = ["check_interleaved_orders", "interleaved_problems", "INTERLEAVED_CASES", "HIDDEN_INTERLEAVED_CASES",
           "check_v_orders", "v_problems", "V_CASES", "HIDDEN_V_CASES"]

# (p, v, m): a ring of 2 that wraps, v = 3 > p, p = 4, odd p, m = p with p >= 3 (the warm-up meets v m),
# v = 1 (no interleaving), one rank.
INTERLEAVED_CASES = [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 6), (3, 2, 3), (4, 3, 4), (2, 2, 2), (3, 1, 6),
                     (1, 3, 2)]
HIDDEN_INTERLEAVED_CASES = [(p, v, m) for p in range(1, 6) for v in range(1, 5) for m in range(p, 4 * p + 1, p)]
T_B_OVER_T_F = (2.0, 1.0)              # chunk-backward time over chunk-forward time: the bound holds for both
_SLACK = 1e-9


def _case(p: int, v: int, m: int) -> str:
    return f"interleaved p={p} v={v} m={m}"


def interleaved_problems(interleaved_order, p: int, v: int, m: int) -> None:
    """Raise `CheckFailed` at the first rule that the orders of ``interleaved_order`` break for (p, v, m)."""
    orders = []
    for rank in range(p):
        name = f"{_case(p, v, m)} rank {rank}"
        order = [tuple(op) for op in interleaved_order(p, v, m, rank)]
        if any(len(op) != 3 for op in order):
            raise CheckFailed(f"{name}: ops are (kind, micro_batch, chunk)",
                              f"got {next(op for op in order if len(op) != 3)!r}",
                              "every op names its chunk, 0 .. v - 1, as its third item")
        try:
            schedules.validate_order(order, m, v)
        except ValueError as e:
            raise CheckFailed(f"{name}: every (micro-batch, chunk) once, F before B", str(e),
                              "each micro-batch goes through each of the rank's v chunks forward once and backward "
                              "once, the backward after its forward in the same list; a warm-up never asks for more "
                              "forwards than exist") from None
        held, cap = schedules.peak_in_flight(order, v), theory.pipeline.interleaved_in_flight(p, v, m, rank)
        if held > cap + _SLACK:
            raise CheckFailed(f"{name}: activations in flight (micro-batches of a whole stage, a chunk counts 1/v)",
                              f"expected at most {cap:g}, got {held:g}",
                              "the memory cap of the exercise depends on the rank: start each rank's backwards as "
                              "soon as its cap allows")
        orders.append(order)
    for ratio in T_B_OVER_T_F:
        try:
            timeline = schedules.simulate(orders, t_f=1.0, t_b=ratio)
        except ValueError as e:
            raise CheckFailed(f"{_case(p, v, m)}: the orders of all ranks run together", str(e),
                              "a chunk-forward needs the forward at the ring position before it, a chunk-backward "
                              "the backward at the position after it: draw one micro-batch's path over the ring"
                              ) from None
        bubble, bound = schedules.bubble_of(timeline), theory.pipeline.interleaved_bubble_fraction(p, m, v)
        if bubble > bound + _SLACK:
            raise CheckFailed(f"{_case(p, v, m)}: simulated bubble with t_b = {ratio:g} t_f",
                              f"expected at most {bound:.4f} (interleaving's bubble), got {bubble:.4f}",
                              "a rank waits when the next op in its order is not ready yet: order the forwards so "
                              "that a micro-batch's next chunk is ready when the rank reaches it, and warm up long "
                              "enough (lesson 03, section 9)")


def check_interleaved_orders(interleaved_order, cases=INTERLEAVED_CASES) -> int:
    """Every rule of 03-interleaved-order for each (p, v, m) of ``cases``; returns how many cases passed."""
    for p, v, m in cases:
        interleaved_problems(interleaved_order, p, v, m)
    return len(cases)


# (p, m), m >= 2 p - 1: the least m, m = 2 p, an odd m, one rank, a deeper pipeline
V_CASES = [(2, 3), (2, 4), (3, 5), (3, 7), (4, 8), (4, 11), (1, 2)]
HIDDEN_V_CASES = [(p, m) for p in range(1, 6) for m in range(max(2 * p - 1, 1), 4 * p + 2)]


def v_problems(v_order, p: int, m: int) -> None:
    """Raise `CheckFailed` at the first rule of 03-v-order that the orders of ``v_order`` break for (p, m)."""
    case = f"V order p={p} m={m}"
    orders = []
    for rank in range(p):
        name = f"{case} rank {rank}"
        order = [tuple(op) for op in v_order(p, m, rank)]
        bad = next((op for op in order if len(op) != 3 or op[2] not in (0, 1)), None)
        if bad is not None:
            raise CheckFailed(f"{name}: ops are (kind, micro_batch, chunk) with chunk 0 or 1", f"got {bad!r}",
                              "every op names the rank's chunk: 0 (on the way down the V) or 1 (on the way back up)")
        try:
            schedules.validate_order(order, m, 2)
            if not any(op[0] == "W" for op in order):
                raise ValueError("no W at all: the backward must be split into B and W")
        except ValueError as e:
            raise CheckFailed(f"{name}: F, B and W of every (micro-batch, chunk) once, in that order", str(e),
                              "each of the 2 m (micro-batch, chunk) pairs of the rank needs one F, then one B, then "
                              "one W, all in this rank's list") from None
        held, cap = schedules.peak_in_flight(order, 2, until="W"), min(p, m)
        if held > cap + _SLACK:
            raise CheckFailed(f"{name}: activations in flight (a chunk's from its F to its W)",
                              f"expected at most {2 * cap:g} chunks ({cap:g} micro-batches of a whole stage), got "
                              f"{2 * held:g}",
                              "a chunk's activations are held from its F until its W: start backwards before the "
                              "forwards pile up, and run each W soon after its B except in the drain")
        orders.append(order)
    try:
        timeline = schedules.simulate(orders, t_f=1.0, t_b=1.0, t_w=1.0, placement="v")
    except ValueError as e:
        raise CheckFailed(f"{case}: the orders of all ranks run together in the V placement", str(e),
                          "chunk 0 of rank r is position r, chunk 1 is 2 p - 1 - r: a forward needs the position "
                          "before it, a B the position after it; draw one micro-batch's path down and back up"
                          ) from None
    span = max(op["end"] for ops in timeline for op in ops)
    idle, bound = span - 6 * m, theory.pipeline.v_shape_idle_time("zb-v", p, m, 1.0)
    if idle > bound + _SLACK:
        raise CheckFailed(f"{case}: idle time per rank with every chunk F, B, W lasting 1",
                          f"expected at most {bound:g} (the pipeline fill, p - 1), got {idle:g}",
                          "run a B as soon as its input is there and keep the Ws for the gaps: a rank that would "
                          "wait should have a W to run (lesson 03, section 10)")


def check_v_orders(v_order, cases=V_CASES) -> int:
    """Every rule of 03-v-order for each (p, m) of ``cases``; returns how many cases passed."""
    for p, m in cases:
        v_problems(v_order, p, m)
    return len(cases)
