"""The planner checked at real scale without GPUs (lesson 08): models of 70-405 B parameters sharded by PyTorch on a
fake process group of up to thousands of ranks, their local shards counted and compared with the planner.

PyTorch can build a sharded model without devices: a process group of backend ``"fake"``
(`torch.testing._internal.distributed.fake_pg.FakeStore`: every collective returns at once, nothing is sent) of any
world size, a `DeviceMesh` on it, and a model on the ``meta`` device (shapes, no storage). ``FakeStore`` is private:
``torch.testing._internal`` is PyTorch's own test helpers, with no stability promise (it may change or disappear in
any release; torchtitan's memory estimator imports it all the same). DTensor's tensor
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

`fake_group_activations(layouts)` checks the planner's activations the same way (torchtitan's memory estimator
does it so): one and two transformer blocks of the real width, heads and sequence length, TP with sequence
parallelism over ``tp`` ranks and FSDP2 (bf16 compute) over the rest, built on ``meta`` and materialised under
`FakeTensorMode` (the mesh is sliced before, outside it), run forward and backward at micro-batch 1 under PyTorch's
`FSDPMemTracker`. The layers that all-gather the sequence (q, k, v; the MLP's first) run under activation
checkpointing, so that autograd keeps the shard and gathers it again in backward, as Megatron-LM does and the planner
counts; DTensor alone keeps the gathered copy (measured too: ``dtensor_bytes``, 3.5 sbh more per layer at t = 8).
The bytes per layer are the tracker's "Activation" memory at the end of the forward of two blocks
minus that of one: what a block leaves alive for its backward, the slope of the activation peak in the number of
layers (the tracker's peak within a forward of one or two blocks is a transient inside the first block, the same for
both). A `saved_tensors_hooks` counter of the bytes autograd packs (storages counted once, the parameters FSDP
frees after the forward left out) gives the same number; both are returned.
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
# (model, world, tp) for the activations: tp 8 with sequence parallelism, dp the rest; seq_len of the preset.
ACT_LAYOUTS = (("gpt3-175b", 1024, 8), ("llama3-70b", 1024, 8), ("llama3-405b", 1024, 8))


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
        planned = stage_params(cfg, tp, pp) / dp
        rows.append(dict(model=name, params=cfg.num_params(), world=world, dp=dp, tp=tp, pp=pp,
                         local_params=local, planner_params=planned, error=local / planned - 1,
                         # bf16 parameters, fp32 gradients, fp32 master + Adam moments: 2 + 4 + 12 bytes each
                         local_state_bytes=18 * local, planner_state_bytes=18 * planned,
                         seconds=round(time.perf_counter() - t0, 2)))
    return rows


def _in_fresh_process(fn: str, layouts, timeout_s: float, module: str = __name__) -> list[dict]:
    """``module.fn(layouts)`` in a fresh Python process (a fake process group is global state); its JSON result."""
    code = (f"import json, sys\nfrom {module} import {fn}\n"
            f"print(json.dumps({fn}(json.loads(sys.argv[1]))))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([list(x) for x in layouts])], capture_output=True,
                         text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"the fake-group simulation failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fake_group_shards(layouts=LAYOUTS, timeout_s: float = 600) -> list[dict]:
    """Run `_simulate` in a fresh Python process; one row per (model, world, tp, pp) layout."""
    return _in_fresh_process("_simulate", layouts, timeout_s)


# ---------------------------------------------------------------------------------------------- activations

def _gpt_blocks(cfg, n_blocks: int, tp_mesh, regather: bool):
    """``n_blocks`` blocks of the course's GPT with DTensor TP + SP (`tensor_dtensor.parallelize_blocks`), and the
    (module, name) of the column-parallel layers that gather their input along the sequence (qkv and fc gather
    their own input whether or not they are then checkpointed: ``regather`` changes nothing here)."""
    import torch

    from course_lib.model import Block
    from course_lib.parallel.tensor_dtensor import parallelize_blocks

    with torch.device("meta"):
        blocks = torch.nn.ModuleList(Block(cfg) for _ in range(n_blocks))
    gathering = [(m, name) for b in blocks for m, name in ((b.attn, "qkv"), (b.mlp, "fc"))]
    return parallelize_blocks(blocks, tp_mesh, sequence_parallel=True), None, gathering


def _llama_blocks(cfg, n_blocks: int, tp_mesh, regather: bool):
    """``n_blocks`` decoder layers of transformers' Llama (SDPA attention) with torchtitan's TP + SP plan, the
    rotary embedding that feeds them, and the (module, name) of the layers that gather their input. ``regather``:
    q, k, v, gate and up each gather their input themselves (one shard then feeds them all), not their parent."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                     num_hidden_layers=n_blocks, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                     max_position_embeddings=cfg.seq_len)
    hf._attn_implementation = "sdpa"
    with torch.device("meta"):
        blocks = torch.nn.ModuleList(LlamaDecoderLayer(hf, i) for i in range(n_blocks))
        rope = LlamaRotaryEmbedding(hf)
    col = ColwiseParallel(input_layouts=Shard(1)) if regather else ColwiseParallel()
    plan = {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col,
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}
    if not regather:                                       # torchtitan: gather once before q, k, v (gate, up)
        plan |= {"self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                 desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    gathering = [(m, name) for b in blocks for m, name in
                 ((b.self_attn, "q_proj"), (b.self_attn, "k_proj"), (b.self_attn, "v_proj"),
                  (b.mlp, "gate_proj"), (b.mlp, "up_proj"))]
    return blocks, rope, gathering


