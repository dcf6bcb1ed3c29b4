"""Tests of node-limited routing (course_lib/parallel/moe_node_limited.py, course_lib/theory/moe_routing.py; lesson 11;
exercise 11-node-limited).

`node_limited_topk` = a brute-force loop over tokens (nodes by the sum of their top k/M scores, then the top k on the
chosen nodes) on random scores for several (E, N, k, M), exactly; every token's experts span <= M nodes; M = N is plain
top-k; = transformers' DeepseekV3TopkRouter (its groups are our nodes); three wrong variants fail the same check (nodes
by their max score, nodes by the sum of all their scores, plain top-k truncated to M nodes). Dispatch bytes counted
on a constructed routing by hand, and on 20 000 random tokens against the formulas of theory/moe_routing.py.
"""

from __future__ import annotations

import pytest
import torch

from course_lib.parallel.moe_node_limited import (dispatch_bytes, even_source_nodes, node_limited_topk, node_of,
                                                  remote_copies, validate_node_limited)
from course_lib.reference import is_reference
from course_lib.theory import moe_routing

SHAPES = [(8, 4, 4, 2), (16, 4, 4, 2), (12, 3, 6, 3), (32, 8, 8, 4), (6, 2, 2, 1), (9, 3, 3, 3), (24, 4, 6, 2)]


