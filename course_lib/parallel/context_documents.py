"""All-gather context parallelism of packed documents under the document mask, per-document balancing (lesson 10).

Pre-training packs several documents into one sequence; with the *document mask* a token attends only to the
earlier tokens of its own document. Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2) chose
all-gather context parallelism because "it is easier and more flexible to support different types of attention
masks in all-gather based CP attention, such as the document mask": once a rank holds every key and value
(`context_attention._AllGatherKV`: all-gather forward, reduce-scatter of dK/dV backward), the mask is any (n, s)
boolean matrix of its queries' and the keys' global positions.

    model = build_model(cfg, seed=0)                                       # the same weights on every rank
    apply_document_context_parallel(model, group, doc_lens, "per_document")   # attention and positions swapped
    rows = rank_rows(doc_lens, cp, rank, "per_document")                   # (s/cp,) this rank's global positions
    loss = model.loss(split_rows(idx, rows), split_rows(targets, rows))    # (B, s) -> (B, s/cp)
    loss.backward(); sync_context_parallel_grads(model, group)            # every gradient = one process's

**Which rows a rank holds** (`rank_rows`, balancer): ``"contiguous"`` (rank r: rows r n .. (r+1) n - 1, n = s/cp),
``"head_tail"`` (the whole sequence in 2cp chunks, rank r holds chunks r and 2cp-1-r: `context.chunk_layout`'s
"balanced", PyTorch's ``_HeadTailLoadBalancer``) and ``"per_document"`` (PyTorch's
``_PerDocumentHeadTailLoadBalancer``: *every document* in 2cp chunks, rank r holds chunks r and 2cp-1-r of each,
documents in order). Head-tail evens the plain causal mask's work; under the document mask, of these three, only the
per-document split gives every rank the same visible pairs, L (L + 1) / 2cp per document
(`course_lib.theory.documents`).

**Positions.** The GPT's learned positions are the packed sequence's (0 .. s-1, not reset per document), so the
one-process reference is the plain GPT with the (s, s) document mask (`document_reference_loss`); a rank's rows map
to their global positions through `DocumentPositions`. Dropout must be 0.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.context import ContextParallelAttention, sequence_positions
from course_lib.parallel.context_attention import _AllGatherKV, cp_rank
from course_lib.reference import reference_for

__all__ = ["BALANCERS", "document_ids", "validate_documents", "rank_rows", "document_mask", "visible_pairs",
           "document_work_per_rank",
           "document_all_gather_attention", "DocumentPositions", "DocumentAttention",
           "apply_document_context_parallel", "split_rows", "document_reference_loss"]

BALANCERS = ("contiguous", "head_tail", "per_document")


def document_ids(doc_lens: list[int]) -> torch.Tensor:
    """The document index of every position of the packed sequence: (s,) int64, e.g. [2, 3] -> [0, 0, 1, 1, 1]."""
    return torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens, dtype=torch.long))


def validate_documents(doc_lens, seq_len: int, cp: int, balancer: str = "per_document") -> None:
    """Raise ValueError naming the field and the fix when cp ranks cannot split these documents (lesson 10)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive int (the number of context-parallel ranks)")
    if balancer not in BALANCERS:
        raise ValueError(f"balancer={balancer!r}: use one of {', '.join(map(repr, BALANCERS))}")
    if not isinstance(doc_lens, (list, tuple)) or not doc_lens:
        raise ValueError(f"doc_lens={doc_lens!r} must be a non-empty list of document lengths (tokens)")
    bad = [(i, L) for i, L in enumerate(doc_lens) if isinstance(L, bool) or not isinstance(L, int) or L < 1]
    if bad:
        raise ValueError(f"doc_lens[{bad[0][0]}]={bad[0][1]!r} must be a positive int (a document's tokens): "
                         f"drop empty documents")
    if sum(doc_lens) != seq_len:
        raise ValueError(f"doc_lens sum to {sum(doc_lens)} tokens but seq_len={seq_len}: pack documents to fill the "
                         f"sequence exactly (end with a padding document of the tokens left)")
    chunks = cp if balancer == "contiguous" else 2 * cp
    if balancer != "per_document" and seq_len % chunks:
        raise ValueError(f"seq_len={seq_len} is not divisible by {'cp' if chunks == cp else '2*cp'}={chunks} (the "
                         f"{balancer} split cuts the sequence into {chunks} equal chunks): use seq_len a multiple "
                         f"of {chunks}")
    bad = [(i, L) for i, L in enumerate(doc_lens) if L % (2 * cp)]
    if balancer == "per_document" and bad:
        i, L = bad[0]
        raise ValueError(f"doc_lens[{i}]={L} is not divisible by 2*cp={2 * cp} (balancer='per_document' cuts every "
                         f"document into 2cp equal chunks): pad it to {L + (-L) % (2 * cp)} tokens, or use "
                         f"balancer='head_tail'")


