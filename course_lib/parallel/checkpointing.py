"""Activation checkpointing applied to a plain GPT (lesson 07).

    apply_activation_checkpointing(model, every=2)          # segments of 2 blocks, full recomputation
    apply_activation_checkpointing(model, selective=True)   # keep matmul / attention outputs, recompute the rest
    recompute_attention_core(model)                         # recompute only q k^T, softmax, attention over v
    remove_activation_checkpointing(model)                  # back to the plain model (both undone)

Full checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): the forward of a
segment of ``every`` blocks runs inside ``torch.utils.checkpoint.checkpoint``, which keeps only the segment's
input; when backward reaches the segment it runs the segment's forward again (with gradients on) and then
its backward. Memory held between forward and backward drops from L blocks' activations to ceil(L/k)
(B, T, C) inputs; the price is one more forward of every block (see ``course_lib.theory.savers``).

Two kinds of selective checkpointing, often confused:

- **Selective activation recomputation** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", section 5; Megatron-LM's ``--recompute-granularity selective``): only the attention core
  (q k^T, scaling and mask, softmax, dropout, attention over v) is recomputed. Those operators keep the
  ``5as/h`` term of the paper's ``sbh(34 + 5as/h)`` bytes per layer, the part that grows with the sequence length,
  for a few percent of the FLOPs. :func:`recompute_attention_core` does this. A fused attention kernel
  (FlashAttention) recomputes the scores inside the kernel, so it gets the same saving without checkpointing.
- **Operator-level selective checkpointing** (torch's ``create_selective_checkpoint_contexts``; torchtitan's
  ``op`` policy): a policy decides per operator whether its output is saved or recomputed.
  :func:`save_matmuls_policy` saves what :data:`SAVE_OPS` computes (matmuls, including ``bmm``, and fused
  attention) and recomputes LayerNorm, GELU and the residual adds: almost no FLOPs paid. With naive attention it
  saves the ``bmm`` output, the (B, H, T, T) scores, so it does not remove the quadratic term.

The model is not restructured: parameter names and ``state_dict`` stay those of the plain model. The first
block of each segment gets an instance-level ``forward`` that runs the whole segment under ``checkpoint``;
the other blocks of the segment pass their input through (``GPT.forward`` still calls every block in order).
Non-reentrant checkpointing (``use_reentrant=False``) is used, as torch recommends: it supports keyword
arguments, inputs that do not require grad, and selective policies.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from course_lib.reference import reference_for

__all__ = ["apply_activation_checkpointing", "remove_activation_checkpointing", "checkpointed_segments",
           "recompute_attention_core", "SAVE_OPS", "save_matmuls_policy", "CheckpointedBlock"]

_aten = torch.ops.aten
# Operators whose outputs selective checkpointing keeps (the rest is recomputed in backward).
SAVE_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
for _name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
    if hasattr(_aten, _name):
        SAVE_OPS.add(getattr(_aten, _name).default)


def save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: save what :data:`SAVE_OPS` computes, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@reference_for("07-checkpoint-block")
class CheckpointedBlock(nn.Module):
    """One block run under full activation checkpointing: ``model.blocks[i] = CheckpointedBlock(block)``.

    The reference answer of exercise 07-checkpoint-block (parameter names gain a ``block.`` prefix;
    :func:`apply_activation_checkpointing` keeps them unchanged)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)     # (B, T, C) -> (B, T, C), only x kept


def _run_segment(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = type(block).forward(block, x)     # the class's forward: the block's own computation
    return x


def _segment_forward(blocks, selective: bool, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():           # inference: nothing to save, nothing to recompute
        return _run_segment(blocks, x)
    kwargs = {}
    if selective:
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, save_matmuls_policy)
    return checkpoint(partial(_run_segment, blocks), x, use_reentrant=False, **kwargs)


def _pass_through(x: torch.Tensor) -> torch.Tensor:
    return x                                  # this block already ran inside its segment's checkpoint


def checkpointed_segments(n_layer: int, every: int) -> list[range]:
    """Block indices of each segment: ``checkpointed_segments(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]``."""
    if every < 1:
        raise ValueError(f"every={every}: a segment holds at least one block")
    return [range(i, min(i + every, n_layer)) for i in range(0, n_layer, every)]


@reference_for("07-checkpoint-block")
def apply_activation_checkpointing(model: nn.Module, every: int = 1, selective: bool = False) -> nn.Module:
    """Checkpoint ``model.blocks`` in segments of ``every`` blocks (in place; returns the model).

    selective=True keeps the outputs of :data:`SAVE_OPS` and recomputes the rest, block by block
    (``every`` must then be 1: a selective segment saves per operator anyway).
    """
    if selective and every != 1:
        raise ValueError(f"selective checkpointing works block by block: use every=1 (got every={every})")
    remove_activation_checkpointing(model)
    blocks = list(model.blocks)
    for seg in checkpointed_segments(len(blocks), every):
        members = [blocks[i] for i in seg]
        members[0].forward = partial(_segment_forward, members, selective)
        for block in members[1:]:
            block.forward = _pass_through
    return model


class _RecomputedCore:
    """``block.attn.attend`` run under ``checkpoint``: keeps q, k, v and recomputes the attention core in backward."""

    def __init__(self, attend):
        self.inner = attend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.inner(q, k, v)
        return checkpoint(self.inner, q, k, v, use_reentrant=False)      # (B, H, T, D) -> (B, H, T, D)


def recompute_attention_core(model: nn.Module) -> nn.Module:
    """Korthikanti et al.'s selective recomputation (in place; returns the model): every block's attention core,
    ``block.attn.attend(q, k, v)`` (whichever kernel it is set to), runs under ``checkpoint``."""
    for block in model.blocks:
        if not isinstance(block.attn.attend, _RecomputedCore):
            block.attn.attend = _RecomputedCore(block.attn.attend)
    return model


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_activation_checkpointing` and :func:`recompute_attention_core`: every block runs its own
    forward and attention kernel again."""
    for block in model.blocks:
        block.__dict__.pop("forward", None)
        core = block.attn.__dict__.get("attend")
        if isinstance(core, _RecomputedCore):
            if getattr(core.inner, "__self__", None) is block.attn:    # the class's own kernel
                del block.attn.attend
            else:
                block.attn.attend = core.inner                          # a kernel set on the instance
    return model
