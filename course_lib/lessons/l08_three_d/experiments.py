"""Lesson 08's experiments on real ranks: 3D training equal to one process, and its communication per dimension.

`rank_3d_comm` trains the course's 3D composition (`course_lib.parallel.three_d`) for a few steps on a
`ProcessGrid` and counts what each dimension moved on this rank, next to the formulas of lessons 02-04:

- tp: Megatron's 2 all-reduces forward + 2 backward per block per micro-batch, each of a (b, T, C) activation
  (`theory.tensor.layer_collectives`);
- pp: one (b, T, C) activation forward and its gradient backward per micro-batch across each stage boundary
  (`pipeline.P2P.bytes_sent`);
- dp: every gradient of the stage's shards all-reduced once per step (`ddp.average_gradients`), or with ZeRO-1
  reduce-scattered and the parameters all-gathered: the same payload twice over.

Payload is the size of the tensor a call reduces or gathers (what `CollectiveCounter` counts); what a rank
puts on the wire is payload x the collective's bus factor on a ring (`theory.comm.bus_factor`: 2(n-1)/n for an
all-reduce, (n-1)/n for an all-gather or a reduce-scatter), so that ZeRO-1's reduce-scatter + all-gather, twice an
all-reduce's payload, send what one all-reduce sends (lesson 05). `wire_bytes` counts that per dimension.
"""

from __future__ import annotations


import torch

from course_lib import dist as cdist
from course_lib.measure.collective_counter import CollectiveCounter
from course_lib.data import random_batches, shard_batch
from course_lib.lessons.errors import max_relative_error
from course_lib.model import build_model
from course_lib.one_process import train_reference
from course_lib.parallel.pipeline_schedules import split_stages
from course_lib.parallel.three_d import make_optimizer_3d, parallelize_3d, shard_reference, train_step_3d
from course_lib.theory.comm import bus_factor
from course_lib.theory.tensor import layer_collectives


def wire_bytes(counter: CollectiveCounter, groups: dict) -> dict:
    """Bytes this rank sent on a ring for the collectives of each named group (``{name: global ranks}``): each
    call's payload x `bus_factor` of its collective and group size."""
    out = dict.fromkeys(groups, 0)
    by_ranks = {tuple(ranks): name for name, ranks in groups.items()}
    for (_, op, nbytes, n), ranks in zip(counter.records, counter.groups):
        name = by_ranks.get(ranks)
        if name is not None:
            out[name] += round(nbytes * bus_factor(op, n))
    return out


def formula_bytes(cfg, grid_sizes: dict, coords: dict, micro_batch: int, m: int, steps: int, stage_numel: int,
                  data_parallel: str = "ddp", sequence_parallel: bool = False) -> dict:
    """Payload bytes per dimension that one rank calls in ``steps`` steps (fp32), by formula.

    With sequence parallelism, TP adds: the first stage's all-gather of the gradient where the sequence is split
    (backward), the last stage's all-gather before the head (forward), one (b, T, C) each per micro-batch; and once
    per step the all-reduce of the gradients of the parameters that saw s/t tokens (per block 2 LayerNorms and the
    2 row-parallel biases); PP's messages are t times smaller."""
    dp, tp, pp = grid_sizes["dp"], grid_sizes["tp"], grid_sizes["pp"]
    sp = sequence_parallel and tp > 1
    blocks = len(range(*split_stages(cfg.n_layer, pp)[coords["pp"]]))
    per_layer = sum(v["bytes"] for v in layer_collectives(cfg, micro_batch, cfg.seq_len, tp, sp).values())
    act = micro_batch * cfg.seq_len * cfg.d_model * 4
    boundaries = (coords["pp"] < pp - 1) + (coords["pp"] > 0)
    grads = stage_numel * 4 if dp > 1 else 0
    tp_bytes = steps * m * blocks * per_layer
    if sp:
        ends = (coords["pp"] == 0) + (coords["pp"] == pp - 1)
        per_block = 2 * cfg.d_model * (2 if cfg.bias else 1) + (2 * cfg.d_model if cfg.bias else 0)
        tp_bytes += steps * (m * ends * act + blocks * per_block * 4)
    return {"tp": tp_bytes, "pp": steps * m * act // (tp if sp else 1) * boundaries,
            "dp": steps * grads * (2 if data_parallel == "zero1" else 1)}