@reference_for("10-document-mask")
def rank_rows(doc_lens: list[int], cp: int, rank: int, balancer: str = "per_document") -> torch.Tensor:
    """Global positions of the rows rank `rank` holds, in its row order: (s/cp,) int64."""
    s = sum(doc_lens)
    validate_documents(list(doc_lens), s, cp, balancer)
    if balancer != "per_document":
        return sequence_positions(s, cp, rank, "contiguous" if balancer == "contiguous" else "balanced")
    rows, start = [], 0
    for L in doc_lens:
        c = L // (2 * cp)                                             # chunk length of this document
        for j in (rank, 2 * cp - 1 - rank):                           # head chunk, then tail chunk
            rows.append(torch.arange(start + j * c, start + (j + 1) * c))
        start += L
    return torch.cat(rows)                                            # 2 x sum_d L_d / 2cp = s/cp rows


@reference_for("10-document-mask")
def document_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """True where query i may see key j: the same document and k_pos[j] <= q_pos[i]. (nq,), (nk,) -> (nq, nk)."""
    same = doc_ids[q_pos].unsqueeze(1) == doc_ids[k_pos].unsqueeze(0)  # (nq, 1) == (1, nk) -> (nq, nk)
    return same & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))


def visible_pairs(rows: torch.Tensor, doc_lens: list[int]) -> int:
    """Visible (query, key) pairs of these query rows (global positions) under the document mask, one sequence, one
    head: the query at offset p of its document sees p + 1 keys."""
    ids = document_ids(doc_lens)                                      # (s,)
    starts = torch.tensor(doc_lens).cumsum(0) - torch.tensor(doc_lens)   # (m,) first position of each document
    return int((rows - starts[ids[rows]] + 1).sum())


def document_work_per_rank(doc_lens: list[int], cp: int, balancer: str = "per_document") -> list[int]:
    """`visible_pairs` of each rank's rows: the attention work of its queries under the document mask."""
    return [visible_pairs(rank_rows(doc_lens, cp, r, balancer), doc_lens) for r in range(cp)]


def document_all_gather_attention(q, k, v, group, rows_of_ranks: list[torch.Tensor], doc_ids: torch.Tensor,
                                  counter=None) -> torch.Tensor:
    """Llama 3's all-gather CP under the document mask: (B, H, n, D) of this rank's rows -> (B, H, n, D).

    `rows_of_ranks[j]` is rank j's global positions (`rank_rows`); `doc_ids` (s,) from `document_ids`. K/V of every
    rank are gathered in rank order, so the keys' positions are ``cat(rows_of_ranks)`` and the mask is built
    against that order (no reordering). ``counter`` records the bytes and, as work, the visible pairs x B x H."""
    cp, r = cp_rank(group)
    if cp == 1:
        keys, values = k, v                                           # (B, H, s, D)
    else:
        kv = _AllGatherKV.apply(k, v, group, counter)                 # (2, B, H, s, D): rank j's rows at j n ..
        keys, values = kv[0], kv[1]                                   # 2 x (B, H, s, D)
    q_pos = rows_of_ranks[r].to(q.device)                             # (n,)
    k_pos = torch.cat(rows_of_ranks).to(q.device)                     # (s,) positions of the gathered rows
    mask = document_mask(q_pos, k_pos, doc_ids.to(q.device))          # (n, s), every row sees at least itself
    if counter is not None:
        counter.add_work(q.shape[0] * q.shape[1] * int(mask.sum()))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)   # (B, H, n, D)


