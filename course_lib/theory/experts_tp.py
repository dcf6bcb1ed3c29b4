"""Formulas of expert tensor parallelism and EP x ETP (lesson 11; `course_lib.parallel.experts_tp`).

**Memory.** Each rank holds E/ep experts, each split F/etp: 3 C F E / (ep etp) expert parameters (w1, w3, w2).

**Communication per MoE layer per rank** (payloads as `ExpertCounter` records them: an all-to-all by its input, an
all-reduce by its tensor). M (ep x E): M[s][e] rows ep rank s sends to expert e (every etp rank of an ep group sends
the same: they route the same tokens). Rank j of its ep group computes R_j = sum_s sum_{e of j} M[s][e] rows.

    ep > 1     the five all-to-alls of `course_lib.theory.experts.layer_comm` (counts, dispatch, combine, and
               the two backward), unchanged by etp: every etp rank repeats them on whole C-wide rows
    etp > 1    forward   1 all-reduce of R_j C b   (g: the row-parallel w2's partial sums)
               backward  1 all-reduce of R_j C b   (f: the gradient of the rows entering w1, w3)

A ring all-reduce sends 2 (etp-1)/etp of its payload from each rank. Uniform routing, no drops, T tokens a data
rank: R_j = T k, so each all-reduce is T k C b, as large as each all-to-all (`uniform_layer_comm`).
"""

from __future__ import annotations

from course_lib.theory.experts import layer_comm as ep_layer_comm

__all__ = ["expert_params_per_rank", "layer_comm", "uniform_layer_comm"]


def expert_params_per_rank(d_model: int, d_ff: int, n_experts: int, ep: int = 1, etp: int = 1) -> int:
    """3 C F E / (ep etp): the expert weights one rank holds in one MoE layer."""
    return 3 * d_model * (d_ff // etp) * (n_experts // ep)


def layer_comm(M: list[list[int]], ep_rank: int, d_model: int, etp: int, dtype_bytes: int = 4) -> dict:
    """{(phase, op): {"calls", "bytes"}} of one MoE layer on a rank at place ``ep_rank`` of its ep group (the module
    docstring): the all-to-alls when ep = len(M) > 1, the two all-reduces when etp > 1 and its experts get rows."""
    ep, E = len(M), len(M[0])
    n = E // ep
    out = ep_layer_comm(M, ep_rank, d_model, dtype_bytes) if ep > 1 else {}
    R = sum(M[s][e] for s in range(ep) for e in range(ep_rank * n, (ep_rank + 1) * n))
    if etp > 1 and R:
        for phase in ("forward", "backward"):
            out[(phase, "all_reduce")] = {"calls": 1, "bytes": R * d_model * dtype_bytes}
    return out


def uniform_layer_comm(tokens: int, top_k: int, d_model: int, ep: int, etp: int, dtype_bytes: int = 4) -> dict:
    """Uniform routing, no drops, ``tokens`` a data rank: {"all_to_all": T k C b per row all-to-all (0 at ep 1),
    "all_reduce": T k C b each (0 at etp 1), "all_reduce_sent": 2 (etp-1)/etp of it, what a ring sends a rank}."""
    payload = tokens * top_k * d_model * dtype_bytes
    ar = payload if etp > 1 else 0
    return {"all_to_all": payload if ep > 1 else 0, "all_reduce": ar, "all_reduce_sent": ar * 2 * (etp - 1) / etp}
