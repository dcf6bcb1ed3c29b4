"""One training step (forward, backward, optimizer step) built from a few switches, the course's GPT or Hugging Face's
GPT-2 at the same shape and weights (lesson 12). Each rung of the ladder (`ladder.RUNGS`) flips one switch.

    opts = StepOptions(autocast=True, attention="sdpa", optimizer="fused")
    built = build_step(cfg, opts, x, y)         # runs the first step: its loss and (compile) time are kept
    built.step()                                # one more training step; returns the loss tensor

What each switch does, and where the technique lives:
  autocast       ``torch.autocast(bf16)`` around the forward and the loss (the loss itself is taken in fp32)
  bf16_weights   parameters in bf16, the optimizer on fp32 copies (`parallel.precision.MasterWeightOptimizer`, l. 06)
  vocab_multiple the vocabulary padded (`ModelConfig.padded_vocab`, `model.pad_vocab`: extra rows zero)
  attention      'naive' (`model.naive_attention`) or 'sdpa' (the fused kernel); transformers: 'eager' or 'sdpa'
  optimizer      AdamW 'for-loop' (``foreach=False``: one kernel per parameter and operation), 'foreach' (one per
                 operation over a list of tensors), 'fused' (one kernel for the whole update)
  compile        None, 'default' (``torch.compile`` of forward + loss) or 'reduce-overhead' (also CUDA graphs)
  transforms     functions model -> model applied before the optimizer is built: the hook for a rung that swaps
                 layers (fp8 training, `course_lib.parallel.float8`)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from course_lib.config import ModelConfig
from course_lib.measure.memory_stats import unique_bytes
from course_lib.measure.speed import synchronize
from course_lib.model import build_model, lm_loss, pad_vocab, set_attention, to_hf_gpt2
from course_lib.parallel.fast_step import optimizer_impl
from course_lib.parallel.precision import MasterWeightOptimizer

__all__ = ["StepOptions", "BuiltStep", "build_step", "compute_dtype", "ADAMW"]

ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)     # the same update on every rung


@dataclass(frozen=True)
class StepOptions:
    """The switches of one training step (see the module's docstring); the defaults are the ladder's first rung."""

    autocast: bool = False
    bf16_weights: bool = False
    vocab_multiple: int | None = None
    attention: str = "naive"
    optimizer: str = "for-loop"
    compile: str | None = None
    micro_batch: int | None = None            # None: the ladder's batch
    transforms: tuple[Callable, ...] = ()
    library: str = "course"                   # 'course' or 'transformers'

    def __post_init__(self) -> None:
        for name, value, choices in (("attention", self.attention, ("naive", "sdpa")),
                                     ("optimizer", self.optimizer, ("for-loop", "foreach", "fused")),
                                     ("compile", self.compile, (None, "default", "reduce-overhead")),
                                     ("library", self.library, ("course", "transformers"))):
            if value not in choices:
                raise ValueError(f"{name}={value!r} is unknown: pick one of {', '.join(map(repr, choices))}")


def compute_dtype(opts: StepOptions) -> torch.dtype:
    """The dtype the step's matmuls run in: bf16 under autocast or with bf16 weights, else fp32."""
    return torch.bfloat16 if opts.autocast or opts.bf16_weights else torch.float32


@dataclass
class BuiltStep:
    """A ready training step: ``step()`` runs one (and returns the loss tensor). ``loss0``: the loss of the first
    step, before any update (every rung starts from the same weights, so a rung that changes the numerics shows
    here); ``first_step_s``: that first step's time (compilation included); ``cfg``: the shape executed (padded)."""

    step: Callable[[], torch.Tensor]
    model: torch.nn.Module
    optimizer: object
    cfg: ModelConfig
    batch: int
    loss0: float
    first_step_s: float
    opts: StepOptions
    device: torch.device

    def state_bytes(self) -> int:
        """Bytes held between steps, counted from the tensors: parameters, fp32 masters, optimizer moments (and
        gradients, where a step leaves them; the ladder's steps free them)."""
        params = list(self.model.parameters())
        opt = self.optimizer
        if isinstance(opt, MasterWeightOptimizer):
            state = list(opt.state_tensors())
        else:
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return unique_bytes(params + [p.grad for p in params] + state, set())


def _model(cfg: ModelConfig, opts: StepOptions, device: torch.device, seed: int):
    model = build_model(cfg, seed).to(device)                    # the same weights on every rung
    if opts.vocab_multiple:
        model = pad_vocab(model, opts.vocab_multiple)
    if opts.library == "transformers":
        model = to_hf_gpt2(model)
        model.set_attn_implementation("sdpa" if opts.attention == "sdpa" else "eager")

        def loss_of(x, y):
            return lm_loss(model(input_ids=x).logits, y)     # labels shifted by the caller, as for the course's GPT
    else:
        set_attention(model, opts.attention)
        loss_of = model.loss
    if opts.bf16_weights:
        model.to(torch.bfloat16)
    for transform in opts.transforms:
        model = transform(model) or model
        if opts.library == "course":
            loss_of = model.loss
    return model, loss_of


def build_step(cfg: ModelConfig, opts: StepOptions, x: torch.Tensor, y: torch.Tensor, device=None,
               seed: int = 0) -> BuiltStep:
    """Build the model (`build_model(cfg, seed)`, then the switches of `opts`), its optimizer (AdamW, `ADAMW`) and
    the step on the batch ``x, y`` (B, T) (already cut to the micro-batch), and run the step once."""
    device = torch.device(device or "cpu")
    model, loss_of = _model(cfg, opts, device, seed)
    kw = dict(ADAMW, **optimizer_impl(opts.optimizer))
    if opts.bf16_weights:
        optimizer = MasterWeightOptimizer(model, torch.optim.AdamW, **kw)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **kw)
    if opts.compile:
        loss_of = torch.compile(loss_of, mode=opts.compile, dynamic=False)   # each micro-batch its own kernels
    graphs = opts.compile == "reduce-overhead"
    x, y = x.to(device), y.to(device)

    def step() -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()           # the previous step's graph outputs may be reused
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.autocast):
            loss = loss_of(x, y)                                 # (B, T) -> scalar (fp32)
        loss.backward()
        optimizer.step()                                         # MasterWeightOptimizer frees both gradients itself
        if not opts.bf16_weights:
            optimizer.zero_grad(set_to_none=True)
        return loss

    synchronize(device)
    t0 = time.perf_counter()
    loss0 = step().item()                                        # waits for the step's work
    first = time.perf_counter() - t0
    shape = cfg.padded_vocab(opts.vocab_multiple) if opts.vocab_multiple else cfg
    return BuiltStep(step=step, model=model, optimizer=optimizer, cfg=shape, batch=x.shape[0], loss0=loss0,
                     first_step_s=first, opts=opts, device=device)
