"""Formulas of context parallelism: communication, attention work and activation memory per rank (lesson 10).

One layer, one micro-batch of B sequences of s tokens, C = d_model, b bytes per element, cp ranks, n = s/cp tokens
per rank. One K/V chunk is a rank's keys and values: kv = 2 B n C b bytes. As `course_lib.parallel.context_attention`
implements them (payloads counted as `ContextCounter` counts them: a send its tensor, an all-gather its output, a
reduce-scatter and an all-to-all their input):

    ring (Liu et al. 2023)   forward   cp-1 sends of kv      (every other rank's K/V passes by once)
                             backward  cp-1 sends of kv      (K/V travel the ring again: not kept from forward)
                                     + cp   sends of kv      (the dK/dV accumulator of each chunk travels with it,
                                                              and makes one last hop home)
    all-gather (Llama 3)     forward   1 all-gather of 2 B s C b      (K/V of the whole sequence)
                             backward  1 reduce-scatter of 2 B s C b  (dK/dV summed back to their owners)
    Ulysses (Jacobs 2023)    forward   4 all-to-alls of B s C b / cp  (q, k, v to head shards, the output back)
                             backward  4 all-to-alls of B s C b / cp  (the same, reversed)

What a rank puts on the wire is the send itself for the ring and (cp-1)/cp of the payload for the collectives
(`bytes_sent_per_rank`): per layer forward the ring and all-gather both send 2 B C b (s - n), Ulysses
4 B C b (s - n)/cp, which *shrinks* as cp grows: Ulysses' advantage, bought with cp | n_head.

Attention work under the causal mask, counted in score elements of the chunk pairs actually computed (a pair whose
keys all follow its queries is skipped). The course's kernel (`attend_block`) computes a diagonal pair whole and
masks it (``diagonal="whole"``); a causal flash kernel computes about half of it, c (c + 1) / 2 of its c^2 scores
(``diagonal="half"``, counted here as c^2 / 2):

                                                diagonal whole                    diagonal half
    contiguous split (cp chunks of n = s/cp)    rank i: (i + 1) n^2               (i + 1/2) n^2
                                                last / first: cp                  2 cp - 1
    balanced split (2cp chunks of c = s/2cp;    rank i: (2cp + 1) c^2             2 cp c^2
    rank i holds chunks i and 2cp-1-i)          the same on every rank            the same on every rank

A ring's ranks wait for each other: a rank holds the chunk of step t only after its left neighbour sent it, so no
rank runs more than a step ahead of its neighbours. `ring_step_work` gives the work of every rank at every step;
its **per-step critical path**, the sum over steps of the slowest rank's work (`ring_critical_path`), is what the
forward's compute takes when the ranks move in step, and with neighbour-only waits the time lies between the
busiest rank's total and it (both splits here: the two are equal). Contiguous: (cp - 1) n^2 + the diagonal, a full
block at every step after the first, whatever the kernel; balanced: every rank's total. Their ratio is
4cp / (2cp + 1) with whole diagonals and 2 - 1/cp with half ones (not cp or 2cp - 1: the slowest rank at each step,
not the least busy one, sets the time). Brandon et al. 2023 (Striped Attention, arXiv 2311.09431, abstract and Table 2)
measure the gain of another balanced split (each device holds tokens spread evenly through the sequence) over the
contiguous ring: up to 1.45x end-to-end throughput on 8 A100s at 256K tokens (1.50x on TPUv4s at 256K), 1.65x on 16
TPUv4 chips at 786K.

Activations saved per layer per rank (`course_lib.theory.tensor.activation_bytes_per_layer` of n tokens: every
activation is per token, and block attention saves q, k, v, the output and one log-sum-exp per row and head, as SDPA
does; the ring's output is laid out (B, n, H, D) in memory, so it is also the projection's input, as SDPA's is).
All-gather CP keeps the gathered K/V of the whole sequence as well, 2 B s C b: it stops shrinking with cp. Ulysses
keeps the attention output twice, head-sharded (B, H/cp, s, D) for the attention's backward and back in sequence
shards as the projection's input: B n C b more than the ring (`extra_activation_bytes`).

With grouped-query attention (Llama 3: 8 KV heads) K and V are ``kv_dim = n_kv_head x head_dim`` wide, not C: the
ring's and the all-gather's bytes, and the all-gather's kept K/V, shrink by n_head / n_kv_head (``kv_dim=``; default
C, the course's GPT). Under tensor parallelism a rank holds 1/tp of the heads: pass C/tp and kv_dim/tp. The 3D
planner (`course_lib.theory.planner`, lesson 08) prices a layout's cp dimension with these formulas.
"""

