"""Lesson 11's coding exercises answered independently: written from exercises/11_mixture_of_experts.ipynb and the
lesson's text, without reading the official solution or the course's implementation (see README.md beside this file)."""

ANSWERS = {
    "11-router-loss": r'''def top_k_route(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """Top-k router (lesson 11): logits (T, E) -> probs (T, E) = softmax over the E experts,
    weights (T, k) = the k largest probs (divided by their sum when normalize), indices (T, k) descending."""
    probs = torch.softmax(logits, dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1, largest=True, sorted=True)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, indices


def balancing_loss(probs: torch.Tensor, indices: torch.Tensor, n_experts: int, alpha: float) -> torch.Tensor:
    """Switch loss (lesson 11): probs (T, E), indices (T, k) -> alpha E sum_i f_i P_i, a 0-d tensor;
    f_i = assignments to expert i / (T k) from the counts, P_i = mean over tokens of probs[:, i]."""
    T, k = indices.shape
    counts = torch.zeros(n_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(0, indices.reshape(-1), torch.ones(T * k, dtype=probs.dtype, device=probs.device))
    fraction = (counts / (T * k)).detach()          # from counts: no gradient
    mean_prob = probs.mean(dim=0)                   # the gradient flows through this one
    return alpha * n_experts * torch.dot(fraction, mean_prob)
''',
    "11-dispatch-permutation": r'''def dispatch_order(indices: torch.Tensor, n_experts: int):
    """indices (T, k) -> order (A,), counts (E,), inverse (A,) with A = T k, choice-major (lesson 11)."""
    flat = indices.t().reshape(-1)                  # position j T + t: token t's choice j
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=n_experts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, counts, inverse
''',
    "11-capacity-drop": r'''def capacity_keep(indices: torch.Tensor, n_experts: int, capacity_factor: float):
    """indices (T, k) -> keep (T, k) bool, dropped (int): an expert serves its first ceil(cf T k / E)
    assignments in choice-major order (lesson 11)."""
    T, k = indices.shape
    capacity = math.ceil(capacity_factor * T * k / n_experts)
    flat = indices.t().reshape(-1)                               # choice-major
    one_hot = torch.nn.functional.one_hot(flat, n_experts)       # (A, E)
    # how many assignments to the same expert came before each one, in that order
    rank_in_expert = (torch.cumsum(one_hot, dim=0) * one_hot).sum(dim=1) - 1
    keep_flat = rank_in_expert < capacity
    keep = keep_flat.reshape(k, T).t().contiguous()
    dropped = int((~keep).sum().item())
    return keep, dropped
''',
    "11-all-to-all-combine": r'''def split_sizes(counts: torch.Tensor, group=None):
    """counts (E,) int64 rows this rank sends to each global expert -> send (P ints), recv (P ints),
    got (P, E/P) int64 (lesson 11)."""
    P = dist.get_world_size(group)
    E = counts.numel()
    per_rank = E // P
    outgoing = counts.to(torch.int64).contiguous()
    incoming = torch.empty_like(outgoing)
    dist.all_to_all_single(incoming, outgoing, group=group)    # part s: rank s's rows for my experts
    got = incoming.reshape(P, per_rank)
    send = [int(v) for v in outgoing.reshape(P, per_rank).sum(dim=1).tolist()]
    recv = [int(v) for v in got.sum(dim=1).tolist()]
    return send, recv, got


def expert_parallel_compute(rows: torch.Tensor, counts: torch.Tensor, experts, group=None) -> torch.Tensor:
    """rows (A, C) sorted by global expert, counts (E,) -> the experts' outputs (A, C), same order; the
    experts live on the ranks of `group`, `experts` is this rank's shard (lesson 11)."""
    send, recv, got = split_sizes(counts, group)
    P, per_rank = got.shape
    C = rows.shape[1]

    # dispatch: my rows to the ranks that hold their experts
    received = rows.new_empty((sum(recv), C))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)

    # received rows come as (source rank, local expert) blocks: regroup them by local expert
    local_expert = torch.arange(per_rank).repeat(P)                        # expert of block (s, e), s-major
    row_expert = torch.repeat_interleave(local_expert, got.reshape(-1).cpu())
    perm = torch.sort(row_expert, stable=True).indices.to(rows.device)
    local_counts = [int(v) for v in got.sum(dim=0).tolist()]
    computed = experts(received[perm], local_counts)

    # back to (source rank, local expert) order, then home
    back = torch.empty_like(computed)
    back[perm] = computed
    result = computed.new_empty((rows.shape[0],) + tuple(computed.shape[1:]))
    dist.all_to_all_single(result, back.contiguous(), output_split_sizes=send, input_split_sizes=recv,
                           group=group)
    return result
''',
    "11-node-limited": r"""def node_limited_topk(scores: torch.Tensor, top_k: int, n_nodes: int, max_nodes: int) -> torch.Tensor:
    '''Each token's top_k experts, on at most max_nodes of the n_nodes nodes (lesson 11, section 9).

    scores (T, E), experts contiguous per node (E / n_nodes each) -> indices (T, top_k).'''
    T, E = scores.shape
    per_node = E // n_nodes
    take = min(top_k // max_nodes, per_node)                       # K_r / M scores summed per node
    # stage 1: each node's score is the sum of its `take` best affinities; keep the max_nodes best nodes
    ranked = torch.sort(scores.reshape(T, n_nodes, per_node), dim=-1, descending=True).values
    node_score = ranked[..., :take].sum(dim=-1)                    # (T, N)
    nodes = torch.argsort(node_score, dim=-1, descending=True)[:, :max_nodes]   # (T, M)
    # stage 2: the candidates are only the experts of those nodes; pick the top_k of them
    offsets = torch.arange(per_node, device=scores.device)
    candidates = (nodes.unsqueeze(-1) * per_node + offsets).reshape(T, max_nodes * per_node)
    candidate_scores = torch.gather(scores, 1, candidates)
    best = torch.argsort(candidate_scores, dim=-1, descending=True)[:, :top_k]
    return torch.gather(candidates, 1, best).to(torch.int64)
""",
}
