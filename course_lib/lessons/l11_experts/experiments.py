"""The measurements of lesson 11 (mixture of experts, expert parallelism), in one process unless named ``rank_*``.

- :func:`mixtral_equality`: our `MoELayer` vs transformers' ``MixtralSparseMoeBlock`` with the same weights.
- :func:`mixtral_config`: a Mixtral-8x7B-shaped `ModelConfig` for the parameter and FLOP formulas.
- :func:`train_balancing`: the tiny GPT with a MoE layer in every block trained on the CPU without balancing, with
  the Switch loss, or with DeepSeek-V3's bias: max / mean tokens per expert at every step, the last routing.
- :func:`dropped_at`: tokens dropped by a routing at several capacity factors (`dispatch_permutation`).
- :func:`rank_moe_lab`: on every rank: expert parallelism (ep = world, and ep 2 x expert-dp 2 on 4 ranks), a few
  SGD steps against one process, bytes of every all-to-all, the rows each rank sent per expert under a skewed
  router; DeepSpeed's MoE layer on 2 ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from course_lib.config import ModelConfig, get_preset
from course_lib.data import random_batches
from course_lib.model import build_model
from course_lib.one_process import grads_of, params_of, train_reference
from course_lib.parallel.moe import (apply_moe, capacity_of, dispatch_permutation, from_hf_mixtral, moe_layers,
                                     moe_loss, switch_loss, update_expert_bias)

__all__ = ["mixtral_equality", "mixtral_config", "train_balancing", "dropped_at", "moe_reference", "rank_moe_lab",
           "deepspeed_moe", "METHODS"]

METHODS = ("none", "switch", "bias")


def mixtral_equality(top_k: int = 2, n_experts: int = 8, hidden: int = 32, ffn: int = 48, seed: int = 0) -> dict:
    """transformers' MixtralSparseMoeBlock (random weights, no download) vs our layer holding a copy of them:
    {"out": max |output diff|, "logits": max |router logits diff|, "loss_ratio": transformers' balancing loss /
    ours (k, as it divides counts by T, not T k)}."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=hidden, intermediate_size=ffn,
                                                num_local_experts=n_experts, num_experts_per_tok=top_k,
                                                hidden_act="silu"))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 16, hidden)
    with torch.no_grad():
        out = block(x)
        ref, ref_logits = out if isinstance(out, tuple) else (out, None)
        ours = from_hf_mixtral(block, alpha=1.0)
        y = ours(x)
    if ref_logits is None:
        ref_logits = torch.nn.functional.linear(x.reshape(-1, hidden), block.gate.weight)
    hf_loss = load_balancing_loss_func((ref_logits,), n_experts, top_k).item()
    return dict(out=(y - ref).abs().max().item(), logits=(ours.router_logits - ref_logits).abs().max().item(),
                loss_ratio=hf_loss / ours.aux_loss.item(), top_k=top_k, n_experts=n_experts)


def mixtral_config() -> ModelConfig:
    """Mixtral 8x7B's shape (Jiang et al. 2024): 32 layers, d_model 4096, 32 heads (8 K/V), experts of 14336."""
    return dataclasses.replace(get_preset("llama-7b"), n_kv_head=8, d_ff=14336, vocab_size=32000, seq_len=4096,
                               name="mixtral-8x7b")


