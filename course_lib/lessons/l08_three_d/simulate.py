"""The planner checked at real scale without GPUs (lesson 08): models of 70-405 B parameters sharded by PyTorch on a
fake process group of up to thousands of ranks, their local shards counted and compared with the planner.

PyTorch can build a sharded model without devices: a process group of backend ``"fake"``
(`torch.testing._internal.distributed.fake_pg.FakeStore`: every collective returns at once, nothing is sent) of any
world size, a `DeviceMesh` on it, and a model on the ``meta`` device (shapes, no storage). DTensor's tensor
parallelism and FSDP2 then create exactly the local shards each rank would hold (torchtitan estimates memory this
way). One process plays one rank; the shards of a rank are the same size on every rank of a stage.

- GPT-3 175B: the course's own GPT (`course_lib.model.GPT`, built from the preset), blocks with DTensor's Megatron
  plan (`parallel.tensor_dtensor.block_plan`), the token embedding split along the vocabulary (its head is tied);
- Llama-3-70B and 405B: `transformers.LlamaForCausalLM` built from a config (no download), torchtitan's Llama plan
  (q/k/v, gate/up column-parallel; o, down row-parallel; embedding and head along the vocabulary);
- pipeline stage 0 of ``pp``: the embedding and the first ceil(L/pp) blocks (the largest stage with the head's
  twin on the last); FSDP2 shards each block, then the stage, over the mesh's ``dp`` dimension.

    python -m course_lib.lessons.l08_three_d.simulate  # prints the comparison table (about a minute)

`fake_group_shards(layouts)` runs the simulation in a fresh Python process (the fake group is global state of a
process) and returns one row per layout: local parameters per GPU, the planner's count, their ratio.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

# (model, world, tp, pp): tp 8 inside a node of 8 GPUs, pipelines of 1-16 stages, world sizes 512-2,048.
LAYOUTS = (("gpt3-175b", 1024, 8, 1), ("gpt3-175b", 1024, 8, 8), ("gpt3-175b", 512, 4, 16),
           ("llama3-70b", 1024, 8, 1), ("llama3-70b", 1024, 8, 4), ("llama3-405b", 1024, 8, 8),
           ("llama3-405b", 2048, 8, 16))


def _gpt_stage(cfg, mesh, pp: int):
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from course_lib.model import GPT
    from course_lib.parallel.tensor_dtensor import block_plan

    if pp > 1:
        cfg = cfg.replace(tie_embeddings=False)            # the pipeline keeps the head on the last stage
    with torch.device("meta"):
        model = GPT(cfg)
    blocks = list(model.blocks)[:math.ceil(cfg.n_layer / pp)]
    for block in blocks:
        parallelize_module(block, mesh["tp"], block_plan(False))
    parallelize_module(model, mesh["tp"], {"tok_emb": RowwiseParallel(input_layouts=Replicate())})
    if cfg.tie_embeddings:
        model.head.weight = model.tok_emb.weight           # tied: the head is the vocabulary-parallel embedding
    elif pp == 1:
        parallelize_module(model, mesh["tp"], {"head": ColwiseParallel()})
    keep = [model.tok_emb, model.pos_emb, *blocks] + ([model.ln_f, model.head] if pp == 1 else [])
    return keep


def _llama_stage(cfg, mesh, pp: int):
    import torch
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                     num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                     num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.seq_len,
                     tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    layers = list(model.model.layers)[:math.ceil(cfg.n_layer / pp)]
    for layer in layers:
        parallelize_module(layer, mesh["tp"], plan)
    parallelize_module(model.model, mesh["tp"], {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    keep = [model.model.embed_tokens, *layers]
    if pp == 1:
        parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel()})
        keep += [model.model.norm, model.lm_head]
    return keep


def _local_params(parts, mesh) -> int:
    """FSDP2 over dp on each part; the local elements this rank then holds."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    for part in parts:
        fully_shard(part, mesh=mesh["dp"])
    seen, total = set(), 0
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return total


def _simulate(layouts) -> list[dict]:
    """In this process: one fake group per world size, one mesh per layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course_lib.config import get_preset
    from course_lib.theory.planner import stage_params

    rows = []
    for name, world, tp, pp in layouts:
        t0 = time.perf_counter()
        dp = world // (tp * pp)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
            cfg = get_preset(name)
            parts = (_gpt_stage if cfg.gpt2_style else _llama_stage)(cfg, mesh, pp)
            local = _local_params(parts, mesh)
        finally:
            dist.destroy_process_group()
        planned = stage_params(cfg if pp == 1 else cfg.replace(tie_embeddings=False), tp, pp) / dp
        rows.append(dict(model=name, params=cfg.num_params(), world=world, dp=dp, tp=tp, pp=pp,
                         local_params=local, planner_params=planned, error=local / planned - 1,
                         local_state_bytes=16 * local, planner_state_bytes=16 * planned,
                         seconds=round(time.perf_counter() - t0, 2)))
    return rows


def fake_group_shards(layouts=LAYOUTS, timeout_s: float = 600) -> list[dict]:
    """Run `_simulate` in a fresh Python process; one row per (model, world, tp, pp) layout."""
    code = ("import json, sys\nfrom course_lib.lessons.l08_three_d.simulate import _simulate\n"
            "print(json.dumps(_simulate(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([list(x) for x in layouts])], capture_output=True,
                         text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"the fake-group simulation failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    """The comparison table: model, layout, world, planner vs shard parameters per GPU, ZeRO-3 state bytes."""
    lines = [f"{'model':<12} {'world':>5} {'dp':>4} {'tp':>3} {'pp':>3} {'planner M/GPU':>14} {'shards M/GPU':>13} "
             f"{'error':>7} {'16 B/param GB':>14}"]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['world']:>5} {r['dp']:>4} {r['tp']:>3} {r['pp']:>3} "
                     f"{r['planner_params'] / 1e6:>14.2f} {r['local_params'] / 1e6:>13.2f} {r['error']:>+7.2%} "
                     f"{r['local_state_bytes'] / 1e9:>14.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(_simulate(LAYOUTS)))
