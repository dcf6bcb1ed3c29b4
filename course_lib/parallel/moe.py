"""A mixture-of-experts layer in one process: router, dispatch permutation, experts, combine (lesson 11).

A sparsely-gated mixture of experts (Shazeer et al. 2017, "Outrageously Large Neural Networks", placed between
stacked LSTM layers; in a transformer block in place of the MLP since GShard, Lepikhin et al. 2020, and Switch, Fedus
et al. 2021) is E expert MLPs and a router that sends each token to k of them. Parameters grow with E; the FLOPs per token
grow with k only (`course_lib.theory.experts`).

    model = apply_moe(build_model(cfg, 0), n_experts=4, top_k=2)      # every block's mlp becomes a MoELayer
    loss = moe_loss(model, idx, targets)                              # cross-entropy + the layers' balancing losses

**Router** (`TopKRouter`): logits = x W_r^T (E per token), probabilities p = softmax(logits) in fp32, the k largest
chosen; their weights renormalised over the k (Mixtral, Jiang et al. 2024: ``normalize=True``) or kept as p (Switch,
Fedus et al. 2021, top-1: ``normalize=False``). With renormalisation, "softmax before top-k" and "softmax of the k
chosen logits" coincide; without it they do not (tests/test_experts.py shows both).

**Load-balancing loss** (Switch, eq. 4-6): ``alpha * E * sum_i f_i P_i``, f_i the fraction of the T k assignments
routed to expert i (token COUNTS: not differentiable), P_i the mean router probability of expert i (differentiable):
it is smallest, alpha, under uniform routing. Switch routes top-1 and divides the counts by the T tokens (eq. 5);
dividing by T k at any k is Megatron-LM's generalisation (``switch_load_balancing_loss_func``'s docstring: "f_i = 1 /
(T * topk) * ..."). transformers' ``load_balancing_loss_func`` divides the counts by T, not T k: its value is k
times ours. Computed per group of tokens (below) and averaged over the groups.

**Capacity** (GShard, Lepikhin et al. 2020; Switch): an expert takes at most
``capacity = ceil(capacity_factor * S * k / E)`` of a group's S tokens; the rest are dropped (their output from the
experts is 0: the residual stream carries them). Order of priority here: every token's first choice before any
second choice, then by position (as DeepSpeed 0.19.8's ``top2gating`` places them). Libraries differ: GShard also serves
first choices first and sends a token to its second-best expert only with probability proportional to its weight
(section 2.2, "random routing", as its lingvo/praxis reference code does it); DeepSpeed's ``top1gating`` keeps a
random subset of an over-full expert's tokens by default (``use_rts=True``); Megatron-LM drops nothing by default
(``moe_expert_capacity_factor=None``) and, with a capacity factor, the lowest probabilities
(``moe_token_drop_policy="probs"``). ``groups``: the tokens of a batch are cut into
``groups`` equal contiguous groups and capacity and the loss are per group (GShard's "groups"): one process with
``groups = dp`` is what dp ranks with one group each compute (`course_lib.parallel.experts`).

**Auxiliary-loss-free balancing** (DeepSeek-V3, 2024, section 2.1.2): a per-expert bias b is added to the scores for
the choice of the top-k only, not to the weights; after each step ``b += gamma * sign(mean load - load)``
(`update_expert_bias`). ``alpha=0`` switches the loss off. Here the bias is added to the softmax probabilities, and
lesson 11 runs gamma = 3e-3 besides DeepSeek-V3's 1e-3; DeepSeek-V3 adds it to sigmoid affinities, takes the gating
weights from the affinities without the bias, normalised over the k selected (as transformers 5.24's
``DeepseekV3TopkRouter``: ``scores = router_logits.sigmoid()``, ``scores_for_choice = scores +
self.e_score_correction_bias``), runs gamma = 0.001 and keeps a small sequence-wise balance loss beside the bias
(report, sections 2.1.2 and 4.2).

**Dispatch as a permutation**: the T k (token, choice) pairs flattened choice-major, ``order = argsort(expert id,
stable)`` groups them by expert, ``counts = bincount(expert id)`` says how many each expert gets; the experts run on
contiguous slices; ``inverse = argsort(order)`` puts their outputs back, and a weighted sum over the k combines them.

Shapes: T tokens (B x s flattened), C d_model, E experts, k top_k, F an expert's hidden size, A = T k assignments.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.reference import reference_for

__all__ = ["TopKRouter", "SwiGLUExperts", "SharedExpert", "MoELayer", "Dispatch", "dispatch_permutation",
           "capacity_of", "switch_loss", "apply_moe", "moe_layers", "moe_loss", "update_expert_bias",
           "from_hf_mixtral", "from_hf_qwen2_moe"]


@reference_for("11-capacity-drop")
def capacity_of(capacity_factor: float | None, tokens: int, top_k: int, n_experts: int) -> int | None:
    """GShard/Switch capacity of one expert: ceil(capacity_factor * tokens * top_k / n_experts); None: unlimited."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


