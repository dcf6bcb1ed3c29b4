"""What the graded exercises of lesson 10 call (solutions/10_context_parallel.ipynb).

The learner writes, with the signatures below:

    merge_lse(out_a, lse_a, out_b, lse_b) -> (out, lse)                           10-merge-lse (one process)
    balanced_chunks(cp, rank) -> [i, j];  step_masks(cp, rank, step) -> [[kind]]   10-balanced-split (one process)
    ring_step(q, kv, out, lse, q_start, kv_start, group=None) -> (out, lse, kv)   10-ring-step (3 gloo ranks)
    seq_to_heads(x, group=None), heads_to_seq(y, group=None)                      10-ulysses-reshape (3 gloo ranks)
    document_mask(q_pos, k_pos, doc_lens) -> bool (nq, nk);
    document_rows(doc_lens, cp, rank) -> [positions]                              10-document-mask (one process)

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
from torch.utils.flop_counter import FlopCounterMode

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.lessons.rank_records import RankRecords, replay_records
from course_lib.parallel import context_documents
from course_lib.parallel.block_attention import attend_block

__all__ = ["check_merge_lse", "check_balanced_split", "check_document_mask", "check_document_rows",
           "rank_try_ring_step", "rank_try_ulysses", "check_records", "MASK_KINDS"]

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
                        rtol=0, hint="each block's output counts as much as its share of the whole row's softmax "
                                     "denominator, which its lse records (section 3)")
            ref_lse = torch.logsumexp(s, -1)
            check_close(f"merge_lse, {name}, {order}: max |lse - logsumexp over all keys| / max(1, |logsumexp|)",
                        ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1)).max().item(), 0.0, atol=ATOL, rtol=0,
                        hint="the merged lse is the log of the whole row's denominator; see torch.logaddexp")
            rows.append(dict(case=name, order=order, max_err=err))
    return rows


# ------------------------------------------------------------------------------ 10-balanced-split

def _kind(qc: int, kc: int) -> str:
    """The causal mask of query chunk qc against key chunk kc: before, the diagonal, after."""
    return "full" if kc < qc else "causal" if kc == qc else "skip"


def check_balanced_split(balanced_chunks, step_masks, cps=(1, 2, 3, 4)) -> dict:
    """For cp in `cps`: the split's rules (two of the 2cp chunks per rank, every chunk held by exactly one rank),
    the work it implies (every rank computes the same number of chunk pairs over the ring: a query chunk needs the
    key chunks up to its own, a causal one counts 1; `theory.context.causal_work_per_rank`), then every ring step's
    masks against the learner's own chunks (rows and columns in the order `balanced_chunks` returns them).

    Any split that satisfies the rules passes: ``[r, 2cp-1-r]``, its reverse, or the pairs given to the ranks in
    another order. Returns {cp: [chunk pairs computed per rank]}."""
    work = {}
    for cp in cps:
        chunks = []
        for r in range(cp):
            got = [int(c) for c in balanced_chunks(cp, r)]
            check_equal(f"balanced_chunks(cp={cp}, rank={r}): number of chunks", len(got), 2,
                        hint="the sequence is cut into 2cp equal chunks and every rank holds two of them")
            chunks.append(got)
        check_equal(f"balanced_chunks(cp={cp}) over every rank, sorted: each of the 2cp chunks held once",
                    sorted(c for pair in chunks for c in pair), list(range(2 * cp)),
                    hint="chunks are numbered from 0 to 2cp - 1, and no two ranks hold the same one")
        needs = [sum(c + 1 for c in pair) for pair in chunks]             # key chunks at or before each query chunk
        check_equal(f"balanced_chunks(cp={cp}): chunk pairs each rank must compute (ranks {chunks})", needs,
                    [2 * cp + 1] * cp,
                    hint="with the causal mask a late query chunk needs many key chunks and an early one few: pair "
                         "them so that every rank needs the same number")
        work[cp] = []
        for r in range(cp):
            pairs = 0
            for t in range(cp):
                src = (r - t) % cp
                masks = step_masks(cp, r, t)
                check_equal(f"step_masks(cp={cp}, rank={r}, step={t}) (rows: my chunks {chunks[r]}, columns: the "
                            f"chunks {chunks[src]} of rank {src}'s K/V)", [list(m) for m in masks],
                            [[_kind(qc, kc) for kc in chunks[src]] for qc in chunks[r]],
                            hint="the columns are the chunks of the rank named in this line; compare each query "
                                 "chunk's position with each key chunk's (the exercise's three kinds)")
                pairs += sum(m != "skip" for row in masks for m in row)
            work[cp].append(pairs)
        check_equal(f"chunk pairs computed per rank, cp={cp}", work[cp], [2 * cp + 1] * cp,
                    hint="balanced: every rank computes the same number of chunk pairs; count each step's")
    return work


# ------------------------------------------------------------------------------ 10-document-mask

def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, doc_lens: list[int]) -> torch.Tensor:
    """(nq, nk): True where the query may see the key: the same document, the key at or before the query."""
    return context_documents.document_mask(q_pos, k_pos, context_documents.document_ids(doc_lens))


DOCUMENT_MASK_CASES = (
    ("one document of 8 (the plain causal mask)", [8], list(range(8)), list(range(8))),
    ("documents [3, 5, 4], rows and keys in order", [3, 5, 4], list(range(12)), list(range(12))),
    ("documents [4, 8, 4], this rank's rows 13, 1, 8, 6, 7 (not in order), every key in gathered order",
     [4, 8, 4], [13, 1, 8, 6, 7], [0, 1, 6, 7, 8, 13, 2, 3, 4, 5, 9, 10, 11, 12, 14, 15]),
    ("documents of 1, 1, 2, 1, 3 tokens, keys reversed", [1, 1, 2, 1, 3], list(range(8)), list(range(7, -1, -1))),
)


def check_document_mask(document_mask) -> int:
    """The learner's ``document_mask(q_pos, k_pos, doc_lens)`` against the rule (the same document, key position at
    or before the query's) on `DOCUMENT_MASK_CASES`: shape (nq, nk), dtype bool, then every entry; a wrong entry is
    reported with both positions and their documents. Returns the number of entries checked."""
    checked = 0
    for name, doc_lens, q, k in DOCUMENT_MASK_CASES:
        q_pos, k_pos = torch.tensor(q), torch.tensor(k)
        got = document_mask(q_pos.clone(), k_pos.clone(), list(doc_lens))
        check_true(f"document_mask, {name}: returns a torch.Tensor", isinstance(got, torch.Tensor),
                   hint="return a (len(q_pos), len(k_pos)) bool tensor")
        check_equal(f"document_mask, {name}: shape (queries, keys)", list(got.shape), [len(q), len(k)],
                    hint="one row per query position, one column per key position, in the order given")
        check_equal(f"document_mask, {name}: dtype", str(got.dtype), str(torch.bool),
                    hint="True = may attend (the boolean attn_mask of scaled_dot_product_attention), not an "
                         "additive 0 / -inf float mask")
        want = _allowed(q_pos, k_pos, doc_lens)
        wrong = (got != want).nonzero()
        if len(wrong):
            i, j = wrong[0].tolist()
            ids = context_documents.document_ids(doc_lens)
            dq, dk = ids[q[i]].item(), ids[k[j]].item()
            why = ("the same document, the key at or before the query" if want[i, j] else
                   "another document" if dq != dk else "the key comes after the query")
            check_equal(f"document_mask, {name}: query at position {q[i]} (document {dq}), key at position "
                        f"{k[j]} (document {dk}) [row {i}, column {j}]", bool(got[i, j]), bool(want[i, j]),
                        hint=f"expected {bool(want[i, j])}: {why}; positions are global (0 .. s-1) and a "
                             "document runs from the sum of the lengths before it")
        checked += want.numel()
    return checked


DOCUMENT_ROW_CASES = ((1, [6, 2]), (2, [4, 12, 8]), (2, [20, 4]), (3, [6, 18, 12]), (4, [8, 32, 8, 16]))


def check_document_rows(document_rows, cases=DOCUMENT_ROW_CASES) -> dict:
    """The rules (every rank holds s/cp positions, each of 0 .. s-1 exactly once) and the goal (every rank's
    queries have the same number of visible pairs under the document mask) for each (cp, document lengths) case;
    every length a multiple of 2cp. Any assignment that meets them passes. Returns {case: work per rank}."""
    out = {}
    for cp, doc_lens in cases:
        s = sum(doc_lens)
        where = f"document_rows(doc_lens={doc_lens}, cp={cp}"
        ranks = []
        for r in range(cp):
            got = [int(x) for x in document_rows(list(doc_lens), cp, r)]
            check_equal(f"{where}, rank={r}): number of positions", len(got), s // cp,
                        hint="every rank holds the same number of tokens, s / cp")
            ranks.append(got)
        check_equal(f"{where}) over every rank, sorted: each position 0 .. {s - 1} held once",
                    sorted(x for rows in ranks for x in rows), list(range(s)),
                    hint="positions are global: a document's tokens start at the sum of the lengths before it")
        work = [context_documents.visible_pairs(torch.tensor(rows), doc_lens) for rows in ranks]
        check_equal(f"{where}): visible (query, key) pairs per rank (ranks' positions {ranks})", work,
                    [sum(work) // cp] * cp,
                    hint="inside one document a late token sees more keys than an early one, and a long "
                         "document holds more work than a short one: balance within every document")
        out[(cp, tuple(doc_lens))] = work
    return out


# ------------------------------------------------------------------------------ ranks

def _ops(counter: CollectiveCounter) -> dict:
    return {op: row["calls"] for (_, op), row in counter.table().items()}


def _ring(rec: RankRecords, ring_step, group, where: str, B: int, H: int, seq_len: int, D: int) -> None:
    """cp steps of `ring_step` on this rank of `group` (contiguous split, causal): the K/V received at each step,
    the matmul FLOPs of a step whose chunk lies wholly after the queries (skipped: none), the output and lse."""
    dev = cdist.device()
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    n = seq_len // cp
    q, k, v = (t.to(dev) for t in _qkv(B, H, seq_len, D, seed=3 + cp))
    mine = slice(r * n, (r + 1) * n)
    kv = torch.stack([k[..., mine, :], v[..., mine, :]]).contiguous()          # (2, B, H, n, D)
    out = torch.zeros(B, H, n, D, device=dev)
    lse = torch.full((B, H, n), float("-inf"), device=dev)
    for t in range(cp):
        src = (r - t) % cp
        counter = FlopCounterMode(display=False)
        with counter:
            out, lse, kv = ring_step(q[..., mine, :].contiguous(), kv, out, lse, r * n, src * n, group)
        if src > r:                                                            # every key after every query
            rec.add("equal", f"{where}step {t}: attention computed on a chunk wholly after the queries (matmul "
                             f"FLOPs, chunk of member {src})", counter.get_total_flops(), 0,
                    "a chunk whose first key comes after the last query contributes nothing: skip it, do not mask it")
        nxt = (src - 1) % cp                                                   # the chunk that came from the left
        want = torch.stack([k[..., nxt * n:(nxt + 1) * n, :], v[..., nxt * n:(nxt + 1) * n, :]])
        rec.add("close", f"{where}after step {t}: the K/V received is member {nxt}'s",
                (kv - want).abs().max().item() if kv.shape == want.shape else float("inf"), 0.0,
                "send what you hold to the next member of the ring (r+1) and receive from the previous one (r-1), "
                "both in one batch_isend_irecv")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., mine, :]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    rec.add("close", f"{where}after {cp} steps: max |output - SDPA over the whole sequence|",
            (out - ref).abs().max().item(), 0.0,
            "attend with the right positions (q_start, kv_start), skip chunks wholly after the queries, mask the "
            "diagonal one, and merge by log-sum-exp")
    rec.add("close", f"{where}after {cp} steps: max |lse - logsumexp of the causal scores|",
            (lse - torch.logsumexp(s, -1)[..., mine]).abs().max().item(), 0.0,
            "return the merged lse with the output")


def rank_try_ring_step(ring_step, B: int = 2, H: int = 2, seq_len: int = 18, D: int = 8) -> list[dict]:
    """Run `ring_step` cp times on every rank (contiguous split, causal), on a ring of the whole world (cp = the
    world size, 3 in the test: the left and right neighbours differ) and, with 3 ranks or more, on a ring of
    ranks 1 and 2 passed as `group` (ring members are not global ranks there). Each: the K/V every step passes on,
    no work on a chunk wholly after the queries, the final output and lse vs SDPA and logsumexp of the whole
    sequence. Returns records."""
    rec = RankRecords("10-ring-step", rtol=0)
    world = dist.get_world_size()
    pair = dist.new_group([1, 2]) if world >= 3 else None                     # every rank calls new_group
    ok = torch.ones(1, device=cdist.device())
    try:
        _ring(rec, ring_step, None, f"ring of {world}, ", B, H, seq_len, D)
    except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check
        rec.error(exc)
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)                                 # the group's ring only if all passed
    if ok.item() and pair is not None and dist.get_rank() in (1, 2):
        try:
            _ring(rec, ring_step, pair, "ring of ranks [1, 2] as group, ", B, H, seq_len, D)
        except Exception as exc:  # noqa: BLE001
            rec.error(exc)
    return rec.items


def rank_try_ulysses(seq_to_heads, heads_to_seq, B: int = 4, seq_len: int = 15, H: int = 6,
                     D: int = 7) -> list[dict]:
    """(B, s/cp, H, D) -> (B, s, H/cp, D) and back on every rank (contiguous split): each result vs slicing the full
    tensor, one all_to_all_single per call and no other collective. The test's sizes on 3 ranks (B 4, s/cp 5,
    H/cp 2, cp 3, D 7) are all different, so no mix-up of two axes of equal size goes unseen. Returns records."""
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
                    0.0, "part j of what you send goes to rank j: order the parts along dim 0 before "
                         "all_to_all_single, and put what you receive back in rank order")
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
