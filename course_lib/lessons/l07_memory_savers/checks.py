"""What the graded exercises of lesson 07 call (solutions/07_memory_savers.ipynb), one process each.

Each ``check_*`` runs the learner's code against a measurement or the course's reference and raises
``course_lib.grading.check.CheckFailed`` (one line: what, expected, got, a hint) at the first difference.
The test cells of the exercises call them; tests/test_checkpointing.py calls them on wrong variants.
"""

from __future__ import annotations

import copy
from typing import Callable

from course_lib import theory
from course_lib.config import ModelConfig, small_config
from course_lib.data import random_batches
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.lessons.l07_memory_savers.experiments import measure_step, use_attention
from course_lib.measure.speed import count_flops
from course_lib.model import build_model
from course_lib.parallel.checkpointing import apply_activation_checkpointing

__all__ = ["CHECK_CFG", "check_checkpointed_block", "check_activation_estimator", "check_budget_fitter",
           "budget_candidates"]

CHECK_CFG = small_config(seq_len=32, n_layer=3, name="check")


def check_checkpointed_block(wrapper_cls: Callable, cfg: ModelConfig = CHECK_CFG, batch: int = 4) -> dict:
    """``wrapper_cls(block)`` replaces every block of a GPT: the loss and every gradient must equal the plain
    model's, the activations held after the forward must be checkpointing's (within 10% of the formula,
    far below the plain model's), and backward must recompute (matmul FLOPs counted)."""
    plain = build_model(cfg, 0)
    wrapped = copy.deepcopy(plain)
    for i, block in enumerate(wrapped.blocks):
        wrapped.blocks[i] = wrapper_cls(block)
    x, y = random_batches(cfg, batch, 1, seed=1)[0]
    ref, got = measure_step(plain, x, y), measure_step(wrapped, x, y)
    check_close("loss of the checkpointed model", got["loss"], ref["loss"], rtol=1e-6,
                hint="run the block itself inside checkpoint: the forward must not change")
    missing = sum(p.grad is None for p in wrapped.parameters())
    check_equal("parameters without a gradient", missing, 0,
                hint="do not detach the input or run under no_grad: gradients must flow through the wrapper")
    err = max((a - b).abs().max().item() for a, b in zip(got["grads"].values(), ref["grads"].values()))
    check_close("largest gradient difference from the plain model", err, 0.0, atol=1e-6,
                hint="the recomputation in backward must run exactly the forward of the first pass")
    est = theory.savers.checkpointed_activation_bytes(cfg, batch, every=1)["held"]
    check_close(f"activation bytes held after the forward (plain model: {ref['held']})", got["held"], est,
                rtol=0.10, hint="torch.utils.checkpoint.checkpoint keeps only the block's input")
    flops_plain = count_flops(lambda: plain.loss(x, y).backward())
    flops_ckpt = count_flops(lambda: wrapped.loss(x, y).backward())
    check_true(f"backward recomputes the blocks (FLOPs {flops_ckpt} vs plain {flops_plain})",
               flops_ckpt > flops_plain, hint="checkpointing trades memory for a second forward")
    return dict(held=got["held"], plain_held=ref["held"], flops=flops_ckpt, plain_flops=flops_plain)


ESTIMATOR_CASES = (  # (config overrides, batch, seq_len, every, attention)
    (dict(), 4, 32, None, "sdpa"), (dict(), 4, 32, 1, "sdpa"), (dict(n_layer=4), 2, 32, 2, "sdpa"),
    (dict(n_layer=5), 2, 32, 2, "sdpa"), (dict(), 2, 32, 3, "sdpa"), (dict(seq_len=96), 2, 96, None, "naive"),
    (dict(seq_len=128, n_head=4), 1, 128, None, "naive"), (dict(n_layer=4, seq_len=64), 2, 64, 2, "naive"),
    # a batch shorter than the model's context (seq_len is an argument, not cfg.seq_len), and 4 blocks in segments of 3
    (dict(seq_len=128), 2, 32, None, "sdpa"), (dict(seq_len=128, n_layer=4), 2, 48, 3, "naive"),
)


