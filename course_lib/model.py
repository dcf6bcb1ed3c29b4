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

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP", "lm_loss", "build_model", "hf_gpt2_config", "to_hf_gpt2"]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) -> scalar, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())   # (B*T, V) vs (B*T,)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, section 3.2) with one fused qkv matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.head_dim, self.dropout = cfg.n_head, cfg.head_dim, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)   # C -> 3C: q, k, v
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)      # C -> C
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)                           # (B, T, C) -> 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, T, C) -> (B, H, T, D)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)      # (B, H, T, D)
        y = self.attend(q, k, v)                                          # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                  # (B, H, T, D) -> (B, T, C)
        return self.resid_drop(self.proj(y))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D) + causal mask) v, fused (SDPA). Lesson 07 swaps in a naive version to
        measure what the fused kernel saves."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )


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


# ---- Hugging Face transformers GPT-2 (a library reference, built from a config: no download) ----------

def hf_gpt2_config(cfg: ModelConfig):
    """A `transformers.GPT2Config` with the same shape as `cfg` (GELU tanh = "gelu_new", eps 1e-5)."""
    from transformers import GPT2Config

    if not cfg.gpt2_style or not cfg.bias:
        raise ConfigError(
            f"hf_gpt2_config needs a gpt2-style config with bias=True; got {cfg.name or cfg!r}"
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
