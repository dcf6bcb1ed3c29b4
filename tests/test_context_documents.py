"""Tests of lesson 10's packed documents under all-gather context parallelism
(course_lib/parallel/context_documents.py, course_lib/theory/documents.py, course_lib/lessons/l10_context/documents.py).

One process: document ids; each balancer's rows vs PyTorch's ``_HeadTailLoadBalancer`` and
``_PerDocumentHeadTailLoadBalancer``; the mask vs a written-out loop; visible pairs counted from the rows == counted
from the mask == the closed form (per-document: sum L (L + 1) / 2cp on every rank); validation names field and fix.
One launch per world size (2 and 4 gloo ranks) runs the tiny GPT (s = 48) with document-masked all-gather CP in every
block under every balancer, on documents with and without a 1-token one: loss and every gradient == one process with
the (s, s) document mask (rtol 1e-5, atol 1e-6); bytes per layer == theory.context.layer_comm("all_gather");
three wrong variants (documents ignored, local positions, gathered keys taken as global order) must fail.
"""

from __future__ import annotations

import dataclasses
import sys

import cloudpickle
import pytest
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer, _PerDocumentHeadTailLoadBalancer)

from course_lib import theory
from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.lessons.l10_context.documents import document_reference, usable_balancers
from course_lib.model import build_model
from course_lib.parallel.context_documents import (BALANCERS, apply_document_context_parallel, document_ids,
                                                   document_mask, document_work_per_rank, rank_rows, split_rows,
                                                   validate_documents)
from course_lib.parallel import context_documents as cd
from course_lib.runtime.launch import run
from course_lib.theory import documents as doc_theory

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank functions below travel by value
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dataclasses.replace(get_preset("tiny"), seq_len=48)     # 2 layers, 4 heads, d_model 64, s = 48
BATCH = random_batches(CFG, 2, 1, seed=0)[0]                  # (x, y), each (2, 48)
# per world size: documents every balancer takes (2cp divides each), and ones with a 1-token document
CASES = {2: ([8, 24, 16], [1, 23, 24]), 4: ([16, 8, 24], [1, 7, 40])}
WRONG = ("documents ignored", "local positions", "gathered keys as global order")
DOC_LISTS = [[8, 24, 16], [16, 8, 24], [8] * 6, [48], [24, 8, 8, 8]]


# ------------------------------------------------------------------------------ one process

def test_document_ids():
    assert document_ids([2, 3]).tolist() == [0, 0, 1, 1, 1]
    assert document_ids([1, 1, 2]).tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("doc_lens", DOC_LISTS)
