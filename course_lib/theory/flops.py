"""FLOPs of training a GPT, by formula (lesson 01).

Convention (the course's; the formula's shape is PaLM's, Chowdhery et al. 2022, appendix B, whose N is every
parameter; Chinchilla, Hoffmann et al. 2022, appendix F):
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

Kaplan et al. 2020 (table 1): an attention row of 2 n_layer n_ctx d_attn forward, half the full matrix's; their N
excludes the embeddings and their total the LM head, so theirs is not the same count. ``causal=True`` halves the
course's attention term (the "Kaplan (causal half)" row of ``FLOP_CONVENTIONS``: Kaplan's attention term, the
course's N).

The conventions of others, one function each (lesson 01, section 1.5; ``FLOP_CONVENTIONS`` names them all):
:func:`palm_flops_per_token` (6N + 12 L H Q T, N every parameter), :func:`megatron_flops_per_token` (Narayanan et
al. 2021, with or without the recomputation term), :func:`megatron_code_flops_per_token` (Megatron-LM's code today:
the causal half), :func:`torchtitan_flops_per_token`; :func:`hardware_flops_per_token`
counts what recomputation adds (HFU's numerator); `course_lib.measure.speed.mfu` divides by the *dense* peak.

Multi-head latent attention (DeepSeek-V2 and V3), whose projections and score width differ from multi-head attention
of the model's width, is priced by :class:`MLASpec` (lesson 11, section 5).
"""

from __future__ import annotations

import dataclasses

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
    ``causal=True`` halves it (only the lower triangle is useful work; Kaplan et al. 2020's attention row).
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


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3, arXiv 2412.19437,
    sections 2.1.1 and 4.2), its matmuls as transformers 5.24's ``DeepseekV3Attention`` builds them
    (``models/deepseek_v3/modeling_deepseek_v3.py``), for a model of width d:

    - query: ``q_a_proj`` d x q_lora_rank (the compression), an RMSNorm, ``q_b_proj`` q_lora_rank x n_head (d_nope +
      d_rope) (the up-projection);
    - key and value: ``kv_a_proj_with_mqa`` d x (kv_lora_rank + d_rope) (the compressed latent and the one decoupled
      RoPE key all heads share), an RMSNorm, ``kv_b_proj`` kv_lora_rank x n_head (d_nope + d_v) (keys' and values'
      up-projection; training applies it to every token, nothing is absorbed);
    - output: ``o_proj`` n_head d_v x d;
    - scores q.k over d_qk = d_nope + d_rope per head, the weighted sum of values over d_v per head.

    DeepSeek-V3 (report, section 4.2; transformers' ``DeepseekV3Config`` defaults): 128 heads, d_nope 128, d_rope 64,
    d_v 128, kv_lora_rank 512, q_lora_rank 1,536, in a model of width 7,168: ``MLASpec(128, 1536, 512, 128, 64, 128)``.
    """

    n_head: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's q.k product: d_nope + d_rope (DeepSeek-V3: 192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def matmul_params(self, d_model: int) -> int:
        """Weights of one layer's attention matmuls (the class docstring's five projections)."""
        h = self.n_head
        q = d_model * self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * h * (
            self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d_model

    def params(self, d_model: int) -> int:
        """Every parameter of one layer's attention: the matmuls and the two RMSNorms of the latents."""
        return self.matmul_params(d_model) + self.q_lora_rank + self.kv_lora_rank

    def core_flops_per_token(self, seq_len: int, causal: bool = False, training: bool = True) -> float:
        """FLOPs per token of one layer's score and value matmuls: forward 2 s n_head d_qk (q.k) + 2 s n_head d_v
        (weights times values), training 3 x that; over the full s x s matrix, as :func:`attention_flops_per_token`
        counts multi-head attention (its 12 L s d is this with d_qk = d_v = d / n_head); ``causal=True`` halves it."""
        f = 2 * seq_len * self.n_head * (self.qk_head_dim + self.v_head_dim) * (3 if training else 1)
        return f / 2 if causal else f


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


# ---------------------------------------------------------------------------------------------
# The same quantity by the conventions the field uses (lesson 01, section 1.5; issue 30, section 4)
# ---------------------------------------------------------------------------------------------
# Published formulas for "training FLOPs per token". They agree on 6 FLOPs per weight per token; they differ in which
# weights N counts, in whether recomputation is counted, and in the attention matrix: full (PaLM, the 2021 Megatron-LM
# paper, torchtitan) or its causal half (Kaplan et al. 2020, Megatron-LM's code today). Each function applies its source's formula, as its source writes it, to a course ModelConfig.


