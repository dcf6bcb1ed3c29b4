"""Lesson 11's grouped-GEMM, router-precision and z-loss experiments, in one process (`parallel.moe_grouped`).

- :func:`dropless_runs`: one forward and backward of the MoE GPT three ways: grouped experts dropless, grouped with
  capacity factor E/k (capacity = the group's S tokens: nothing can drop), the per-expert loop dropless.
- :func:`expert_gemm_curve`: the experts' first matmul at n tokens per expert, three ways: one ``torch._grouped_mm``
  (or the loop where it cannot run: the path is recorded), the per-expert Python loop, and the ceiling: one dense
  matmul of the same A = E n rows through expert 0's weights. 2 A C F FLOPs; small groups run far below the
  ceiling.
- :func:`router_precision`: top-k choices of a bf16 router, and of the fp32 router on bf16 weights, against an
  all-fp32 computation on the same (bf16) values: tokens whose chosen set differs, max |logit diff|.
- :func:`z_loss_run`: the tiny MoE GPT (grouped experts, dropless) trained on a Markov corpus with and without
  ST-MoE's z-loss: cross-entropy, max |router logit| and mean logsumexp^2 per step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from course_lib.config import get_preset
from course_lib.data import get_batch, synthetic_corpus
from course_lib.measure.hardware import hardware_label
from course_lib.measure.speed import time_fn
from course_lib.model import build_model
from course_lib.parallel import moe
from course_lib.parallel.moe_grouped import (FP32Router, GroupedSwiGLUExperts, apply_grouped_experts,
                                             apply_router_options, moe_z_loss, offsets_of)

__all__ = ["dropless_runs", "expert_gemm_curve", "router_precision", "z_loss_run", "flips"]

TOKENS_PER_EXPERT = tuple(2 ** i for i in range(11))       # 1 .. 1024


DROPLESS_WAYS = (("grouped, dropless", None, True), ("grouped, capacity = S", "E/k", True),
                 ("loop, dropless", None, False))


def dropless_runs(cfg, batch, n_experts: int = 4, top_k: int = 2, d_ff: int = 32, alpha: float = 0.1) -> dict:
    """{way: {"loss", "grads", "dropped" (every layer), "path" (of the experts' matmuls)}} for `DROPLESS_WAYS`, the
    same weights (seed 0) and batch (x, y) (B, s)."""
    from course_lib.one_process import grads_of

    x, y = batch
    out = {}
    for name, cf, grouped in DROPLESS_WAYS:
        model = moe.apply_moe(build_model(cfg, 0), n_experts, top_k, d_ff, alpha=alpha,
                              capacity_factor=n_experts / top_k if cf else None)
        if grouped:
            apply_grouped_experts(model)
        loss = moe.moe_loss(model, x, y)
        loss.backward()
        layers = moe.moe_layers(model)
        out[name] = dict(loss=loss.detach(), grads=grads_of(model), dropped=[m.dropped for m in layers],
                         path=getattr(layers[0].experts, "path", "loop"))
    return out


def expert_gemm_curve(tokens_per_expert=TOKENS_PER_EXPERT, d_model: int = 128, d_ff: int = 256, n_experts: int = 8,
                      dtype: torch.dtype = torch.float32, repeats: int = 5, device="cpu", seed: int = 0,
                      min_rows: int = 2048) -> dict:
    """The first expert matmul x w1^T, x (A, C) grouped by expert, w1 (E, F, C), at n = tokens per expert, A = E n,
    2 A C F FLOPs: {"rows": per n, {"n", "rows": A, "gflop", and for each way "grouped" (one ``torch._grouped_mm``,
    or the loop where it cannot run: see "path"), "loop" (E matmuls from Python), "dense" (one (A, C) x (C, F) matmul
    through expert 0's weights: the ceiling) its median seconds "<way>_s" and "<way>_gflops"}, "path", "reason",
    "hardware"}. Forward, no grad; a timed call repeats the product ceil(min_rows / A) times (tiny ones are us)."""
    torch.manual_seed(seed)
    experts = GroupedSwiGLUExperts(n_experts, d_model, d_ff).to(device, dtype)
    probe = torch.empty(0, d_model, device=device, dtype=dtype)
    ok, reason = experts.can_group(probe)
    w1, w0 = experts.w1.detach(), experts.w1.detach()[0]                   # (E, F, C), (F, C)
    rows = []
    for n in tokens_per_expert:
        A, counts = n * n_experts, [n] * n_experts
        x = torch.randn(A, d_model, device=device, dtype=dtype)             # (A, C) grouped by expert
        offs = offsets_of(counts, device)                                   # (E,) int32 ends
        inner = -(-min_rows // A)
        ways = dict(grouped=(lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) if ok
                    else (lambda: _loop(x, w1, counts)),
                    loop=lambda: _loop(x, w1, counts),                      # E x (n, C) x (C, F) -> (A, F)
                    dense=lambda: x @ w0.t())                               # (A, C) x (C, F) -> (A, F)
        row = dict(n=n, rows=A, gflop=2 * A * d_model * d_ff / 1e9)
        for way, fn in ways.items():
            s = time_fn(lambda: [fn() for _ in range(inner)], warmup=1, repeats=repeats, device=device) / inner
            row[f"{way}_s"], row[f"{way}_gflops"] = s, row["gflop"] / s
        rows.append(row)
    return dict(rows=rows, path="grouped_mm" if ok else "loop", reason=reason, dtype=str(dtype), d_model=d_model,
                d_ff=d_ff, n_experts=n_experts, hardware=hardware_label(device=device))


def _loop(x, w, counts):
    return torch.cat([r @ w[e].t() for e, r in enumerate(torch.split(x, counts))])   # E x (n_e, C) -> (A, F)


def flips(indices: torch.Tensor, reference: torch.Tensor) -> int:
    """Tokens whose set of chosen experts differs: indices, reference (T, k) -> count (the order within k ignored)."""
    return int((indices.sort(-1).values != reference.sort(-1).values).any(-1).sum())


def router_precision(n_tokens: int = 4096, d_model: int = 64, n_experts: int = 8, top_k: int = 2,
                     scales=(0.02, 0.2), seed: int = 0) -> list[dict]:
    """For each router weight std in ``scales`` (0.02: at init; larger: logits of a trained-ish router), bf16 x and
    bf16 weights: {"scale", "bf16_flips", "fp32_flips" (the `FP32Router`), "tokens", "max_logit_diff" (bf16 router vs
    fp32), "max_logit"}, against top-k of F.linear(x.float(), w.float()) on the same bf16 values."""
    out = []
    for scale in scales:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n_tokens, d_model, generator=g).bfloat16()                 # (T, C), as after a norm
        router = moe.TopKRouter(d_model, n_experts, top_k)
        with torch.no_grad():
            router.weight.copy_(torch.randn(n_experts, d_model, generator=g) * scale)
        router = router.bfloat16()
        fp32 = FP32Router.holding(router)
        with torch.no_grad():
            ref_logits = F.linear(x.float(), router.weight.float())                  # (T, E) all fp32
            ref = torch.topk(ref_logits.softmax(-1), top_k, -1).indices              # (T, k)
            lb, _, _, ib = router(x)
            _, _, _, i32 = fp32(x)
        out.append(dict(scale=scale, tokens=n_tokens, bf16_flips=flips(ib, ref), fp32_flips=flips(i32, ref),
                        max_logit_diff=(lb.float() - ref_logits).abs().max().item(),
                        max_logit=ref_logits.abs().max().item()))
    return out


def z_loss_run(steps: int = 100, coefs=(0.0, 1e-3, 1e-1), n_experts: int = 4, top_k: int = 2, batch: int = 8,
               seq_len: int = 32, lr: float = 1e-2, alpha: float = 0.01, seed: int = 0) -> dict:
    """The tiny GPT, every MLP a dropless MoE with grouped experts, trained (AdamW) on a Markov corpus once per
    z-loss coefficient in ``coefs`` (0: none), the same data and initial weights: {coef: {"loss": cross-entropy per
    step, "max_logit": max |router logit| over the layers per step, "max_lse": max logsumexp of a token's logits,
    "z": mean_t logsumexp^2 summed over the layers (before the coefficient) per step, "path"}, "ideal": the corpus's
    entropy rate (nats)}. The z-loss is smallest at logsumexp = 0, i.e. logits about -ln E when near uniform: it
    bounds logsumexp, not |logit|, and can push small logits negative."""
    cfg = dataclasses.replace(get_preset("tiny"), seq_len=seq_len)
    corpus = synthetic_corpus(20_000, cfg.vocab_size, seed=seed)
    out = dict(ideal=corpus.ideal_loss)
    for coef in coefs:
        model = moe.apply_moe(build_model(cfg, seed), n_experts, top_k, d_ff=cfg.d_model, seed=seed, alpha=alpha)
        apply_router_options(apply_grouped_experts(model), z_loss_coef=1.0)         # z: the unscaled sum
        layers = moe.moe_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        rec = dict(loss=[], max_logit=[], max_lse=[], z=[])
        for step in range(steps):
            x, y = get_batch(corpus.tokens, batch, seq_len, step, seed=seed)
            loss = model.loss(x, y)
            z = moe_z_loss(model)
            (loss + sum(m.aux_loss for m in layers) + coef * z).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec["loss"].append(loss.item())
            rec["z"].append(z.item())
            rec["max_logit"].append(max(m.router_logits.abs().max().item() for m in layers))
            rec["max_lse"].append(max(m.router_logits.float().logsumexp(-1).max().item() for m in layers))
        rec["path"] = layers[0].experts.path
        out[coef] = rec
    return out
