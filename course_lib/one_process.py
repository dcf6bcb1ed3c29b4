"""What one process computes: the reference every parallel run must reproduce (lesson 02), and snapshots of a
model's parameters and gradients to compare with it (`course_lib.lessons.errors`).

    cfg = small_config(n_head=4)
    batches = random_batches(cfg, global_batch=8, steps=3)
    ref = train_reference(cfg, batches, optimizer="sgd", lr=0.1)
    ref["losses"], ref["params"], ref["grads"]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from course_lib.config import ModelConfig
from course_lib.model import build_model, lm_loss

__all__ = ["params_of", "grads_of", "train_reference"]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: a CPU copy of the parameter}: a snapshot that later steps do not change."""
    return {k: p.detach().clone().cpu() for k, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: a CPU copy of the gradient} of every parameter that has one."""
    return {k: p.grad.detach().clone().cpu() for k, p in model.named_parameters() if p.grad is not None}


def train_reference(cfg: ModelConfig, batches, optimizer: str | None = "sgd", lr: float = 0.1, seed: int = 0,
                    device: torch.device | str = "cpu", model: nn.Module | None = None,
                    loss_fn: Callable | None = None, after_step: Callable | None = None) -> dict:
    """One process on the whole global batch: what every parallel run must reproduce.

    optimizer: 'sgd', 'adamw' or None (forward and backward only: gradients accumulate over the batches).
    ``model``: another model than ``build_model(cfg, seed)`` (e.g. a GPT whose MLPs are experts, lesson 11);
    ``loss_fn(model, x, y)``: another loss than the LM loss of its logits (then no logits are returned).
    ``after_step(model)``: called after every batch, once its step is taken (e.g. DeepSeek-V3's expert bias, lesson 11).
    Returns {'losses': [...], 'params' (after the last step), 'grads' (of the last batch), 'first_grads' (of
    the first), 'logits' (of the last batch)}."""
    model = (build_model(cfg, seed) if model is None else model).to(device)
    opt = None
    if optimizer is not None:
        opt = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](model.parameters(), lr=lr)
    losses, grads, first_grads, logits = [], None, None, None
    for x, y in batches:
        if loss_fn is None:
            logits = model(x.to(device))                               # (B, T, V)
            loss = lm_loss(logits, y.to(device))
        else:
            loss = loss_fn(model, x.to(device), y.to(device))
        loss.backward()
        grads = grads_of(model)
        first_grads = first_grads or grads
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model)
        losses.append(loss.item())
    return {"losses": losses, "params": params_of(model), "grads": grads, "first_grads": first_grads,
            "logits": logits.detach() if logits is not None else None}
