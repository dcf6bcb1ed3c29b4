"""What the graded exercises of lesson 10 call (solutions/10_context_parallel.ipynb).

The learner writes, with the signatures below:

    merge_lse(out_a, lse_a, out_b, lse_b) -> (out, lse)                           10-merge-lse (one process)
    balanced_chunks(cp, rank) -> [i, j];  step_masks(cp, rank, step) -> [[kind]]   10-balanced-split (one process)
    ring_step(q, kv, out, lse, q_start, kv_start, group=None) -> (out, lse, kv)   10-ring-step (2 gloo ranks)
    seq_to_heads(x, group=None), heads_to_seq(y, group=None)                      10-ulysses-reshape (2 gloo ranks)

Each check compares with a one-process reference (SDPA on the whole sequence, `torch.logsumexp`, slicing the full
tensor), and a failure raises `CheckFailed` with a one-line message naming the case. The rank-side harnesses
(``rank_try_*``) return records that `check_records` turns into checks, so that an error in a rank (a stub's
NotImplementedError included) becomes a failed check with its message.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.lessons.rank_records import RankRecords, replay_records
from course_lib.parallel.block_attention import attend_block
from course_lib.reference import reference_for

__all__ = ["check_merge_lse", "check_balanced_split", "rank_try_ring_step", "rank_try_ulysses", "check_records",
           "MASK_KINDS"]

MASK_KINDS = ("full", "causal", "skip")
ATOL = 1e-5                                                           # fp32 attention, values of order 1


def _qkv(B=2, H=3, T=12, D=8, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * scale
    return q, torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)


# ------------------------------------------------------------------------------ 10-merge-lse

def check_merge_lse(merge_lse) -> list[dict]:
    """Merge partial results over two key blocks and compare with attention over all keys: non-causal (split at 5
    and 1 of 12 keys), scores of magnitude ~30 (overflow without the max trick), causal (rows that see no key of
    the second block: lse = -inf there), and both orders. Returns one row per case."""
    rows = []
    cases = [("two blocks, keys 0-4 | 5-11", 5, False, 1.0), ("one key | 11 keys", 1, False, 1.0),
             ("large scores (x30)", 6, False, 30.0), ("causal, keys 0-5 | 6-11", 6, True, 1.0)]
    for name, cut, causal, scale in cases:
        q, k, v = _qkv(scale=scale, seed=len(rows))
        a = attend_block(q, k[..., :cut, :], v[..., :cut, :], 0, 0, masked=causal)
        b = attend_block(q, k[..., cut:, :], v[..., cut:, :], 0, cut, masked=causal)
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
        for order, (x, y) in (("a then b", (a, b)), ("b then a", (b, a))):
            out, lse = merge_lse(*x, *y)
            err = (out - whole).abs().max().item()
            check_true(f"merge_lse, {name}, {order}: output has no nan/inf", bool(torch.isfinite(out).all()),
                       hint="a row that sees no key in one block has lse = -inf there: its weight must be 0, not nan")
            check_close(f"merge_lse, {name}, {order}: max |output - attention over all keys|", err, 0.0, atol=ATOL,
                        rtol=0, hint="weight each output by exp(its lse - the merged lse): its share of the "
                                     "softmax denominator; the weights of the two must add up to 1")
            ref_lse = torch.logsumexp(s, -1)
            check_close(f"merge_lse, {name}, {order}: max |lse - logsumexp over all keys| / max(1, |logsumexp|)",
                        ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1)).max().item(), 0.0, atol=ATOL, rtol=0,
                        hint="the merged lse is log(exp(lse_a) + exp(lse_b)), computed without overflow")
            rows.append(dict(case=name, order=order, max_err=err))
    return rows


# ------------------------------------------------------------------------------ 10-balanced-split

@reference_for("10-balanced-split")
def _expected_chunks(cp: int, rank: int) -> list[int]:
    return [rank, 2 * cp - 1 - rank]


@reference_for("10-balanced-split")
def _expected_masks(cp: int, rank: int, step: int) -> list[list[str]]:
    src = (rank - step) % cp
    kind = lambda qc, kc: "full" if kc < qc else "causal" if kc == qc else "skip"   # noqa: E731
    return [[kind(qc, kc) for kc in _expected_chunks(cp, src)] for qc in _expected_chunks(cp, rank)]


def check_balanced_split(balanced_chunks, step_masks, cps=(1, 2, 3, 4)) -> dict:
    """Every rank's chunks and every ring step's masks for cp in `cps`; then the work they imply: every rank
    computes the same number of chunk pairs, 2cp + 1 (a causal one counts 1; `theory.context.causal_work_per_rank`).
    Returns {cp: [chunk pairs computed per rank]}."""
    work = {}
    for cp in cps:
        work[cp] = []
        for r in range(cp):
            got = balanced_chunks(cp, r)
            check_equal(f"balanced_chunks(cp={cp}, rank={r})", [int(c) for c in got], _expected_chunks(cp, r),
                        hint="2cp chunks; each rank takes one from the front and its mirror from the back")
            pairs = 0
            for t in range(cp):
                masks = step_masks(cp, r, t)
                check_equal(f"step_masks(cp={cp}, rank={r}, step={t}) (rows: my chunks, columns: the chunks of rank "
                            f"{(r - t) % cp}'s K/V)", [list(m) for m in masks], _expected_masks(cp, r, t),
                            hint="at step t the rank holds rank (r - t) % cp's K/V; a key chunk before the query "
                                 "chunk is 'full', the same chunk 'causal', a later one 'skip'")
                pairs += sum(m != "skip" for row in masks for m in row)
            work[cp].append(pairs)
        check_equal(f"chunk pairs computed per rank, cp={cp}", work[cp], [2 * cp + 1] * cp,
                    hint="balanced: every rank computes 2cp + 1 chunk pairs")
    return work


# ------------------------------------------------------------------------------ ranks

def _ops(counter: CollectiveCounter) -> dict:
    return {op: row["calls"] for (_, op), row in counter.table().items()}


def rank_try_ring_step(ring_step, B: int = 2, H: int = 3, seq_len: int = 16, D: int = 8) -> list[dict]:
    """Run `ring_step` cp times on every rank (contiguous split, causal; cp = the world size): the K/V each step
    passes on, and the final output and lse vs SDPA and logsumexp of the whole sequence. Returns records."""
    rec = RankRecords("10-ring-step", rtol=0)
    dev = cdist.device()
    cp, r = dist.get_world_size(), dist.get_rank()
    n = seq_len // cp
    q, k, v = (t.to(dev) for t in _qkv(B, H, seq_len, D, seed=3))
    mine = slice(r * n, (r + 1) * n)
    try:
        kv = torch.stack([k[..., mine, :], v[..., mine, :]]).contiguous()          # (2, B, H, n, D)
        out = torch.zeros(B, H, n, D, device=dev)
        lse = torch.full((B, H, n), float("-inf"), device=dev)
        for t in range(cp):
            src = (r - t) % cp
            out, lse, kv = ring_step(q[..., mine, :].contiguous(), kv, out, lse, r * n, src * n, None)
            nxt = (src - 1) % cp                                                   # the chunk that came from the left
            want = torch.stack([k[..., nxt * n:(nxt + 1) * n, :], v[..., nxt * n:(nxt + 1) * n, :]])
            rec.add("close", f"after step {t}: the K/V received is rank {nxt}'s",
                    (kv - want).abs().max().item() if kv.shape == want.shape else float("inf"), 0.0,
                    "send what you hold to rank r+1 and receive from rank r-1, both in one batch_isend_irecv")
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., mine, :]
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        s = s.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        rec.add("close", f"after {cp} steps: max |output - SDPA over the whole sequence|",
                (out - ref).abs().max().item(), 0.0,
                "attend with the right positions (q_start, kv_start), skip chunks wholly after the queries, mask the "
                "diagonal one, and merge by log-sum-exp")
        rec.add("close", f"after {cp} steps: max |lse - logsumexp of the causal scores|",
                (lse - torch.logsumexp(s, -1)[..., mine]).abs().max().item(), 0.0,
                "return the merged lse with the output")
    except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check
        rec.error(exc)
    return rec.items


def rank_try_ulysses(seq_to_heads, heads_to_seq, B: int = 2, seq_len: int = 8, H: int = 4, D: int = 3) -> list[dict]:
    """(B, s/cp, H, D) -> (B, s, H/cp, D) and back on every rank (contiguous split): each result vs slicing the full
    tensor, one all_to_all_single per call and no other collective. Returns records."""
    rec = RankRecords("10-ulysses-reshape", rtol=0)
    dev = cdist.device()
    cp, r = dist.get_world_size(), dist.get_rank()
    n, h = seq_len // cp, H // cp
    x = torch.randn(B, seq_len, H, D, generator=torch.Generator().manual_seed(4)).to(dev)
    try:
        x_r = x[:, r * n:(r + 1) * n].contiguous()
        for name, fn, arg, want in (("seq_to_heads", seq_to_heads, x_r, x[:, :, r * h:(r + 1) * h]),
                                    ("heads_to_seq", heads_to_seq, x[:, :, r * h:(r + 1) * h].contiguous(), x_r)):
            counter = CollectiveCounter()
            with counter:
                y = fn(arg, None)
            rec.add("equal", f"{name}: output shape", list(y.shape), list(want.shape),
                    "sequence-sharded (B, s/cp, H, D) <-> head-sharded (B, s, H/cp, D)")
            rec.add("close", f"{name}: max |output - the slice of the full tensor|", (y - want).abs().max().item(),
                    0.0, "part j of what you send goes to rank j: order the parts along dim 0 before all_to_all_single, "
                         "and put what you receive back in rank order")
            rec.add("equal", f"{name}: collectives called", _ops(counter), {"all_to_all_single": 1},
                    "one dist.all_to_all_single, nothing else")
        back = heads_to_seq(seq_to_heads(x_r, None), None)
        rec.add("close", "heads_to_seq(seq_to_heads(x)) == x", (back - x_r).abs().max().item(), 0.0,
                "the two are inverse permutations")
    except Exception as exc:  # noqa: BLE001
        rec.error(exc)
    return rec.items


def check_records(returns: list, exercise: str) -> int:
    """Every rank's records of `exercise` as check_* calls (`rank_records.replay_records`: the first failure raises
    `CheckFailed`); the number of checks that passed."""
    return replay_records(returns, exercise)
