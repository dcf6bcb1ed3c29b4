"""How many copies of a token cross nodes at dispatch, with and without node-limited routing (lesson 11;
DeepSeek-V3 report, 2024, sections 2.1.2 and 3.2.2; `course_lib.parallel.moe_node_limited`).

N nodes hold E = N n experts, n on each, contiguously; a token lives on one node and picks k distinct experts.

**Without deduplication** a row crosses nodes once per chosen expert on another node. Under uniform independent
routing (the k experts a uniformly random k-subset, as iid scores give) each chosen expert is on the token's node
with probability n/E = 1/N, so by linearity of expectation

    E[copies] = k (N - 1) / N.

Node-limited routing does not change this expectation when the scores are iid: which nodes win is exchangeable, so
each chosen expert is still on the token's own node with probability 1/N. What it bounds is the next line.

**With deduplication** (a token crosses to a node once and is forwarded inside it: DeepSeek-V3 sends over InfiniBand
once per node, then over NVLink) the copies are the distinct other nodes among the chosen experts. A given other node
holds none of the k experts with probability C(E - n, k) / C(E, k), so under uniform routing

    E[copies] = (N - 1) (1 - C(E - n, k) / C(E, k))            at most min(k, N - 1).

Node-limited to M nodes: at most M copies (M - 1 when the token's own node is among the M). Under iid scores the M
chosen nodes are exchangeable, the own node among them with probability M/N, so E[copies] <= M - M/N = M (N - 1)/N
(with equality when every chosen node receives one of the k experts, which the node score makes likely, not certain).

DeepSeek-V3 (N = 8 nodes of 32 routed experts, E = 256, k = 8, M = 4; the numbers of transformers 5.24's
``DeepseekV3Config`` defaults: 256 experts, ``n_group`` 8, ``topk_group`` 4, k = 8): without dedup 7 copies per
token; uniform routing with dedup 7 (1 - C(224, 8)/C(256, 8)) = 4.6; node-limited with dedup at most 4, 3.5 expected
at most. The report's own reasoning (section 3.2.2): "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that
of IB (50 GB/s)... we limit each token to be dispatched to at most 4 nodes, thereby reducing IB traffic"; a token
goes by IB to one GPU of each target node and is forwarded over NVLink there, so it "can efficiently select an
average of 3.2 experts per node", and the 8 routed experts could grow "to a maximum of 13 experts (4 nodes x 3.2
experts/node) while preserving the same communication cost".
"""

from __future__ import annotations

from math import comb

__all__ = ["uniform_remote_copies", "node_limited_remote_copies", "expected_dispatch_bytes"]


def _check(n_experts: int, n_nodes: int, top_k: int) -> int:
    if n_nodes < 1 or n_experts % n_nodes:
        raise ValueError(f"n_experts={n_experts} is not divisible by n_nodes={n_nodes}: pick n_nodes dividing it")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
    return n_experts // n_nodes


def uniform_remote_copies(n_experts: int, n_nodes: int, top_k: int, dedup: bool) -> float:
    """Expected copies of a token's row that cross nodes under uniform independent routing: k (N-1)/N without dedup,
    (N-1) (1 - C(E-n, k)/C(E, k)) with it (the module docstring)."""
    n = _check(n_experts, n_nodes, top_k)
    if not dedup:
        return top_k * (n_nodes - 1) / n_nodes
    return (n_nodes - 1) * (1 - comb(n_experts - n, top_k) / comb(n_experts, top_k))


def node_limited_remote_copies(n_experts: int, n_nodes: int, top_k: int, max_nodes: int, dedup: bool) -> dict:
    """Copies a token's row crosses nodes under node-limited routing to ``max_nodes``: {"max": the most any token
    sends, "max_if_home_chosen": the most when its own node is among the M, "expected": k (N-1)/N without dedup
    (iid scores), "expected_at_most": M (N-1)/N with dedup (an upper bound on the expectation under iid scores)}."""
    n = _check(n_experts, n_nodes, top_k)
    if not 1 <= max_nodes <= n_nodes:
        raise ValueError(f"max_nodes={max_nodes} must be between 1 and n_nodes={n_nodes}")
    remote_nodes = min(max_nodes, n_nodes - 1)
    if dedup:
        return dict(max=min(remote_nodes, top_k), max_if_home_chosen=min(max_nodes - 1, top_k),
                    expected_at_most=max_nodes * (n_nodes - 1) / n_nodes)
    return dict(max=min(top_k, remote_nodes * n), max_if_home_chosen=min(top_k, (max_nodes - 1) * n),
                expected=top_k * (n_nodes - 1) / n_nodes)


def expected_dispatch_bytes(tokens: int, bytes_per_token: int, copies: float) -> float:
    """Bytes one dispatch sends across nodes: T x copies per token x bytes of a row (C x dtype bytes)."""
    return tokens * copies * bytes_per_token