# one per rule of the exercise text: the hint points at the rule the failing case uses, without its formula
_ESTIMATOR_HINTS = {
    "checkpointed": "the exercise text's checkpointing rule: what each segment keeps, and how many segments L blocks "
                    "make when k does not divide L; the loss's part is still there",
    "naive": "the exercise text's naive-attention rule: what the block keeps instead of the log-sum-exps",
    "sdpa": "the exercise text's per-block rule (elements and fp32 statistics, in bytes), plus the loss's part",
}


def check_activation_estimator(fn: Callable, cases=ESTIMATOR_CASES) -> list[dict]:
    """``fn(cfg, batch_size, seq_len, every, attention)`` must be within 10% of the activation bytes measured
    after the forward of ``GPT(cfg).loss`` (``LiveActivations``), for checkpointing every k and naive attention."""
    out = []
    for over, batch, T, every, attention in cases:
        cfg = CHECK_CFG.replace(**over)
        model = build_model(cfg, 0)
        if every is not None:
            apply_activation_checkpointing(model, every=every)
        x, y = random_batches(cfg, batch, 1, seed=2, seq_len=T)[0]
        with use_attention(model, attention):
            measured = measure_step(model, x, y)["held"]
        got = fn(cfg, batch, T, every, attention)
        check_close(f"bytes for L={cfg.n_layer}, B={batch}, T={T}, every={every}, {attention} attention "
                    f"(measured)", got, measured, rtol=0.10,
                    hint=_ESTIMATOR_HINTS["checkpointed" if every is not None else
                                          "naive" if attention == "naive" else "sdpa"])
        out.append(dict(cfg=cfg, batch=batch, T=T, every=every, attention=attention, measured=measured, got=got))
    return out


def budget_candidates(seq_len: int = 128) -> list[ModelConfig]:
    """The models of the budget challenge: widths 64-384 and depths 2-12 of the course's GPT, vocabulary 256."""
    out = []
    for d, heads in ((64, 4), (128, 4), (192, 6), (256, 8), (384, 8)):
        for L in (2, 4, 8, 12):
            out.append(ModelConfig(vocab_size=256, seq_len=seq_len, n_layer=L, n_head=heads, d_model=d,
                                   name=f"d{d}-L{L}"))
    return out


# (budget bytes, global batch[, everys]): global batches 12 and 20 have divisors that halving misses (4 of 12) and
# non-divisors that fit (3 of 20); the last case passes its own checkpointing choices
BUDGET_CASES = ((8e6, 8), (25e6, 16), (60e6, 32), (60e6, 1), (150e6, 64), (1e5, 4), (15e6, 12), (100e6, 20),
                (60e6, 12, (None, 3)))


def check_budget_fitter(fn: Callable, cases=BUDGET_CASES) -> list[dict]:
    """``fn(budget_bytes, candidates, global_batch)`` (and ``everys=`` where a case gives it) must choose what
    ``course_lib.theory.savers.fit_budget`` chooses: the same model, micro-batch and checkpointing (None when
    nothing fits)."""
    cands = budget_candidates()
    out = []
    for budget, gb, *rest in cases:
        if rest:
            want = theory.savers.fit_budget(budget, cands, gb, everys=rest[0])
            got = fn(budget, cands, gb, everys=rest[0])
            gb_text = f"{gb}, everys={rest[0]}"
        else:
            want = theory.savers.fit_budget(budget, cands, gb)
            got = fn(budget, cands, gb)
            gb_text = f"{gb}"
        if want is None:
            check_true(f"nothing fits in {budget / 1e6:g} MB: return None (got {got})", got is None)
        else:
            check_true(f"a plan for {budget / 1e6:g} MB, global batch {gb_text} (got {got})", isinstance(got, dict),
                       hint="return a dict with name, micro_batch, accum_steps, every, bytes")
            for key in ("name", "micro_batch", "accum_steps", "every"):
                check_equal(f"{key} of the plan for {budget / 1e6:g} MB, global batch {gb_text}", got.get(key),
                            want[key], hint="rules 1 and 2 of the exercise, in their order: every micro-batch that "
                                            "divides the global batch, with each checkpointing choice of everys")
            check_close(f"device bytes of the plan for {budget / 1e6:g} MB", got.get("bytes"), want["bytes"],
                        rtol=1e-6, hint="the bytes the exercise's pricing function gives for the plan you chose")
        out.append(dict(budget=budget, global_batch=gb, plan=want))
    return out
