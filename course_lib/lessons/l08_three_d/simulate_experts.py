"""The planner's parameter bytes per GPU under expert parallelism checked on a fake process group (lesson 08,
issue 32).

As `simulate_context` does for cp: a fake group of dp ranks (256 by default: ep 8 x expert-dp 32), this process rank
0 of it. A Mixtral-8x7B-shaped model (8 experts, top-2, d_model 4,096, expert d_ff 14,336, 32 heads with 8 K/V heads,
vocabulary 32,000; a few blocks: the bytes per block are what matter) is built on ``meta`` from the course's own
`parallel.moe.MoELayer` (its router and shapes), whose experts are replaced by this ep rank's shard (8/ep experts,
`SwiGLUExperts(first=...)`, what `parallel.experts.apply_expert_parallel` keeps), attention as four plain
``nn.Linear`` of Mixtral's shapes and two ``nn.RMSNorm``. Then FSDP2 (``fully_shard``): each block's experts over the
expert-dp ranks (the "edp" dimension of a (edp, ep) mesh, sharded along the hidden size F: dim 0 holds only 8/ep
experts), every block's dense part and the embeddings / head over all dp ranks. The local shards' elements x 2 bytes
(bf16) are compared with the planner's ZeRO-3 parameter bytes (`planner.moe_stage_params`, `model_state_bytes`).
"""

from __future__ import annotations

import time

from course_lib.config import ModelConfig
from course_lib.lessons.l08_three_d import simulate

__all__ = ["MIXTRAL_SHAPE", "MIXTRAL_MOE", "EP_LAYOUTS", "fake_group_ep_params", "ep_param_table"]

MIXTRAL_SHAPE = ModelConfig(vocab_size=32000, seq_len=4096, n_layer=2, n_head=32, n_kv_head=8, d_model=4096,
                            d_ff=14336, bias=False, tie_embeddings=False, norm="rmsnorm", mlp="swiglu", pos="rope",
                            name="mixtral-8x7b-shape")
EP_LAYOUTS = ((256, 8), (256, 4))            # (dp ranks, ep): expert-dp 32 and 64


def _moe():
    from course_lib.theory.experts import MoESpec
    return MoESpec(n_experts=8, top_k=2, expert_d_ff=14336)


MIXTRAL_MOE = _moe()


def _model(cfg: ModelConfig, ep: int, ep_rank: int):
    """On meta: embeddings, cfg.n_layer blocks (attention, two RMSNorms, a MoELayer with this ep rank's experts),
    final norm, head."""
    import torch
    import torch.nn as nn

    from course_lib.parallel.moe import MoELayer, SwiGLUExperts

    moe = MIXTRAL_MOE
    C, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(C), nn.RMSNorm(C)
            self.q, self.k, self.v, self.o = (nn.Linear(C, C, bias=False), nn.Linear(C, kv, bias=False),
                                              nn.Linear(C, kv, bias=False), nn.Linear(C, C, bias=False))
            self.moe = MoELayer(C, moe.n_experts, moe.top_k, moe.expert_d_ff)
            n = moe.n_experts // ep
            self.moe.experts = SwiGLUExperts(n, C, moe.expert_d_ff, first=ep_rank * n)   # (E/ep, F, C) x 3

    with torch.device("meta"):
        model = nn.Module()
        model.embed = nn.Embedding(cfg.vocab_size, C)
        model.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layer))
        model.norm = nn.RMSNorm(C)
        model.head = nn.Linear(C, cfg.vocab_size, bias=False)
    return model


def _ep_params(layouts) -> list[dict]:
    """In this process: per (dp, ep), shard the model with EP x FSDP2 on a fake group of dp ranks; rank 0's local
    elements of the experts and of the rest beside the planner's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course_lib.theory.planner import model_state_bytes, moe_stage_params

    cfg, rows = MIXTRAL_SHAPE, []
    for dp, ep in layouts:
        t0 = time.perf_counter()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
        try:
            dp_mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
            edp_mesh = init_device_mesh("cpu", (dp // ep, ep), mesh_dim_names=("edp", "ep"))["edp"]
            model = _model(cfg, ep, ep_rank=0)
            for block in model.blocks:
                fully_shard(block.moe.experts, mesh=edp_mesh, shard_placement_fn=lambda p: Shard(1))   # along F
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
            experts = {id(p) for b in model.blocks for p in b.moe.experts.parameters()}
            local = {"experts": 0, "dense": 0}
            for p in model.parameters():
                local["experts" if id(p) in experts else "dense"] += p.to_local().numel()
        finally:
            dist.destroy_process_group()
        split = moe_stage_params(cfg, MIXTRAL_MOE, 1, 1, "first")
        planner = dict(dense=model_state_bytes(split["dense"], dp, 3)["params"],
                       experts=model_state_bytes(split["experts"] / ep, dp // ep, 3)["params"])
        shards = {k: 2 * v for k, v in local.items()}                  # bf16 bytes
        rows.append(dict(model=cfg.name, blocks=cfg.n_layer, dp=dp, ep=ep, edp=dp // ep,
                         shard_bytes=sum(shards.values()), planner_bytes=sum(planner.values()),
                         shard_expert_bytes=shards["experts"], planner_expert_bytes=planner["experts"],
                         shard_dense_bytes=shards["dense"], planner_dense_bytes=planner["dense"],
                         error=sum(shards.values()) / sum(planner.values()) - 1,
                         seconds=round(time.perf_counter() - t0, 2)))
    return rows


def fake_group_ep_params(layouts=EP_LAYOUTS, timeout_s: float = 300) -> list[dict]:
    """Run `_ep_params` in a fresh Python process (the fake group is global state); one row per (dp, ep)."""
    return simulate._in_fresh_process("_ep_params", layouts, timeout_s,
                                      module="course_lib.lessons.l08_three_d.simulate_experts")


def ep_param_table(rows: list[dict]) -> str:
    lines = [f"{'model':<20} {'blocks':>6} {'dp':>4} {'ep':>3} {'edp':>4} {'experts MB':>10} {'planner':>8} "
             f"{'dense MB':>9} {'planner':>8} {'total MB':>9} {'planner':>8} {'error':>7}"]
    for r in rows:
        lines.append(f"{r['model']:<20} {r['blocks']:>6} {r['dp']:>4} {r['ep']:>3} {r['edp']:>4} "
                     f"{r['shard_expert_bytes'] / 1e6:>10.2f} {r['planner_expert_bytes'] / 1e6:>8.2f} "
                     f"{r['shard_dense_bytes'] / 1e6:>9.2f} {r['planner_dense_bytes'] / 1e6:>8.2f} "
                     f"{r['shard_bytes'] / 1e6:>9.2f} {r['planner_bytes'] / 1e6:>8.2f} {r['error']:>+7.2%}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(ep_param_table(fake_group_ep_params()))
