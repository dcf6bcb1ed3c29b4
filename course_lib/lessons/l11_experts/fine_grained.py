"""Fine-grained and shared experts at equal parameters, trained in one process (lesson 11; DeepSeekMoE, Dai et al.
2024, section 3; formulas in `course_lib.theory.experts_fine`).

Three MoE layers with the same expert parameters, total and active, in every block of the tiny GPT:

    coarse   E = 4 routed of F, top-1                            (N, K, F)
    fine     E = 16 routed of F/4, top-4                         (mN, mK, F/m), m = 4
    shared   1 shared of F/4 + E = 15 routed of F/4, top-3       (mN - K_s, mK - K_s), K_s = 1

(DeepSeekMoE keeps mN experts in all: with one shared, 15 are routed, not 12.) Only the router differs, C E: 4 C,
16 C, 15 C a layer. Gating as DeepSeekMoE's (section 2, eq. 3-5): the k largest softmax scores weigh their experts
as they are (``normalize=False``, which also gives the top-1 router a gradient), the shared expert's output is added
with weight 1; the Switch loss (alpha 0.01) on the routed experts (DeepSeekMoE's expert-level balance loss, eq. 12-13,
is the same sum). Every expert weight, the shared ones too, is drawn with std 0.02 (the shared expert's nn.Linear
default would start it larger than the routed ones). Data: the course's text (`course_lib.data.text_corpus`, bytes),
its last 10 % held out; AdamW; the same batches for the three.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from course_lib.config import get_preset
from course_lib.data import get_batch, text_corpus
from course_lib.model import build_model
from course_lib.parallel.moe import apply_moe, moe_layers
from course_lib.theory import experts_fine

__all__ = ["variant_shapes", "build_variant", "count_params", "train_variants"]


def variant_shapes(n_experts: int = 4, top_k: int = 1, d_ff: int = 64, m: int = 4) -> dict[str, experts_fine.MoEShape]:
    """{"coarse", "fine", "shared"}: (N, K, F), its segmentation by m, and that with one shared expert."""
    return {"coarse": experts_fine.MoEShape(n_experts, top_k, d_ff),
            "fine": experts_fine.fine_grained(n_experts, top_k, d_ff, m),
            "shared": experts_fine.fine_grained(n_experts, top_k, d_ff, m, n_shared=1)}


def build_variant(cfg, shape: experts_fine.MoEShape, alpha: float = 0.01, seed: int = 0) -> torch.nn.Module:
    """The tiny GPT (same dense weights for every shape at a seed) with every MLP a MoE layer of ``shape``."""
    model = apply_moe(build_model(cfg, seed), shape.n_experts, shape.top_k, shape.d_ff, seed=seed, normalize=False,
                      alpha=alpha, shared_d_ff=shape.shared_d_ff)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in moe_layers(model):
            if layer.shared is not None:
                for p in layer.shared.parameters():                  # std 0.02, as the routed experts
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def count_params(layer) -> dict:
    """Counted from one `MoELayer`'s modules: {"total", "active", "expert_total", "expert_active"} (active: the
    router, the shared expert and k routed experts)."""
    ex = layer.experts
    one = ex.w1[0].numel() + ex.w3[0].numel() + ex.w2[0].numel()
    shared = sum(p.numel() for p in layer.shared.parameters()) if layer.shared is not None else 0
    experts = sum(p.numel() for p in ex.parameters())
    router = layer.router.weight.numel()
    return {"total": router + experts + shared, "active": router + layer.top_k * one + shared,
            "expert_total": experts + shared, "expert_active": layer.top_k * one + shared}


def _formula(d_model: int, shape) -> dict:
    e = experts_fine.expert_params(d_model, shape)
    return {"total": experts_fine.total_params(d_model, shape), "active": experts_fine.active_params(d_model, shape),
            "expert_total": e["total"], "expert_active": e["active"]}


def train_variants(steps: int, batch: int = 8, seq_len: int = 32, lr: float = 3e-3, d_ff: int = 64, m: int = 4,
                   alpha: float = 0.01, seed: int = 0, eval_batches: int = 8, corpus_bytes: int = 1_000_000) -> dict:
    """Train the three variants ``steps`` AdamW steps each on the same text batches. {"variants": {name: {"shape",
    "loss" (cross-entropy per step), "eval_loss" (held-out text, after training), "params" (counted per layer),
    "formula" (`theory.experts_fine`), "combinations" C(E, k), "tokens_per_expert" (per layer, summed over the last
    10 steps), "seconds"}}, "hardware", "steps"}. Asserts equal expert parameters, total and active."""
    from course_lib.measure.hardware import hardware_label

    cfg = dataclasses.replace(get_preset("tiny"), seq_len=seq_len)
    tokens = text_corpus(corpus_bytes).long() % cfg.vocab_size
    cut = int(0.9 * tokens.numel())
    train, held = tokens[:cut], tokens[cut:]
    batches = [get_batch(train, batch, seq_len, s, seed=seed) for s in range(steps)]
    evals = [get_batch(held, batch, seq_len, s, seed=seed) for s in range(eval_batches)]
    shapes = variant_shapes(d_ff=d_ff, m=m)
    models = {name: build_variant(cfg, shape, alpha, seed) for name, shape in shapes.items()}
    for key in ("expert_total", "expert_active"):                     # fail before training, not after
        counts = {name: count_params(moe_layers(model)[0])[key] for name, model in models.items()}
        assert len(set(counts.values())) == 1, f"{key} differs between the variants: {counts}"
    out = {}
    for name, shape in shapes.items():
        start = time.perf_counter()
        model = models[name]
        layers = moe_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        losses, load = [], [torch.zeros(shape.n_experts, dtype=torch.long) for _ in layers]
        for step, (x, y) in enumerate(batches):
            loss = model.loss(x, y)
            (loss + sum(layer.aux_loss for layer in layers)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step >= steps - 10:
                load = [c + layer.counts for c, layer in zip(load, layers)]
        with torch.no_grad():
            eval_loss = sum(model.loss(x, y).item() for x, y in evals) / len(evals)
        out[name] = dict(shape=dataclasses.asdict(shape), loss=losses, eval_loss=eval_loss,
                         params=count_params(layers[0]), formula=_formula(cfg.d_model, shape),
                         combinations=experts_fine.routing_combinations(shape.n_experts, shape.top_k),
                         tokens_per_expert=[c.tolist() for c in load], seconds=time.perf_counter() - start)
    return {"variants": out, "hardware": hardware_label(), "steps": steps}
