"""3D parallelism: a plain GPT on a `ProcessGrid`, pipelined over pp, Megatron TP over tp, data parallel over dp
(lesson 08), composed from the course's own pieces of lessons 02-05.

    grid = ProcessGrid(dp=2, pp=2, tp=2)                      # 8 ranks
    stage = parallelize_3d(build_model(cfg, seed=0), grid)    # cfg.tie_embeddings=False (pipelining needs it)
    opt = make_optimizer_3d(stage, grid, torch.optim.SGD, "zero1", lr=0.1)
    loss = train_step_3d(stage, grid, x_dp, y_dp, m=4, optimizer=opt)   # x_dp: this DP rank's rows (b, T)

- **pp**: the rank keeps the blocks of its pipeline stage (`pipeline.build_stage` with its ``pp`` coordinate), and
  one step runs the 1F1B (or GPipe) schedule over m micro-batches (`pipeline.run_schedule`) inside its pp group:
  TP rank t of stage s exchanges activations with TP rank t of stages s - 1 and s + 1.
- **tp**: the stage's blocks become Megatron's column/row-parallel attention and MLP over the tp group
  (`tensor_model.tensor_parallel_blocks`). Embeddings, the final LayerNorm and the head stay whole on every TP rank
  of their stage (lesson 04 splits the vocabulary on its own): between blocks the activations are whole and the same
  on the TP ranks, so every TP rank computes the same loss and the same gradients for the unsplit parameters.
  With ``sequence_parallel=True`` the activations between and around the blocks are split along the sequence
  (b, T/t, C), so are the messages between stages, and the LayerNorms' and row biases' gradients are summed over tp.
- **dp**: the grid's dp group holds replicas of the same shards; after the schedule their gradients are averaged
  over it (`ddp.average_gradients`, "ddp"), or ZeRO-1 shards the optimizer over it (`zero.ZeroOptimizer`,
  "zero1"), each rank's rows being its share of the global batch.

The result equals one process on the global batch (tests/test_three_d.py: 8 gloo ranks as 2 x 2 x 2).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.dist import ProcessGrid
from course_lib.parallel.ddp import average_gradients
from course_lib.parallel.pipeline import P2P, Stage, build_stage, run_schedule, split_microbatches
from course_lib.parallel.pipeline_schedules import schedule_orders
from course_lib.parallel.sequence import gather_to_replicated, split_to_sequence
from course_lib.parallel.tensor_model import (shard_like, sync_sequence_parallel_grads, tensor_parallel_blocks,
                                              validate_tensor_parallel)
from course_lib.parallel.zero import ZeroOptimizer

__all__ = ["parallelize_3d", "make_optimizer_3d", "train_step_3d", "shard_reference"]


class _Through(nn.Module):
    """``fn(module(x), group)`` or ``module(fn(x, group))``: a stage's replicated layer with a sequence-parallel
    boundary on one side (the same parameters as the model's own ``module``)."""

    def __init__(self, module: nn.Module, fn, group, before: bool):
        super().__init__()
        self.module, self.fn, self.group, self.before = module, fn, group, before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.fn(x, self.group)) if self.before else self.fn(self.module(x), self.group)