def train_balancing(method: str, steps: int, n_experts: int = 8, top_k: int = 2, batch: int = 8, seq_len: int = 32,
                    lr: float = 1e-3, alpha: float = 0.05, gamma: float = 3e-3, seed: int = 0) -> dict:
    """Train the tiny GPT with every MLP a MoE layer on random tokens (AdamW): "none" (no balancing), "switch"
    (Switch loss, ``alpha``), "bias" (DeepSeek-V3's bias, ``gamma``). {"load": max/mean tokens per expert, mean over
    the layers, per step; "loss": cross-entropy per step; "indices": the last step's (T, k) choices of layer 0}."""
    if method not in METHODS:
        raise ValueError(f"method={method!r}: one of {METHODS}")
    cfg = dataclasses.replace(get_preset("tiny"), seq_len=seq_len)
    model = apply_moe(build_model(cfg, seed), n_experts, top_k, d_ff=cfg.d_model, seed=seed,
                      alpha=alpha if method == "switch" else 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    load, losses = [], []
    for x, y in random_batches(cfg, batch, steps, seed=seed):
        loss = model.loss(x, y)
        (loss + sum(m.aux_loss for m in moe_layers(model))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if method == "bias":
            update_expert_bias(model, gamma)
        layers = moe_layers(model)
        load.append(sum((m.counts.max() / m.counts.float().mean()).item() for m in layers) / len(layers))
        losses.append(loss.item())
    return dict(load=load, loss=losses, indices=_last_indices(moe_layers(model)[0]), n_experts=n_experts, top_k=top_k)


def _last_indices(layer) -> torch.Tensor:
    """The (T, k) choices of the layer's last forward, the bias included (as the layer chose)."""
    probs = layer.router_logits.float().softmax(-1)
    return torch.topk(probs + layer.router.expert_bias, layer.top_k, -1).indices


def dropped_at(indices: torch.Tensor, n_experts: int, factors=(1.0, 1.25, 2.0)) -> list[dict]:
    """Assignments dropped by capacity ceil(cf T k / E) for each capacity factor: {"cf", "capacity", "dropped",
    "fraction"}."""
    T, k = indices.shape
    rows = []
    for cf in factors:
        cap = capacity_of(cf, T, k, n_experts)
        d = dispatch_permutation(indices, n_experts, cap)
        rows.append(dict(cf=cf, capacity=cap, dropped=d.dropped, fraction=d.dropped / (T * k)))
    return rows


# ------------------------------------------------------------------------------ expert parallelism

MOE = dict(n_experts=4, d_ff=32, alpha=0.05)


def _model(cfg, top_k, cf, groups, dev="cpu"):
    return apply_moe(build_model(cfg, 0), MOE["n_experts"], top_k, MOE["d_ff"], alpha=MOE["alpha"],
                     capacity_factor=cf, groups=groups).to(dev)


def moe_reference(cfg, batches, top_k, cf, groups, lr) -> dict:
    """One process on the global batch, capacity per group of tokens (= one rank's): losses, first gradients,
    parameters after the steps (SGD)."""
    return train_reference(cfg, batches, "sgd", lr, model=_model(cfg, top_k, cf, groups), loss_fn=moe_loss)


def _run_ep(cfg, batches, top_k, cf, ep, lr, skew=0.0):
    import torch.distributed as dist

    from course_lib import dist as cdist
    from course_lib.data import shard_batch
    from course_lib.parallel.experts import ExpertGroups, apply_expert_parallel, sync_expert_parallel_grads

    dev, r, world = cdist.device(), dist.get_rank(), dist.get_world_size()
    groups = ExpertGroups(ep, n_experts=MOE["n_experts"])
    model = apply_expert_parallel(_model(cfg, top_k, cf, 1, dev), groups)
    if skew:
        for m in moe_layers(model):                                  # the router prefers expert 0, then 1
            m.router.expert_bias.copy_(torch.tensor([2 * skew, skew] + [0.0] * (MOE["n_experts"] - 2)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = dict(losses=[], ep_rank=groups.ep_rank, ep_ranks=groups.ep_ranks, edp_ranks=groups.edp_ranks,
               dp_ranks=groups.dp_ranks, experts=[moe_layers(model)[0].experts.first + i
                                                  for i in range(MOE["n_experts"] // ep)])
    for step, (x, y) in enumerate(batches):
        x, y = (shard_batch(t, r, world).to(dev) for t in (x, y))
        loss = moe_loss(model, x, y)
        loss.backward()
        if step == 0:
            out["comm"] = [m.counter.table() for m in moe_layers(model)]
            out["sent"] = [m.sent for m in moe_layers(model)]
            out["dropped"] = sum(m.dropped for m in moe_layers(model))
        sync_expert_parallel_grads(model, groups)
        if step == 0:
            out["first_grads"] = grads_of(model)
        out["losses"].append(cdist.global_mean(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = params_of(model)
    return out


def deepspeed_moe(top_ks=(1, 2, 3)) -> dict:
    """DeepSpeed's MoE layer (its own TopKGate) on ep = world ranks, for each k of ``top_ks``: {k: its l_aux, the
    Switch loss of `parallel.moe.switch_loss` on the same gate's probabilities ("ours": f_i from all k choices,
    count / (T k)) and the same formula on the first choices only ("first": f_i = count of first choices / T)}, or
    {"error"}. DeepSpeed 0.19's conventions (deepspeed/moe/sharded_moe.py): top1gating and top2gating take
    ``ce = mean(mask1)``, the first choices only (``l_aux = mean(me * ce) * E * E`` in top2gating), so at k = 2 its
    loss is "first", not ours; topkgating (k >= 3) takes every choice and divides by k, which is ours. At k = 2
    DeepSpeed samples the second expert with Gumbel noise by default (``top2_2nd_expert_sampling``), so its counts are
    not the deterministic top-2 that "ours" takes; its loss uses the first choices only, which are deterministic."""
    import torch.distributed as dist

    from course_lib import dist as cdist

    dev = cdist.device()
    out = {}
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend=dist.get_backend())
        for k in top_ks:
            torch.manual_seed(0)
            expert = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
            layer = MoE(16, expert, num_experts=4, ep_size=dist.get_world_size(), k=k, capacity_factor=1.0,
                        min_capacity=0, use_rts=False).to(dev)
            x = torch.randn(2, 8, 16, device=dev, requires_grad=True)
            y, l_aux, counts = layer(x)
            (y.sum() + l_aux).backward()
            logits = torch.nn.functional.linear(x.detach().reshape(-1, 16).float(), layer.deepspeed_moe.gate.wg.weight)
            probs = logits.softmax(-1)                                              # (T, E)
            chosen = probs.topk(k, -1).indices                                      # (T, k)
            out[k] = dict(l_aux=l_aux.item(), ours=switch_loss(probs, chosen, 4).item(),
                          first=switch_loss(probs, chosen[:, :1], 4).item(), shape=tuple(y.shape),
                          grad=x.grad is not None, counts=[int(c) for c in counts])
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        return dict(error=f"{type(exc).__name__}: {exc}")
    return out


def rank_moe_lab(cfg, batches, lr: float, cases, skew: float = 1.0) -> dict:
    """Every experiment of lesson 11's section 3 on this rank (one launch per world size): {case key: `_run_ep`},
    "skewed": one step with a router biased towards experts 0 and 1, "deepspeed" on 2 ranks, "hardware"."""
    import torch.distributed as dist

    from course_lib import dist as cdist
    from course_lib.measure.hardware import hardware_label

    world = dist.get_world_size()
    out = {f"k{k}/cf{cf}/ep{ep}": _run_ep(cfg, batches, k, cf, ep, lr)      # a case given twice runs once
           for k, cf, ep in dict.fromkeys(map(tuple, cases)) if ep <= world and world % ep == 0}
    out["skewed"] = _run_ep(cfg, batches[:1], 2, None, world, lr, skew=skew)
    if world == 2:
        out["deepspeed"] = deepspeed_moe()
    out["hardware"] = hardware_label(cdist.backend(), cdist.device())
    return out
