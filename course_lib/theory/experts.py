"""Formulas of mixture-of-experts layers and expert parallelism (lesson 11).

**Parameters.** A MoE layer of E SwiGLU experts of hidden size F, a router (E x C) and an optional shared expert of
hidden size F_s replaces a block's MLP: total per layer 3 C F E + C E + 3 C F_s; a token meets only k experts,
active 3 C F k + C E + 3 C F_s (Shazeer et al. 2017; Mixtral, Jiang et al. 2024: 47 B total, 13 B active).
FLOPs per token of training are 6 N_active + attention (`course_lib.theory.flops`: the 6N rule with N the active
matmul weights).

**Switch loss** (Fedus et al. 2021, eq. 4): alpha E sum_i f_i P_i; uniform routing (f_i = P_i = 1/E) gives alpha.

**Communication per MoE layer per rank** (`course_lib.parallel.experts`; an all-to-all counted by its input, as
`ExpertCounter` counts it). Routing as a matrix M (P x E) of an ep group of P ranks: M[s, e] rows rank s sends to
expert e (after capacity). Rank r holds experts r E/P .. (r+1) E/P - 1; it sends S_r = sum_e M[r, e] rows and
receives R_r = sum_s sum_{e of r} M[s, e]. With rows of C elements of b bytes:

    forward   counts    1 all-to-all of E int64               (how many rows each expert gets)
              dispatch  1 all-to-all of S_r C b               (rows to their experts' ranks)
              combine   1 all-to-all of R_r C b               (outputs back to their tokens' ranks)
    backward  combine   1 all-to-all of S_r C b               (gradients of the outputs, reversed)
              dispatch  1 all-to-all of R_r C b               (gradients of the rows, reversed)

What leaves the rank is the payload minus the rows it sends to itself. Under uniform routing (T tokens a rank, no
drops) S_r = R_r = T k: each all-to-all's payload is T k C b and (ep-1)/ep of it leaves the rank.
"""

from __future__ import annotations

import dataclasses

from course_lib.config import ModelConfig
from course_lib.theory import flops

__all__ = ["MoESpec", "moe_layer_params", "moe_params", "moe_matmul_params", "moe_flops_per_token", "switch_loss",
           "layer_comm", "bytes_leaving", "uniform_layer_comm"]


def _mlp_params(cfg: ModelConfig) -> int:
    d, dff, b = cfg.d_model, cfg.d_ff, int(cfg.bias)
    return 2 * d * dff + b * (dff + d) if cfg.mlp == "gelu" else 3 * d * dff + b * (2 * dff + d)


def moe_layer_params(d_model: int, n_experts: int, experts_used: int, d_ff: int, shared_d_ff: int = 0) -> int:
    """One SwiGLU MoE layer's parameters counting ``experts_used`` of its experts (E for the total, k for what a
    token uses): 3 C F used + C E (the router) + 3 C F_s (a shared expert)."""
    return 3 * d_model * d_ff * experts_used + d_model * n_experts + 3 * d_model * shared_d_ff


def _moe_layer(cfg: ModelConfig, n_experts: int, experts_used: int, d_ff: int | None, shared_d_ff: int) -> int:
    return moe_layer_params(cfg.d_model, n_experts, experts_used, d_ff or cfg.d_ff, shared_d_ff)


def moe_params(cfg: ModelConfig, n_experts: int, top_k: int, d_ff: int | None = None, shared_d_ff: int = 0,
               shared_gated: bool = False) -> dict:
    """{"total", "active"}: every parameter of the GPT with each block's MLP a MoE layer, and those one token uses
    (k of the E experts). d_ff: an expert's hidden size (default cfg.d_ff)."""
    gate = cfg.d_model if shared_gated else 0
    dense = cfg.num_params() - cfg.n_layer * _mlp_params(cfg)
    return {"total": dense + cfg.n_layer * (_moe_layer(cfg, n_experts, n_experts, d_ff, shared_d_ff) + gate),
            "active": dense + cfg.n_layer * (_moe_layer(cfg, n_experts, top_k, d_ff, shared_d_ff) + gate)}


def moe_matmul_params(cfg: ModelConfig, n_experts: int, top_k: int, d_ff: int | None = None,
                      shared_d_ff: int = 0) -> int:
    """N_active of the 6N rule: `flops.matmul_params` with each MLP replaced by the router and k experts' matrices."""
    mlp = (2 if cfg.mlp == "gelu" else 3) * cfg.d_model * cfg.d_ff
    return flops.matmul_params(cfg) + cfg.n_layer * (_moe_layer(cfg, n_experts, top_k, d_ff, shared_d_ff) - mlp)