def parallelize_3d(model: nn.Module, grid: ProcessGrid, sequence_parallel: bool = False) -> Stage:
    """This rank's part of a plain GPT (built with the same seed on every rank): the blocks of its pipeline stage,
    tensor-parallel over the grid's tp group. The model's blocks are changed in place (so ``model``'s parameter
    names still name this rank's shards: see `shard_reference`).

    ``sequence_parallel`` (Korthikanti et al. 2022, lesson 04): between and around the blocks each TP rank holds
    (b, T/t, C). The first stage's embeddings stay whole on every TP rank and hand the blocks this rank's shard of
    the sequence (`sequence.split_to_sequence`); the last stage gathers it back before its final LayerNorm and head
    (`sequence.gather_to_replicated`); between stages each TP rank sends its (b, T/t, C) shard, t times less."""
    tp = grid.sizes["tp"]
    sequence_parallel = sequence_parallel and tp > 1
    validate_tensor_parallel(model.cfg, tp, sequence_parallel=sequence_parallel)
    stage = build_stage(model, grid.coord("pp"), grid.sizes["pp"])
    stage.sequence_parallel = sequence_parallel
    if tp > 1:
        tensor_parallel_blocks(stage.blocks, grid.group("tp"), sequence_parallel=sequence_parallel)
    if sequence_parallel:
        if stage.is_first:
            stage.drop = _Through(stage.drop, split_to_sequence, grid.group("tp"), before=False)
        if stage.is_last:
            stage.ln_f = _Through(stage.ln_f, gather_to_replicated, grid.group("tp"), before=True)
    return stage


def make_optimizer_3d(stage: nn.Module, grid: ProcessGrid, optimizer_cls=torch.optim.SGD, data_parallel: str = "ddp",
                      **kwargs):
    """The optimizer of a stage's shards: a plain ``optimizer_cls`` ("ddp": every DP replica steps the same
    averaged gradients) or ZeRO-1 over the dp group ("zero1": each DP rank steps 1/dp of every shard)."""
    if data_parallel == "ddp":
        return optimizer_cls(stage.parameters(), **kwargs)
    if data_parallel == "zero1":
        return ZeroOptimizer(stage, optimizer_cls, stage=1, group=grid.group("dp"), **kwargs)
    raise ValueError(f"data_parallel={data_parallel!r}: choose 'ddp' or 'zero1'")


def train_step_3d(stage: Stage, grid: ProcessGrid, x: torch.Tensor, y: torch.Tensor, m: int, optimizer,
                  schedule: str = "1f1b", stats: dict | None = None) -> float | None:
    """One training step. x, y: this DP rank's rows (b, T), the same on every rank of its pp and tp groups.
    Returns the mean loss of those rows on the last stage (None on the other stages). ``stats`` (a dict) receives
    the schedule's ``bytes_sent`` between stages and its ``timeline`` (`pipeline.run_schedule`)."""
    p, pp_rank, tp = grid.sizes["pp"], grid.coord("pp"), grid.sizes["tp"]
    device = next(stage.parameters()).device
    order = schedule_orders(schedule, p, m)[pp_rank]
    comm = P2P(pp_rank, p, device, group=grid.group("pp")) if p > 1 else None
    sp = getattr(stage, "sequence_parallel", False)
    hidden = (x.shape[0] // m, x.shape[1] // tp, stage.d_model) if sp else None     # what crosses a stage boundary
    out = run_schedule(stage, order, split_microbatches(x, m), split_microbatches(y, m), comm, hidden_shape=hidden)
    if stats is not None:
        stats.update(bytes_sent=out["bytes_sent"], timeline=out["timeline"])
    if sp:
        sync_sequence_parallel_grads(stage, grid.group("tp"))      # LayerNorms and row biases saw T/t tokens
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.step()                 # reduce-scatters the gradients over dp, steps its chunks, all-gathers
    else:
        if grid.sizes["dp"] > 1:
            average_gradients(stage, group=grid.group("dp"))
        optimizer.step()
    optimizer.zero_grad()
    return sum(out["losses"]) / m if stage.is_last else None


def shard_reference(model: nn.Module, stage: nn.Module, grid: ProcessGrid,
                    full: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (this rank's parameter, the same slice of the one-process tensor ``full[name]``)} for every
    parameter of ``stage``, named as in the plain ``model``: the pairs a test compares."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = {names[id(p)]: p.detach().cpu() for p in stage.parameters()}
    ref = shard_like(model, {n: full[n] for n in mine}, group=grid.group("tp"))
    return {n: (mine[n], ref[n]) for n in mine}
