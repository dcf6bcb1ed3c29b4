"""Rank functions of lesson 04's experiments: tensor parallelism checked against one process, measured.

Each function runs on every rank of a `launch.run` job. With 4 ranks one job covers tp = 2 (two groups,
ranks {0, 1} and {2, 3}) and tp = 4 (all ranks), so a lesson or a test starts processes once.
Every rank also computes the single-process reference itself (the model is tiny): same seed, same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.config import ModelConfig, small_config
from course_lib.data import random_batches
from course_lib.lessons.errors import max_relative_error
from course_lib.measure.memory_stats import SavedActivations
from course_lib.model import build_model, lm_loss
from course_lib.one_process import train_reference
from course_lib.parallel.tensor_model import apply_tensor_parallel, local_param_bytes, shard_like
from course_lib.parallel.vocab import vocab_parallel_cross_entropy

__all__ = ["tp_config", "tp_group", "tp_mesh", "rank_tp_report", "rank_dtensor_compare"]


def tp_config(**overrides) -> ModelConfig:
    """`small_config` with 4 heads (2 layers, d_model 32, vocab 64, T 16): a step takes milliseconds; tp in
    {1, 2, 4} divides it."""
    return small_config(**{"n_head": 4, "name": "tp-small", **overrides})


def tp_group(tp: int):
    """This rank's tensor-parallel group of `tp` consecutive ranks. Every rank must call it (new_group is
    collective) with the same tp. tp == world size -> the default group (None)."""
    n, r = dist.get_world_size(), dist.get_rank()
    if n % tp:
        raise ValueError(f"tp={tp} does not divide the world size {n}")
    if tp == n:
        return None
    mine = None
    for start in range(0, n, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if start <= r < start + tp:
            mine = g
    return mine


def _reference(cfg: ModelConfig, idx, targets, seed: int = 0) -> dict:
    """One process, whole model, one forward and backward: logits, loss and gradients on idx's device."""
    ref = train_reference(cfg, [(idx, targets)], optimizer=None, seed=seed, device=idx.device)
    grads = {k: v.to(idx.device) for k, v in ref["grads"].items()}
    return dict(logits=ref["logits"], loss=ref["losses"][0], grads=grads)