def moe_flops_per_token(cfg: ModelConfig, n_experts: int, top_k: int, d_ff: int | None = None, shared_d_ff: int = 0,
                        seq_len: int | None = None, training: bool = True) -> float:
    """6 N_active + 12 L T d for training (forward only: a third), as `course_lib.theory.flops.flops_per_token`."""
    f = 6 * moe_matmul_params(cfg, n_experts, top_k, d_ff, shared_d_ff) + flops.attention_flops_per_token(cfg, seq_len)
    return f if training else f / 3


def switch_loss(f: list[float], P: list[float], alpha: float = 0.01) -> float:
    """alpha E sum_i f_i P_i (Switch, eq. 4): f_i the fraction of assignments, P_i the mean probability of expert i."""
    return alpha * len(f) * sum(a * b for a, b in zip(f, P))


def layer_comm(M: list[list[int]], rank: int, d_model: int, dtype_bytes: int = 4) -> dict:
    """{(phase, op): {"calls", "bytes"}} of one MoE layer on ep rank ``rank``, M[s][e] rows rank s sends to expert e
    (the module docstring)."""
    P, E = len(M), len(M[0])
    n = E // P
    S = sum(M[rank])
    R = sum(M[s][e] for s in range(P) for e in range(rank * n, (rank + 1) * n))
    row = d_model * dtype_bytes
    return {("forward", "counts"): {"calls": 1, "bytes": 8 * E},
            ("forward", "dispatch"): {"calls": 1, "bytes": S * row}, ("forward", "combine"): {"calls": 1, "bytes": R * row},
            ("backward", "combine"): {"calls": 1, "bytes": S * row}, ("backward", "dispatch"): {"calls": 1, "bytes": R * row}}


def bytes_leaving(M: list[list[int]], rank: int, d_model: int, dtype_bytes: int = 4) -> int:
    """Bytes of rows rank ``rank``'s forward dispatch sends to other ranks: S_r minus its own experts' rows."""
    n = len(M[0]) // len(M)
    own = sum(M[rank][rank * n:(rank + 1) * n])
    return (sum(M[rank]) - own) * d_model * dtype_bytes


