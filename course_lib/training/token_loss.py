"""A loss that counts tokens right: divide the summed loss by the global number of valid tokens (lessons 02, 09).

With padded or variable-length sequences, the targets of a padding position are `ignore_index` (-100, as in
`torch.nn.functional.cross_entropy`) and carry no loss. The mean loss of a global batch is then

    L = (sum over every valid token t of the batch of loss_t) / N,   N = valid tokens over micro-batches and ranks.

Averaging per micro-batch and per rank instead -- `F.cross_entropy(..., reduction="mean")` on each micro-batch,
divided by the number of micro-batches, then DDP's mean over ranks -- gives each micro-batch the same weight
whatever its number of valid tokens: a token in a half-padded micro-batch weighs twice as much as one in a full
micro-batch. The sum of the means is not the mean of the sum: (x1 / n1 + x2 / n2) / 2 != (x1 + x2) / (n1 + n2).

torchtitan fixed exactly this. Issue pytorch/torchtitan#1842 ("More robust distributed loss") outlines the
solution: "don't let FSDP do implicit gradient division", "always run cross entropy with reduction="sum"", and
count "the number of tokens involving in loss computation, e.g. by explicitly doing num_tokens = (labels !=
IGNORE_INDEX).sum() on each rank". PR pytorch/torchtitan#2206 ("Fix loss computation by handling valid token
imbalance in train loop") implements it: cross-entropy with "sum" reduction, the valid tokens of every
micro-batch summed "across DP ranks before gradient accumulation start", and back-propagation of
"loss = local_rank_loss_sum / global_valid_tokens" with FSDP's gradient averaging disabled.

Here the same recipe, in three calls per step:

    n_global = global_valid_tokens([y for _, y in micro_batches], group)       # one all-reduce, before backward
    for x, y in micro_batches:
        loss_sum, _ = loss_sum_and_tokens(model(x), y)
        token_normalized(loss_sum, n_global, grad_divisor=ddp.world_size).backward()

`grad_divisor` undoes the division by the world size that a DDP which *averages* gradients makes (our
`BucketedDDP` and `torch.nn.parallel.DistributedDataParallel` both do; torchtitan instead switches FSDP's division
off): loss_sum x n / N on each rank, averaged over n ranks, is the gradient of (sum over ranks of loss_sum) / N.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist

__all__ = ["IGNORE_INDEX", "loss_sum_and_tokens", "global_token_count", "global_valid_tokens", "token_normalized",
           "mask_padding"]

IGNORE_INDEX = -100      # the target of a padding position: F.cross_entropy's default ignore_index


def loss_sum_and_tokens(logits: torch.Tensor, targets: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy (fp32, nats) over the valid targets, and how many there are.

    logits (B, T, V), targets (B, T) with `ignore_index` at padding -> (loss_sum: 0-dim fp32 tensor with a
    gradient, n_tokens: 0-dim int64 tensor). A micro-batch without a valid token gives (0.0, 0).
    """
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),   # (B*T, V) vs (B*T,)
                               ignore_index=ignore_index, reduction="sum")
    n_tokens = (targets != ignore_index).sum()                                    # (B, T) -> ()
    return loss_sum, n_tokens


def global_token_count(n_local: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over the ranks of `group` of each rank's count (all-reduce SUM) when torch.distributed is
    initialised; the count itself otherwise. Returns a new tensor: `n_local` is left as it was. Distributed, it lives
    on the rank's device (`course_lib.dist.device()`: under NCCL a collective's tensor must be on the GPU)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.as_tensor(n_local).detach().clone()
    n = torch.as_tensor(n_local).detach().to(cdist.device(), copy=True)
    dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n


def global_valid_tokens(targets: Iterable[torch.Tensor], group=None,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """N: the valid targets of every micro-batch of this step on this rank, summed over the ranks of `group`.

    Call it once per optimizer step, before the first backward (every rank must call it: it is a collective).
    targets: this rank's micro-batches' targets, each (b, T). Returns a 0-dim int64 tensor.
    """
    local = sum(((y != ignore_index).sum() for y in targets), torch.zeros((), dtype=torch.int64))
    return global_token_count(local, group)


def token_normalized(loss_sum: torch.Tensor, n_global: torch.Tensor | int, grad_divisor: int = 1) -> torch.Tensor:
    """The loss to back-propagate: loss_sum x grad_divisor / N (N clamped to at least 1, so a step without any
    valid token gives zero gradients rather than NaN).

    grad_divisor: the number of ranks a gradient-averaging DDP divides by (its world size); 1 where the gradients
    are summed over ranks (torchtitan's FSDP with its division switched off) or on one process.
    """
    n = torch.as_tensor(n_global, device=loss_sum.device).clamp(min=1)
    return loss_sum * grad_divisor / n


def mask_padding(targets: torch.Tensor, lengths: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Targets of right-padded sequences: row i keeps its first lengths[i] targets, the rest become `ignore_index`.

    targets (B, T), lengths (B,) ints in [0, T] -> (B, T), a new tensor.
    """
    T = targets.shape[-1]
    if lengths.shape != targets.shape[:1] or bool((lengths < 0).any()) or bool((lengths > T).any()):
        raise ValueError(f"lengths {tuple(lengths.tolist())} must be {targets.shape[0]} values in [0, T={T}]")
    pad = torch.arange(T, device=targets.device) >= lengths[:, None].to(targets.device)   # (B, T) True at padding
    return targets.masked_fill(pad, ignore_index)
