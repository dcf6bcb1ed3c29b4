"""Pipeline parallelism: a GPT's layers split into stages on different ranks (lesson 03).

The model knows nothing of pipelining. `build_stage(model, rank, p)` takes a plain `GPT` and keeps the part
that rank `rank` owns: the embeddings go to the first stage, a contiguous range of blocks to every stage
(`split_stages`), the final LayerNorm and the head to the last. Activations travel forward with `send`, their
gradients backward; the loss is computed on the last stage.

`run_schedule(stage, order, x_mbs, y_mbs)` executes one rank's list of ``("F", i)`` / ``("B", i)`` ops (from
`course_lib.parallel.pipeline_schedules`: naive, GPipe, 1F1B) and records, for every op, its start and end
(start after the input arrived, end when the compute is done, before sending; CUDA events on a GPU) and the exact
bytes of activations held for backward (saved-tensor hooks, `course_lib.measure.SavedActivations`). Between two ops
a rank sends the output of the op it finished and receives the input of the next in one batch
(``dist.batch_isend_irecv``): a rank waits only for data it needs, so any dependency-respecting order runs without
deadlock, on gloo and on NCCL (which runs the messages between two ranks in one queue: a send and a receive between
the same ranks posted apart can wait on each other there; see `course_lib.nccl_rules`).

Papers: GPipe (Huang et al. 2019), PipeDream / 1F1B (Narayanan et al. 2019, 2021 "Megatron-LM").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import measure
from course_lib.config import ConfigError
from course_lib.model import lm_loss
from course_lib.parallel.collectives import send_recv
from course_lib.parallel.pipeline_schedules import split_stages, validate_order
from course_lib.reference import reference_for

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

    `exchange(send, recv)` posts this op's outgoing message and the next op's incoming one together with
    ``dist.batch_isend_irecv`` and waits for both: NCCL runs the messages between two ranks in one queue, so a send
    and a receive between the same two ranks must travel in one batch (torch.distributed.pipelining and Megatron-LM
    post them the same way); a receive posted ahead on its own can block a send the peer needs first, a deadlock on
    GPUs that gloo forgives (`course_lib.nccl_rules`). ``send_forward`` / ``recv_forward`` / ``send_backward`` /
    ``recv_backward`` (asynchronous sends, blocking receives, ``wait_all`` at the end) are for schedules written by
    hand, as in lesson 03's exercise. ``bytes_sent`` counts what this rank sent.
    """

    def __init__(self, rank: int, p: int, device: torch.device, group=None):
        self.rank, self.p, self.device, self.group = rank, p, device, group
        self.pending: list = []
        self.bytes_sent = 0

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def exchange(self, send: tuple[torch.Tensor, int] | None = None, recv: tuple[tuple, int] | None = None,
                 dtype=torch.float32) -> torch.Tensor | None:
        """Send ``send = (tensor, to)`` and receive ``recv = (shape, from)`` (either may be None) as one batch, and
        wait for both. Returns the received tensor (or None)."""
        t = buf = to = frm = None
        if send is not None:
            t, to = send[0].detach().contiguous(), self._peer(send[1])
            self.bytes_sent += t.numel() * t.element_size()
        if recv is not None:
            buf, frm = torch.empty(recv[0], dtype=dtype, device=self.device), self._peer(recv[1])
        send_recv(t, to, buf, frm, self.group)
        return buf

    def send(self, t: torch.Tensor, to: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, self._peer(to), group=self.group), t))   # keep t alive
        self.bytes_sent += t.numel() * t.element_size()

    def recv(self, shape, frm: int, dtype=torch.float32) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, self._peer(frm), group=self.group)
        return buf

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


@reference_for("03-gpipe")
def run_schedule(stage: Stage, order: list, x_mbs: list[torch.Tensor], y_mbs: list[torch.Tensor],
                 comm: P2P | None = None, loss_fn=lm_loss, hidden_shape=None) -> dict:
    """Run one rank's ops of one training step (no optimizer step): gradients accumulate in `.grad`.

    x_mbs / y_mbs: the m micro-batches of token ids / targets, (b, T) each (only the first stage reads x,
    only the last reads y). Each micro-batch's loss is divided by m, so the accumulated gradients are those
    of the mean loss over the whole batch, as on one process.
    Between two ops the rank sends the previous op's output and receives the next op's input in one batch
    (`P2P.exchange`). Every op is timed with `course_lib.measure.Stopwatch` (CUDA events on a GPU: never a
    ``torch.cuda.synchronize()``, which would wait for NCCL's messages too): start after its input arrived, end when
    its compute is done, before sending.
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
    act_bytes: dict[int, int] = {}             # mb -> saved activation bytes
    losses, stamps = [None] * m, []
    live = peak = 0
    outgoing = None                            # (tensor, to): the previous op's output, sent with the next receive
    if comm is not None:
        dist.barrier(group=comm.group)         # every rank starts together
    clock = measure.Stopwatch(device)
    for kind, i in order:
        incoming = None                        # activations come from rank-1, their gradients from rank+1
        if kind == "F" and not stage.is_first:
            incoming = (shape, comm.rank - 1)
        elif kind == "B" and not stage.is_last:
            incoming = (shape, comm.rank + 1)
        received = comm.exchange(outgoing, incoming) if outgoing or incoming else None
        outgoing = None
        if kind == "F":
            inp = x_mbs[i].to(device) if stage.is_first else received.requires_grad_()
            start = clock.stamp()
            with measure.SavedActivations(stage) as acts:
                out = stage(inp)
                if stage.is_last:
                    loss = loss_fn(out, y_mbs[i].to(device))
                    losses[i] = loss.detach()
                    out = loss / m
            end = clock.stamp()                # compute done; sending counts as idle time
            act_bytes[i] = acts.bytes
            live += acts.bytes
            peak = max(peak, live)
            if not stage.is_last:
                outgoing = (out, comm.rank + 1)
            held[i] = (inp, out)
        else:
            inp, out = held.pop(i)
            start = clock.stamp()
            torch.autograd.backward(out, None if stage.is_last else received)
            end = clock.stamp()
            live -= act_bytes[i]
            if not stage.is_first:
                outgoing = (inp.grad, comm.rank - 1)
        stamps.append((kind, i, start, end))
    if outgoing is not None:
        comm.exchange(outgoing)
    timeline = [dict(kind=kind, mb=i, start=clock.seconds(s), end=clock.seconds(e)) for kind, i, s, e in stamps]
    return dict(losses=[float(v) for v in losses] if stage.is_last else [], timeline=timeline, act_peak=peak,
                act_per_mb=[act_bytes[i] for i in range(m)], bytes_sent=comm.bytes_sent if comm else 0)


def sequential_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Loss of the p stages chained in one process: equal to model.loss(x, y) when the split is right."""
    h = x
    for r in range(p):
        h = build_stage(model, r, p)(h)
    return lm_loss(h, y)
