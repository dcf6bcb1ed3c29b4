"""Pipeline parallelism: a GPT's layers split into stages on different ranks (lesson 03).

The model knows nothing of pipelining. `build_stage(model, rank, p)` takes a plain `GPT` and keeps the part
that rank `rank` owns: the embeddings go to the first stage, a contiguous range of blocks to every stage
(`split_stages`), the final LayerNorm and the head to the last. Activations travel forward with `send`, their
gradients backward; the loss is computed on the last stage.

`run_schedule(stage, order, x_mbs, y_mbs)` executes one rank's list of ``("F", i)`` / ``("B", i)`` ops (from
`course_lib.parallel.pipeline_schedules`: naive, GPipe, 1F1B) and records, for every op, its start and end
(``time.perf_counter``: start after the input arrived, end when the compute is done, before sending) and the exact bytes of activations held for backward
(saved-tensor hooks, `course_lib.measure.SavedActivations`). Sends are asynchronous (``isend``); each receive is
posted one op ahead (``irecv``) so that the message travels while the current op computes, and waited for
just before its data is used: a rank waits only for data it needs, so any dependency-respecting order runs
without deadlock (messages between two ranks arrive in the order they were sent, which is the order of use).

Papers: GPipe (Huang et al. 2019), PipeDream / 1F1B (Narayanan et al. 2019, 2021 "Megatron-LM").
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import measure
from course_lib.config import ConfigError
from course_lib.model import lm_loss
from course_lib.parallel.pipeline_schedules import split_stages, validate_order

__all__ = ["Stage", "build_stage", "P2P", "run_schedule", "split_microbatches", "sequential_loss"]


class Stage(nn.Module):
    """One pipeline stage of a GPT: [embeddings] + blocks[start:end] + [ln_f, head].

    forward: first stage idx (b, T) int64 -> (b, T, C); middle stages (b, T, C) -> (b, T, C);
    last stage (b, T, C) -> logits (b, T, V). With p = 1 the one stage is the whole model.
    The sub-modules are the model's own (not copies): a stage's gradients are the model's gradients.
    """

    def __init__(self, model: nn.Module, layers: tuple[int, int], is_first: bool, is_last: bool):
        super().__init__()
        self.layers, self.is_first, self.is_last = layers, is_first, is_last
        self.d_model = model.cfg.d_model
        if is_first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[layers[0]:layers[1]])
        if is_last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))      # (b, T) -> (b, T, C)
        for block in self.blocks:
            x = block(x)                                            # (b, T, C)
        if self.is_last:
            x = self.head(self.ln_f(x))                             # (b, T, C) -> (b, T, V)
        return x


def build_stage(model: nn.Module, rank: int, p: int, ranges: list[tuple[int, int]] | None = None) -> Stage:
    """Rank `rank`'s stage of a plain GPT split into p stages (`split_stages` unless `ranges` is given).

    Tied embeddings (head.weight is tok_emb.weight) would live on two ranks whose gradients must be summed
    (Megatron-LM all-reduces them over an "embedding group"); this course keeps them apart: use
    ``tie_embeddings=False`` for p > 1.
    """
    if p > 1 and model.cfg.tie_embeddings:
        raise ConfigError("tie_embeddings=True shares the embedding between the first and the last stage: "
                          "build the model with tie_embeddings=False to pipeline it over p > 1 stages")
    ranges = ranges or split_stages(len(model.blocks), p)
    return Stage(model, ranges[rank], rank == 0, rank == p - 1)


def split_microbatches(t: torch.Tensor, m: int) -> list[torch.Tensor]:
    """(B, ...) -> m tensors (B/m, ...). B must be a multiple of m, so every micro-batch weighs the same."""
    if t.shape[0] % m:
        raise ValueError(f"batch of {t.shape[0]} rows does not split into m={m} equal micro-batches: "
                         f"use a batch size that is a multiple of {m}")
    return [c.clone() for c in t.chunk(m)]   # own storage: a view would count the whole batch as saved


class P2P:
    """Point-to-point messages between neighbouring stages (ranks rank-1 and rank+1 of `group`).

    Sends are ``isend`` (the handle is kept until `wait_all`), receives are blocking ``recv`` into a buffer of
    a known shape. ``bytes_sent`` counts what this rank sent.
    """

    def __init__(self, rank: int, p: int, device: torch.device, group=None):
        self.rank, self.p, self.device, self.group = rank, p, device, group
        self.pending: list = []
        self.bytes_sent = 0

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send(self, t: torch.Tensor, to: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, self._peer(to), group=self.group), t))   # keep t alive
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, shape, frm: int, dtype=torch.float32) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, self._peer(frm), group=self.group)
        return buf

    def irecv(self, shape, frm: int, dtype=torch.float32):
        """Post a receive now, wait for it later: returns (work, buffer); ``work.wait()`` before reading."""
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, self._peer(frm), group=self.group), buf

    def send_forward(self, t):                 # activation to the next stage
        self.send(t, self.rank + 1)

    def send_backward(self, t):                # gradient of my input to the previous stage
        self.send(t, self.rank - 1)

    def recv_forward(self, shape, dtype=torch.float32):
        return self.recv(shape, self.rank - 1, dtype)

    def recv_backward(self, shape, dtype=torch.float32):
        return self.recv(shape, self.rank + 1, dtype)

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_schedule(stage: Stage, order: list, x_mbs: list[torch.Tensor], y_mbs: list[torch.Tensor],
                 comm: P2P | None = None, loss_fn=lm_loss, hidden_shape=None) -> dict:
    """Run one rank's ops of one training step (no optimizer step): gradients accumulate in `.grad`.

    x_mbs / y_mbs: the m micro-batches of token ids / targets, (b, T) each (only the first stage reads x,
    only the last reads y). Each micro-batch's loss is divided by m, so the accumulated gradients are those
    of the mean loss over the whole batch, as on one process.
    Returns ``losses`` (per micro-batch, last stage, unscaled), ``timeline`` (per op: kind, mb, start, end in
    seconds of ``time.perf_counter``, the monotonic clock that all processes of one machine share, so the
    ranks' timelines line up without a clock-offset estimate), ``act_peak`` (bytes of saved activations held
    at the peak), ``act_per_mb`` (bytes per micro-batch), ``bytes_sent``.
    """
    m = len(x_mbs)
    validate_order(order, m)
    device = next(stage.parameters()).device
    b, T = x_mbs[0].shape
    shape = hidden_shape or (b, T, stage.d_model)   # what travels between stages: (b, T, C)
    held: dict[int, tuple] = {}                # mb -> (input, output or loss): what backward needs
    posted: dict[int, tuple] = {}              # op index -> (work, buffer) of its receive, posted one op early

    def needs_recv(k: int) -> bool:
        return k < len(order) and ((order[k][0] == "F" and not stage.is_first) or
                                   (order[k][0] == "B" and not stage.is_last))

    def post(k: int) -> None:                  # activations come from rank-1, their gradients from rank+1
        if needs_recv(k) and k not in posted:
            frm = comm.rank - 1 if order[k][0] == "F" else comm.rank + 1
            posted[k] = comm.irecv(shape, frm)

    def received(k: int) -> torch.Tensor:
        post(k)
        post(k + 1)                            # the next op's message travels while this op computes
        work, buf = posted.pop(k)
        work.wait()
        return buf

    act_bytes: dict[int, int] = {}             # mb -> saved activation bytes
    losses, timeline = [None] * m, []
    live = peak = 0
    if comm is not None:
        dist.barrier(group=comm.group)   # every rank starts together
    for k, (kind, i) in enumerate(order):
        if kind == "F":
            if stage.is_first:
                inp = x_mbs[i].to(device)
                if comm is not None:
                    post(k + 1)
            else:
                inp = received(k).requires_grad_()
            start = _now(device)
            with measure.SavedActivations(stage) as acts:
                out = stage(inp)
                if stage.is_last:
                    loss = loss_fn(out, y_mbs[i].to(device))
                    losses[i] = loss.item()
                    out = loss / m
            end = _now(device)                 # compute done; sending counts as idle time
            act_bytes[i] = acts.bytes
            live += acts.bytes
            peak = max(peak, live)
            if not stage.is_last:
                comm.send_forward(out)
            held[i] = (inp, out)
        else:
            inp, out = held.pop(i)
            if stage.is_last:
                grad = None
                if comm is not None:
                    post(k + 1)
            else:
                grad = received(k)
            start = _now(device)
            torch.autograd.backward(out, grad)
            end = _now(device)
            live -= act_bytes[i]
            if not stage.is_first:
                comm.send_backward(inp.grad)
        timeline.append(dict(kind=kind, mb=i, start=start, end=end))
    if comm is not None:
        comm.wait_all()
    return dict(losses=losses if stage.is_last else [], timeline=timeline, act_peak=peak,
                act_per_mb=[act_bytes[i] for i in range(m)], bytes_sent=comm.bytes_sent if comm else 0)


def _now(device: torch.device) -> float:
    measure.synchronize(device)    # on GPU the clock is read after queued kernels finish
    return time.perf_counter()


def sequential_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Loss of the p stages chained in one process: equal to model.loss(x, y) when the split is right."""
    h = x
    for r in range(p):
        h = build_stage(model, r, p)(h)
    return lm_loss(h, y)