def _blocks_activations(cfg, n_blocks: int, mesh, regather: bool) -> tuple[int, int]:
    """Forward + backward of ``n_blocks`` blocks on one rank's shard of the sequence, (b, s/t, h) bf16, under
    `FakeTensorMode`: (the tracker's activation bytes, the bytes autograd saved) at the end of the forward.

    ``regather``: the layers that all-gather their input run under activation checkpointing, so that autograd keeps
    the (b, s/t, h) shard and gathers it again in backward, as Megatron-LM's sequence parallelism does
    (`parallel.sequence.SequenceParallelLinear`); DTensor alone keeps the gathered (b, s, h) copy."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    s = cfg.seq_len

    class Stack(torch.nn.Module):                          # FSDP's root: the blocks, Llama's cos and sin
        def __init__(self, blocks, rope):
            super().__init__()
            self.blocks, self.rope = blocks, rope

        def forward(self, x):                              # (b, s/t, h) -> (b, s/t, h)
            kw = {}
            if self.rope is not None:                      # cos, sin (b, s, h/a), shared by all layers
                kw = dict(position_embeddings=self.rope(x, torch.arange(s)[None]))
            for block in self.blocks:
                x = block(x, **kw)
            return x

    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]              # sliced outside FakeTensorMode
    blocks, rope, gathering = (_gpt_blocks if cfg.gpt2_style else _llama_blocks)(cfg, n_blocks, tp_mesh, regather)
    for parent, name in gathering if regather else ():
        setattr(parent, name, checkpoint_wrapper(getattr(parent, name)))
    model = Stack(blocks, rope)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)   # torchtitan's
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    saved = {}                                             # storage -> the storage (its bytes read after forward)

    def pack(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        saved.setdefault(storage._cdata, storage)
        return tensor

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")                      # the meta shards become fake tensors
        x = torch.randn(1, s // tp_mesh.size(), cfg.d_model, dtype=torch.bfloat16, requires_grad=True)  # (b, s/t, h)
        tracker = FSDPMemTracker(model)
        tracker.track_inputs((x,))
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                y = model(x)                               # (b, s/t, h) -> (b, s/t, h)
            snapshot = next(iter(tracker.get_tracker_snapshot().values()))
            kept = sum(st.nbytes() for st in saved.values())   # FSDP has freed the gathered parameters
            y.float().sum().backward()
    act = next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")
    return act, kept


def _activations(layouts) -> list[dict]:
    """In this process: per (model, world, tp), one and two blocks on a fake group, their difference; with the
    sequence gathered again in backward (Megatron-LM's SP, the planner's) and as DTensor keeps it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course_lib.config import get_preset
    from course_lib.theory.planner import layer_activation_bytes

    rows = []
    for name, world, tp in layouts:
        t0 = time.perf_counter()
        cfg = get_preset(name)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
            (act1, kept1), (act2, kept2), (dt1, _), (dt2, _) = (
                _blocks_activations(cfg, n, mesh, regather) for regather in (True, False) for n in (1, 2))
        finally:
            dist.destroy_process_group()
        planned = sum(layer_activation_bytes(cfg, tp, cfg.seq_len, 1).values())
        sbh = cfg.seq_len * cfg.d_model
        rows.append(dict(model=name, world=world, dp=world // tp, tp=tp, seq_len=cfg.seq_len, micro_batch=1,
                         tracker_bytes=act2 - act1, saved_bytes=kept2 - kept1, dtensor_bytes=dt2 - dt1,
                         planner_bytes=planned,
                         error=(act2 - act1) / planned - 1, tracker_sbh=(act2 - act1) / sbh,
                         planner_sbh=planned / sbh, seconds=round(time.perf_counter() - t0, 2)))
    return rows


