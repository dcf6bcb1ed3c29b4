"""The measurements of lesson 07 (memory savers), in one process unless named ``rank_*``.

- :class:`LiveActivations`: bytes of the tensors a step creates that are still alive, at the end of the
  forward (``held``: what backward will need) and at the worst moment (``peak``). ``SavedActivations``
  (course_lib.measure.speed) sees what autograd saves through saved-tensor hooks; checkpointing's selective
  policy keeps its tensors in its own cache, past those hooks, so here every storage an operator creates
  is followed (a ``TorchDispatchMode`` + weak references to the storages). Parameters and their ``.grad``
  are model state, not activations: excluded.
- :func:`checkpoint_sweep`: memory, counted FLOPs and time of one training step for checkpointing every k.
- :func:`attention_sweep`: bytes naive attention vs ``scaled_dot_product_attention`` keep, over T.
- :func:`accumulation_sweep`: gradient accumulation, the same global batch in smaller micro-batches.
- :func:`rank_offload`: DeepSpeed ZeRO with and without ``offload_optimizer`` / ``offload_param``.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from course_lib import dist as cdist
from course_lib.data import random_batches
from course_lib.measure.hardware import hardware_label
from course_lib.lessons.variants import train_variant
from course_lib.measure.speed import count_flops, time_fn
from course_lib.measure.memory_stats import SavedActivations, model_state_bytes
from course_lib.model import build_model, naive_attention   # naive_attention: shared by lessons 07, 10 and 12
from course_lib.one_process import grads_of
from course_lib.parallel.checkpointing import (apply_activation_checkpointing, recompute_attention_core,
                                              remove_activation_checkpointing)
from course_lib.theory.savers import attention_saved_bytes, checkpointed_activation_bytes

__all__ = ["LiveActivations", "measure_step", "naive_attention", "use_attention", "checkpoint_sweep",
           "selective_policies",
           "attention_sweep", "accumulation_sweep", "accumulate_step", "rank_offload"]


class LiveActivations(TorchDispatchMode):
    """Bytes of storages created by operators inside the block that are still alive (CPU tensors).

    >>> lin = torch.nn.Linear(4, 3)
    >>> with LiveActivations(lin) as live:
    ...     y = torch.relu(lin(torch.randn(2, 4, requires_grad=True)))   # addmm output, kept by relu
    ...     live.end_forward()
    >>> live.held    # relu's output (2x3 fp32, kept by relu's backward and by y)
    24

    ``held``: bytes alive when :meth:`end_forward` was called; ``peak``: the most at any operator;
    ``current()``: now. Storages are followed by weak reference, so a tensor that only autograd keeps (saved
    for backward, no Python object) still counts, and counts no more once backward has freed it.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self._params = list(model.parameters()) if model is not None else []
        self._exclude = {p.untyped_storage().data_ptr() for p in self._params}
        self._live: dict[int, tuple] = {}
        self.held = self.peak = 0
        self._grew = False

    def __enter__(self):
        self._hooks = [p.register_post_accumulate_grad_hook(self._forget_grad) for p in self._params
                       if p.requires_grad]
        return super().__enter__()

    def __exit__(self, *exc):
        self.peak = max(self.peak, self.current())
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _forget_grad(self, p: torch.Tensor) -> None:
        ptr = p.grad.untyped_storage().data_ptr()
        self._exclude.add(ptr)                 # a gradient is model state, not an activation
        self._live.pop(ptr, None)

    def current(self) -> int:
        for ptr in [p for p, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[ptr]
        return sum(n for _, n in self._live.values())

    def end_forward(self) -> int:
        self.held = self.current()
        self.peak = max(self.peak, self.held)
        return self.held

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The peak is read before each operator, i.e. after the previous one *and* the hooks that ran since:
        # a weight's gradient is dropped from the count by then (it is model state, not an activation).
        # Memory only grows when an operator allocates, so only then is there a new peak to look for.
        if self._grew:
            self.peak, self._grew = max(self.peak, self.current()), False
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                ptr = s.data_ptr()
                old = self._live.get(ptr)
                if ptr and ptr not in self._exclude and (old is None or old[0].expired()):
                    self._live[ptr] = (StorageWeakRef(s), s.nbytes())   # new (or at a freed one's address)
                    self._grew = True
        return out


def measure_step(model, x, y) -> dict:
    """One forward + backward of ``model.loss(x, y)``: activation bytes held after the forward and at the peak
    (:class:`LiveActivations`), the loss and the gradients. Gradients are left in the model."""
    model.zero_grad(set_to_none=True)
    with LiveActivations(model) as live:
        loss = model.loss(x, y)
        live.end_forward()
        loss.backward()
    return dict(held=live.held, peak=live.peak, loss=loss.item(), grads=grads_of(model))


# ------------------------------------------------------------------------------ naive attention (course_lib.model)

def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@contextmanager
def use_attention(model, kind: str = "naive"):
    """Inside the block, every ``block.attn`` of the GPT computes attention the ``kind`` way ('naive' or
    'sdpa'); the model's own kernel (SDPA) comes back afterwards. Dropout must be 0."""
    fn = {"naive": naive_attention, "sdpa": _sdpa}[kind]
    for block in model.blocks:
        block.attn.attend = fn
    try:
        yield model
    finally:
        for block in model.blocks:
            block.attn.__dict__.pop("attend", None)


# ------------------------------------------------------------------------------ sweeps

def _set_checkpointing(model, every, selective):
    remove_activation_checkpointing(model)
    if every is not None:
        apply_activation_checkpointing(model, every=every, selective=selective)


def checkpoint_sweep(cfg, batch: int, everys=(None, 1, 2, 4), selective: bool = True, seed: int = 0,
                     repeats: int = 5, cost: bool = True) -> list[dict]:
    """For each k in ``everys`` (None: plain) and, with ``selective``, the selective policy: held and peak
    activation bytes (measured, formula), FLOPs of one step (matmuls counted, recomputation included), median
    step time, and the largest gradient difference from the plain model. The variants are timed in alternating
    rounds (the first discarded), so that a noisy shared machine slows them alike. ``cost=False``: memory only
    (``flops`` and ``step_s`` None: counting FLOPs runs every operator through Python, slow on deep models)."""
    model = build_model(cfg, seed)
    x, y = random_batches(cfg, batch, 1, seed)[0]
    variants = [(k, False) for k in everys] + ([(1, True)] if selective else [])
    step = lambda: model.loss(x, y).backward()  # noqa: E731
    rows, ref = [], None
    for every, sel in variants:
        _set_checkpointing(model, every, sel)
        m = measure_step(model, x, y)
        ref = ref or m
        est = checkpointed_activation_bytes(cfg, batch, every=every, selective=sel)
        dgrad = max((m["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
        rows.append(dict(every=every, selective=sel, label="plain" if every is None else
                         ("selective" if sel else f"every {every}"), held=m["held"], peak=m["peak"],
                         est_held=est["held"], est_peak=est["peak"], loss=m["loss"],
                         dloss=abs(m["loss"] - ref["loss"]), dgrad=dgrad,
                         flops=count_flops(step) if cost else None, step_s=None, times=[]))
    for _ in range(repeats + 1 if cost else 0):
        for row, (every, sel) in zip(rows, variants):
            _set_checkpointing(model, every, sel)
            row["times"].append(time_fn(step, warmup=0, repeats=1))
    for row in rows:
        row["step_s"] = statistics.median(row["times"][1:]) if cost else None
    remove_activation_checkpointing(model)
    return rows


SELECTIVE_POLICIES = ("none", "op policy", "attention core")


def selective_policies(cfg, batch: int, seed: int = 0) -> list[dict]:
    """The two selective checkpointings of section 2.3, with SDPA and with naive attention: one step each with no
    checkpointing, the operator-level policy (``apply_activation_checkpointing(selective=True)``, torchtitan's) and
    the recomputed attention core (``recompute_attention_core``, Korthikanti et al.'s). Rows: attention, policy,
    held and peak activation bytes (measured), matmul FLOPs of the step, largest gradient difference from that
    attention's plain step."""
    model = build_model(cfg, seed)
    x, y = random_batches(cfg, batch, 1, seed)[0]
    step = lambda: model.loss(x, y).backward()  # noqa: E731
    rows = []
    for kind in ("sdpa", "naive"):
        with use_attention(model, kind):
            ref = None
            for policy in SELECTIVE_POLICIES:
                remove_activation_checkpointing(model)
                if policy == "op policy":
                    apply_activation_checkpointing(model, every=1, selective=True)
                elif policy == "attention core":
                    recompute_attention_core(model)
                m = measure_step(model, x, y)
                ref = ref or m
                rows.append(dict(attention=kind, policy=policy, held=m["held"], peak=m["peak"],
                                 flops=count_flops(step),
                                 dgrad=max((m["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])))
            remove_activation_checkpointing(model)
    return rows


def attention_sweep(seq_lens=(128, 256, 512, 1024), batch: int = 1, n_head: int = 4, head_dim: int = 16,
                    repeats: int = 3) -> list[dict]:
    """Bytes one causal attention keeps for backward (``SavedActivations``) and its forward + backward time,
    naive vs SDPA, next to :func:`course_lib.theory.savers.attention_saved_bytes`; and whether they agree."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for T in seq_lens:
        q, k, v = (torch.randn(batch, n_head, T, head_dim, generator=g).requires_grad_() for _ in range(3))
        row = dict(T=T)
        outs = {}
        for kind, fn in (("naive", naive_attention), ("sdpa", _sdpa)):
            with SavedActivations() as acts:
                out = fn(q, k, v)
            outs[kind] = out.detach()
            row[kind] = acts.bytes
            row[f"{kind}_formula"] = attention_saved_bytes(batch, n_head, T, head_dim, kind)
            row[f"{kind}_s"] = time_fn(lambda: fn(q, k, v).sum().backward(), warmup=1, repeats=repeats)
        row["max_diff"] = (outs["naive"] - outs["sdpa"]).abs().max().item()
        rows.append(row)
    return rows


def accumulate_step(model, x, y, micro_batch: int) -> float:
    """Gradients of the mean loss over the global batch x, y (B, T), in B / micro_batch micro-batches:
    each micro-batch's mean loss is divided by their number, so the summed gradients equal the full batch's."""
    n = x.shape[0] // micro_batch
    total = 0.0
    for xs, ys in zip(x.split(micro_batch), y.split(micro_batch)):
        loss = model.loss(xs, ys) / n                                         # (mb, T) -> scalar
        loss.backward()                                                       # gradients add up in .grad
        total += loss.item()
    return total


def accumulation_sweep(cfg, global_batch: int = 16, micro_batches=(16, 8, 4, 2, 1), seed: int = 0,
                       repeats: int = 3) -> list[dict]:
    """For each micro-batch: activation bytes of one micro-batch (held, peak), parameters + gradients, time of one
    accumulated step, and the largest difference of the gradients from the full batch's."""
    model = build_model(cfg, seed)
    x, y = random_batches(cfg, global_batch, 1, seed)[0]
    rows, ref = [], None
    for mb in micro_batches:
        m = measure_step(model, x[:mb], y[:mb])                              # one micro-batch's activations
        model.zero_grad(set_to_none=True)
        loss = accumulate_step(model, x, y, mb)
        grads = grads_of(model)
        ref = ref or grads
        state = model_state_bytes(model)["total"]                             # parameters + gradients
        seconds = time_fn(lambda: accumulate_step(model, x, y, mb), warmup=1, repeats=repeats)
        rows.append(dict(micro_batch=mb, accum_steps=global_batch // mb, held=m["held"], peak=m["peak"],
                         est_held=checkpointed_activation_bytes(cfg, mb)["held"], state=state, step_s=seconds,
                         loss=loss, dgrad=max((grads[k] - ref[k]).abs().max().item() for k in ref)))
        model.zero_grad(set_to_none=True)
    return rows


def rank_offload(cfg, global_batch: int = 8, steps: int = 3, variants=("ds2", "ds2-offload", "ds3", "ds3-offload")):
    """Runs on every rank: DeepSpeed ZeRO-2/3 with and without CPU offload (`variants.train_variant`, as in lesson
    05) on the same data; returns per variant the losses, the bytes of every tensor alive on the rank's device (on
    a GPU: the GPU's tensors) and the median step time, and the hardware label."""
    batches = random_batches(cfg, global_batch, steps)
    out = {v: train_variant(cfg, batches, v, full_params=False) for v in variants}
    keep = ("losses", "live_bytes", "step_s")
    return {"runs": {v: {k: r[k] for k in keep} for v, r in out.items()},
            "hardware": hardware_label(cdist.backend(), cdist.device())}