@reference_for("11-router-loss")
def switch_loss(probs: torch.Tensor, indices: torch.Tensor, n_experts: int, alpha: float = 1.0) -> torch.Tensor:
    """Switch Transformer's load-balancing loss alpha E sum_i f_i P_i (Fedus et al. 2021, eq. 4-6; lesson 11).

    probs (T, E) router probabilities; indices (T, k) chosen experts. f_i = count_i / (T k) from the token counts
    (no gradient), P_i = mean_t probs[t, i] (the gradient flows through it)."""
    counts = torch.bincount(indices.reshape(-1), minlength=n_experts).to(probs.dtype)   # (T, k) -> (E,)
    f = counts / indices.numel()
    P = probs.mean(0)                                                                   # (T, E) -> (E,)
    return alpha * n_experts * (f * P).sum()


@reference_for("11-router-loss")
class TopKRouter(nn.Module):
    """Top-k router (lesson 11; Shazeer et al. 2017, Mixtral, Switch): x (T, C) -> logits (T, E), probs (T, E),
    weights (T, k), indices (T, k). ``expert_bias`` (E,) shifts the choice only (DeepSeek-V3)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, normalize: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))          # (E, C), as Mixtral's gate
        nn.init.normal_(self.weight, std=0.02)
        self.n_experts, self.top_k, self.normalize = n_experts, top_k, normalize
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)                                    # (T, C) -> (T, E)
        probs = logits.float().softmax(-1)                                   # (T, E), fp32
        _, indices = torch.topk(probs + self.expert_bias, self.top_k, -1)    # (T, k): the bias picks, never weighs
        weights = probs.gather(-1, indices)                                  # (T, k)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), indices


class SwiGLUExperts(nn.Module):
    """E SwiGLU MLPs stored as three (E, ...) tensors (Mixtral's w1 gate, w3 up, w2 down; Shazeer 2020 "GLU Variants
    Improve Transformer"): y = (silu(x w1^T) * (x w3^T)) w2^T. ``first`` = the global index of expert 0 here (a shard
    under expert parallelism holds experts first .. first+E-1)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, first: int = 0):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) * 0.02)     # (E, F, C)
        self.w3 = nn.Parameter(torch.randn(n_experts, d_ff, d_model) * 0.02)     # (E, F, C)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_model, d_ff) * 0.02)     # (E, C, F)
        self.first = first

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (A, C) grouped by expert, counts[e] rows for local expert e -> (A, C)."""
        out = []
        for e, rows in enumerate(torch.split(x, counts)):                  # (A, C) -> E x (count_e, C)
            h = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())    # (count_e, C) -> (count_e, F)
            out.append(h @ self.w2[e].t())                                  # (count_e, F) -> (count_e, C)
        return torch.cat(out) if out else x[:0]


class SharedExpert(nn.Module):
    """An expert every token goes through (DeepSeekMoE; Qwen2-MoE adds a sigmoid gate per token: ``gated``)."""

    def __init__(self, d_model: int, d_ff: int, gated: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))    # (T, C) -> (T, F) -> (T, C)
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


class Dispatch:
    """One group's routing as a permutation: ``order`` (A,) sorts the choice-major assignments by expert, ``keep``
    (A,) bool in sorted order (capacity), ``counts`` (E,) kept rows per expert, ``inverse`` (A,) undoes ``order``."""

    def __init__(self, order, inverse, tokens, keep, counts, dropped):
        self.order, self.inverse, self.tokens, self.keep, self.counts, self.dropped = \
            order, inverse, tokens, keep, counts, dropped


@reference_for("11-dispatch-permutation", "11-capacity-drop")
def dispatch_permutation(indices: torch.Tensor, n_experts: int, capacity: int | None = None) -> Dispatch:
    """indices (T, k) -> `Dispatch`: argsort of the expert ids (choice-major, stable), counts per expert, tokens over
    ``capacity`` dropped in order (first choices before second, then by position), and the inverse permutation."""
    T, k = indices.shape
    flat = indices.t().reshape(-1)                                   # (T, k) -> (A,): all first choices, then seconds
    order = torch.argsort(flat, stable=True)                         # (A,) sorted by expert
    inverse = torch.argsort(order)                                   # (A,): order[inverse] = arange(A)
    tokens = order % T                                               # (A,) token of each sorted row
    counts = torch.bincount(flat, minlength=n_experts)               # (E,)
    if capacity is None:
        return Dispatch(order, inverse, tokens, None, counts, 0)
    starts = torch.cumsum(counts, 0) - counts                        # (E,) first sorted row of each expert
    slot = torch.arange(T * k, device=indices.device) - starts[flat[order]]   # (A,) place in its expert's queue
    keep = slot < capacity                                           # (A,)
    kept = counts.clamp(max=capacity)
    return Dispatch(order, inverse, tokens, keep, kept, int((counts - kept).sum()))


class MoELayer(nn.Module):
    """A block's MLP replaced by a mixture of experts (lesson 11): x (B, s, C) -> (B, s, C).

    After a forward: ``aux_loss`` (the Switch loss, mean over groups; 0-d tensor with graph), ``counts`` (E,) tokens
    routed to each expert before capacity, ``dropped`` (int), ``router_logits`` (T, E)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_ff: int, capacity_factor: float | None = None,
                 normalize: bool = True, alpha: float = 0.01, groups: int = 1, shared_d_ff: int = 0,
                 shared_gated: bool = False):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.router = TopKRouter(d_model, n_experts, top_k, normalize)
        self.experts = SwiGLUExperts(n_experts, d_model, d_ff)
        self.shared = SharedExpert(d_model, shared_d_ff, shared_gated) if shared_d_ff else None
        self.n_experts, self.top_k, self.d_ff = n_experts, top_k, d_ff
        self.capacity_factor, self.alpha, self.groups = capacity_factor, alpha, groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                      # (B, s, C) -> (T, C)
        if x.shape[0] % self.groups:
            raise ValueError(f"groups={self.groups} does not divide the {x.shape[0]} tokens of this batch")
        outs, losses, counts, logits, self.dropped = [], [], 0, [], 0
        for xg in x.chunk(self.groups):                                   # (T, C) -> groups x (S, C)
            lg, probs, weights, indices = self.router(xg)
            losses.append(switch_loss(probs, indices, self.n_experts, self.alpha))
            counts = counts + torch.bincount(indices.reshape(-1), minlength=self.n_experts)
            logits.append(lg)
            outs.append(self.route(xg, weights, indices))
        self.aux_loss = torch.stack(losses).mean()
        self.counts, self.router_logits = counts, torch.cat(logits)
        y = torch.cat(outs)                                               # (T, C)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)                                           # (T, C) -> (B, s, C)

    def route(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """One group: x (S, C), weights and indices (S, k) -> the experts' weighted sum (S, C)."""
        S, k = indices.shape
        d = dispatch_permutation(indices, self.n_experts, capacity_of(self.capacity_factor, S, k, self.n_experts))
        self.dropped += d.dropped
        rows = x[d.tokens]                                                # (S, C) -> (A, C) sorted by expert
        if d.keep is not None:
            rows = rows[d.keep]                                           # (A, C) -> (A_kept, C)
        y = self.compute(rows, d)                                         # (A_kept, C)
        return combine(y, d, weights)

    def compute(self, rows: torch.Tensor, d: Dispatch) -> torch.Tensor:
        """The experts on rows grouped by expert (the piece expert parallelism replaces)."""
        return self.experts(rows, d.counts.tolist())


def combine(y: torch.Tensor, d: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Expert outputs in sorted order (A_kept, C) -> the weighted sum over the k choices (S, C): dropped rows are 0,
    the inverse permutation restores the choice-major order, (A, C) -> (k, S, C)."""
    S, k = weights.shape
    if d.keep is not None:
        full = y.new_zeros(S * k, y.shape[-1])
        y = full.index_put((d.keep.nonzero().squeeze(1),), y)            # (A_kept, C) -> (A, C)
    y = y[d.inverse].view(k, S, -1)                                       # (A, C) -> (k, S, C)
    return (y * weights.t().unsqueeze(-1)).sum(0)                         # (k, S, C) -> (S, C)


def apply_moe(model: nn.Module, n_experts: int, top_k: int, d_ff: int | None = None, seed: int = 0,
              **kwargs) -> nn.Module:
    """Replace every block's ``mlp`` by a `MoELayer` (d_ff: an expert's hidden size, default the config's), in place,
    weights drawn from ``torch.manual_seed(seed)``; the GPT itself is unchanged (lesson 11). kwargs: `MoELayer`'s."""
    cfg = model.cfg
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: the MoE comparisons need dropout=0")
    torch.manual_seed(seed)
    dev = next(model.parameters()).device
    for block in model.blocks:
        block.mlp = MoELayer(cfg.d_model, n_experts, top_k, d_ff or cfg.d_ff, **kwargs).to(dev)
    return model


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """Every `MoELayer` of a model (expert-parallel ones included), in order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def moe_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The next-token cross-entropy plus every MoE layer's balancing loss."""
    loss = model.loss(idx, targets)
    return loss + sum(m.aux_loss for m in moe_layers(model))


@torch.no_grad()
def update_expert_bias(model: nn.Module, gamma: float = 1e-3, group=None) -> None:
    """DeepSeek-V3's auxiliary-loss-free update after a step: b_i += gamma * sign(mean load - load_i), the loads of
    the last forward (summed over ``group``'s ranks when given: every rank then keeps the same bias)."""
    import torch.distributed as dist

    for m in moe_layers(model):
        load = m.counts.to(m.router.expert_bias.dtype)
        if group is not None or (dist.is_available() and dist.is_initialized()):
            dist.all_reduce(load, group=group)
        m.router.expert_bias += gamma * torch.sign(load.mean() - load)


@torch.no_grad()
def from_hf_mixtral(block, capacity_factor=None, alpha: float = 0.01) -> MoELayer:
    """A `MoELayer` holding a copy of transformers' ``MixtralSparseMoeBlock``'s weights (gate (E, C); experts'
    gate_up_proj (E, 2F, C) = [w1; w3], down_proj (E, C, F) = w2)."""
    E, twoF, C = block.experts.gate_up_proj.shape
    layer = MoELayer(C, E, block.top_k, twoF // 2, capacity_factor, True, alpha)
    layer.router.weight.copy_(block.gate.weight)
    layer.experts.w1.copy_(block.experts.gate_up_proj[:, :twoF // 2])
    layer.experts.w3.copy_(block.experts.gate_up_proj[:, twoF // 2:])
    layer.experts.w2.copy_(block.experts.down_proj)
    return layer


@torch.no_grad()
def from_hf_qwen2_moe(block) -> MoELayer:
    """The same for ``Qwen2MoeSparseMoeBlock``: a shared expert with a sigmoid gate, top-k weights renormalised or not
    (``norm_topk_prob``)."""
    E, twoF, C = block.experts.gate_up_proj.shape
    shared = block.shared_expert
    layer = MoELayer(C, E, block.gate.top_k, twoF // 2, None, block.gate.norm_topk_prob, 0.01,
                     shared_d_ff=shared.gate_proj.out_features, shared_gated=True)
    layer.router.weight.copy_(block.gate.weight)
    layer.experts.w1.copy_(block.experts.gate_up_proj[:, :twoF // 2])
    layer.experts.w3.copy_(block.experts.gate_up_proj[:, twoF // 2:])
    layer.experts.w2.copy_(block.experts.down_proj)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.shared, name).weight.copy_(getattr(shared, name).weight)
    layer.shared.gate.weight.copy_(block.shared_expert_gate.weight)
    return layer