def rank_3d_comm(cfg, dp: int, pp: int, tp: int, global_batch: int, m: int, steps: int = 3,
                 data_parallel: str = "ddp", lr: float = 0.1, sequence_parallel: bool = False) -> dict:
    """Runs on every rank of a dp x pp x tp launch: 3D training, its error against one process, and the payload
    bytes of each dimension's calls on this rank (counted) beside `formula_bytes`, and the bytes it sent on the wire
    (`wire_bytes`). The optimizer is SGD without momentum, which keeps no state: with ``data_parallel="zero1"``
    ZeRO-1 has no optimizer state to shard here, and what the run checks is its communication (reduce-scatter of
    the gradients, all-gather of the updated parameters) and its result; lesson 05 measured ZeRO's memory with
    Adam."""
    grid = cdist.ProcessGrid(dp=dp, pp=pp, tp=tp)
    batches = random_batches(cfg, global_batch, steps=steps, seed=1)
    ref = train_reference(cfg, batches, "sgd", lr=lr, seed=0)
    model = build_model(cfg, seed=0)
    stage = parallelize_3d(model, grid, sequence_parallel)
    opt = make_optimizer_3d(stage, grid, torch.optim.SGD, data_parallel, lr=lr)
    counter, losses, pp_bytes, stats = CollectiveCounter(), [], 0, {}
    with counter:
        for x, y in batches:
            r = grid.coord("dp")
            losses.append(train_step_3d(stage, grid, shard_batch(x, r, dp), shard_batch(y, r, dp), m, opt,
                                        stats=stats))
            pp_bytes += stats["bytes_sent"]
    by_group = counter.bytes_by_group()
    counted = {name: by_group.get(tuple(grid.ranks(name)), 0) for name in ("tp", "dp")}
    counted["pp"] = pp_bytes
    wire = wire_bytes(counter, {name: grid.ranks(name) for name in ("tp", "dp")})
    wire["pp"] = pp_bytes                                       # point to point: the payload is what is sent
    pairs = shard_reference(model, stage, grid, ref["params"])
    stage_numel = sum(p.numel() for p in stage.parameters())
    coords = grid.coords_of(cdist.rank())
    return {"coords": coords, "losses": losses, "ref_losses": ref["losses"], "counted": counted, "wire": wire,
            "formula": formula_bytes(cfg, grid.sizes, coords, global_batch // dp // m, m, steps, stage_numel,
                                     data_parallel, sequence_parallel),
            "param_err": max_relative_error({n: a for n, (a, _) in pairs.items()},
                                            {n: b for n, (_, b) in pairs.items()})}


def rank_grid(dp: int, pp: int, tp: int) -> dict:
    """Runs on every rank: builds the `ProcessGrid` and checks each of its groups for real, by an all-reduce of the
    rank ids over the group (the sum must be that of the group's members). Returns the coordinates, the members of
    each group and the sums."""
    grid = cdist.ProcessGrid(dp=dp, pp=pp, tp=tp)
    out = {"coords": grid.coords_of(cdist.rank()), "groups": {}, "sums": {}}
    for name in ("tp", "pp", "dp"):
        t = torch.tensor([float(cdist.rank())], device=cdist.device())
        torch.distributed.all_reduce(t, group=grid.group(name))
        out["groups"][name], out["sums"][name] = grid.ranks(name), int(t.item())
    return out


def rank_torch_3d(cfg, dp: int, pp: int, tp: int, global_batch: int, m: int, steps: int = 3,
                  lr: float = 0.1) -> dict:
    """The same training with PyTorch's pieces, as torchtitan composes them (`parallel.three_d_torch`): a 3-D
    DeviceMesh, DTensor TP, FSDP2 over dp, `torch.distributed.pipelining`'s 1F1B. Its losses and full parameters
    against one process."""
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.parallel.three_d_torch import (full_parameters_3d, parallelize_3d_torch, pipeline_schedule_3d,
                                                   train_step_3d_torch)

    mesh = init_device_mesh(cdist.device().type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    batches = random_batches(cfg, global_batch, steps=steps, seed=1)
    ref = train_reference(cfg, batches, "sgd", lr=lr, seed=0)
    model = build_model(cfg, seed=0)
    stage = parallelize_3d_torch(model, mesh)
    schedule = pipeline_schedule_3d(stage, mesh, m)
    opt = torch.optim.SGD(stage.parameters(), lr=lr)
    dp_rank, losses = mesh["dp"].get_local_rank(), []
    for x, y in batches:
        losses.append(train_step_3d_torch(schedule, mesh, shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp),
                                          opt))
    full = full_parameters_3d(model, stage, mesh)
    return {"losses": losses, "ref_losses": ref["losses"], "pp": mesh["pp"].get_local_rank(),
            "param_err": max_relative_error(full, {n: ref["params"][n] for n in full}), "n_params": len(full)}