def _brute(scores: torch.Tensor, top_k: int, n_nodes: int, max_nodes: int):
    """One token at a time, in plain Python: (weights (T, k), indices (T, k)), descending."""
    T, E = scores.shape
    n = E // n_nodes
    weights, indices = [], []
    for row in scores.tolist():
        node_score = [sum(sorted(row[j * n:(j + 1) * n], reverse=True)[:top_k // max_nodes]) for j in range(n_nodes)]
        chosen = sorted(range(n_nodes), key=lambda j: -node_score[j])[:max_nodes]
        allowed = [e for e in range(E) if e // n in chosen]
        best = sorted(allowed, key=lambda e: -row[e])[:top_k]
        indices.append(best)
        weights.append([row[e] for e in best])
    return torch.tensor(weights, dtype=scores.dtype), torch.tensor(indices)


def _scores(T, E, seed=0):
    return torch.rand(T, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("E,N,k,M", SHAPES)
def test_equals_brute_force_and_spans_at_most_m_nodes(E, N, k, M):
    scores = _scores(200, E)
    w, idx = node_limited_topk(scores, k, N, M)
    bw, bidx = _brute(scores, k, N, M)
    assert torch.equal(idx, bidx)
    assert torch.equal(w, bw)
    nodes = node_of(idx, E // N).sort(1).values
    spans = (nodes[:, 1:] != nodes[:, :-1]).sum(1) + 1                      # distinct nodes per token
    assert spans.max() <= M
    assert len(set(idx[0].tolist())) == k


@pytest.mark.parametrize("E,N,k", [(8, 4, 4), (32, 8, 8), (12, 3, 6)])
def test_all_nodes_is_plain_topk(E, N, k):
    scores = _scores(300, E, seed=1)
    w, idx = node_limited_topk(scores, k, N, N)
    ref = scores.topk(k, -1)
    assert torch.equal(idx, ref.indices) and torch.equal(w, ref.values)


def test_equals_transformers_deepseek_v3_router():
    """transformers 5.24's DeepseekV3TopkRouter: groups = our nodes, topk_group = M, the top 2 of each group summed
    (k/M = 4/2 here), on sigmoid scores; it returns its k unsorted, so the sets are compared."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=8, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                           norm_topk_prob=False, routed_scaling_factor=1.0)
    router = DeepseekV3TopkRouter(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(256, 8)
    with torch.no_grad():
        logits, hf_w, hf_idx = router(x)
        w, idx = node_limited_topk(logits.sigmoid(), 4, 4, 2)
    assert torch.equal(idx.sort(1).values, hf_idx.sort(1).values)
    assert torch.equal(w.sort(1).values, hf_w.sort(1).values)
    plain = logits.sigmoid().topk(4, -1).indices.sort(1).values
    assert not torch.equal(plain, hf_idx.sort(1).values), "no token was limited: the comparison proves nothing"


def _by_max(scores, top_k, n_nodes, max_nodes):
    """Wrong: nodes ranked by their best expert alone."""
    T, E = scores.shape
    n = E // n_nodes
    node_score = scores.view(T, n_nodes, n).max(-1).values
    return _top_on(scores, node_score, top_k, n_nodes, max_nodes)


def _by_sum_of_all(scores, top_k, n_nodes, max_nodes):
    """Wrong: nodes ranked by the sum of all their experts' scores."""
    T, E = scores.shape
    return _top_on(scores, scores.view(T, n_nodes, E // n_nodes).sum(-1), top_k, n_nodes, max_nodes)


def _top_on(scores, node_score, top_k, n_nodes, max_nodes):
    T, E = scores.shape
    nodes = node_score.topk(max_nodes, -1).indices
    allowed = torch.zeros(T, n_nodes, dtype=torch.bool).scatter(1, nodes, True).repeat_interleave(E // n_nodes, 1)
    idx = scores.masked_fill(~allowed, float("-inf")).topk(top_k, -1).indices
    return scores.gather(1, idx), idx


def _topk_then_truncate(scores, top_k, n_nodes, max_nodes):
    """Wrong: plain top-k, then the experts beyond the first M nodes met (in score order) dropped (index -1)."""
    w, idx = scores.topk(top_k, -1)
    n = scores.shape[1] // n_nodes
    idx = idx.clone()
    for t in range(idx.shape[0]):
        seen = []
        for j, e in enumerate(idx[t].tolist()):
            if e // n not in seen:
                seen.append(e // n)
            if seen.index(e // n) >= max_nodes:
                idx[t, j] = -1
    return w, idx


@pytest.mark.parametrize("wrong", [_by_max, _by_sum_of_all, _topk_then_truncate])
def test_wrong_variants_fail(wrong):
    scores = _scores(400, 32, seed=2)
    _, ref = _brute(scores, 8, 8, 4)
    _, ours = node_limited_topk(scores, 8, 8, 4)
    _, bad = wrong(scores, 8, 8, 4)
    assert torch.equal(ours, ref)
    differ = (bad != ref).any(1).float().mean().item()
    assert differ > 0.01, f"{wrong.__name__} agrees with the reference on {1 - differ:.1%} of the tokens"


def test_validation_names_field_and_fix():
    validate_node_limited(256, 8, 8, 4)
    with pytest.raises(ValueError,
                       match=r"n_experts=10 is not divisible by n_nodes=4 .* pick n_nodes in \{1, 2, 5, 10\}"):
        node_limited_topk(torch.rand(3, 10), 4, 4, 2)
    with pytest.raises(ValueError, match=r"top_k=6 is not divisible by max_nodes=4 .* pick max_nodes in \{1, 2, 3\}"):
        node_limited_topk(torch.rand(3, 16), 6, 4, 4)
    with pytest.raises(ValueError, match=r"max_nodes=5 > n_nodes=4: pick max_nodes <= n_nodes"):
        validate_node_limited(16, 5, 4, 5)
    with pytest.raises(ValueError, match=r"top_k/max_nodes = 4 > 2 experts a node: pick max_nodes >= 2"):
        validate_node_limited(8, 4, 4, 1)


def test_marked_as_the_exercise_answer():
    assert is_reference(node_limited_topk, ["11-node-limited"])


def test_dispatch_bytes_on_a_constructed_routing():
    """4 nodes of 2 experts, token t on node t; by hand: (no dedup, dedup) copies = (0,0), (2,2), (2,1), (1,1)."""
    idx = torch.tensor([[0, 1], [0, 4], [6, 7], [6, 1]])
    src = torch.arange(4)
    assert torch.equal(even_source_nodes(4, 4), src)
    assert remote_copies(idx, 2, src, dedup=False).tolist() == [0, 2, 2, 1]
    assert remote_copies(idx, 2, src, dedup=True).tolist() == [0, 2, 1, 1]
    assert dispatch_bytes(idx, 4, 2, 100, dedup=False) == 500
    assert dispatch_bytes(idx, 4, 2, 100, dedup=True) == 400
    assert dispatch_bytes(idx, 4, 2, 100, dedup=True, source_node=torch.tensor([3, 3, 3, 3])) == 100 * (1 + 2 + 0 + 1)
    with pytest.raises(ValueError, match="expert id 7 >= n_nodes x experts_per_node = 6"):
        dispatch_bytes(idx, 3, 2, 100, dedup=True)


def test_dispatch_bytes_against_the_formulas():
    """20 000 tokens, seeded: uniform routing (plain top-k of iid scores) vs k (N-1)/N and (N-1)(1 - C(E-n,k)/C(E,k));
    node-limited to M: without dedup the same k (N-1)/N, with dedup at most M per token (M - 1 when the token's node
    is chosen) and at most M (N-1)/N on average, well below unlimited routing's."""
    E, N, k, M, T, row = 32, 4, 4, 2, 20000, 64 * 2
    scores = _scores(T, E, seed=3)
    src = even_source_nodes(T, N)
    plain = scores.topk(k, -1).indices
    for dedup in (False, True):
        expected = moe_routing.uniform_remote_copies(E, N, k, dedup) * T * row
        assert dispatch_bytes(plain, N, E // N, row, dedup) == pytest.approx(expected, rel=0.02)
    _, idx = node_limited_topk(scores, k, N, M)
    bound = moe_routing.node_limited_remote_copies(E, N, k, M, dedup=True)
    copies = remote_copies(idx, E // N, src, dedup=True)
    home_chosen = (node_of(idx, E // N) == src.view(-1, 1)).any(1)
    assert copies.max() == bound["max"] == M
    assert copies[home_chosen].max() <= bound["max_if_home_chosen"] == M - 1
    assert copies.float().mean() <= bound["expected_at_most"]
    assert copies.float().mean() < moe_routing.uniform_remote_copies(E, N, k, dedup=True) - 0.3
    no_dedup = moe_routing.node_limited_remote_copies(E, N, k, M, dedup=False)
    assert dispatch_bytes(idx, N, E // N, row, dedup=False) == pytest.approx(no_dedup["expected"] * T * row, rel=0.02)


def test_deepseek_v3_numbers():
    assert moe_routing.uniform_remote_copies(256, 8, 8, dedup=False) == 7.0
    assert moe_routing.uniform_remote_copies(256, 8, 8, dedup=True) == pytest.approx(4.633, abs=1e-3)
    assert moe_routing.node_limited_remote_copies(256, 8, 8, 4, dedup=True) == dict(
        max=4, max_if_home_chosen=3, expected_at_most=3.5)