class DocumentPositions(nn.Module):
    """``model.pos_emb`` for a rank holding rows `rows` (global positions) of the sequence: the GPT asks for
    ``arange(n)``; local row i gets the embedding of position rows[i]. Holds the original weight (same name)."""

    def __init__(self, emb: nn.Embedding, rows: torch.Tensor):
        super().__init__()
        self.weight = emb.weight                                      # (T_max, C), shared
        self.register_buffer("rows", rows.clone(), persistent=False)  # (n,) moves with the model, not in state_dict

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.rows[pos], self.weight)               # (n,) -> (n, C)


class DocumentAttention(ContextParallelAttention):
    """A block's attention done by `document_all_gather_attention` across the cp ranks; same parameters as the
    plain attention it replaces; ``counter`` holds this layer's bytes and visible pairs."""

    def __init__(self, attn, group, rows_of_ranks: list[torch.Tensor], doc_ids: torch.Tensor, balancer: str):
        super().__init__(attn, group, variant="all_gather")
        self.split = None                                             # rows come from the balancer, not a split
        self.balancer, self.rows_of_ranks, self.doc_ids = balancer, rows_of_ranks, doc_ids

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (B, H, n, D) of this rank's rows -> (B, H, n, D), over its documents' earlier tokens."""
        _, r = cp_rank(self.group)
        if q.shape[2] != len(self.rows_of_ranks[r]):
            raise ValueError(f"this rank holds {len(self.rows_of_ranks[r])} rows but the input has {q.shape[2]}: "
                             f"pass split_rows(idx, rank_rows(doc_lens, cp, rank, {self.balancer!r}))")
        return document_all_gather_attention(q, k, v, self.group, self.rows_of_ranks, self.doc_ids, self.counter)


def apply_document_context_parallel(model: nn.Module, group=None, doc_lens=None, balancer: str = "per_document"):
    """Make a plain GPT all-gather context-parallel over `group` under the document mask of `doc_lens` (which must
    fill cfg.seq_len), in place; returns it. Feed it ``split_rows(idx, rank_rows(doc_lens, cp, rank, balancer))``."""
    cfg = model.cfg
    cp, r = cp_rank(group)
    validate_documents(doc_lens, cfg.seq_len, cp, balancer)
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: context parallelism here needs dropout=0 (no RNG tracking)")
    rows_of_ranks = [rank_rows(doc_lens, cp, j, balancer) for j in range(cp)]    # cp x (s/cp,)
    ids = document_ids(doc_lens)                                                  # (s,)
    for block in model.blocks:
        block.attn = DocumentAttention(block.attn, group, rows_of_ranks, ids, balancer)
    model.pos_emb = DocumentPositions(model.pos_emb, rows_of_ranks[r]).to(model.pos_emb.weight.device)
    return model


def split_rows(x: torch.Tensor, rows: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's rows of `x` (the same full x on every rank) along `dim`: (B, s, ...) -> (B, s/cp, ...)."""
    return x.index_select(dim, rows.to(x.device))


def document_reference_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, doc_lens) -> torch.Tensor:
    """One process: the plain GPT's mean loss on idx, targets (B, s) with every block's attention under the (s, s)
    document mask (SDPA with ``attn_mask``); the model is left as it was (backward through the loss still works)."""
    s = idx.shape[1]
    validate_documents(doc_lens, s, 1, "contiguous")
    pos = torch.arange(s, device=idx.device)                          # (s,)
    mask = document_mask(pos, pos, document_ids(doc_lens).to(idx.device))   # (s, s)

    def attend(q, k, v):                                              # (B, H, s, D) -> (B, H, s, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    for block in model.blocks:
        block.attn.attend = attend                                    # an instance attribute hides the method
    try:
        return model.loss(idx, targets)
    finally:
        for block in model.blocks:
            del block.attn.attend
