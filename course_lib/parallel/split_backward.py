"""Zero-bubble's split backward: B, the gradient of a chunk's input, now; W, its weight gradients, later (lesson 03).

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241) split a stage's backward in two: B is on the
critical path (the previous stage waits for the input gradient), W is not (nothing downstream needs the weight
gradients before the optimizer step), so a schedule moves W into the bubble. Here the split goes through autograd on
a plain module: forward hooks record the output of every module that owns parameters; B asks autograd for the
gradient of the input and of those outputs, keeping the graph; W turns each saved output gradient into that
module's weight gradients through its own autograd node. It assumes a module that owns parameters does not also
contain modules that do, as in `course_lib.model.GPT` (Linear, LayerNorm, Embedding).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["record_param_outputs", "backward_input", "backward_weight"]


def record_param_outputs(chunk: nn.Module, record: list) -> list:
    """Forward hooks recording the output of every module that owns parameters (Linear, LayerNorm, Embedding): the
    tensors where a split backward stops (B) and restarts for the weight gradients (W)."""
    return [mod.register_forward_hook(lambda mod, args, out: record.append((mod, out)))
            for mod in chunk.modules() if any(True for _ in mod.parameters(recurse=False))]


def backward_input(out, grad_out, inp, outputs: list):
    """B of a split backward: the gradient of the chunk's input (None on the first chunk, whose input is token ids)
    and of every parameter-owning module's output, keeping the graph for W. No weight gradient is computed: autograd
    runs only what leads to the tensors asked for."""
    wanted = ([inp] if inp.requires_grad else []) + [o for _, o in outputs]
    grads = torch.autograd.grad(out, wanted, grad_out, retain_graph=True, allow_unused=True)
    return (grads[0] if inp.requires_grad else None), grads[1 if inp.requires_grad else 0:]


def backward_weight(outputs: list, grads) -> None:
    """W of a split backward: each module's weight gradients from its output's gradient saved by B,
    dW = (dL/dy) x^T through the module's own autograd node only; accumulated into ``.grad``."""
    for (mod, y), g in zip(outputs, grads):
        if g is None:
            continue
        params = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        for q, dq in zip(params, torch.autograd.grad(y, params, g)):   # frees this module's part of the graph
            q.grad = dq if q.grad is None else q.grad + dq
