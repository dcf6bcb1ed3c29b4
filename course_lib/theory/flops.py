"""FLOPs of training a GPT, by formula (lesson 01).

Convention (PaLM, Chowdhery et al. 2022, appendix B; Chinchilla, Hoffmann et al. 2022, appendix F):
one multiply-add = 2 FLOPs; a training step = forward + backward, and the backward pass costs twice the
forward (gradients with respect to the input *and* the weight of every matmul). Per token:

    training FLOPs per token = 6 N + 12 * n_layer * seq_len * d_model

- ``N`` counts the weights that take part in a matmul: q/k/v/output projections and MLP matrices of
  every layer, plus the LM head (d_model x vocab), which is a matmul even when its weight is tied to the
  token embedding. Embedding lookups, biases and norms do no matmul and are left out.
- The attention term counts ``Q K^T`` and ``softmax(.) V`` (2 x 2 x seq_len x d_model FLOPs per token per
  layer forward, x3 for training) over the *full* seq_len x seq_len score matrix, i.e. **not** halved
  for the causal mask. This is what PaLM does, and what ``FlopCounterMode`` counts for
  ``scaled_dot_product_attention`` (it ignores ``is_causal``).
- Recomputation (activation checkpointing, flash attention's backward) is not counted: these are
  *model* FLOPs, the numerator of MFU.

What the formula leaves out (and ``FlopCounterMode`` also does not count): softmax, layer norm, GELU,
residual adds, the loss and the optimizer step: O(d_model) per token each, a few percent at most.

Kaplan et al. 2020 (table 1) write 6N + 6 n_layer n_ctx d_attn: the same count with the causal half
of the attention matrix skipped. ``causal=True`` gives that convention.
"""

from __future__ import annotations

from course_lib.config import ModelConfig
from course_lib.reference import reference_for


@reference_for("01-flops-per-token")
def matmul_params(cfg: ModelConfig) -> int:
    """N of the 6N rule: weights used in a matmul per token (per layer attention + MLP, plus the LM head).

    Attention: q and output projection d x d each, k and v d x (n_kv_head * head_dim) each (grouped-query
    attention shrinks them). MLP: 2 matrices d x d_ff (GELU) or 3 (SwiGLU). Head: d x vocab.
    """
    d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
    attn = 2 * d * d + 2 * d * kv
    mlp = (2 if cfg.mlp == "gelu" else 3) * d * cfg.d_ff
    return cfg.n_layer * (attn + mlp) + d * cfg.vocab_size


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, causal: bool = False) -> float:
    """Training FLOPs per token of the score and value matmuls: 12 * n_layer * seq_len * d_model.

    Forward: Q K^T costs 2 * seq_len * d_model per token per layer, P V the same; training = 3 x forward.
    ``causal=True`` halves it (only the lower triangle is useful work; Kaplan et al. 2020).
    """
    T = cfg.seq_len if seq_len is None else seq_len
    f = 12 * cfg.n_layer * T * cfg.d_model
    return f / 2 if causal else f


@reference_for("01-flops-per-token")
def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, causal: bool = False,
                    training: bool = True) -> float:
    """Model FLOPs per token: 6N + 12 L T d for training (forward + backward), 2N + 4 L T d forward only."""
    f = 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal)
    return f if training else f / 3


def training_flops(n_params: float, n_tokens: float) -> float:
    """Total training compute by the 6 N D rule (attention neglected): 6 x parameters x tokens.

    GPT-3 175B on 300B tokens: 6 * 175e9 * 300e9 = 3.15e23 FLOPs (Brown et al. 2020, table D.1: 3.14e23).
    """
    return 6 * n_params * n_tokens


def step_flops(cfg: ModelConfig, batch_size: int, seq_len: int | None = None) -> float:
    """Model FLOPs of one training step on ``batch_size`` sequences of ``seq_len`` tokens."""
    T = cfg.seq_len if seq_len is None else seq_len
    return flops_per_token(cfg, T) * batch_size * T


def training_days(total_flops: float, n_gpus: int, peak_flops_per_gpu: float, mfu: float) -> float:
    """Wall-clock days to spend ``total_flops`` on ``n_gpus`` running at ``mfu`` of their peak."""
    return total_flops / (n_gpus * peak_flops_per_gpu * mfu) / 86400
