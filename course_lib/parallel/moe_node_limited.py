"""Node-limited routing: each token's experts on at most M nodes (lesson 11; DeepSeek-V3 report, 2024, section 2.1.2).

Under expert parallelism across nodes a token's row crosses the slow inter-node network (InfiniBand) once for each
remote expert it picks. DeepSeek-V3 bounds that traffic: "each token will be sent to at most M nodes, which are
selected according to the sum of the highest K_r/M affinity scores of the experts distributed on each node" (section
2.1.2, "Node-Limited Routing"; as DeepSeek-V2's device-limited routing did for devices). With the experts laid out
contiguously, N nodes of E/N experts each (node of expert e = e // (E/N)), for every token:

    1. node score   = the sum of its top (k/M) scores among the experts of that node        (T, E) -> (T, N)
    2. the M nodes with the highest node scores                                              (T, N) -> (T, M)
    3. the top k among the experts of those M nodes (the others masked to -inf)              (T, E) -> (T, k)

``node_limited_topk`` (exercise 11-node-limited). With M = N it is plain top-k. transformers' ``DeepseekV3TopkRouter``
(5.24) does the same with "groups" (``n_group`` = N, ``topk_group`` = M; it sums the top 2 per group, which is
k/M for DeepSeek-V3's k = 8, M = 4; its config defaults: 256 routed experts, 8 groups, 4 chosen, k = 8).

**Dispatch bytes** (`dispatch_bytes`): a token on node ``source_node`` sends its row (``bytes_per_token``) across
nodes once per chosen expert on another node, or, deduplicated, once per other node that holds one of its experts
(DeepSeek-V3, section 3.2.2: a token goes once over InfiniBand to each target node, then is forwarded over NVLink to
the GPUs there). Node-limited routing with deduplication bounds it at M copies per token (M - 1 when the token's own
node is among the M); the formulas are in `course_lib.theory.moe_routing`.

Shapes: T tokens, E experts, N nodes, n = E/N experts a node, k top_k, M max_nodes.
"""

from __future__ import annotations

import torch

from course_lib.config import check_positive_ints, divisors_hint
from course_lib.reference import reference_for

__all__ = ["validate_node_limited", "node_limited_topk", "node_of", "even_source_nodes", "remote_copies",
           "dispatch_bytes"]


def validate_node_limited(n_experts: int, top_k: int, n_nodes: int, max_nodes: int) -> None:
    """Raise ValueError naming the field and the fix when these sizes cannot route node-limited."""
    check_positive_ints(n_experts=n_experts, top_k=top_k, n_nodes=n_nodes, max_nodes=max_nodes)
    if n_experts % n_nodes:
        raise ValueError(f"n_experts={n_experts} is not divisible by n_nodes={n_nodes} (each node holds "
                         f"n_experts/n_nodes experts): pick n_nodes in {divisors_hint(n_experts, None)}")
    if max_nodes > n_nodes:
        raise ValueError(f"max_nodes={max_nodes} > n_nodes={n_nodes}: pick max_nodes <= n_nodes")
    if top_k % max_nodes:
        ok = [d for d in range(1, min(top_k, n_nodes) + 1) if top_k % d == 0]
        raise ValueError(f"top_k={top_k} is not divisible by max_nodes={max_nodes} (a node is scored by its top "
                         f"top_k/max_nodes experts): pick max_nodes in {{{', '.join(map(str, ok))}}}")
    per_node = n_experts // n_nodes
    if top_k // max_nodes > per_node:
        raise ValueError(f"top_k/max_nodes = {top_k // max_nodes} > {per_node} experts a node: pick max_nodes >= "
                         f"{-(-top_k // per_node)}")


@reference_for("11-node-limited")
def node_limited_topk(scores: torch.Tensor, top_k: int, n_nodes: int, max_nodes: int):
    """DeepSeek-V3's node-limited top-k (the module docstring): scores (T, E) -> (weights (T, k), indices (T, k)),
    every token's k experts on at most ``max_nodes`` of the ``n_nodes`` nodes (expert e on node e // (E / n_nodes)),
    nodes chosen by the sum of each node's top (top_k / max_nodes) scores, then the top k on the chosen nodes.
    ``weights`` are the chosen scores, in descending order (normalise them as the router does)."""
    T, E = scores.shape
    validate_node_limited(E, top_k, n_nodes, max_nodes)
    per_node = E // n_nodes
    by_node = scores.view(T, n_nodes, per_node)                                     # (T, E) -> (T, N, n)
    node_score = by_node.topk(top_k // max_nodes, -1).values.sum(-1)                # (T, N, n) -> (T, N)
    nodes = node_score.topk(max_nodes, -1).indices                                  # (T, N) -> (T, M)
    allowed = torch.zeros(T, n_nodes, dtype=torch.bool, device=scores.device).scatter(1, nodes, True)   # (T, N)
    masked = scores.masked_fill(~allowed.repeat_interleave(per_node, 1), float("-inf"))                  # (T, E)
    indices = masked.topk(top_k, -1).indices                                        # (T, E) -> (T, k)
    return scores.gather(1, indices), indices


def node_of(indices: torch.Tensor, experts_per_node: int) -> torch.Tensor:
    """The node of each expert id (experts laid out contiguously): e // experts_per_node, same shape."""
    return torch.div(indices, experts_per_node, rounding_mode="floor")


def even_source_nodes(tokens: int, n_nodes: int, device=None) -> torch.Tensor:
    """(T,) the node each token lives on, tokens spread evenly and contiguously over the nodes: t N // T."""
    return torch.arange(tokens, device=device) * n_nodes // tokens


def remote_copies(indices: torch.Tensor, experts_per_node: int, source_node: torch.Tensor, dedup: bool):
    """(T,) copies of each token's row that cross nodes: its chosen experts on another node than ``source_node``
    (without dedup), or the distinct other nodes among them (dedup: once per node, then forwarded inside it)."""
    nodes = node_of(indices, experts_per_node)                                      # (T, k)
    remote = nodes != source_node.view(-1, 1)                                       # (T, k)
    if not dedup:
        return remote.sum(1)
    first = torch.ones_like(remote)                                                 # first time a node appears
    sorted_nodes = nodes.sort(1).values
    first[:, 1:] = sorted_nodes[:, 1:] != sorted_nodes[:, :-1]
    return (first & (sorted_nodes != source_node.view(-1, 1))).sum(1)


def dispatch_bytes(indices: torch.Tensor, n_nodes: int, experts_per_node: int, bytes_per_token: int, dedup: bool,
                   source_node: torch.Tensor | None = None) -> int:
    """Bytes one dispatch sends across nodes for the routing ``indices`` (T, k): ``bytes_per_token`` x the sum over
    tokens of `remote_copies`; ``source_node`` (T,) defaults to tokens spread evenly over the ``n_nodes``."""
    if indices.numel() == 0:
        return 0
    if source_node is None:
        source_node = even_source_nodes(indices.shape[0], n_nodes, indices.device)
    if int(indices.max()) >= n_nodes * experts_per_node:
        raise ValueError(f"expert id {int(indices.max())} >= n_nodes x experts_per_node = "
                         f"{n_nodes * experts_per_node}: check experts_per_node")
    return int(remote_copies(indices, experts_per_node, source_node, dedup).sum()) * bytes_per_token
