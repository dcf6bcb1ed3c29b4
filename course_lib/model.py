"""A small, readable GPT in plain torch (lesson 00; its FLOPs and memory are dissected in lesson 01).

The model follows GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"),
itself the decoder of the Transformer (Vaswani et al. 2017, "Attention Is All You Need") with the
LayerNorm moved before each sub-layer ("pre-LN"). It is written in the style of Karpathy's nanoGPT.

The model knows nothing of parallelism: techniques in `course_lib.parallel` are applied to a plain
`GPT` from outside. Attribute names are fixed by docs/CONVENTIONS.md:
model.tok_emb, model.pos_emb, model.blocks[i].{ln1, attn.{qkv, proj}, ln2, mlp.{fc, proj}}, model.ln_f,
model.head (tied to tok_emb when cfg.tie_embeddings).

`to_hf_gpt2(model)` copies the weights into a Hugging Face `transformers.GPT2LMHeadModel` built from
a config (no download), so lessons can check the model against a library implementation.

Shorthand in shape comments: B batch, T sequence length, C = d_model, H = n_head, D = head_dim,
F = d_ff, V = vocab_size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.config import ConfigError, ModelConfig

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP", "lm_loss", "z_loss", "naive_attention", "set_attention",
           "track_attention_logits", "max_attention_logit", "build_model", "pad_vocab", "hf_gpt2_config",
           "to_hf_gpt2"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar, computed in fp32.
    Targets equal to -100 (padding) are left out of the mean (`course_lib.training.token_loss`)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())   # (B*T, V) vs (B*T,)


def z_loss(logits: torch.Tensor, targets: torch.Tensor | None = None, ignore_index: int = -100,
           reduction: str = "mean") -> torch.Tensor:
    """log(Z)^2 of the output softmax, Z = sum_v exp(logit_v), per position (fp32): the auxiliary loss of PaLM
    (Chowdhery et al. 2022, "Training setup": "We additionally use an auxiliary loss of z_loss = 10^-4 · log^2 Z to
    encourage the softmax normalizer log(Z) to be close to 0, which we found increases the stability of
    training"). Add `1e-4 * z_loss(logits, targets)` to the training loss (lesson 09).

    It acts on the *output* logits only: it keeps them from drifting (the softmax is unchanged by adding a
    constant to every logit, so cross-entropy alone never pulls them back); it does not touch the attention logits.
    logits (B, T, V); targets (B, T) or None: positions whose target is `ignore_index` are left out.
    reduction 'mean' (over kept positions) or 'sum' (to divide by a global token count, `course_lib.training.token_loss`).
    """
    lse = torch.logsumexp(logits.float(), dim=-1)                   # (B, T, V) -> (B, T): log Z per position
    sq = lse.square()
    if targets is not None:
        sq = sq.masked_fill(targets == ignore_index, 0.0)
        count = (targets != ignore_index).sum().clamp(min=1)
    else:
        count = sq.numel()
    if reduction == "sum":
        return sq.sum()
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r} is unknown: pick 'mean' or 'sum'")
    return sq.sum() / count


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v, written out: the (B, H, T, T) softmax output is kept for backward
    (lessons 07, 12: what the fused kernel saves in memory and time). No dropout."""
    T, D = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))                # (B, H, T, D) -> (B, H, T, T)
    mask = torch.full((T, T), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
    return torch.softmax(scores + mask, dim=-1) @ v                           # (B, H, T, T) -> (B, H, T, D)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, section 3.2) with one fused qkv matmul.

    cfg.qk_norm adds `q_norm`, `k_norm`: a LayerNorm over each head's D features of the queries and of the keys
    (shared by the heads) before the dot product. Dehghani et al. 2023 ("Scaling Vision Transformers to 22 Billion
    Parameters") saw a divergence caused by "extremely large values in attention logits, which lead to
    (almost one-hot) attention weights with near-zero entropy" and "apply LayerNorm (Ba et al., 2016) to the queries
    and keys before the dot-product attention computation". OLMo 2 (Team OLMo 2024) uses QK-norm with RMSNorm, over
    the whole query (and key) projection of all heads at once (Hugging Face's `Olmo2Attention`:
    `q_norm = Olmo2RMSNorm(num_attention_heads * head_dim)`); here the per-head LayerNorm of Dehghani et al.

    Set `record_max_logit = True` (or `track_attention_logits(model)`) to keep, after each forward, the largest
    attention logit q.k / sqrt(D) over the causal positions in `max_logit` (a 0-dim tensor, no gradient): an extra
    (B, H, T, T) matmul without autograd; the output is not changed.
    """

    qk_norm = False                       # class defaults: a subclass that skips this __init__ (lesson 10's
    record_max_logit = False              # ContextParallelAttention) still runs `forward`
    max_logit: torch.Tensor | None = None
    attention = "sdpa"                    # `set_attention(model, "naive")`: the written-out kernel instead

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.head_dim, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)   # C -> 3C: q, k, v
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)      # C -> C
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.LayerNorm(cfg.head_dim, bias=cfg.bias)          # over D, per head
            self.k_norm = nn.LayerNorm(cfg.head_dim, bias=cfg.bias)
        self.record_max_logit = False
        self.max_logit = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)                           # (B, T, C) -> 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, T, C) -> (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        if self.qk_norm:                                                  # QK-norm (Dehghani et al. 2023)
            q, k = self.q_norm(q), self.k_norm(k)                         # (B, H, T, D), each head normalised
        if self.record_max_logit:
            self.max_logit = self._max_logit(q.detach(), k.detach())
        y = self.attend(q, k, v)                                          # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                  # (B, H, T, D) -> (B, T, C)
        return self.resid_drop(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D) + causal mask) v, fused (SDPA), or `naive_attention` where `set_attention`
        chose it (lesson 12's ladder). Lesson 07 swaps in a naive version to measure what the fused kernel saves."""
        if self.attention == "naive":
            return naive_attention(q, k, v)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )

    @torch.no_grad()
    def _max_logit(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """max over batch, heads and causal (query, key) pairs of q.k / sqrt(D), in fp32: a 0-dim tensor."""
        T = q.shape[-2]
        logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)   # (B, H, T, T)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)            # (T, T) key after query
        return logits.masked_fill(future, float("-inf")).amax()


def set_attention(model: nn.Module, kind: str = "sdpa") -> nn.Module:
    """Every `CausalSelfAttention` of `model` computes attention the `kind` way from now on: 'sdpa' (the fused
    kernel, the default) or 'naive' (`naive_attention`, which has no dropout: refused when dropout > 0). Returns
    `model` (lesson 12)."""
    if kind not in ("sdpa", "naive"):
        raise ValueError(f"attention kind={kind!r} is unknown: pick 'sdpa' or 'naive'")
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            if kind == "naive" and m.dropout > 0:
                raise ConfigError(f"dropout={m.dropout} with naive attention: naive_attention has no dropout, "
                                  f"use dropout=0.0 or kind='sdpa'")
            m.attention = kind
    return model


def track_attention_logits(model: nn.Module, on: bool = True) -> None:
    """Switch the recording of the largest attention logit on (or off) in every `CausalSelfAttention` of `model`
    (lesson 09). Read it after a forward with `max_attention_logit(model)`."""
    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.record_max_logit = on
            m.max_logit = None


def max_attention_logit(model: nn.Module) -> float:
    """The largest attention logit q.k / sqrt(D) of the last forward, over every layer (NaN where none was
    recorded: call `track_attention_logits(model)` first)."""
    seen = [m.max_logit for m in model.modules() if isinstance(m, CausalSelfAttention) and m.max_logit is not None]
    return max(float(t) for t in seen) if seen else float("nan")


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear C->F, GELU (tanh approximation, GPT-2's "gelu_new"), Linear F->C."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)     # C -> F
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)   # F -> C
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x), approximate="tanh")                    # (B, T, C) -> (B, T, F)
        return self.drop(self.proj(h))                                # (B, T, F) -> (B, T, C)


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) (Radford et al. 2019, section 2.3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))   # (B, T, C)
        x = x + self.mlp(self.ln2(x))    # (B, T, C)
        return x


