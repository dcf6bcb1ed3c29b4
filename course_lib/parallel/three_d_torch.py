"""The library version of 3D parallelism (lesson 08), composed as torchtitan composes it, on the same plain GPT:

    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage = parallelize_3d_torch(build_model(cfg, seed=0), mesh)          # DTensor TP, then FSDP2 over dp
    schedule = pipeline_schedule_3d(stage, mesh, m=4)                     # torch.distributed.pipelining 1F1B
    losses = train_step_3d_torch(schedule, mesh, x_dp, y_dp, optimizer)

- the rank's pipeline stage is `pipeline.build_stage` of its ``pp`` coordinate (torchtitan splits the model the
  same way, by blocks, with `PipelineStage` per stage);
- its blocks get DTensor's Megatron plan over ``mesh["tp"]`` (`tensor_dtensor.parallelize_blocks`);
- FSDP2's `fully_shard` shards every block, then the stage, over ``mesh["dp"]`` (its parameters become 2-D
  DTensors: Shard(0) over dp on top of TP's placement);
- `PipelineStage` + `Schedule1F1B` (or `ScheduleGPipe`) run the micro-batches over ``mesh["pp"]``'s group.

The result equals one process on the global batch, and the course's own `three_d` (tests/test_three_d.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.model import lm_loss
from course_lib.parallel.pipeline import Stage, build_stage
from course_lib.parallel.tensor_dtensor import parallelize_blocks, unpermute_qkv_rows

__all__ = ["parallelize_3d_torch", "pipeline_schedule_3d", "train_step_3d_torch", "full_parameters_3d"]


def parallelize_3d_torch(model: nn.Module, mesh) -> Stage:
    """This rank's stage of a plain GPT (same seed on every rank): DTensor TP over mesh["tp"], FSDP2 over mesh["dp"].
    The model's blocks are changed in place."""
    from torch.distributed.fsdp import fully_shard

    stage = build_stage(model, mesh["pp"].get_local_rank(), mesh["pp"].size())
    if mesh["tp"].size() > 1:
        parallelize_blocks(stage.blocks, mesh["tp"])
    if mesh["dp"].size() > 1:
        for block in stage.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    return stage


def pipeline_schedule_3d(stage: Stage, mesh, m: int, kind: str = "1f1b"):
    """torch.distributed.pipelining's schedule of ``m`` micro-batches for this stage over mesh["pp"]'s group."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    device = next(stage.parameters()).device
    pipe = PipelineStage(stage, stage_index=mesh["pp"].get_local_rank(), num_stages=mesh["pp"].size(),
                         device=device, group=mesh["pp"].get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    return cls(pipe, n_microbatches=m, loss_fn=lm_loss)   # scale_grads: gradients of the mean over micro-batches


def train_step_3d_torch(schedule, mesh, x: torch.Tensor, y: torch.Tensor, optimizer) -> float | None:
    """One step on this DP rank's rows x, y (b, T), on the rank's device. Returns their mean loss on the last stage
    (None elsewhere)."""
    rank, p = mesh["pp"].get_local_rank(), mesh["pp"].size()
    losses: list = []
    if p == 1:
        schedule.step(x, target=y, losses=losses)
    elif rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(sum(v.item() for v in losses) / len(losses)) if losses else None


def full_parameters_3d(model: nn.Module, stage: nn.Module, mesh) -> dict[str, torch.Tensor]:
    """{name (as in the plain model): the full tensor of this stage's parameter}, gathered from its DTensor shards
    (collective over dp and tp: every rank of the stage calls it), qkv rows back in [q; k; v] order."""
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for param in stage.parameters():
        name = names[id(param)]
        t = param.full_tensor() if isinstance(param, DTensor) else param
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            t = unpermute_qkv_rows(t, mesh["tp"].size())
        out[name] = t.detach().cpu().clone()
    return out
