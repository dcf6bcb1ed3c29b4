"""Lesson 10's packed-document experiments: all-gather context parallelism under the document mask, three ways to
give ranks their rows (contiguous, head-tail, per-document head-tail; `course_lib.parallel.context_documents`).

- :func:`document_step`: on every rank, one forward and backward of the GPT under one balancer: global loss,
  gradients, bytes per layer, visible pairs counted by the layer and from the rows.
- :func:`rank_documents`: every balancer the documents allow.
- :func:`rank_document_times`: per balancer, one rank's attention forward timed with the dense document mask and
  one document at a time (`per_document_attention`, as a kernel given the documents' boundaries computes it).
- :func:`document_reference`: one process, the plain GPT with the (s, s) document mask: what every rank must equal.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.model import build_model, lm_loss
from course_lib.one_process import grads_of
from course_lib.parallel.context import context_parallel_loss, sync_context_parallel_grads
from course_lib.parallel.context_attention import cp_rank
from course_lib.parallel.context_documents import (BALANCERS, apply_document_context_parallel, document_ids,
                                                   document_mask, document_reference_loss, document_work_per_rank,
                                                   rank_rows, split_rows, validate_documents, visible_pairs)

__all__ = ["document_step", "rank_documents", "per_document_attention", "rank_document_times", "document_reference",
           "usable_balancers"]


def usable_balancers(doc_lens: list[int], cp: int) -> list[str]:
    """The balancers that can split these documents over cp ranks (per-document needs 2cp | every length)."""
    ok = []
    for b in BALANCERS:
        try:
            validate_documents(doc_lens, sum(doc_lens), cp, b)
            ok.append(b)
        except ValueError:
            pass
    return ok


def document_step(cfg, batch, doc_lens: list[int], balancer: str, group=None) -> dict:
    """One forward and backward on this rank: {"loss": global mean (nats), "grads": {name: (cp-averaged) grad},
    "comm": [per layer {"phase/op": {"calls", "bytes"}}], "work": [per layer B x H x visible pairs],
    "pairs": visible pairs of this rank's queries counted from its rows (one sequence, one head)}."""
    cp, r = cp_rank(group)
    dev = cdist.device()
    model = apply_document_context_parallel(build_model(cfg, 0).to(dev), group, doc_lens, balancer)
    rows = rank_rows(doc_lens, cp, r, balancer)                       # (s/cp,)
    x, y = (split_rows(t.to(dev), rows) for t in batch)               # (B, s) -> (B, s/cp)
    loss = lm_loss(model(x), y)                                       # this rank's mean over its B s/cp tokens
    loss.backward()
    sync_context_parallel_grads(model, group)
    return dict(loss=context_parallel_loss(loss, group), grads=grads_of(model),
                comm=[{f"{ph}/{op}": v for (ph, op), v in b.attn.counter.table().items()} for b in model.blocks],
                work=[b.attn.counter.work for b in model.blocks],
                pairs=document_work_per_rank(doc_lens, cp, balancer)[r])


def rank_documents(cfg, batch, doc_lens: list[int], balancers=None) -> dict:
    """On every rank of a cp launch (cp = the world size): {balancer: `document_step`} for each balancer (default:
    every one the documents allow, `usable_balancers`)."""
    cp, _ = cp_rank()
    return {b: document_step(cfg, batch, doc_lens, b) for b in balancers or usable_balancers(doc_lens, cp)}


@torch.no_grad()
def per_document_attention(q, keys, values, q_pos, k_pos, doc_lens: list[int]) -> tuple[torch.Tensor, int]:
    """The document mask computed one document at a time, as a kernel given the documents' boundaries does
    (FlashAttention's variable-length kernels take them as ``cu_seqlens``): for each document, this rank's queries
    in it against that document's keys only, the causal mask by position inside. q (B, H, n, D), keys and values
    (B, H, s, D) with positions q_pos (n,), k_pos (s,) -> (out (B, H, n, D), scores computed per head: the sum over
    documents of (this rank's queries in it) x (its length))."""
    ids = document_ids(doc_lens).to(q.device)
    out, scores = torch.empty_like(q), 0
    dq, dk = ids[q_pos], ids[k_pos]
    for d in range(len(doc_lens)):
        qi, ki = (dq == d).nonzero().squeeze(1), (dk == d).nonzero().squeeze(1)
        if len(qi) == 0:
            continue
        mask = k_pos[ki][None, :] <= q_pos[qi][:, None]               # (n_d, L_d) causal inside the document
        out[:, :, qi] = F.scaled_dot_product_attention(q[:, :, qi], keys[:, :, ki], values[:, :, ki], attn_mask=mask)
        scores += len(qi) * len(ki)
    return out, scores


def rank_document_times(doc_lens: list[int], batch: int = 1, n_head: int = 4, head_dim: int = 16, repeats: int = 3,
                        balancers=None) -> dict:
    """On every rank (each with a core or a GPU of its own): per balancer, this rank's attention forward over its
    rows with random q and gathered K/V (B, H, s, D), timed (fastest of `repeats`, a barrier before each) two ways:
    the dense (n, s) document mask in one SDPA call (every score computed, the masked ones too) and
    `per_document_attention` (each document on its own). Returns {balancer: {"dense_s", "per_document_s",
    "scores": per-document scores per head, "pairs": visible pairs, "max_diff": |per-document - dense|}},
    "hardware"}."""
    from course_lib.measure.hardware import hardware_label

    cp, r = cp_rank()
    dev = cdist.device()
    s = sum(doc_lens)
    g = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(batch, n_head, s, head_dim, generator=g).to(dev) for _ in range(2))   # (B, H, s, D)
    k_pos, ids = torch.arange(s, device=dev), document_ids(doc_lens).to(dev)
    out = {}
    for b in balancers or usable_balancers(doc_lens, cp):
        q_pos = rank_rows(doc_lens, cp, r, b).to(dev)                 # (n,)
        q = torch.randn(batch, n_head, len(q_pos), head_dim, generator=g).to(dev)
        mask = document_mask(q_pos, k_pos, ids)                       # (n, s)
        dense = lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)   # noqa: E731
        split = lambda: per_document_attention(q, keys, values, q_pos, k_pos, doc_lens)   # noqa: E731
        per_document, scores = split()
        row = dict(max_diff=(per_document - dense()).abs().max().item(), scores=scores,
                   pairs=visible_pairs(q_pos.cpu(), doc_lens))
        for name, fn in (("dense_s", dense), ("per_document_s", split)):
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)                       # the kernels, not their launch
                best = min(best, time.perf_counter() - t0)
            row[name] = best
        out[b] = row
    return dict(balancers=out, hardware=hardware_label(cdist.backend(), dev))


def document_reference(cfg, batch, doc_lens: list[int]) -> dict:
    """One process: {"loss": mean loss (nats), "grads": {name: grad}} of the plain GPT under the document mask."""
    model = build_model(cfg, 0)
    loss = document_reference_loss(model, *batch, doc_lens)
    loss.backward()
    return dict(loss=loss.item(), grads=grads_of(model))