class GPT(nn.Module):
    """A GPT-2-style decoder-only language model (lesson 00).

    `GPT(cfg)` initialises from torch's global RNG (seed it, or use `build_model(cfg, seed)`).
    Only gpt2-style configs (LayerNorm, GELU, learned positions, n_kv_head == n_head) can be built;
    llama-style presets are theory-only and raise ConfigError.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not cfg.gpt2_style:
            wrong = [f"{f}={getattr(cfg, f)!r} (need {need!r})" for f, need in
                     (("norm", "layernorm"), ("mlp", "gelu"), ("pos", "learned"), ("n_kv_head", cfg.n_head))
                     if getattr(cfg, f) != need]
            raise ConfigError(
                f"GPT builds gpt2-style configs only; config {cfg.name or '(unnamed)'!r} has "
                f"{', '.join(wrong)}: it is theory-only, use cfg.num_params() and course_lib.theory for it, "
                f"or pick a gpt2-style preset such as 'tiny'"
            )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)   # (V, C)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)      # (T_max, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)   # C -> V
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight   # one (V, C) matrix used twice
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: weights N(0, 0.02), biases 0, LayerNorm (1, 0); the two projections that
        write into the residual stream (attn.proj, mlp.proj) get std 0.02 / sqrt(2 * n_layer)
        (Radford et al. 2019, section 2.3), so the residual stream's variance does not grow with depth."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 token ids -> logits (B, T, V)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence length T={T} exceeds cfg.seq_len={self.cfg.seq_len}: "
                f"crop the input to its last {self.cfg.seq_len} tokens or build a model with a larger seq_len"
            )
        pos = torch.arange(T, device=idx.device)                    # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))        # (B, T) -> (B, T, C)
        for block in self.blocks:
            x = block(x)                                            # (B, T, C)
        x = self.ln_f(x)
        return self.head(x)                                         # (B, T, C) -> (B, T, V)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats) of the logits for idx (B, T) against targets (B, T)."""
        logits = self(idx)                                          # (B, T, V)
        return lm_loss(logits, targets)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied head counted once); equals cfg.num_params()."""
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """Seed torch's RNG with `seed`, then build `GPT(cfg)`: the same seed gives the same weights."""
    torch.manual_seed(seed)
    return GPT(cfg)


