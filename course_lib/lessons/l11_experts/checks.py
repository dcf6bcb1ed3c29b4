"""What the graded exercises of lesson 11 call (solutions/11_mixture_of_experts.ipynb).

The learner writes, with the signatures below:

    top_k_route(logits, top_k, normalize) -> (probs, weights, indices)
    balancing_loss(probs, indices, n_experts, alpha) -> 0-d tensor                 11-router-loss (one process)
    dispatch_order(indices, n_experts) -> (order, counts, inverse)                  11-dispatch-permutation
    capacity_keep(indices, n_experts, capacity_factor) -> (keep (T, k), dropped)     11-capacity-drop
    split_sizes(counts, group=None) -> (send, recv, got)
    expert_parallel_compute(rows, counts, experts, group=None) -> out              11-all-to-all-combine (3 ranks)
    node_limited_topk(scores, top_k, n_nodes, max_nodes) -> indices (T, k)          11-node-limited (one process)

Each check compares with a one-process reference (`course_lib.parallel.moe`), and a failure raises `CheckFailed`
with a one-line message naming the case. `rank_try_all_to_all` returns records (`rank_records.RankRecords`) that
`check_records` replays in the kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.lessons.rank_records import RankRecords, replay_records
from course_lib.parallel.moe import SwiGLUExperts, capacity_of, dispatch_permutation, switch_loss

__all__ = ["check_router_loss", "check_dispatch", "check_capacity", "check_node_limited", "rank_try_all_to_all",
           "check_records"]


def _logits(T=24, E=6, seed=0, scale=2.0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------------------------------------ 11-node-limited

NODE_LIMITED_CASES = (   # (name, T, E, n_nodes, top_k, max_nodes, seed, shift: scores in [-shift, 1 - shift))
    ("8 experts on 4 nodes, top-4 on at most 2 nodes", 48, 8, 4, 4, 2, 0, 0.0),
    ("16 experts on 4 nodes, top-4 on at most 2 nodes", 48, 16, 4, 4, 2, 1, 0.0),
    ("12 experts on 3 nodes, top-6 on at most 3 nodes (= plain top-6)", 32, 12, 3, 6, 3, 2, 0.0),
    ("12 experts on 6 nodes, top-4 on at most 2 nodes", 48, 12, 6, 4, 2, 3, 0.0),
    ("64 experts on 8 nodes, top-8 on at most 4 nodes (DeepSeek-V3's k and M)", 64, 64, 8, 8, 4, 4, 0.0),
    ("8 experts on 4 nodes, top-4 on at most 2 nodes, scores mostly negative (affinity + bias)", 48, 8, 4, 4, 2, 5,
     0.8),
)


def check_node_limited(node_limited_topk, cases=NODE_LIMITED_CASES) -> int:
    """The learner's ``node_limited_topk(scores, top_k, n_nodes, max_nodes) -> indices (T, k)`` on random scores (one
    case mostly negative, as affinities plus DeepSeek-V3's bias can be: a mask of 0 instead of -inf fails there):
    shape, every token's experts distinct and on at most max_nodes nodes, then the set of experts of every token
    against the rule (any order within a row). A wrong token is reported with its node scores. Returns the number of
    tokens checked."""
    from course_lib.parallel.moe_node_limited import node_limited_topk as reference

    checked = 0
    for name, T, E, N, k, M, seed, shift in cases:
        scores = torch.rand(T, E, generator=torch.Generator().manual_seed(seed)) - shift
        got = node_limited_topk(scores.clone(), k, N, M)
        if isinstance(got, (tuple, list)):
            got = got[-1]                                            # (weights, indices) is accepted too
        check_equal(f"node_limited_topk, {name}: shape of the indices", list(torch.as_tensor(got).shape), [T, k],
                    hint="one row per token, top_k expert ids per row")
        check_true(f"node_limited_topk, {name}: returns expert ids (an integer tensor), got dtype "
                   f"{torch.as_tensor(got).dtype}", not torch.as_tensor(got).is_floating_point(),
                   hint="return the indices of the chosen experts (what topk gives as .indices), not their scores")
        got = torch.as_tensor(got).long()
        per_node = E // N
        want = reference(scores, k, N, M)[1]
        for t in range(T):
            mine, theirs = sorted(got[t].tolist()), sorted(want[t].tolist())
            if mine == theirs:
                continue
            nodes = sorted({e // per_node for e in mine if 0 <= e < E})
            check_true(f"node_limited_topk, {name}: token {t}'s experts {mine} are {k} distinct ids in 0 .. {E - 1}",
                       len(set(mine)) == k and all(0 <= e < E for e in mine),
                       hint="each token picks top_k different experts")
            check_true(f"node_limited_topk, {name}: token {t}'s experts {mine} lie on nodes {nodes}, at most {M} "
                       f"allowed (expert e lives on node e // {per_node})", len(nodes) <= M,
                       hint="restrict the choice to the chosen nodes' experts before taking the top k")
            node_scores = scores[t].view(N, per_node).topk(k // M, -1).values.sum(-1)
            ranked = node_scores.argsort(descending=True).tolist()
            check_equal(f"node_limited_topk, {name}: token {t}'s experts (your nodes {nodes}; expert e lives on node "
                        f"e // {per_node}; its nodes by the sum of their top {k // M} scores: {ranked})", mine, theirs,
                        hint=f"choose the {M} nodes first, each scored by the sum of its {k // M} highest scores, "
                             f"then the {k} highest scores among the experts of those nodes only")
        checked += T
    return checked


# ------------------------------------------------------------------------------ 11-router-loss

def check_router_loss(top_k_route, balancing_loss) -> dict:
    """The router for k = 1, 2, 3, with and without renormalisation (Switch keeps p of the chosen experts; softmax
    of the k chosen logits is then wrong); the Switch loss and its gradient w.r.t. the logits (through P_i only),
    on a skewed routing (f_i from probabilities differ from f_i from counts), and on a noisy router's assignments
    (not the top-k of the probabilities: f_i comes from the indices given). Returns {k: loss on the skewed
    routing}."""
    out = {}
    for k in (1, 2, 3):
        for normalize in (True, False):
            logits = _logits(seed=k)
            probs, weights, indices = top_k_route(logits, k, normalize)
            ref_p = logits.softmax(-1)
            ref_w, ref_i = torch.topk(ref_p, k, -1)
            if normalize:
                ref_w = ref_w / ref_w.sum(-1, keepdim=True)
            case = f"top_k_route(k={k}, normalize={normalize})"
            check_close(f"{case}: probs = softmax over all E experts", probs, ref_p, rtol=0, atol=1e-6,
                        hint="softmax of the logits over the experts' dimension, before choosing any")
            check_equal(f"{case}: indices (the k largest, in descending order)", indices.tolist(), ref_i.tolist(),
                        hint="torch.topk of the probabilities along the experts' dimension")
            check_close(f"{case}: weights", weights, ref_w, rtol=0, atol=1e-6,
                        hint="the chosen probabilities; renormalised over the k only when normalize is True "
                             "(a softmax over the k chosen logits renormalises always)")
    for k in (1, 2):
        logits = (_logits(T=32, E=4, seed=10 + k) + torch.tensor([3.0, 1.0, 0.0, 0.0])).requires_grad_()
        probs = logits.softmax(-1)
        indices = torch.topk(probs, k, -1).indices
        got = balancing_loss(probs, indices, 4, 0.01)
        want = switch_loss(probs, indices, 4, 0.01)
        check_close(f"balancing_loss(k={k}, skewed routing, alpha=0.01)", float(torch.as_tensor(got).detach()),
                    float(want.detach()), rtol=1e-5, atol=0,
                    hint="f_i = the fraction of the T k assignments that chose expert i (counts, not probabilities); "
                         "P_i = the mean probability of expert i; alpha E sum_i f_i P_i")
        g_got, = torch.autograd.grad(got, logits, retain_graph=True)
        g_want, = torch.autograd.grad(want, logits)
        check_close(f"balancing_loss(k={k}): gradient w.r.t. the logits", g_got, g_want, rtol=0, atol=1e-7,
                    hint="the counts carry no gradient; only P_i does")
        out[k] = float(torch.as_tensor(got).detach())
    # The loss takes the assignments it is given: here a noisy router's (Shazeer et al. 2017's noisy top-k, Switch's
    # jitter), so they are not the top-k of the probabilities it is given and re-deriving them is wrong.
    g = torch.Generator().manual_seed(20)
    logits = (_logits(T=40, E=5, seed=21) + torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0])).requires_grad_()
    probs = logits.softmax(-1)
    indices = torch.topk(logits.detach() + 2.0 * torch.randn(40, 5, generator=g), 2, -1).indices
    got = balancing_loss(probs, indices, 5, 0.01)
    want = switch_loss(probs, indices, 5, 0.01)
    check_close("balancing_loss(k=2, a noisy router's assignments: not the top-k of probs, 5 experts)",
                float(torch.as_tensor(got).detach()), float(want.detach()), rtol=1e-5, atol=0,
                hint="f_i counts the assignments in `indices`, whichever way the router made them: use the "
                     "indices you are given")
    g_got, = torch.autograd.grad(got, logits, retain_graph=True)
    g_want, = torch.autograd.grad(want, logits)
    check_close("balancing_loss(k=2, a noisy router's assignments): gradient w.r.t. the logits", g_got, g_want,
                rtol=0, atol=1e-7, hint="the counts carry no gradient; only P_i does")
    uniform = torch.full((8, 4), 0.25)
    check_close("balancing_loss of a uniform routing (8 tokens, 4 experts, k=1, alpha=0.01)",
                float(balancing_loss(uniform, torch.arange(8).remainder(4).unsqueeze(1), 4, 0.01)), 0.01, rtol=1e-6,
                hint="f_i = P_i = 1/E: the loss is alpha")
    return out


# ------------------------------------------------------------------------------ 11-dispatch-permutation

def check_dispatch(dispatch_order) -> list[dict]:
    """Routings of k = 1 and 2 (random, one expert never chosen, all to one expert): order = stable argsort of the
    choice-major expert ids, counts per expert, inverse: sorted rows put back == the rows. Returns one row a case."""
    rows = []
    g = torch.Generator().manual_seed(3)
    cases = [("random, k=1", torch.randint(0, 5, (40, 1), generator=g)),
             ("random, k=2", torch.randint(0, 5, (40, 2), generator=g)),
             ("expert 4 never chosen, k=2", torch.randint(0, 4, (17, 2), generator=g)),
             ("all to expert 2, k=1", torch.full((9, 1), 2))]
    for name, idx in cases:
        order, counts, inverse = dispatch_order(idx, 5)
        ref = dispatch_permutation(idx, 5)
        check_equal(f"dispatch_order({name}): order", [int(i) for i in order], ref.order.tolist(),
                    hint="flatten the (T, k) ids choice-major (all first choices, then all second), then a stable "
                         "argsort")
        check_equal(f"dispatch_order({name}): counts", [int(c) for c in counts], ref.counts.tolist(),
                    hint="one count per expert, zeros included (minlength)")
        x = torch.arange(idx.numel()) * 10
        check_equal(f"dispatch_order({name}): x[order][inverse] == x", x[order][inverse].tolist(), x.tolist(),
                    hint="the inverse permutation puts each sorted row back where it came from: argsort of the order")
        rows.append(dict(case=name, counts=[int(c) for c in counts]))
    return rows


# ------------------------------------------------------------------------------ 11-capacity-drop

def check_capacity(capacity_keep) -> list[dict]:
    """keep (T, k) and the number dropped for capacity factors 0.5, 0.9, 1.0, 1.1, 1.25, 2.0 on skewed routings of
    k = 1 and 2: over-capacity assignments dropped in order (every first choice before any second, then by
    position). cf T k / E is then an integer, or has a fraction below one half (5.4, 13.2), one half (7.5) or above
    (10.8, 6.6): ceil differs from round, from floor and from +1."""
    rows = []
    g = torch.Generator().manual_seed(5)
    for k in (1, 2):
        T, E = 24, 4
        probs = (torch.randn(T, E, generator=g) + torch.tensor([2.0, 1.0, 0.0, 0.0])).softmax(-1)
        idx = torch.topk(probs, k, -1).indices
        for cf in (0.5, 0.9, 1.0, 1.1, 1.25, 2.0):
            keep, dropped = capacity_keep(idx, E, cf)
            d = dispatch_permutation(idx, E, capacity_of(cf, T, k, E))
            want = torch.zeros(T * k, dtype=torch.bool)
            want[d.order[d.keep]] = True                                  # sorted rows -> choice-major positions
            want = want.view(k, T).t()                                    # (A,) -> (T, k)
            case = f"capacity_keep(k={k}, capacity_factor={cf}, {T} tokens, {E} experts)"
            check_equal(f"{case}: dropped", int(dropped), d.dropped,
                        hint="capacity = ceil(capacity_factor T k / E); an expert keeps at most that many")
            check_equal(f"{case}: keep", torch.as_tensor(keep).bool().tolist(), want.tolist(),
                        hint="every token's first choice is served before any second choice; within a choice, "
                             "earlier tokens first")
            rows.append(dict(k=k, cf=cf, dropped=int(dropped)))
    return rows


# ------------------------------------------------------------------------------ 11-all-to-all-combine

def rank_try_all_to_all(split_sizes, expert_parallel_compute, T: int = 12, C: int = 8, F: int = 5,
                        n_experts: int = 6, top_k: int = 2) -> list[dict]:
    """On every rank (ep = the world size): this rank's tokens routed (skewed, seeded by rank), sorted by expert;
    the learner's split sizes vs the counts every rank sent; the learner's compute (its experts' shard, all-to-all
    there and back) vs the full experts in one process; collectives called. The test runs it on 3 ranks with 6
    experts (ep 3 != E/ep 2, so no (ep, E/ep) table reads the same transposed), rank s's routing skewed towards
    experts s and s + 1. Returns records."""
    rec = RankRecords("11-all-to-all-combine", rtol=0)
    dev = cdist.device()
    P, r = dist.get_world_size(), dist.get_rank()
    n = n_experts // P
    torch.manual_seed(0)
    full = SwiGLUExperts(n_experts, C, F).to(dev)                       # the same weights on every rank
    shard = SwiGLUExperts(n, C, F, first=r * n).to(dev)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(shard, name).copy_(getattr(full, name)[r * n:(r + 1) * n])
    g = torch.Generator().manual_seed(100 + r)
    skew = [torch.zeros(n_experts).index_fill_(0, torch.tensor([s % n_experts]), 1.5 * s + 1.0)
            .index_fill_(0, torch.tensor([(s + 1) % n_experts]), 1.0) for s in range(P)]   # rank s favours expert s
    all_idx = [torch.topk(torch.randn(T, n_experts, generator=torch.Generator().manual_seed(100 + s)) + skew[s],
                          top_k, -1).indices for s in range(P)]
    idx = all_idx[r]
    x = torch.randn(T, C, generator=g).to(dev)
    d = dispatch_permutation(idx, n_experts)
    rows = x[d.tokens.to(dev)]                                          # (A, C) sorted by expert
    counts = d.counts.to(dev)
    sent = torch.stack([torch.bincount(i.reshape(-1), minlength=n_experts) for i in all_idx])   # (P, E)
    try:
        with torch.no_grad():
            send, recv, got = split_sizes(counts.clone(), None)
            rec.add("equal", "split_sizes: send (rows to each rank)", [int(v) for v in send],
                    sent[r].view(P, n).sum(1).tolist(), "rank j holds experts j E/P .. (j+1) E/P - 1: add their counts")
            rec.add("equal", "split_sizes: recv (rows from each rank)", [int(v) for v in recv],
                    sent[:, r * n:(r + 1) * n].sum(1).tolist(),
                    "exchange the counts with one all_to_all_single: part j of (E,) goes to rank j")
            rec.add("equal", "split_sizes: got (P, E/P)", torch.as_tensor(got).reshape(P, n).tolist(),
                    sent[:, r * n:(r + 1) * n].tolist(), "got[s, e]: rows rank s sends to my local expert e")
            counter = CollectiveCounter()
            with counter:
                y = expert_parallel_compute(rows, counts.clone(), shard, None)
            want = full(rows, d.counts.tolist())
            rec.add("equal", "expert_parallel_compute: output shape", list(y.shape), list(want.shape),
                    "one output row per input row, in the input's order")
            rec.add("close", "expert_parallel_compute: max |output - the full experts in one process|",
                    (y - want).abs().max().item() if y.shape == want.shape else float("inf"), 0.0,
                    "received rows arrive ordered (source rank, expert): sort them by local expert before the "
                    "experts, and undo that sort before sending them back", tol=1e-5)
            ops = {op: row["calls"] for (_, op), row in counter.table().items()}
            rec.add("equal", "expert_parallel_compute: collectives called", sorted(ops), ["all_to_all_single"],
                    "only dist.all_to_all_single (counts, dispatch, combine)")
    except Exception as exc:  # noqa: BLE001 - a learner's error becomes a failed check
        rec.error(exc)
    return rec.items


def check_records(returns: list, exercise: str) -> int:
    """Every rank's records of `exercise` replayed as check_* calls (`rank_records.replay_records`)."""
    return replay_records(returns, exercise)