def test_rows_equal_torch_load_balancers(doc_lens, cp):
    s = sum(doc_lens)
    ours = {b: torch.stack([rank_rows(doc_lens, cp, r, b) for r in range(cp)]) for b in BALANCERS}   # (cp, s/cp)
    per_doc = _PerDocumentHeadTailLoadBalancer([doc_lens], cp, "cpu")._generate_indices().reshape(cp, s // cp)
    head_tail = _HeadTailLoadBalancer(s, cp, "cpu")._generate_indices().reshape(cp, s // cp)
    assert ours["per_document"].tolist() == per_doc.tolist()
    assert ours["head_tail"].tolist() == head_tail.tolist()
    assert ours["contiguous"].tolist() == torch.arange(s).view(cp, s // cp).tolist()
    for b, rows in ours.items():
        assert sorted(rows.flatten().tolist()) == list(range(s)), b          # every position on exactly one rank


def test_document_mask_equals_a_loop():
    doc_lens = [3, 1, 4]
    ids = document_ids(doc_lens)
    q_pos, k_pos = torch.tensor([5, 0, 3, 7]), torch.tensor([7, 4, 3, 0, 1, 2, 6, 5])
    mask = document_mask(q_pos, k_pos, ids)                                   # (4, 8)
    loop = [[bool(ids[q] == ids[k] and k <= q) for k in k_pos.tolist()] for q in q_pos.tolist()]
    assert mask.tolist() == loop
    assert document_mask(torch.tensor([3]), torch.tensor([3, 2, 4]), ids).tolist() == [[True, False, False]]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("doc_lens", DOC_LISTS)
def test_work_counted_equals_mask_and_closed_form(doc_lens, cp):
    s, ids = sum(doc_lens), document_ids(doc_lens)
    every = torch.arange(s)
    for b in BALANCERS:
        work = document_work_per_rank(doc_lens, cp, b)
        assert work == [int(document_mask(rank_rows(doc_lens, cp, r, b), every, ids).sum()) for r in range(cp)], b
        assert sum(work) == doc_theory.document_causal_pairs(doc_lens), b
    assert document_work_per_rank(doc_lens, cp) == doc_theory.per_document_work_per_rank(doc_lens, cp)
    pairs = doc_theory.document_causal_pairs(doc_lens)
    assert doc_theory.per_document_work_per_rank(doc_lens, cp) == [pairs // cp] * cp and pairs % cp == 0


def test_only_per_document_balances_documents():
    assert doc_theory.document_causal_pairs([48]) == doc_theory.causal_pairs(48)
    assert document_work_per_rank([48], 4, "head_tail") == [294] * 4                  # one document: head-tail is even
    head_tail = document_work_per_rank([16, 8, 24], 4, "head_tail")
    assert head_tail == [150, 150, 118, 54] and max(head_tail) > 2.5 * min(head_tail)  # documents: it is not
    assert document_work_per_rank([16, 8, 24], 4, "per_document") == [118] * 4


def test_validation_names_field_and_fix():
    validate_documents([8, 24, 16], 48, 4, "per_document")
    with pytest.raises(ValueError, match=r"doc_lens\[0\]=1 is not divisible by 2\*cp=4 .* pad it to 4 tokens, or use "
                                         r"balancer='head_tail'"):
        validate_documents([1, 23, 24], 48, 2, "per_document")
    with pytest.raises(ValueError, match=r"doc_lens\[1\]=0 must be a positive int"):
        validate_documents([48, 0], 48, 2, "contiguous")
    with pytest.raises(ValueError, match=r"doc_lens sum to 40 tokens but seq_len=48: .* padding document"):
        validate_documents([8, 32], 48, 2, "head_tail")
    with pytest.raises(ValueError, match=r"seq_len=44 is not divisible by 2\*cp=8 .* head_tail"):
        validate_documents([44], 44, 4, "head_tail")
    with pytest.raises(ValueError, match=r"balancer='striped'"):
        validate_documents([48], 48, 2, "striped")
    with pytest.raises(ValueError, match=r"cp=0"):
        validate_documents([48], 48, 0)
    with pytest.raises(ValueError, match=r"doc_lens\[2\]=10 is not divisible by 2\*cp=4"):
        doc_theory.per_document_work_per_rank([8, 4, 10], 2)
    assert usable_balancers([1, 23, 24], 2) == ["contiguous", "head_tail"]


@pytest.fixture(scope="module")
def reference():
    """{doc_lens as a tuple: one process's loss and gradients under the document mask}."""
    return {tuple(d): document_reference(CFG, BATCH, d) for case in CASES.values() for d in case}


def test_document_mask_changes_the_loss_and_one_rank_equals_it(reference):
    ref = reference[(8, 24, 16)]
    plain = build_model(CFG, 0).loss(*BATCH).item()
    assert abs(plain - ref["loss"]) > 1e-3                                    # the mask matters: the test can fail
    model = apply_document_context_parallel(build_model(CFG, 0), None, [8, 24, 16], "per_document")   # cp = 1
    rows = rank_rows([8, 24, 16], 1, 0)
    assert model.loss(*(split_rows(t, rows) for t in BATCH)).item() == pytest.approx(ref["loss"], rel=1e-6)


# ------------------------------------------------------------------------------ ranks

def _wrong_step(cfg, batch, doc_lens, wrong):
    """`document_step` under per-document balancing with one mistake patched in."""
    from course_lib.lessons.l10_context.documents import document_step
    from course_lib.parallel import context_documents as cd

    real_mask, real_positions = cd.document_mask, cd.DocumentPositions
    try:
        if wrong == "documents ignored":                                     # the plain causal mask
            cd.document_mask = lambda q, k, ids: k.unsqueeze(0) <= q.unsqueeze(1)
        elif wrong == "local positions":                                     # the GPT's arange(s/cp) embeddings
            cd.DocumentPositions = lambda emb, rows: emb
        else:                                                                # gathered row j taken as position j
            cd.document_mask = lambda q, k, ids: real_mask(q, torch.arange(len(k), device=k.device), ids)
        return document_step(cfg, batch, doc_lens, "per_document")
    finally:
        cd.document_mask, cd.DocumentPositions = real_mask, real_positions


def _all_checks(cfg, batch, cases):
    from course_lib.lessons.l10_context.documents import rank_document_times, rank_documents

    full, short = cases
    return dict(full=rank_documents(cfg, batch, full), short=rank_documents(cfg, batch, short),
                wrong={w: _wrong_step(cfg, batch, full, w) for w in WRONG},
                times=rank_document_times(full, repeats=1))


@pytest.fixture(scope="module")
def ranks():
    """{world size: every rank's results}: one launch per world size."""
    return {n: run(_all_checks, n, args=(CFG, BATCH, CASES[n]), backend="gloo", timeout_s=120, stream=False).returns
            for n in (2, 4)}


def _assert_equal_one_process(row, ref, what):
    assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), what
    assert row["grads"].keys() == ref["grads"].keys(), what
    for k, g in ref["grads"].items():
        torch.testing.assert_close(row["grads"][k], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, grad {k}: {m}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["full", "short"])
def test_equals_one_process(ranks, reference, world, case):
    doc_lens = CASES[world][case == "short"]
    for r, res in enumerate(ranks[world]):
        assert list(res[case]) == usable_balancers(doc_lens, world)
        for b, row in res[case].items():
            _assert_equal_one_process(row, reference[tuple(doc_lens)], f"{doc_lens} {b} rank {r}/{world}")
    assert len(ranks[world][0]["full"]) == 3 and len(ranks[world][0]["short"]) == 2   # no per-document: 1-token doc


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_and_work_equal_formula(ranks, world):
    comm = {f"{ph}/{op}": v for (ph, op), v in
            theory.context.layer_comm("all_gather", BATCH[0].shape[0], CFG.seq_len, CFG.d_model, world).items()}
    B_H = BATCH[0].shape[0] * CFG.n_head
    for case, doc_lens in zip(("full", "short"), CASES[world]):
        for b in usable_balancers(doc_lens, world):
            pairs = [res[case][b]["pairs"] for res in ranks[world]]
            assert pairs == document_work_per_rank(doc_lens, world, b)
            if b == "per_document":
                assert pairs == doc_theory.per_document_work_per_rank(doc_lens, world)
            for r, res in enumerate(ranks[world]):
                row = res[case][b]
                assert row["comm"] == [comm] * CFG.n_layer, f"{case} {b} rank {r}"
                assert row["work"] == [B_H * pairs[r]] * CFG.n_layer, f"{case} {b} rank {r}"


@pytest.mark.parametrize("world", [2, 4])
def test_per_document_kernel_equals_the_dense_mask(ranks, world):
    """The lesson's timed per-document attention computes what the dense (n, s) mask gives, with sum over documents
    of (this rank's queries in it) x (its length) scores per head; its visible pairs are document_work_per_rank's."""
    doc_lens = CASES[world][0]
    ids = cd.document_ids(doc_lens)
    for r, res in enumerate(ranks[world]):
        for b, row in res["times"]["balancers"].items():
            rows = cd.rank_rows(doc_lens, world, r, b)
            assert row["max_diff"] < 1e-5, f"{b} rank {r}"
            assert row["scores"] == sum(int((ids[rows] == d).sum()) * L for d, L in enumerate(doc_lens))
            assert row["pairs"] == document_work_per_rank(doc_lens, world, b)[r]
            assert row["dense_s"] > 0 and row["per_document_s"] > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wrong", WRONG)
def test_wrong_variants_fail(ranks, reference, world, wrong):
    ref = reference[tuple(CASES[world][0])]
    for r, res in enumerate(ranks[world]):
        row = res["wrong"][wrong]
        loss_err = abs(row["loss"] - ref["loss"])
        grad_err = max((row["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
        assert loss_err > 1e-3 or grad_err > 1e-3, f"{wrong} rank {r}: loss error {loss_err}, grad error {grad_err}"
        with pytest.raises(AssertionError):                                  # the comparison the right runs pass
            _assert_equal_one_process(row, ref, wrong)
