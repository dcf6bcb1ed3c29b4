"""Tests of a loss that counts tokens right (course_lib/training/token_loss.py; lesson 02's DP, lesson 09).

Data parallelism on 2 gloo ranks x gradient accumulation over 2 micro-batches, on padded batches whose micro-batches
and ranks hold different numbers of valid tokens, must equal one process over the same tokens when the summed loss
is divided by the global number of valid tokens; the per-micro-batch mean (each micro-batch's mean / k, DDP's mean
over ranks) must not, by a margin far above the tolerance.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from course_lib.config import small_config
from course_lib.runtime.launch import run
from course_lib.lessons.l02_data_parallel import experiments as ddp_lab
from course_lib.one_process import train_reference
from course_lib.training.token_loss import (IGNORE_INDEX, global_token_count, global_valid_tokens, loss_sum_and_tokens,
                                   mask_padding, token_normalized)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = small_config()
STEPS, GLOBAL_BATCH, ACCUM = 2, 8, 2          # 2 ranks x 2 micro-batches x 2 rows
RTOL, ATOL = 1e-5, 1e-7


def test_loss_sum_and_tokens_counts_only_valid_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    y = mask_padding(torch.randint(11, (3, 5), generator=g), torch.tensor([5, 2, 0]))
    assert (y == IGNORE_INDEX).sum() == 3 + 5
    loss_sum, n = loss_sum_and_tokens(logits, y)
    assert n.item() == 7 and n.dtype == torch.int64
    keep = y.flatten() != IGNORE_INDEX
    by_hand = -logits.flatten(0, 1)[keep].log_softmax(-1).gather(1, y.flatten()[keep, None]).sum()
    torch.testing.assert_close(loss_sum, by_hand, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(token_normalized(loss_sum, n), F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    assert token_normalized(loss_sum * 0, torch.tensor(0)).item() == 0.0       # no valid token: 0, not NaN
    # without a process group: identity (a copy), and micro-batches' counts add up
    assert global_token_count(n).item() == 7 and global_token_count(n) is not n
    assert global_valid_tokens([y, y[:1]]).item() == 7 + 5
    with pytest.raises(ValueError, match="lengths"):
        mask_padding(y, torch.tensor([6, 0, 0]))


def _rank_both(cfg, batches):
    return {norm: ddp_lab.rank_train(cfg, batches, mode="bucketed", bucket_cap_mb=0.01, accum_steps=ACCUM,
                                     loss_norm=norm) for norm in ("tokens", "mean")}


def _max_rel(actual: dict, expected: dict) -> float:
    return max(float((actual[k] - expected[k]).norm() / expected[k].norm()) for k in expected)


def test_dp2_x_accum2_on_padded_batches_equals_one_process():
    batches = ddp_lab.padded_batches(CFG, GLOBAL_BATCH, STEPS, seed=3)
    x, y = batches[0]
    per_micro = [(y[i:i + 2] != IGNORE_INDEX).sum().item() for i in range(0, GLOBAL_BATCH, 2)]
    assert max(per_micro) >= 1.5 * min(per_micro), f"valid tokens per micro-batch {per_micro}: not unequal enough"
    ref = train_reference(CFG, batches, lr=0.1)            # lm_loss ignores -100: the token mean of the global batch
    returns = run(_rank_both, 2, args=(CFG, batches), timeout_s=240, stream=False, backend="gloo").returns
    for rank, out in enumerate(returns):
        tok = out["tokens"]
        assert tok["losses"] == pytest.approx(ref["losses"], rel=RTOL), f"rank {rank}: token-mean losses"
        for what in ("first_grads", "grads", "params"):
            for k in ref[what]:
                torch.testing.assert_close(tok[what][k], ref[what][k], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"rank {rank}, {what} {k}: {m}")
    wrong = returns[0]["mean"]
    grad_err = _max_rel(wrong["first_grads"], ref["first_grads"])
    right_err = _max_rel(returns[0]["tokens"]["first_grads"], ref["first_grads"])
    print(f"\nvalid tokens per micro-batch (rank 0: 1st, 2nd; rank 1: 1st, 2nd) {per_micro}; largest relative "
          f"gradient error vs one process: per-micro-batch mean {grad_err:.2e}, global-token sum {right_err:.2e}; "
          f"first-step loss {wrong['losses'][0]:.5f} (mean of means) vs {ref['losses'][0]:.5f} (token mean)")
    assert grad_err > 1000 * RTOL and right_err < RTOL, (grad_err, right_err)
