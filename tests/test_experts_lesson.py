"""Lesson 11's graded checks (course_lib/lessons/l11_experts/checks.py): the right answers pass, each typical wrong
answer fails with a one-line `CheckFailed` naming the case and what differs. Exercise 4 (two ranks) is graded in
tests/test_grading.py; its report pieces (the EP mesh figure) are drawn here from a stored 4-rank result."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

from course_lib.grading.check import CheckFailed
from course_lib.lessons.l11_experts import checks, report

matplotlib.use("Agg")


# ------------------------------------------------------------------ right answers (as solutions/11's, from scratch)

def top_k_route(logits, top_k, normalize=True):
    probs = logits.softmax(-1)
    weights, indices = torch.topk(probs, top_k, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return probs, weights, indices


def balancing_loss(probs, indices, n_experts, alpha):
    f = torch.bincount(indices.reshape(-1), minlength=n_experts).to(probs.dtype) / indices.numel()
    return alpha * n_experts * (f * probs.mean(0)).sum()


def dispatch_order(indices, n_experts):
    flat = indices.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts), torch.argsort(order)


def _place(flat, n_experts):
    onehot = torch.nn.functional.one_hot(flat, n_experts)
    return (onehot.cumsum(0) * onehot).sum(1) - 1                     # 0-based place in its expert's queue


def capacity_keep(indices, n_experts, capacity_factor, capacity=None, token_major=False, served=None):
    T, k = indices.shape
    capacity = math.ceil(capacity_factor * T * k / n_experts) if capacity is None else capacity(capacity_factor, T, k,
                                                                                                 n_experts)
    if token_major:                                                    # wrong: token 0's choices, then token 1's
        keep = (_place(indices.reshape(-1), n_experts) < capacity).view(T, k)
    else:
        place = _place(indices.t().reshape(-1), n_experts)
        keep = ((place <= capacity) if served == "<=" else (place < capacity)).view(k, T).t()
    return keep, int((~keep).sum())


def test_the_right_answers_pass():
    losses = checks.check_router_loss(top_k_route, balancing_loss)
    assert set(losses) == {1, 2} and all(v > 0.01 for v in losses.values())   # skewed: above alpha
    assert len(checks.check_dispatch(dispatch_order)) == 4
    rows = checks.check_capacity(capacity_keep)
    assert len(rows) == 12 and rows[0]["dropped"] > 0 and rows[-1]["dropped"] == 0


# ------------------------------------------------------------------ 11-router-loss

def route_softmax_after_top_k(logits, top_k, normalize=True):
    """Top-k of the logits, then a softmax over the k chosen: always renormalised (wrong for normalize=False)."""
    chosen, indices = torch.topk(logits, top_k, -1)
    return logits.softmax(-1), chosen.softmax(-1), indices


def route_never_renormalised(logits, top_k, normalize=True):
    probs = logits.softmax(-1)
    weights, indices = torch.topk(probs, top_k, -1)
    return probs, weights, indices


def route_probs_of_the_k(logits, top_k, normalize=True):
    """The probabilities as a softmax of the k chosen logits only (zeros elsewhere)."""
    chosen, indices = torch.topk(logits, top_k, -1)
    w = chosen.softmax(-1)
    return torch.zeros_like(logits).scatter(-1, indices, w), w, indices


def loss_f_from_probabilities(probs, indices, n_experts, alpha):
    P = probs.mean(0)
    return alpha * n_experts * (P * P).sum()


def loss_f_over_tokens(probs, indices, n_experts, alpha):       # counts / T, not T k (transformers' convention)
    f = torch.bincount(indices.reshape(-1), minlength=n_experts).to(probs.dtype) / indices.shape[0]
    return alpha * n_experts * (f * probs.mean(0)).sum()


def loss_indices_rederived(probs, indices, n_experts, alpha):   # the top-k of probs, not the indices given
    chosen = torch.topk(probs, indices.shape[1], -1).indices
    return balancing_loss(probs, chosen, n_experts, alpha)


def loss_f_detached_wrongly(probs, indices, n_experts, alpha):   # P_i detached too: no gradient at all
    f = torch.bincount(indices.reshape(-1), minlength=n_experts).to(probs.dtype) / indices.numel()
    return alpha * n_experts * (f * probs.detach().mean(0)).sum() + 0 * probs.sum()


@pytest.mark.parametrize("route, loss, match", [
    (route_softmax_after_top_k, balancing_loss, r"top_k_route\(k=1, normalize=False\): weights"),
    (route_never_renormalised, balancing_loss, r"top_k_route\(k=1, normalize=True\): weights"),
    (route_probs_of_the_k, balancing_loss, r"top_k_route\(k=1, normalize=True\): probs = softmax over all E"),
    (top_k_route, loss_f_from_probabilities, r"balancing_loss\(k=1, skewed routing"),
    (top_k_route, loss_f_over_tokens, r"balancing_loss\(k=2, skewed routing"),
    (top_k_route, loss_f_detached_wrongly, r"balancing_loss\(k=1\): gradient w.r.t. the logits"),
    (top_k_route, loss_indices_rederived, r"balancing_loss\(k=2, a noisy router's assignments"),
], ids=["softmax-after-top-k", "never-renormalised", "probs-of-the-k", "f-from-probabilities", "f-over-T",
        "no-gradient", "indices-rederived"])
def test_router_loss_wrong_answers_fail(route, loss, match):
    with pytest.raises(CheckFailed, match=match) as err:
        checks.check_router_loss(route, loss)
    assert "\n" not in str(err.value) and "Hint:" in str(err.value)


# ------------------------------------------------------------------ 11-dispatch-permutation

def dispatch_inverse_twice(indices, n_experts):
    """The inverse applied twice: argsort(argsort(order)) is the order itself, not its inverse."""
    order, counts, inverse = dispatch_order(indices, n_experts)
    return order, counts, torch.argsort(inverse)


def dispatch_token_major(indices, n_experts):                  # flattened row-major: token 0's k choices first
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=n_experts), torch.argsort(order)


def dispatch_no_empty_experts(indices, n_experts):             # bincount without minlength
    order, _, inverse = dispatch_order(indices, n_experts)
    return order, torch.bincount(indices.t().reshape(-1)), inverse


@pytest.mark.parametrize("fn, match", [
    (dispatch_inverse_twice, r"dispatch_order\(random, k=1\): x\[order\]\[inverse\] == x"),
    (dispatch_token_major, r"dispatch_order\(random, k=2\): order"),
    (dispatch_no_empty_experts, r"dispatch_order\(expert 4 never chosen, k=2\): counts"),
], ids=["inverse-twice", "token-major", "no-minlength"])
def test_dispatch_wrong_answers_fail(fn, match):
    with pytest.raises(CheckFailed, match=match):
        checks.check_dispatch(fn)


# ------------------------------------------------------------------ 11-capacity-drop

@pytest.mark.parametrize("kwargs, match", [
    (dict(token_major=True), r"capacity_keep\(k=2, capacity_factor=0.5, 24 tokens, 4 experts\): keep"),
    (dict(served="<="), r"capacity_keep\(k=1, capacity_factor=0.5, 24 tokens, 4 experts\): dropped"),
    (dict(capacity=lambda cf, T, k, E: math.floor(cf * T * k / E)),
     r"capacity_keep\(k=1, capacity_factor=0.9, .*dropped"),
    (dict(capacity=lambda cf, T, k, E: round(cf * T * k / E)),             # 5.4 -> 5: a fraction below one half
     r"capacity_keep\(k=1, capacity_factor=0.9, .*dropped"),
    (dict(capacity=lambda cf, T, k, E: math.ceil(cf * T * k / E) + 1),
     r"capacity_keep\(k=1, capacity_factor=0.5, .*dropped"),
    (dict(capacity=lambda cf, T, k, E: math.ceil(cf * T / E)), r"capacity_keep\(k=2, capacity_factor=0.5, .*dropped"),
], ids=["token-major-order", "place-<=-capacity", "floor", "round", "capacity+1", "without-k"])
def test_capacity_wrong_answers_fail(kwargs, match):
    with pytest.raises(CheckFailed, match=match):
        checks.check_capacity(lambda idx, E, cf: capacity_keep(idx, E, cf, **kwargs))


def test_capacity_drops_latest_first_choice_last():
    """Dropping in reverse (the last tokens kept) keeps as many but not the same ones."""
    def reverse(idx, E, cf):
        keep, dropped = capacity_keep(idx.flip(0), E, cf)
        return keep.flip(0), dropped
    with pytest.raises(CheckFailed, match=r"capacity_keep\(k=1, capacity_factor=0.5, .*: keep"):
        checks.check_capacity(reverse)


# ------------------------------------------------------------------ the EP mesh figure

def test_mesh_figure_draws_every_rank():
    rows = [dict(experts=[2 * (r % 2), 2 * (r % 2) + 1], ep_rank=r % 2, ep_ranks=[r - r % 2, r - r % 2 + 1],
                 edp_ranks=[r % 2, r % 2 + 2], dp_ranks=[0, 1, 2, 3]) for r in range(4)]
    returns = [{"k2/cfNone/ep2": row} for row in rows]
    fig = report.mesh_figure(returns, "k2/cfNone/ep2", "cpu")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert [t for t in texts if t.startswith("rank ")] == [f"rank {r}" for r in range(4)]
    assert texts.count("E0") == 2 and texts.count("E3") == 2 and "expert-dp [1, 3]" in texts
    assert any("dp 4" in t for t in texts)
    assert "expert-dp" in report.mesh_table(returns, "k2/cfNone/ep2")
