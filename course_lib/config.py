"""Typed configs for models and training runs, with presets (lesson 00 onwards).

`ModelConfig` describes a decoder-only transformer. Two families share one dataclass:

* gpt2-style (LayerNorm, GELU MLP, learned positions, biases, tied head) -- Radford et al. 2019,
  "Language Models are Unsupervised Multitask Learners". These can be built as `course_lib.model.GPT`.
* llama-style (RMSNorm, SwiGLU MLP, rotary positions, no biases, untied head, grouped-query attention)
  -- Touvron et al. 2023, "LLaMA" / "Llama 2". Theory-only in this course: `num_params()` counts them
  exactly, lessons use them in formulas (lesson 01 FLOPs and memory, lesson 08 planner).

`TrainConfig` holds the optimisation settings of a run (batch, micro-batch, learning rate, ...).

Every config validates itself when created and raises `ConfigError` with a message that names the
field and says how to fix it (STYLE.md habit 8).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ConfigError", "ModelConfig", "TrainConfig", "PRESETS", "get_preset", "check_positive_ints",
           "divisors_hint"]


class ConfigError(ValueError):
    """An invalid config value; the message names the field and the fix."""


_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_POS = ("learned", "rope")
_DTYPES = ("float32", "bfloat16", "float16")


def divisors_hint(n: int, limit: int | None = 6) -> str:
    """'{1, 2, 4, 8, ...}': the first `limit` divisors of n (all of them with ``limit=None``), as a hint in error
    messages ("pick ep in {1, 2, 4}")."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    shown = ", ".join(str(d) for d in divs[:limit])
    return "{" + shown + (", ...}" if limit is not None and len(divs) > limit else "}")