from __future__ import annotations

from course_lib.config import ModelConfig
from course_lib.theory import tensor as tensor_theory
from course_lib.theory.comm import bus_factor

__all__ = ["VARIANTS", "kv_chunk_bytes", "layer_comm", "bytes_sent_per_rank", "causal_work_per_rank", "work_imbalance",
           "ring_step_work", "ring_critical_path", "ring_hiding_tokens", "extra_activation_bytes",
           "activation_bytes_per_layer"]

VARIANTS = ("ring", "all_gather", "ulysses")     # as `course_lib.parallel.context_attention.VARIANTS`


def kv_chunk_bytes(batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
                   kv_dim: int | None = None) -> int:
    """Bytes of one rank's keys and values, 2 B (s/cp) C b (C -> ``kv_dim`` with GQA)."""
    return 2 * batch * (seq_len // cp) * (d_model if kv_dim is None else kv_dim) * dtype_bytes


def layer_comm(variant: str, batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
               kv_dim: int | None = None) -> dict:
    """{(phase, op): {"calls": n, "bytes": payload}} of one layer's attention on one rank (see the module docstring);
    ``kv_dim``: the width of K and V (n_kv_head x head_dim with GQA; default ``d_model``)."""
    if cp == 1:
        return {}
    kv_dim = d_model if kv_dim is None else kv_dim
    kv = kv_chunk_bytes(batch, seq_len, d_model, cp, dtype_bytes, kv_dim)
    if variant == "ring":
        return {("forward", "send"): {"calls": cp - 1, "bytes": (cp - 1) * kv},
                ("backward", "send"): {"calls": 2 * cp - 1, "bytes": (2 * cp - 1) * kv}}
    whole = 2 * batch * seq_len * kv_dim * dtype_bytes
    if variant == "all_gather":
        return {("forward", "all_gather"): {"calls": 1, "bytes": whole},
                ("backward", "reduce_scatter"): {"calls": 1, "bytes": whole}}
    if variant == "ulysses":
        four = 2 * batch * seq_len * (d_model + kv_dim) * dtype_bytes // cp      # q and the output; k and v
        return {("forward", "all_to_all"): {"calls": 4, "bytes": four},
                ("backward", "all_to_all"): {"calls": 4, "bytes": four}}
    raise ValueError(f"variant={variant!r}: use 'ring', 'all_gather' or 'ulysses'")


def bytes_sent_per_rank(table: dict, cp: int, phase: str | None = None) -> float:
    """What one rank puts on the wire for `table` (a send: itself; a collective: payload x (cp-1)/cp)."""
    return sum(row["bytes"] * (1.0 if op == "send" else bus_factor(op, cp))
               for (ph, op), row in table.items() if phase in (None, ph))


def causal_work_per_rank(seq_len: int, cp: int, split: str = "balanced", batch: int = 1, n_head: int = 1) -> list[int]:
    """Score elements each rank computes in one causal attention forward, fully masked chunk pairs skipped."""
    if split == "contiguous":
        n = seq_len // cp
        return [batch * n_head * (i + 1) * n * n for i in range(cp)]
    if split == "balanced":
        c = seq_len // (2 * cp)
        return [batch * n_head * (2 * cp + 1) * c * c for _ in range(cp)]
    raise ValueError(f"split={split!r}: use 'balanced' or 'contiguous'")


def work_imbalance(seq_len: int, cp: int, split: str = "balanced") -> float:
    """The busiest rank's attention work over the least busy one's, diagonal pairs computed whole (cp for the
    contiguous split, 1 balanced; with a causal flash kernel's half diagonals the contiguous split gives 2cp - 1)."""
    w = causal_work_per_rank(seq_len, cp, split)
    return max(w) / min(w)


def _chunks(cp: int, rank: int, split: str) -> list[tuple[int, int]]:
    """(first token, length) of the chunks `rank` holds, in units of s/(2cp) tokens."""
    if split == "contiguous":
        return [(2 * rank, 2)]
    if split == "balanced":
        return [(rank, 1), (2 * cp - 1 - rank, 1)]
    raise ValueError(f"split={split!r}: use 'balanced' or 'contiguous'")


def ring_step_work(seq_len: int, cp: int, split: str = "balanced", diagonal: str = "whole") -> list[list[float]]:
    """Score elements each rank computes at each ring step of one causal forward (one sequence, one head):
    ``[step][rank]``. At step t rank r holds the K/V of rank (r - t) mod cp; a key chunk after the query chunk is
    skipped, one before it is computed whole, the diagonal whole (``"whole"``, the course's kernel) or half
    (``"half"``, a causal flash kernel). Summed over the steps: `causal_work_per_rank` for ``"whole"``."""
    if diagonal not in ("whole", "half"):
        raise ValueError(f"diagonal={diagonal!r}: use 'whole' or 'half'")
    c = seq_len // (2 * cp)
    out = []
    for t in range(cp):
        row = []
        for r in range(cp):
            work = 0.0
            for q0, qn in _chunks(cp, r, split):
                for k0, kn in _chunks(cp, (r - t) % cp, split):
                    if k0 + kn <= q0:                      # every key before every query
                        work += qn * kn
                    elif k0 == q0:                         # the diagonal (same chunk)
                        work += qn * kn * (1 if diagonal == "whole" else 0.5)
            row.append(work * c * c)
        out.append(row)
    return out


def ring_critical_path(seq_len: int, cp: int, split: str = "balanced", diagonal: str = "whole") -> float:
    """The sum over ring steps of the slowest rank's work (`ring_step_work`): the forward's compute when each
    step waits for the slowest rank."""
    return sum(max(step) for step in ring_step_work(seq_len, cp, split, diagonal))


def ring_hiding_tokens(peak_flops: float, bandwidth: float, dtype_bytes: int = 2, kv_fraction: float = 1.0,
                       pair_fraction: float = 1.0) -> float:
    """Tokens per rank n above which one ring step's attention, ``pair_fraction`` of a full chunk pair of n queries
    and n keys at ``peak_flops`` (a full pair: 4 n^2 C FLOPs, q k^T and P v), outlasts the next K/V chunk's
    transfer, 2 n C b bytes at ``bandwidth`` bytes/s: n >= b peak / (2 bandwidth) x ``kv_fraction`` (n_kv_head /
    n_head with GQA) / ``pair_fraction``. ``pair_fraction`` = 1: a fully visible pair; the balanced causal split's
    average step, (2 cp + 1) / (4 cp) of a pair (`causal_work_per_rank` / cp), is what the planner's ring charges
    (`course_lib.theory.planner.cp_layer_time`, whose forward is exposed exactly below this n when latency is 0).
    A lower bound: at a kernel's real efficiency the compute takes longer, and fewer tokens suffice; a message's
    latency (alpha) needs more (lesson 10 fits both on this machine)."""
    return dtype_bytes * peak_flops * kv_fraction / (2 * bandwidth * pair_fraction)


def extra_activation_bytes(variant: str, batch: int, seq_len: int, d_model: int, cp: int, dtype_bytes: int = 4,
                           kv_dim: int | None = None) -> int:
    """Bytes one layer keeps on one rank beyond what its own s/cp tokens keep: all-gather the gathered K/V of the
    whole sequence, 2 B s kv_dim b; Ulysses its output a second time, B (s/cp) C b; the ring nothing."""
    if cp == 1 or variant == "ring":
        return 0
    if variant == "all_gather":
        return 2 * batch * seq_len * (d_model if kv_dim is None else kv_dim) * dtype_bytes
    if variant == "ulysses":
        return batch * (seq_len // cp) * d_model * dtype_bytes
    raise ValueError(f"variant={variant!r}: use 'ring', 'all_gather' or 'ulysses'")


def activation_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int, cp: int, variant: str = "ring",
                               dtype_bytes: int = 4) -> int:
    """Bytes one layer saves for backward on one rank under context parallelism (see the module docstring)."""
    own = tensor_theory.activation_bytes_per_layer(cfg, batch, seq_len // cp, dtype_bytes=dtype_bytes)
    return own + extra_activation_bytes(variant, batch, seq_len, cfg.d_model, cp, dtype_bytes)
