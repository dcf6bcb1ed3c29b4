"""Formulas of hybrid context parallelism, Ulysses inside a group of u ranks and the ring across (lesson 10).

One layer, one micro-batch of B sequences of s tokens, C = d_model, b bytes per element, cp = u r ranks
(`course_lib.parallel.context_hybrid`), n = s/cp tokens per rank. Payloads as `ContextCounter` counts them (a send
its tensor, an all-to-all its input; `course_lib.theory.context`):

    Ulysses (u > 1)   forward   4 all-to-alls of B n C b   q, k, v (B, H, n, D) to (B, H/u, u n, D); the output back
                      backward  4 all-to-alls of B n C b   the output's gradient to heads; dq, dk, dv back
    ring (r > 1)      forward   r - 1 sends of 2 B n C b   one K/V chunk (2, B, H/u, u n, D): 2 B (u n)(C/u) b
                      backward  2r - 1 sends of 2 B n C b  K/V again (r - 1) and each chunk's dK/dV (r)

The all-to-all's input and the ring's chunk do not depend on u: B n C b and 2 B n C b, as pure Ulysses and the pure
ring over cp have them. What changes is how many: 8 all-to-alls in a group of u and 3r - 2 sends instead of
3cp - 2. On the wire (`theory.context.bytes_sent_per_rank`, an all-to-all sends (u-1)/u of its input) forward:

    4 B n C b (u-1)/u  (inside the Ulysses group, the fast links)  +  2 B n C b (r - 1)  (across, the ring)

The limit of Ulysses is the heads: u must divide the heads of a rank, n_head/tp queries and n_kv_head/tp K/V heads
under tensor parallelism (`ulysses_degree_cap`); past the K/V heads, K/V heads must be copied to several members.

Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models": 128 query heads, 8 KV heads; TP 8 in Table 4): a TP
rank holds 128/8 = 16 query heads and 8/8 = 1 K/V head, so a Ulysses degree above 1 already copies K/V heads, and
16 is the most that splits the query heads at all. Llama 3 used all-gather context parallelism (section 3.3.2; CP 16 in
its long-context stage, Table 4), which has no head limit.
"""

from __future__ import annotations

from typing import NamedTuple

from course_lib.theory.comm import bus_factor

__all__ = ["hybrid_layer_comm", "hybrid_bytes_sent_per_rank", "UlyssesCap", "ulysses_degree_cap"]


def _check(cp: int, ulysses: int) -> int:
    if cp < 1 or ulysses < 1 or cp % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide cp={cp} (cp = ulysses x ring)")
    return cp // ulysses


def hybrid_layer_comm(batch: int, seq_len: int, d_model: int, cp: int, ulysses: int, dtype_bytes: int = 4) -> dict:
    """{(phase, op): {"calls": n, "bytes": payload}} of one layer's hybrid attention on one rank (see the module
    docstring); a degree of 1 has no calls: u = 1 is the ring over cp, u = cp is Ulysses over cp."""
    ring = _check(cp, ulysses)
    row = batch * (seq_len // cp) * d_model * dtype_bytes            # B n C b: one of q, k, v, out; or half a chunk
    out = {}
    if ulysses > 1:
        out[("forward", "all_to_all")] = {"calls": 4, "bytes": 4 * row}
        out[("backward", "all_to_all")] = {"calls": 4, "bytes": 4 * row}
    if ring > 1:
        out[("forward", "send")] = {"calls": ring - 1, "bytes": (ring - 1) * 2 * row}
        out[("backward", "send")] = {"calls": 2 * ring - 1, "bytes": (2 * ring - 1) * 2 * row}
    return out


def hybrid_bytes_sent_per_rank(batch: int, seq_len: int, d_model: int, cp: int, ulysses: int, dtype_bytes: int = 4,
                               phase: str | None = None) -> dict[str, float]:
    """What one rank puts on the wire in one layer: {"ulysses": inside its Ulysses group, "ring": across}."""
    table = hybrid_layer_comm(batch, seq_len, d_model, cp, ulysses, dtype_bytes)
    pick = lambda op: sum(v["bytes"] for (ph, o), v in table.items() if o == op and phase in (None, ph))   # noqa: E731
    return {"ulysses": pick("all_to_all") * bus_factor("all_to_all", ulysses), "ring": float(pick("send"))}


class UlyssesCap(NamedTuple):
    """kv: the largest Ulysses degree that splits the K/V heads of a TP rank without copies (n_kv_head/tp);
    query: the largest that splits its query heads at all (n_head/tp), copying each K/V head to query/kv members."""
    kv: int
    query: int


def ulysses_degree_cap(n_head: int, n_kv_head: int, tp: int = 1) -> UlyssesCap:
    """The Ulysses degree caps of a model under tensor parallelism tp (see the module docstring; a degree must also
    divide them). Llama 3 405B: ``ulysses_degree_cap(128, 8, 8) == UlyssesCap(kv=1, query=16)``."""
    if n_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} does not divide n_head={n_head}: each K/V head serves a group of "
                         f"query heads")
    if n_kv_head % tp:
        raise ValueError(f"tp={tp} does not divide n_kv_head={n_kv_head}: TP gives each rank n_kv_head/tp K/V heads; "
                         f"pick tp dividing {n_kv_head}")
    return UlyssesCap(kv=n_kv_head // tp, query=n_head // tp)