def _one_block(block, cfg, batch, T, tp, sp, dev) -> tuple[int, dict]:
    """One block's forward + backward on this rank: (activation bytes saved, measured with saved-tensor hooks;
    collectives counted {(phase, op): {"calls", "bytes"}})."""
    x = torch.randn(batch, T // tp if sp else T, cfg.d_model, device=dev, requires_grad=True)   # (B, T(/t), C)
    counter = CollectiveCounter()
    with counter, SavedActivations(model=block) as acts:
        with counter.phase("forward"):
            y = block(x)
        with counter.phase("backward"):
            y.backward(torch.ones_like(y))
    return acts.bytes, counter.table()


def rank_tp_report(cfg: ModelConfig, batch: int = 2, tps=(1, 2, 4), seed: int = 0) -> list[dict]:
    """For each tp and with / without sequence parallelism: errors vs one process (logits, loss, gradients),
    collectives counted in one forward + backward, parameter bytes and one block's activation bytes per rank."""
    dev = cdist.device()
    idx, targets = (t.to(dev) for t in random_batches(cfg, batch, seed=seed)[0])
    ref = _reference(cfg, idx, targets, seed)
    rows = []
    for tp in tps:
        group = tp_group(tp)
        for sp in (False, True):
            model = apply_tensor_parallel(build_model(cfg, seed).to(dev), group, sequence_parallel=sp)
            counter = CollectiveCounter()
            with counter:
                with counter.phase("forward"):
                    local = model(idx)                                            # (B, T, V/t)
                    loss = vocab_parallel_cross_entropy(local, targets, group)    # what model.loss does
                with counter.phase("backward"):
                    loss.backward()
                with counter.phase("grad sync"):
                    model.sync_sequence_parallel_grads()
            logits = model.gather_logits(local.detach())
            grads = {n: p.grad for n, p in model.named_parameters()}
            rows.append(dict(
                tp=tp, sp=sp, rank=dist.get_rank(),
                logits_err=float((logits - ref["logits"]).abs().max()),
                loss_err=abs(loss.item() - ref["loss"]),
                grad_err=max_relative_error(grads, shard_like(model, ref["grads"])),
                comm=counter.table(),
                param_bytes=local_param_bytes(model),
            ))
            rows[-1]["act_bytes"], rows[-1]["layer_comm"] = _one_block(model.blocks[0], cfg, batch, cfg.seq_len, tp, sp, dev)
    return rows


# ------------------------------------------------------------------ own TP vs DTensor parallelize_module

def tp_mesh(tp: int):
    """A DeviceMesh of this rank's `tp` consecutive ranks (a 2-D (dp, tp) mesh when tp < world size)."""
    from torch.distributed.device_mesh import DeviceMesh

    n, dev = dist.get_world_size(), cdist.device().type
    if tp == n:
        return DeviceMesh(dev, list(range(n)))
    return DeviceMesh(dev, torch.arange(n).view(-1, tp), mesh_dim_names=("dp", "tp"))["tp"]


def _full_grads_dtensor(model, tp: int) -> dict:
    """{name: full gradient} of a DTensor-parallelized plain GPT, qkv rows back in [q; k; v] order."""
    from torch.distributed.tensor import DTensor

    from course_lib.parallel.tensor_dtensor import unpermute_qkv_rows

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            g = unpermute_qkv_rows(g, tp)
        out[name] = g.detach()
    return out


def rank_dtensor_compare(cfg: ModelConfig, batch: int = 2, tps=(2, 4), seed: int = 0) -> list[dict]:
    """Own TP vs DTensor `parallelize_module` on the same GPT: whole model without sequence parallelism,
    the stack of blocks with it. Errors of each against one process, and of ours against DTensor."""
    from course_lib.parallel.tensor_dtensor import apply_dtensor_tp, parallelize_blocks
    from course_lib.parallel.tensor_model import tensor_parallel_blocks

    dev = cdist.device()
    idx, targets = (t.to(dev) for t in random_batches(cfg, batch, seed=seed)[0])
    ref = _reference(cfg, idx, targets, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g).to(dev)        # (B, T, C) block-stack input
    w_full = torch.randn(batch, cfg.seq_len, cfg.d_model, generator=g).to(dev)        # loss = sum(y * w)
    rows = []
    for tp in tps:
        group, mesh = tp_group(tp), tp_mesh(tp)
        r = dist.get_rank(group)
        # whole GPT, no sequence parallelism
        ours = apply_tensor_parallel(build_model(cfg, seed).to(dev), group)
        local = ours(idx)
        loss_ours = vocab_parallel_cross_entropy(local, targets, group)
        loss_ours.backward()
        theirs = apply_dtensor_tp(build_model(cfg, seed).to(dev), mesh)
        logits_theirs = theirs(idx)
        loss_theirs = lm_loss(logits_theirs, targets)
        loss_theirs.backward()
        g_theirs = _full_grads_dtensor(theirs, tp)
        rows.append(dict(tp=tp, sp=False, what="whole GPT",
                         out_vs_ref=float((logits_theirs - ref["logits"]).abs().max()),
                         grad_vs_ref=max_relative_error(g_theirs, ref["grads"]),
                         out_ours_vs_theirs=float((ours.gather_logits(local.detach()) - logits_theirs).abs().max()),
                         loss_ours_vs_theirs=abs(loss_ours.item() - loss_theirs.item()),
                         grad_ours_vs_theirs=max_relative_error({n: p.grad for n, p in ours.named_parameters()},
                                                           shard_like(ours, g_theirs))))
        # the blocks with sequence parallelism: (B, T/t, C) in and out
        plain = build_model(cfg, seed).to(dev).blocks
        x = x_full.clone().requires_grad_()
        y = x
        for b in plain:
            y = b(y)
        (y * w_full).sum().backward()
        ref_grads = {n: p.grad for n, p in plain.named_parameters()}
        n_loc = cfg.seq_len // tp
        sl = slice(r * n_loc, (r + 1) * n_loc)
        results = {}
        for kind in ("ours", "theirs"):
            blocks = build_model(cfg, seed).to(dev).blocks
            if kind == "ours":
                tensor_parallel_blocks(blocks, group, sequence_parallel=True)
            else:
                parallelize_blocks(blocks, mesh, sequence_parallel=True)
            xs = x_full[:, sl].clone().requires_grad_()                         # (B, T/t, C)
            ys = xs
            for b in blocks:
                ys = b(ys)
            (ys * w_full[:, sl]).sum().backward()
            if kind == "ours":
                grads = {n: p.grad for n, p in blocks.named_parameters()}
                for n, p in blocks.named_parameters():                          # LayerNorms, row biases: partial
                    if getattr(p, "sequence_parallel", False):
                        dist.all_reduce(grads[n], group=group)
                wrapper = torch.nn.Module()
                wrapper.blocks, wrapper.group, wrapper.tp = blocks, group, tp
                full_ref = shard_like(wrapper, {"blocks." + n: v for n, v in ref_grads.items()})
                err = max_relative_error({"blocks." + n: v for n, v in grads.items()}, full_ref)
            else:
                gt = _full_grads_dtensor(blocks, tp)
                err = max_relative_error(gt, ref_grads)
            results[kind] = dict(y=ys.detach(), xgrad=xs.grad, err=err)
        rows.append(dict(tp=tp, sp=True, what="blocks",
                         out_vs_ref=float((results["theirs"]["y"] - y.detach()[:, sl]).abs().max()),
                         grad_vs_ref=results["theirs"]["err"], grad_ours_vs_ref=results["ours"]["err"],
                         out_ours_vs_theirs=float((results["ours"]["y"] - results["theirs"]["y"]).abs().max()),
                         xgrad_ours_vs_ref=float((results["ours"]["xgrad"] - x.grad[:, sl]).abs().max()),
                         xgrad_theirs_vs_ref=float((results["theirs"]["xgrad"] - x.grad[:, sl]).abs().max())))
    return rows