def palm_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """PaLM's model FLOPs per token (Chowdhery et al. 2022, arXiv 2204.02311, appendix B): 6 N + 12 L H Q T.

    L layers, H heads, Q head dimension, T sequence length; ``N`` the model's parameter count. Here N is
    ``cfg.num_params()``, every parameter, a tied table counted once: that is how the formula is used in practice,
    e.g. nanoGPT's ``estimate_mfu`` (karpathy/nanoGPT, model.py), which cites the appendix:

        # see PaLM paper Appendix B as ref: https://arxiv.org/abs/2204.02311
        N = self.get_num_params()
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd//cfg.n_head, cfg.block_size
        flops_per_token = 6*N + 12*L*H*Q*T

    (nanoGPT's ``get_num_params`` leaves out the position table only.) Against :func:`flops_per_token` it adds 6 x
    the weights that do no matmul: embedding tables (a tied table is the LM head, so it is counted once, correctly),
    norms and biases. H * Q = d_model, so the attention term is the course's.
    """
    T = cfg.seq_len if seq_len is None else seq_len
    return 6 * cfg.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T


def megatron_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, recompute: bool = False) -> float:
    """Megatron-LM's FLOPs per token (Narayanan et al. 2021, arXiv 2104.04473, section 5.1 / appendix).

    The paper counts, per iteration of batch B, sequence s, l layers, hidden size h, vocabulary V, *with* full
    activation recomputation (forward, recomputed forward, backward = 4 forward passes of the layers):

        F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))

    Derivation (per layer, forward, per sequence): QKV 6 s h^2, scores Q K^T 2 s^2 h, P V 2 s^2 h, output projection
    2 s h^2, MLP (4h) 16 s h^2: 24 s h^2 + 4 s^2 h. Times 4 passes = 96 s h^2 (1 + s / (6 h)); the LM head 2 s h V
    runs forward + backward only (x3): 6 s h V = 96 s l h^2 * V / (16 l h). Without recomputation the layers run 3
    passes: F = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h)). Per token (divided by B s):

        recompute=False:  72 l h^2 (1 + s/(6h) + V/(12 l h)) = 72 l h^2 + 12 l s h + 6 h V   (model FLOPs, MFU)
        recompute=True:   96 l h^2 (1 + s/(6h) + V/(16 l h)) = 96 l h^2 + 16 l s h + 6 h V   (hardware FLOPs, HFU)

    The paper's formula assumes a GPT block: d_ff = 4 h, full multi-head attention, GELU (2 MLP matrices). On such a
    model ``recompute=False`` equals :func:`flops_per_token` exactly; on SwiGLU / grouped-query models (Llama) it
    does not (Megatron's code, ``num_floating_point_operations``, generalises it). The paper's "achieved TFLOP/s"
    (its Table 1) use ``recompute=True``: hardware FLOPs, not model FLOPs.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    l, h, V = cfg.n_layer, cfg.d_model, cfg.vocab_size
    if recompute:
        return 96 * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))


def megatron_code_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Megatron-LM's FLOPs per token as its code counts them today, not as the 2021 paper wrote them
    (NVIDIA/Megatron-LM, ``megatron/training/training.py``, ``num_floating_point_operations``, the MHA / GQA branch of
    ``transformer_flops`` as at commit 9a7cd17f, quoted below; since 5e4fc931 (2026-05-21) the core-attention term is a
    separate ``standard_self_attn_core_term`` multiplied by ``seqlen_squared_sum_in_batch``, the same value for
    unpacked sequences, with the same ``/ 2  # causal mask (only half of the mask is non-zero)``; checked at da5a81d,
    2026-08-22):

        forward_backward_expansion_factor = 3, fma_expansion_factor = 2
        ffn_expansion_factor = 3 if args.swiglu else 2
        standard_self_attn_term = forward_backward_expansion_factor * fma_expansion_factor * (
            ## qkv proj
            args.hidden_size * (query_projection_size + key_projection_size + value_projection_size + ...)
            ## core attention
            + query_projection_size * args.seq_length
            / 2  # causal mask (only half of the mask is non-zero)
            * 2  # QK^T and (QK^T)V
            ## out proj
            + query_projection_size * args.hidden_size)

    plus the MLP ``6 h d_ff x ffn_expansion_factor`` per layer and the logits ``6 h V`` (V: Megatron's
    ``args.padded_vocab_size``; the course's vocabulary here), all per token. The
    matmul weights are the course's N; the attention matrix is the causal half, 6 L T d: the count equals
    ``flops_per_token(cfg, causal=True)`` (the causal half), on GPT, SwiGLU and grouped-query blocks alike. The
    paper's formula (:func:`megatron_flops_per_token`) counts the full matrix, 12 L T d. No recomputation is counted.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    h, q = cfg.d_model, cfg.n_head * cfg.head_dim
    kv = cfg.n_kv_head * cfg.head_dim
    attn = 3 * 2 * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)
    mlp = 3 * 2 * h * cfg.d_ff * (3 if cfg.mlp == "swiglu" else 2)
    return cfg.n_layer * (attn + mlp) + 3 * 2 * h * cfg.vocab_size


def torchtitan_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, before_tying_fix: bool = False) -> float:
    """torchtitan's FLOPs per token (pytorch/torchtitan, ``torchtitan/models/utils.py``,
    ``get_dense_model_nparams_and_flops``, read at commit b5bcd76c, 2026-08-21):

        nparams = sum(p.numel() for p in model.parameters())
        nparams_embedding = sum(... for m in model.children() if isinstance(m, nn.Embedding))
        # 4. we follow the convention and do not account for sparsity in causal attention
        nparams_for_matmul = nparams if enable_weight_tying else nparams - nparams_embedding
        num_flops_per_token = (
            6 * nparams_for_matmul + 6 * n_layers * n_heads * head_dims * seq_len
        )

    with ``head_dims = 2 * (dim // n_heads)`` for Llama 3 (``models/llama3/model.py``), i.e. 6 N + 12 L d T. N is
    every parameter (``model.parameters()`` yields a tied table once) minus the ``nn.Embedding`` children when the
    head is untied: norms (and biases) stay in, the LM head stays in. Before PR #3225 ("Fix weight tying parameter
    accounting", 2026-05-08) the embedding was subtracted even when tied, which dropped the tied LM head's matmul
    from the count: ``before_tying_fix=True`` gives that older count. On a course GPT the ``nn.Embedding`` children are
    the token and the learned position table, which is what ``cfg.num_params(include_embeddings=False)`` leaves out.
    """
    T = cfg.seq_len if seq_len is None else seq_len
    keep_all = cfg.tie_embeddings and not before_tying_fix
    n = cfg.num_params() if keep_all else cfg.num_params(include_embeddings=False)
    return 6 * n + 6 * cfg.n_layer * cfg.n_head * (2 * cfg.head_dim) * T


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int | None = None, recompute: str = "none") -> float:
    """FLOPs the hardware executes per token (the numerator of HFU), by what is recomputed in the backward:

    - ``"none"``: the model FLOPs, :func:`flops_per_token` (HFU = MFU);
    - ``"attention"``: a flash-attention backward recomputes ``Q K^T`` (one more of its two forward matmuls:
      attention 12 -> 14 L T d); this is what the stock ``FlopCounterMode`` counts for the flash/efficient kernels
      (5 matmuls in the backward, ``sdpa_backward_flop_count``);
    - ``"full"``: full activation checkpointing reruns every layer's forward (8 N_layers + 16 L T d; the LM head is
      not recomputed), Megatron's 96 B s l h^2 (...) generalised to any block (:func:`megatron_flops_per_token`).
    """
    T = cfg.seq_len if seq_len is None else seq_len
    head = cfg.d_model * cfg.vocab_size
    layers = matmul_params(cfg) - head
    attn = attention_flops_per_token(cfg, T)                     # 12 L T d: forward 4, backward 8
    if recompute == "none":
        return 6 * (layers + head) + attn
    if recompute == "attention":
        return 6 * (layers + head) + attn * 14 / 12
    if recompute == "full":
        return 8 * layers + 6 * head + attn * 16 / 12
    raise ValueError(f"recompute={recompute!r}: pick 'none', 'attention' or 'full'")


FLOP_CONVENTIONS = {
    "course (6N + 12LTd)": flops_per_token,
    "Kaplan (causal half)": lambda cfg: flops_per_token(cfg, causal=True),
    "PaLM (6N_all + 12LHQT)": palm_flops_per_token,
    "Megatron paper (no recompute)": megatron_flops_per_token,
    "Megatron-LM code (causal half)": megatron_code_flops_per_token,
    "torchtitan": torchtitan_flops_per_token,
    "torchtitan before #3225": lambda cfg: torchtitan_flops_per_token(cfg, before_tying_fix=True),
    "HFU, full recompute": lambda cfg: hardware_flops_per_token(cfg, recompute="full"),
}
"""Name -> training FLOPs per token of a config, one entry per convention (lesson 01's table)."""