def check_positive_ints(**values) -> None:
    """Raise ``ConfigError`` (a ValueError) "<name>=<value> must be a positive int" for the first of ``values`` that
    is not an int >= 1 (bools refused): the first line of the techniques' argument checks."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r} must be a positive int")


def _validate_pos_int(obj, name: str, allow_none: bool = False) -> None:
    value = getattr(obj, name)
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive int (e.g. {name}=64)")


def _validate_choice(obj, name: str, choices: tuple) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is unknown: pick one of {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    Fields (see docs/CONVENTIONS.md): vocab_size, seq_len (maximum context), n_layer, n_head,
    d_model, d_ff (MLP hidden size; None is resolved to 4*d_model when the config is created),
    n_kv_head (key/value heads for grouped-query attention; None is resolved to n_head), dropout, bias (biases in Linear and LayerNorm), tie_embeddings (output
    head shares the token embedding), norm, mlp, pos, name, qk_norm (a LayerNorm over each head's query and key
    before the dot product, Dehghani et al. 2023; lesson 09: attention-logit growth at a high learning rate).
    """

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int | None = None
    n_kv_head: int | None = None
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    norm: str = "layernorm"
    mlp: str = "gelu"
    pos: str = "learned"
    name: str = ""
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for f in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            _validate_pos_int(self, f)
        _validate_pos_int(self, "d_ff", allow_none=True)
        _validate_pos_int(self, "n_kv_head", allow_none=True)
        # Resolve the defaults: d_ff=None -> 4*d_model, n_kv_head=None -> n_head.
        # (remember which were defaulted, outside the dataclass fields, so that replace() re-derives them)
        auto = tuple(f for f in ("d_ff", "n_kv_head") if getattr(self, f) is None)
        object.__setattr__(self, "_auto", auto)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.d_model % self.n_head:
            raise ConfigError(
                f"n_head={self.n_head} does not divide d_model={self.d_model}: "
                f"pick n_head in {divisors_hint(self.d_model)}"
            )
        kv = self.n_kv_head
        if self.n_head % kv:
            raise ConfigError(
                f"n_kv_head={kv} does not divide n_head={self.n_head}: "
                f"pick n_kv_head in {divisors_hint(self.n_head)}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout!r} must be a float in [0, 1) (e.g. dropout=0.0)")
        for f in ("bias", "tie_embeddings", "qk_norm"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"{f}={getattr(self, f)!r} must be True or False")
        _validate_choice(self, "norm", _NORMS)
        _validate_choice(self, "mlp", _MLPS)
        _validate_choice(self, "pos", _POS)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """d_model / n_head: the width of one attention head."""
        return self.d_model // self.n_head

    @property
    def gpt2_style(self) -> bool:
        """True when `course_lib.model.GPT` can build this config (LayerNorm, GELU, learned positions, MHA)."""
        return (self.norm == "layernorm" and self.mlp == "gelu" and self.pos == "learned"
                and self.n_kv_head == self.n_head)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (validated again).

        A d_ff / n_kv_head that was left to its default is derived again from the new d_model / n_head
        (use this rather than dataclasses.replace, which would keep the old resolved value).
        """
        for f in getattr(self, "_auto", ()):
            changes.setdefault(f, None)
        return dataclasses.replace(self, **changes)

    def padded_vocab(self, multiple: int = 128) -> "ModelConfig":
        """A copy whose vocab_size is rounded up to a multiple of `multiple` (lesson 12): 50257 -> 50304 for 128.

        nanoGPT pads GPT-2's vocabulary so ("50304 ... padded up to nearest multiple of 64 for efficiency"): the LM
        head's and the embedding's matmuls get a dimension that the matmul kernels tile without a ragged edge. The
        tokenizer still emits ids below the old vocab_size, so the extra rows never receive a target, and the extra
        embedding rows are never looked up. Their logits still enter the softmax's normaliser (as in nanoGPT): the
        loss is that of the unpadded logits with the extra logits appended, and training pushes the extra logits
        down. Model FLOPs stay those of the unpadded model (the padding is executed work, counted in HFU, not MFU).
        Off unless asked for: no preset is padded. A vocab_size already a multiple comes back unchanged."""
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple <= 0:
            raise ConfigError(f"multiple={multiple!r} (the vocab_size padding) must be a positive int (e.g. 128)")
        padded = -(-self.vocab_size // multiple) * multiple
        return self if padded == self.vocab_size else self.replace(vocab_size=padded)

    # ---- parameter count (lesson 01) ---------------------------------------------------------
    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact number of parameters (a tied head is counted once).

        Per layer: two norms, attention (q, k, v, output projection; k and v have n_kv_head heads),
        MLP (GELU: 2 matrices; SwiGLU: 3 matrices). Plus token embedding, learned position embedding
        (pos="learned" only), final norm, and the output head when it is not tied.

        include_embeddings=False leaves out the lookup tables (token and position embeddings), the
        "non-embedding" count N of Kaplan et al. 2020 used in FLOPs = 6N per token; an untied output
        head is a matmul per token and stays in.
        """
        d, dff, b = self.d_model, self.d_ff, int(self.bias)
        kv_dim = self.n_kv_head * self.head_dim
        # LayerNorm has weight (+ bias); RMSNorm only a weight.
        norm = d * (1 + b) if self.norm == "layernorm" else d
        attn = d * d + 2 * d * kv_dim + d * d          # q, k, v, output projection
        attn += b * (d + 2 * kv_dim + d)
        if self.qk_norm:                               # one norm over head_dim for q, one for k, shared by heads
            attn += 2 * (self.head_dim * (1 + b) if self.norm == "layernorm" else self.head_dim)
        if self.mlp == "gelu":
            mlp = 2 * d * dff + b * (dff + d)          # fc (d->dff), proj (dff->d)
        else:
            mlp = 3 * d * dff + b * (2 * dff + d)      # gate, up (d->dff), down (dff->d)
        per_layer = 2 * norm + attn + mlp
        total = self.n_layer * per_layer + norm        # + final norm
        if not self.tie_embeddings:
            total += self.vocab_size * d               # output head (no bias)
        if include_embeddings:
            total += self.vocab_size * d
            if self.pos == "learned":
                total += self.seq_len * d
        return total


