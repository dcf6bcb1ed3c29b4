"""Lesson 11's expert tensor parallelism on every rank (`course_lib.parallel.experts_tp`): EP x ETP, each expert's
SwiGLU split over etp ranks (w1, w3 along F, column parallel; w2 along F, row parallel; one all-reduce of the expert
output), the experts over ep ranks.

- :func:`rank_expert_tp`: the tiny GPT with a MoE in every block, a few SGD steps: losses (global mean), the first
  step's gradients and the final parameters (this rank's shards), each layer's bytes per (phase, op), every
  collective of the first step, this rank's place in the groups.
- :func:`moe_model`: the plain MoE GPT both the ranks and the one-process reference start from.
"""

from __future__ import annotations

import torch

from course_lib.model import build_model
from course_lib.one_process import grads_of, params_of
from course_lib.parallel.moe import apply_moe, moe_layers, moe_loss

__all__ = ["moe_model", "rank_expert_tp"]


def moe_model(cfg, n_experts: int, top_k: int, d_ff: int, alpha: float, groups: int, device="cpu"):
    """The GPT with every MLP a `MoELayer` (seed 0); ``groups``: balancing and capacity groups (= data ranks)."""
    return apply_moe(build_model(cfg, 0), n_experts, top_k, d_ff, alpha=alpha, groups=groups).to(device)


def rank_expert_tp(cfg, batches, ep: int, etp: int, lr: float, n_experts: int = 4, top_k: int = 2, d_ff: int = 32,
                   alpha: float = 0.1) -> dict:
    """On every rank of a world of ep x etp x edp ranks: SGD steps on `batches` (each (x, y) of the global batch,
    sharded over the data ranks = world / etp). {"losses", "first_grads", "params", "comm" (per layer, first step),
    "sent", "collectives", "rank", "etp_rank", "ep_rank", "groups", "hardware"}; {"error"} if the model cannot be
    built (a wrong split's shapes)."""
    import torch.distributed as dist

    from course_lib import dist as cdist
    from course_lib.data import shard_batch
    from course_lib.measure.collective_counter import CollectiveCounter
    from course_lib.measure.hardware import hardware_label
    from course_lib.parallel import experts_tp

    dev = cdist.device()
    groups = experts_tp.ExpertTPGroups(ep, etp, n_experts, d_ff)
    try:
        model = experts_tp.apply_expert_tensor_parallel(
            moe_model(cfg, n_experts, top_k, d_ff, alpha, 1, dev), groups)
    except RuntimeError as exc:
        return dict(error=str(exc))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = dict(losses=[], rank=dist.get_rank(), etp_rank=groups.etp_rank, ep_rank=groups.ep_rank,
               groups={k: getattr(groups, f"{k}_ranks") for k in ("etp", "ep", "dp", "edp")},
               hardware=hardware_label(cdist.backend(), dev))
    for step, (x, y) in enumerate(batches):
        x, y = (shard_batch(t, groups.data_rank, groups.dp).to(dev) for t in (x, y))   # (B, s) -> (B/dp, s)
        coll = CollectiveCounter()
        with coll:
            with coll.phase("forward"):
                loss = moe_loss(model, x, y)
            with coll.phase("backward"):
                loss.backward()
        if step == 0:
            layers = moe_layers(model)
            out["comm"] = [m.experts.counter.table() for m in layers]
            out["sent"] = [m.sent if ep > 1 else m.counts.tolist() for m in layers]
            out["collectives"] = coll.table()
        experts_tp.sync_expert_tp_grads(model, groups)
        if step == 0:
            out["first_grads"] = {k: v.cpu() for k, v in grads_of(model).items()}
        out["losses"].append(cdist.global_mean(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = {k: v.cpu() for k, v in params_of(model).items()}
    return out
