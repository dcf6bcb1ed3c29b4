"""Pipeline parallelism: a GPT's layers split into stages on different ranks (lesson 03).

The model knows nothing of pipelining. `build_stage(model, rank, p)` takes a plain `GPT` and keeps the part
that rank `rank` owns: the embeddings go to the first stage, a contiguous range of blocks to every stage
(`split_stages`), the final LayerNorm and the head to the last. Activations travel forward with `send`, their
gradients backward; the loss is computed on the last stage.

`run_schedule(stage, order, x_mbs, y_mbs)` executes one rank's list of ``("F", i)`` / ``("B", i)`` ops (from
`course_lib.parallel.pipeline_schedules`: naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1) and records, for every op,
its start and end (start after the input arrived, end when the compute is done, before sending; CUDA events on a
GPU) and the exact bytes of activations held for backward (saved-tensor hooks,
`course_lib.measure.memory_stats.SavedActivations`). Between two ops a rank sends the output of the op it finished and receives
the input of the next in one batch (``dist.batch_isend_irecv``): a rank waits only for data it needs, so any
dependency-respecting order runs without deadlock, on gloo and on NCCL (which runs the messages between two ranks in
one queue: a send and a receive between the same ranks posted apart can wait on each other there; see
`course_lib.runtime.nccl_rules`).

Interleaved schedules give a rank v chunks (`build_chunks`: ring positions rank, rank + p, ...; rank p - 1 sends to
rank 0, and on p = 2 both directions join the same two ranks), so their messages follow
`pipeline_messages.p2p_plan`, an order every pair of ranks agrees on. The V-shaped schedules (ZB-V, DualPipeV:
`course_lib.parallel.pipeline_v`) give a rank chunks r and 2 p - 1 - r instead (``placement="v"``). Zero-bubble
schedules split each backward into B (the input's gradient) and W (the weight gradients, later):
`course_lib.parallel.split_backward`.

Papers: GPipe (Huang et al. 2019), PipeDream / 1F1B (Narayanan et al. 2019, 2021 "Megatron-LM"), zero bubble (Qi et
al. 2023).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.measure import memory_stats, speed
from course_lib.config import ConfigError
from course_lib.model import lm_loss
from course_lib.parallel.collectives import batch_send_recv
from course_lib.parallel.pipeline_messages import adjacent_plan
from course_lib.parallel.pipeline_schedules import (op_parts, position, split_stages, validate_interleaving,
                                                    validate_order)
from course_lib.parallel.split_backward import backward_input, backward_weight, record_param_outputs
from course_lib.reference import reference_for

__all__ = ["Stage", "build_stage", "build_chunks", "P2P", "run_schedule", "split_microbatches", "sequential_loss"]


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
    GPUs that gloo forgives (`course_lib.runtime.nccl_rules`). ``send_forward`` / ``recv_forward`` / ``send_backward`` /
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
        got = self.post([send] if send is not None else [], [recv] if recv is not None else [], dtype)
        return got[0] if got else None

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[tuple, int]],
             dtype=torch.float32) -> list[torch.Tensor]:
        """Post every ``(tensor, to)`` send and ``(shape, from)`` receive in one ``dist.batch_isend_irecv`` and wait
        for all (`collectives.batch_send_recv`): several messages at once for interleaved schedules, where rank
        p - 1 also sends to rank 0 and, on p = 2, both directions of the ring join the same two ranks. Returns the
        received tensors."""
        sends = [(t.detach().contiguous(), self._peer(to)) for t, to in sends]
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, _ in recvs]
        batch_send_recv(sends, [(buf, self._peer(frm)) for buf, (_, frm) in zip(bufs, recvs)], self.group)
        return bufs

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


def build_chunks(model: nn.Module, rank: int, p: int, v: int, placement: str = "loop") -> list[Stage]:
    """Rank `rank`'s v model chunks for interleaved and V-shaped schedules: the model's blocks split into v p equal
    chunks, of which rank r holds chunks r, r + p, ..., r + (v - 1) p in the "loop" placement (ring positions;
    Narayanan et al. 2021, section 2.2), r and 2 p - 1 - r in the "v" placement (v = 2: ZB-V, DualPipeV). The first
    chunk of the ring has the embeddings, the last one ln_f and the head. n_layers must be a multiple of p v."""
    validate_interleaving(p, v, p, len(model.blocks))
    if placement == "v" and v != 2:
        raise ValueError(f"the V placement gives each rank 2 chunks, not v={v}: use v=2")
    ranges = split_stages(len(model.blocks), v * p)
    return [build_stage(model, position(rank, c, p, placement), v * p, ranges) for c in range(v)]


def _take(msg, inbox: dict, outbox: dict) -> torch.Tensor:
    """An op's input: received, or made by this rank's own previous chunk (p = 1, or the plan kept it local)."""
    return inbox.pop(msg) if msg in inbox else outbox.pop(msg).detach()


@reference_for("03-gpipe")
def run_schedule(stage: Stage | list[Stage], order: list, x_mbs: list[torch.Tensor], y_mbs: list[torch.Tensor],
                 comm: P2P | None = None, loss_fn=lm_loss, hidden_shape=None, plan: list | None = None,
                 placement: str = "loop") -> dict:
    """Run one rank's ops of one training step (no optimizer step): gradients accumulate in `.grad`.

    stage: this rank's `Stage`, or its v chunks (`build_chunks`) for ops ``("F"|"B"|"W", i, c)``. An order with W ops
    splits each backward: B computes the gradient of the chunk's input only (what the previous rank waits for), W
    the weight gradients later (zero-bubble schedules, Qi et al. 2023).
    x_mbs / y_mbs: the m micro-batches of token ids / targets, (b, T) each (only the first stage reads x,
    only the last reads y). Each micro-batch's loss is divided by m, so the accumulated gradients are those
    of the mean loss over the whole batch, as on one process.
    Before each op the rank posts one batch of messages (`P2P.exchange`): by default the previous op's output with
    the next op's input; ``plan`` (`pipeline_messages.p2p_plan`, from every rank's order) is required with chunks;
    ``placement`` ("loop" or "v", `pipeline_schedules.position`) says where the chunks sit, as `build_chunks` did.
    Every op is timed with `course_lib.measure.speed.Stopwatch` (CUDA events on a GPU: never a
    ``torch.cuda.synchronize()``, which would wait for NCCL's messages too): start after its input arrived, end when
    its compute is done, before sending.
    Returns ``losses`` (per micro-batch, last stage, unscaled), ``timeline`` (per op: kind, mb, chunk, pos (the
    chunk's ring position), start, end in
    seconds of ``time.perf_counter``, the monotonic clock that all processes of one machine share, so the
    ranks' timelines line up without a clock-offset estimate), ``act_peak`` (bytes of saved activations held
    at the peak; a split backward holds them until W), ``act_per_mb`` (bytes per micro-batch, all chunks),
    ``bytes_sent``, ``messages`` (sent by this rank).
    """
    chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    v, m = len(chunks), len(x_mbs)
    validate_order(order, m, v)
    rank, p = (comm.rank, comm.p) if comm is not None else (0, 1)
    if plan is None:
        if v > 1:
            raise ValueError("chunks need the messages of every rank: pass plan=p2p_plan(orders, rank)")
        plan = adjacent_plan(order, rank, p)
    split = any(op[0] == "W" for op in order)
    device = next(chunks[0].parameters()).device
    b, T = x_mbs[0].shape
    shape = hidden_shape or (b, T, chunks[0].d_model)   # what travels between stages: (b, T, C)
    held: dict[tuple, tuple] = {}              # (mb, chunk) -> (input, output or loss, module outputs): for B
    pending_w: dict[tuple, tuple] = {}         # (mb, chunk) -> (module outputs, their gradients): for W
    act_bytes: dict[tuple, int] = {}           # (mb, chunk) -> saved activation bytes
    inbox, outbox = {}, {}                     # message id -> tensor received / to send
    losses, stamps = [None] * m, []
    live = peak = messages = 0
    if comm is not None:
        dist.barrier(group=comm.group)         # every rank starts together
    clock = speed.Stopwatch(device)
    for op, batch in zip(list(order) + [None], plan):
        if batch:
            sends = [(outbox.pop(msg), peer) for kind, peer, msg in batch if kind == "S"]
            recvs = [(msg, peer) for kind, peer, msg in batch if kind == "R"]
            inbox.update(zip([msg for msg, _ in recvs], comm.post(sends, [(shape, peer) for _, peer in recvs])))
            messages += len(sends)
        if op is None:
            break
        kind, i, c = op_parts(op)
        chunk = chunks[c]
        pos = position(rank, c, p, placement)
        if kind == "F":
            inp = x_mbs[i].to(device) if chunk.is_first else _take(("F", i, pos - 1), inbox, outbox).requires_grad_()
            outputs: list = []
            hooks = record_param_outputs(chunk, outputs) if split else []
            start = clock.stamp()
            with memory_stats.SavedActivations(chunk) as acts:
                out = chunk(inp)
                if chunk.is_last:
                    loss = loss_fn(out, y_mbs[i].to(device))
                    losses[i] = loss.detach()
                    out = loss / m
            end = clock.stamp()                # compute done; sending counts as idle time
            for h in hooks:
                h.remove()
            act_bytes[(i, c)] = acts.bytes
            live += acts.bytes
            peak = max(peak, live)
            if not chunk.is_last:
                outbox[("F", i, pos)] = out
            held[(i, c)] = (inp, out, outputs)
        elif kind == "B":
            inp, out, outputs = held.pop((i, c))
            grad_out = None if chunk.is_last else _take(("B", i, pos + 1), inbox, outbox)
            start = clock.stamp()
            if split:
                grad_in, grads = backward_input(out, grad_out, inp, outputs)
                pending_w[(i, c)] = (outputs, grads)
            else:
                torch.autograd.backward(out, grad_out)
                grad_in = inp.grad
                live -= act_bytes[(i, c)]
            end = clock.stamp()
            if not chunk.is_first:
                outbox[("B", i, pos)] = grad_in
        else:
            start = clock.stamp()
            backward_weight(*pending_w.pop((i, c)))
            end = clock.stamp()
            live -= act_bytes[(i, c)]
        stamps.append((kind, i, c, pos, start, end))
    timeline = [dict(kind=kind, mb=i, chunk=c, pos=pos, start=clock.seconds(s), end=clock.seconds(e))
                for kind, i, c, pos, s, e in stamps]
    is_last = chunks[-1].is_last
    return dict(losses=[float(x) for x in losses] if is_last else [], timeline=timeline, act_peak=peak,
                act_per_mb=[sum(act_bytes[(i, c)] for c in range(v)) for i in range(m)],
                bytes_sent=comm.bytes_sent if comm else 0, messages=messages)


def sequential_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, p: int) -> torch.Tensor:
    """Loss of the p stages chained in one process: equal to model.loss(x, y) when the split is right."""
    h = x
    for r in range(p):
        h = build_stage(model, r, p)(h)
    return lm_loss(h, y)