@dataclass(frozen=True)
class TrainConfig:
    """Settings of a training run (lessons 02, 06, 09).

    batch_size is the global batch in sequences per optimizer step; micro_batch_size (None ->
    batch_size) is what one forward/backward processes, so grad_accum = batch_size // micro_batch_size
    on one process (see `grad_accum_steps(world_size)` for data parallelism).
    grad_clip=None (or 0) disables clipping.
    """

    batch_size: int = 8
    micro_batch_size: int | None = None
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    max_steps: int = 100
    grad_clip: float | None = 1.0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _validate_pos_int(self, "batch_size")
        _validate_pos_int(self, "micro_batch_size", allow_none=True)
        _validate_pos_int(self, "max_steps")
        if self.batch_size % self.micro:
            raise ConfigError(
                f"micro_batch_size={self.micro} does not divide batch_size={self.batch_size}: "
                f"pick micro_batch_size in {divisors_hint(self.batch_size)}"
            )
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or self.lr <= 0:
            raise ConfigError(f"lr={self.lr!r} must be a positive float (e.g. lr=3e-4)")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0 (e.g. weight_decay=0.1)")
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(x, (int, float)) and 0.0 <= x < 1.0 for x in betas)):
            raise ConfigError(f"betas={betas!r} must be two floats in [0, 1) (e.g. betas=(0.9, 0.95))")
        object.__setattr__(self, "betas", tuple(float(x) for x in betas))
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps!r} must be an int >= 0")
        if self.warmup_steps > self.max_steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps}: "
                f"use warmup_steps <= {self.max_steps}"
            )
        if self.grad_clip is not None and (not isinstance(self.grad_clip, (int, float))
                                           or self.grad_clip < 0):
            raise ConfigError(f"grad_clip={self.grad_clip!r} must be >= 0 or None (e.g. grad_clip=1.0)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be an int >= 0")
        _validate_choice(self, "dtype", _DTYPES)

    @property
    def micro(self) -> int:
        """The resolved micro-batch size (micro_batch_size, or batch_size when None)."""
        return self.batch_size if self.micro_batch_size is None else self.micro_batch_size

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on one process: batch_size // micro_batch_size."""
        return self.batch_size // self.micro

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-batches per rank per step when `world_size` data-parallel ranks share the batch (lesson 02)."""
        if world_size <= 0 or self.batch_size % (self.micro * world_size):
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by micro_batch_size*world_size="
                f"{self.micro}*{world_size}: pick batch_size as a multiple of {self.micro * max(world_size, 1)}"
            )
        return self.batch_size // (self.micro * world_size)

    @property
    def torch_dtype(self):
        """The torch dtype named by `dtype`."""
        import torch
        return getattr(torch, self.dtype)

    def replace(self, **changes) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _gpt2(name: str, n_layer: int, n_head: int, d_model: int) -> ModelConfig:
    return ModelConfig(vocab_size=50257, seq_len=1024, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, name=name)


def _llama(name: str, n_layer: int, n_head: int, d_model: int, d_ff: int, n_kv_head=None,
           seq_len: int = 4096, vocab_size: int = 32000) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                       d_model=d_model, d_ff=d_ff, n_kv_head=n_kv_head, bias=False,
                       tie_embeddings=False, norm="rmsnorm", mlp="swiglu", pos="rope", name=name)


PRESETS: dict[str, ModelConfig] = {
    # CPU-sized, instantiable: a training step at batch 8 takes milliseconds on a laptop.
    "tiny": ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64, name="tiny"),
    "small": ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128, name="small"),
    # Real models, for formulas (Radford et al. 2019; Brown et al. 2020; Touvron et al. 2023).
    "gpt2-124m": _gpt2("gpt2-124m", 12, 12, 768),
    "gpt2-350m": _gpt2("gpt2-350m", 24, 16, 1024),
    "gpt2-774m": _gpt2("gpt2-774m", 36, 20, 1280),
    "gpt2-1.5b": _gpt2("gpt2-1.5b", 48, 25, 1600),
    "gpt3-175b": ModelConfig(vocab_size=50257, seq_len=2048, n_layer=96, n_head=96, d_model=12288,
                             name="gpt3-175b"),
    # BLOOM (BigScience 2022, arXiv 2211.05100, table 3; Megatron-DeepSpeed's tr11-176B-ml.slurm): 70 layers,
    # hidden 14,336, 112 heads, tied embeddings, vocabulary padded to 250,880 (the tokenizer has 250,680). BLOOM
    # uses ALiBi, which has no parameters; the learned positions here add 2,048 x 14,336 = 29 M (0.02 %) so that
    # the course's GPT can build it. Its embedding LayerNorm (28,672 parameters) is left out.
    "bloom-176b": ModelConfig(vocab_size=250880, seq_len=2048, n_layer=70, n_head=112, d_model=14336,
                              name="bloom-176b"),
    "llama-7b": _llama("llama-7b", 32, 32, 4096, 11008),
    "llama-70b": _llama("llama-70b", 80, 64, 8192, 28672, n_kv_head=8),
    # Llama 3 (Dubey et al. 2024, table 3): vocabulary 128,256, GQA with 8 key/value heads, context 8,192.
    "llama3-70b": _llama("llama3-70b", 80, 64, 8192, 28672, n_kv_head=8, seq_len=8192, vocab_size=128256),
    "llama3-405b": _llama("llama3-405b", 126, 128, 16384, 53248, n_kv_head=8, seq_len=8192, vocab_size=128256),
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name` (see PRESETS); an unknown name raises ConfigError listing the names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}: pick one of {', '.join(PRESETS)}") from None


def small_config(**overrides) -> ModelConfig:
    """The 'tiny' preset made smaller still (vocabulary 64, T 16, 2 layers, 2 heads, d_model 32), so that a few
    training steps take milliseconds on a CPU; ``overrides`` change any field (lessons 02-07)."""
    base = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, name="small")
    base.update(overrides)
    return ModelConfig(**base)