def uniform_layer_comm(tokens: int, top_k: int, d_model: int, ep: int, dtype_bytes: int = 4) -> dict:
    """Uniform routing, no drops: {"payload": T k C b per all-to-all, "leaving": (ep-1)/ep of it}."""
    payload = tokens * top_k * d_model * dtype_bytes
    return {"payload": payload, "leaving": payload * (ep - 1) / ep}


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """What makes a `ModelConfig` a mixture of experts, for the planner (lesson 08 with lesson 11; issue 32): every
    block from ``first_dense_layers`` on has E = ``n_experts`` routed SwiGLU experts of hidden size F =
    ``expert_d_ff`` (top-``top_k`` routing) plus ``n_shared`` always-on experts of the same size, and a router
    (C x E); the first ``first_dense_layers`` blocks keep the config's own MLP (``cfg.d_ff``). Mixtral 8x7B:
    ``MoESpec(8, 2, 14336)``.

    Two more parts of DeepSeek-V3's shape that a `ModelConfig` cannot hold: ``mla``, its attention (`flops.MLASpec`),
    replaces the config's multi-head attention in every block's parameters and FLOPs (the planner's activation count
    still reads the config's heads); ``mtp_depth``, its multi-token prediction modules (report, section 2.2: depth
    D = 1), each one more MoE block, a projection 2C x C and the output head again on every token, priced in FLOPs
    only (`mtp_flops_per_token`). DeepSeek-V3: ``MoESpec(256, 8, 2048, n_shared=1, first_dense_layers=3, mla=...,
    mtp_depth=1)`` (`lessons.l08_three_d.published`)."""

    n_experts: int
    top_k: int
    expert_d_ff: int
    n_shared: int = 0
    first_dense_layers: int = 0
    mla: flops.MLASpec | None = None
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_d_ff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} > n_experts={self.n_experts}: pick top_k <= n_experts")
        if self.n_shared < 0 or self.first_dense_layers < 0 or self.mtp_depth < 0:
            raise ValueError("n_shared, first_dense_layers and mtp_depth must be >= 0")

    @property
    def shared_d_ff(self) -> int:
        """Hidden size of the shared experts together (one SwiGLU MLP of n_shared x F)."""
        return self.n_shared * self.expert_d_ff

    @property
    def active_d_ff(self) -> int:
        """Hidden size a token's activations see in a MoE layer: k routed experts and the shared ones (k F + F_s)."""
        return self.top_k * self.expert_d_ff + self.shared_d_ff

    def moe_layers(self, cfg: ModelConfig, first: int = 0, count: int | None = None) -> int:
        """MoE blocks among blocks ``first .. first + count - 1`` (default: all of cfg's)."""
        count = cfg.n_layer - first if count is None else count
        return max(0, min(cfg.n_layer, first + count) - max(first, self.first_dense_layers))

    def expert_params(self, cfg: ModelConfig) -> int:
        """Routed experts' parameters of one MoE block: 3 C F E (sharded by expert parallelism)."""
        return 3 * cfg.d_model * self.expert_d_ff * self.n_experts

    def dense_delta(self, cfg: ModelConfig) -> int:
        """A MoE block's dense parameters minus the dense block's: router C E + shared 3 C F_s - the config's MLP."""
        return cfg.d_model * self.n_experts + 3 * cfg.d_model * self.shared_d_ff - _mlp_params(cfg)

    def attention_delta(self, cfg: ModelConfig, matmul_only: bool = False) -> int:
        """One block's attention parameters with ``mla`` minus the config's multi-head attention (0 without MLA)."""
        if self.mla is None:
            return 0
        d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
        mha = 2 * d * d + 2 * d * kv + (0 if matmul_only else int(cfg.bias) * (2 * d + 2 * kv))
        return (self.mla.matmul_params(d) if matmul_only else self.mla.params(d)) - mha

    def attention_core_flops_per_token(self, cfg: ModelConfig, seq_len: int | None = None) -> float:
        """Training FLOPs per token of every block's score and value matmuls: `flops.attention_flops_per_token`, or
        ``mla``'s `flops.MLASpec.core_flops_per_token` per block."""
        if self.mla is None:
            return flops.attention_flops_per_token(cfg, seq_len)
        return cfg.n_layer * self.mla.core_flops_per_token(cfg.seq_len if seq_len is None else seq_len)

    def active_matmul_params(self, cfg: ModelConfig) -> int:
        """N_active of the 6N rule: `flops.matmul_params` with each MoE block's MLP replaced by its router, k routed
        experts and the shared ones (the first dense blocks keep theirs), and every block's attention by ``mla``'s
        (multi-token prediction not included: `mtp_flops_per_token`)."""
        mlp = (2 if cfg.mlp == "gelu" else 3) * cfg.d_model * cfg.d_ff
        return flops.matmul_params(cfg) + self.moe_layers(cfg) * (
            _moe_layer(cfg, self.n_experts, self.top_k, self.expert_d_ff, self.shared_d_ff) - mlp) + (
            cfg.n_layer * self.attention_delta(cfg, matmul_only=True))

    def mtp_flops_per_token(self, cfg: ModelConfig, seq_len: int | None = None) -> float:
        """Training FLOPs per token of the ``mtp_depth`` multi-token prediction modules (DeepSeek-V3 report, section
        2.2): each runs on every token one more block (attention, router, k routed and the shared experts), the
        projection M of the concatenated [norm(h); norm(embedding)] (2C -> C) and the shared output head (C x V):
        6 x those matmul weights + one block's attention core. The shared embedding is a lookup (no matmul)."""
        if not self.mtp_depth:
            return 0.0
        d = cfg.d_model
        attn = 2 * d * d + 2 * d * cfg.n_kv_head * cfg.head_dim + self.attention_delta(cfg, matmul_only=True)
        block = attn + _moe_layer(cfg, self.n_experts, self.top_k, self.expert_d_ff, self.shared_d_ff)
        core = self.attention_core_flops_per_token(cfg, seq_len) / cfg.n_layer
        return self.mtp_depth * (6 * (block + 2 * d * d + d * cfg.vocab_size) + core)

    def flops_per_token(self, cfg: ModelConfig, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 N_active + the attention core (12 L T d, or ``mla``'s) + the multi-token
        prediction modules (`moe_flops_per_token` when every block is MoE and neither is given)."""
        return (6 * self.active_matmul_params(cfg) + self.attention_core_flops_per_token(cfg, seq_len)
                + self.mtp_flops_per_token(cfg, seq_len))

    def total_params(self, cfg: ModelConfig) -> int:
        """Every parameter of the model (embeddings included; the multi-token prediction modules not)."""
        return cfg.num_params() + self.moe_layers(cfg) * (self.dense_delta(cfg) + self.expert_params(cfg)) + (
            cfg.n_layer * self.attention_delta(cfg))