@torch.no_grad()
def pad_vocab(model: GPT, multiple: int = 128) -> GPT:
    """A copy of `model` with its vocabulary padded to a multiple of `multiple` (`ModelConfig.padded_vocab`, lesson
    12): every weight copied, the extra rows of the embedding and of the LM head zero, so the first vocab_size
    logits are the unpadded model's and each extra logit is 0 (it enters the softmax's normaliser; it is never a
    target). Same device, dtype and train/eval mode as `model`."""
    cfg, new_cfg = model.cfg, model.cfg.padded_vocab(multiple)
    w = model.tok_emb.weight
    with torch.random.fork_rng(devices=[]):                       # its random init is overwritten: leave the RNG be
        padded = GPT(new_cfg).to(device=w.device, dtype=w.dtype).train(model.training)
    state = model.state_dict()
    for name, t in padded.state_dict().items():
        if t.shape != state[name].shape:                          # tok_emb.weight / head.weight: (V, C) -> (V', C)
            t.zero_()[: cfg.vocab_size].copy_(state[name])
        else:
            t.copy_(state[name])
    return padded


# ---- Hugging Face transformers GPT-2 (a library reference, built from a config: no download) ----------

def hf_gpt2_config(cfg: ModelConfig):
    """A `transformers.GPT2Config` with the same shape as `cfg` (GELU tanh = "gelu_new", eps 1e-5)."""
    from transformers import GPT2Config

    if not cfg.gpt2_style or not cfg.bias or cfg.qk_norm:
        raise ConfigError(
            f"hf_gpt2_config needs a gpt2-style config with bias=True and qk_norm=False; got {cfg.name or cfg!r}"
        )
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=cfg.d_ff, activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=1e-5, initializer_range=0.02, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1,
    )


@torch.no_grad()
def to_hf_gpt2(model: GPT):
    """A `transformers.GPT2LMHeadModel` holding a copy of `model`'s weights (same logits, lesson 00).

    GPT-2's checkpoints use `Conv1D` layers whose weight is stored (in, out), the transpose of
    `nn.Linear`'s (out, in): every matrix except the embeddings is transposed on the way.
    """
    from transformers import GPT2LMHeadModel

    cfg = model.cfg
    hf = GPT2LMHeadModel(hf_gpt2_config(cfg))
    tr = hf.transformer
    tr.wte.weight.copy_(model.tok_emb.weight)
    tr.wpe.weight.copy_(model.pos_emb.weight)
    for ours, theirs in zip(model.blocks, tr.h):
        pairs = [
            (ours.ln1, theirs.ln_1, False), (ours.attn.qkv, theirs.attn.c_attn, True),
            (ours.attn.proj, theirs.attn.c_proj, True), (ours.ln2, theirs.ln_2, False),
            (ours.mlp.fc, theirs.mlp.c_fc, True), (ours.mlp.proj, theirs.mlp.c_proj, True),
        ]
        for src, dst, transpose in pairs:
            dst.weight.copy_(src.weight.t() if transpose else src.weight)   # Linear (out, in) -> Conv1D (in, out)
            dst.bias.copy_(src.bias)
    tr.ln_f.weight.copy_(model.ln_f.weight)
    tr.ln_f.bias.copy_(model.ln_f.bias)
    if not cfg.tie_embeddings:
        hf.lm_head.weight.copy_(model.head.weight)
    hf.to(device=model.tok_emb.weight.device, dtype=model.tok_emb.weight.dtype)
    hf.train(model.training)
    return hf
