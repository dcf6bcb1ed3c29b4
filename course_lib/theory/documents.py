"""Attention work of packed documents under the document mask, per context-parallel rank (lesson 10).

A packed sequence of s tokens holds documents of lengths L_1, ..., L_m (sum L = s). Under the document mask a query
sees only the keys of its own document at or before it: the query at offset p of its document (p = 0 .. L-1) has
p + 1 visible (query, key) pairs, a document L (L + 1) / 2, the sequence

    pairs = sum_d L_d (L_d + 1) / 2        (<= s (s + 1) / 2, the plain causal mask's; equal with one document)

**Per-document head-tail balancing** (PyTorch's ``_PerDocumentHeadTailLoadBalancer``): each document is cut into
2cp chunks of c = L / 2cp tokens and rank r holds chunks r and 2cp-1-r of every document. Chunk j's queries are
at offsets jc .. jc + c - 1, so it has

    sum_{p=jc}^{jc+c-1} (p + 1) = j c^2 + c (c + 1) / 2

visible pairs, and the two chunks of rank r together

    (r + 2cp - 1 - r) c^2 + c (c + 1) = 2cp c^2 + c = c (L + 1) = L (L + 1) / (2cp)

which does not depend on r: every rank has exactly 1/cp of every document's pairs, so of the whole sequence's,
**pairs / cp on every rank** (an integer: 2cp divides L). The whole sequence's head-tail split (Megatron-LM, Llama 3
section 3.3.2) balances the plain causal mask but not the document mask: a chunk may fall inside a long document
on one rank and across short ones on another. Those splits have no closed form in general; they are counted from
the rows (`course_lib.parallel.context_documents.document_work_per_rank`) and the tests check the formula above
against that count.
"""

from __future__ import annotations

__all__ = ["document_causal_pairs", "causal_pairs", "per_document_work_per_rank"]


def document_causal_pairs(doc_lens: list[int]) -> int:
    """Visible (query, key) pairs of a packed sequence under the document mask: sum L (L + 1) / 2."""
    return sum(L * (L + 1) // 2 for L in doc_lens)


def causal_pairs(seq_len: int) -> int:
    """Visible pairs under the plain causal mask (one document of s tokens): s (s + 1) / 2."""
    return seq_len * (seq_len + 1) // 2


def per_document_work_per_rank(doc_lens: list[int], cp: int) -> list[int]:
    """Visible pairs of each rank's queries under per-document head-tail balancing: sum_d L_d (L_d + 1) / (2cp),
    the same on every rank (see the module docstring). Every L must be divisible by 2cp."""
    bad = [(i, L) for i, L in enumerate(doc_lens) if L % (2 * cp)]
    if bad:
        i, L = bad[0]
        raise ValueError(f"doc_lens[{i}]={L} is not divisible by 2*cp={2 * cp}: per-document head-tail cuts every "
                         f"document into 2cp equal chunks; pad it to {L + (-L) % (2 * cp)} tokens")
    return [sum(L * (L + 1) // (2 * cp) for L in doc_lens)] * cp