def fake_group_activations(layouts=ACT_LAYOUTS, timeout_s: float = 300) -> list[dict]:
    """Run `_activations` in a fresh Python process; one row per (model, world, tp) layout: activation bytes per
    layer per GPU from the memory tracker and from autograd's saved tensors, and the planner's."""
    return _in_fresh_process("_activations", layouts, timeout_s)


def table(rows: list[dict]) -> str:
    """The comparison table: model, layout, world, planner vs shard parameters per GPU, ZeRO-3 state GiB (2 + 4 + 12
    bytes per parameter: bf16 parameters, fp32 gradients, fp32 master weights and Adam moments)."""
    lines = [f"{'model':<12} {'world':>5} {'dp':>4} {'tp':>3} {'pp':>3} {'planner M/GPU':>14} {'shards M/GPU':>13} "
             f"{'error':>7} {'18 B/param GiB':>15}"]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['world']:>5} {r['dp']:>4} {r['tp']:>3} {r['pp']:>3} "
                     f"{r['planner_params'] / 1e6:>14.2f} {r['local_params'] / 1e6:>13.2f} {r['error']:>+7.2%} "
                     f"{r['local_state_bytes'] / 2 ** 30:>15.2f}")
    return "\n".join(lines)


def activation_table(rows: list[dict]) -> str:
    """Activation bytes per layer per GPU: the memory tracker's, autograd's saved tensors', the planner's (in MB and
    in units of s b h bytes), Korthikanti et al. 2022's count for their block with TP + SP (naive attention and
    dropout, `planner.korthikanti_layer_bytes`, in sbh), and the tracker's without re-gathering the sequence in
    backward (DTensor's SP alone)."""
    from course_lib.config import get_preset
    from course_lib.theory.planner import korthikanti_layer_bytes

    lines = [f"{'model':<12} {'tp':>3} {'seq':>5} {'tracker MB':>11} {'saved MB':>9} {'planner MB':>11} "
             f"{'error':>7} {'tracker sbh':>12} {'planner sbh':>12} {'Korthikanti sbh':>16} {'DTensor MB':>11}"]
    for r in rows:
        cfg = get_preset(r["model"])
        paper = korthikanti_layer_bytes(cfg, r["tp"], r["seq_len"], 1) / (r["seq_len"] * cfg.d_model)
        lines.append(f"{r['model']:<12} {r['tp']:>3} {r['seq_len']:>5} {r['tracker_bytes'] / 1e6:>11.1f} "
                     f"{r['saved_bytes'] / 1e6:>9.1f} {r['planner_bytes'] / 1e6:>11.1f} {r['error']:>+7.2%} "
                     f"{r['tracker_sbh']:>12.3f} {r['planner_sbh']:>12.3f} {paper:>16.2f} "
                     f"{r['dtensor_bytes'] / 1e6:>11.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(_simulate(LAYOUTS)))
    print(activation_table(_activations(ACT_LAYOUTS)))
