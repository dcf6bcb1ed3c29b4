"""The planner's activations under context parallelism checked on a fake process group (lesson 08, issue 31).

As `simulate.fake_group_activations` does for TP x FSDP2, with a cp dimension between them: a fake group of
dp x cp x tp ranks (512 by default: dp 4 x cp 16 x tp 8), a `DeviceMesh` ("dp", "cp", "tp") on it, one and two
transformer blocks of the real width built on ``meta``, TP with sequence parallelism over "tp" (DTensor,
`parallel.tensor_dtensor.parallelize_blocks`; the layers that all-gather the sequence checkpointed, so that autograd
keeps the shard, as Megatron-LM and the planner do), FSDP2 over "dp", and each block's attention done by lesson 10's
`parallel.context_attention` (ring or all-gather) over the "cp" group, forward and backward under `FakeTensorMode`
and PyTorch's `FSDPMemTracker`. The bytes per layer are the tracker's "Activation" memory at the end of the forward
of two blocks minus that of one (a `saved_tensors_hooks` count of autograd's saved storages gives the second figure).

What runs is one rank's share: this process is rank 0 of the fake group, so its blocks see rank 0's s/cp tokens,
(1, s/(cp tp), C) after sequence parallelism, and the ring or the all-gather moves K/V chunks of the right shapes
(the fake group moves no data; `FakeTensorMode` computes no values). Every CP rank keeps the same bytes under the
balanced split, so rank 0 stands for all.

The model: the course's GPT builds only gpt2-style blocks (LayerNorm, GELU, multi-head attention), so the block has
Llama-3-70B's widths (d_model 8,192, 64 heads of 128, d_ff 28,672) in the gpt2 style, without GQA (K/V as wide as
the queries). `apply_context_parallel` itself swaps the attention of a whole GPT (with its position table), not of
TP-sharded blocks, so the blocks here call `context_attention.ring_attention` / `all_gather_attention` on their
local heads, as `ContextParallelAttention.attend` does.
"""

from __future__ import annotations

import time

from course_lib.config import ModelConfig
from course_lib.lessons.l08_three_d import simulate

__all__ = ["CP_LAYOUTS", "GPT_70B_WIDTHS", "fake_group_cp_activations", "cp_activation_table"]

# Llama-3-70B's widths in the course's gpt2 style (no GQA, GELU, LayerNorm); a 128K sequence.
GPT_70B_WIDTHS = ModelConfig(vocab_size=128256, seq_len=131072, n_layer=80, n_head=64, d_model=8192, d_ff=28672,
                             bias=False, name="gpt2-style-70b-widths")
# (dp, cp, tp, variant): 512 ranks, sequence 131,072.
CP_LAYOUTS = ((4, 16, 8, "ring"), (4, 16, 8, "all_gather"))


def _cp_attention_forward(self, x):
    """A TP-sharded block's attention on this rank's heads, attending over the CP group: (B, n/t, C) sequence shard
    in, gathered over TP by the column-parallel qkv, (B, n, 3C/t) -> q, k, v (B, H/t, n, D) -> across the cp ranks
    -> (B, n, C/t) -> the row-parallel projection scatters it back to (B, n/t, C)."""
    from course_lib.parallel import context_attention
    from course_lib.parallel.context import layouts

    qkv = self.qkv(x)                                                        # (B, n, 3C/t), a local tensor
    B, n, _ = qkv.shape
    q, k, v = (u.reshape(B, n, -1, self.head_dim).transpose(1, 2) for u in qkv.chunk(3, dim=-1))   # (B, H/t, n, D)
    fn = getattr(context_attention, f"{self.cp_variant}_attention")
    y = fn(q, k, v, self.cp_group, layouts(n * self.cp, self.cp), True, None)  # (B, H/t, n, D)
    y = y.transpose(1, 2).reshape(B, n, -1)                                  # (B, n, C/t)
    return self.resid_drop(self.proj(y))


def _blocks(cfg, n_blocks: int, mesh, variant: str) -> tuple[int, int]:
    """Forward of ``n_blocks`` blocks on rank 0's share under the tracker: (tracker activation bytes, autograd's
    saved bytes) at the end of the forward; then the backward runs (it must: the ring's backward is part of it)."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from course_lib.model import Block
    from course_lib.parallel.tensor_dtensor import parallelize_blocks

    tp_mesh, dp_mesh, cp = mesh["tp"], mesh["dp"], mesh["cp"].size()
    cp_group = mesh["cp"].get_group()
    with torch.device("meta"):
        blocks = torch.nn.ModuleList(Block(cfg) for _ in range(n_blocks))
    parallelize_blocks(blocks, tp_mesh, sequence_parallel=True)
    for b in blocks:
        b.attn.cp, b.attn.cp_group, b.attn.cp_variant = cp, cp_group, variant
        b.attn.forward = types.MethodType(_cp_attention_forward, b.attn)
        b.attn.qkv = checkpoint_wrapper(b.attn.qkv)       # keep the (B, n/t, C) shard, gather again in backward
        b.mlp.fc = checkpoint_wrapper(b.mlp.fc)
    class Stack(torch.nn.Module):                          # FSDP's root
        def __init__(self, blocks):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):                              # (b, s/(cp t), h) -> (b, s/(cp t), h)
            for block in self.blocks:
                x = block(x)
            return x

    model = Stack(blocks)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)   # torchtitan's
    for b in blocks:
        fully_shard(b, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    saved = {}

    def pack(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        saved.setdefault(storage._cdata, storage)
        return tensor

    n_local = cfg.seq_len // cp // tp_mesh.size()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")                      # the meta shards become fake tensors
        x = torch.randn(1, n_local, cfg.d_model, dtype=torch.bfloat16, requires_grad=True)   # (b, s/(cp t), h)
        tracker = FSDPMemTracker(model)
        tracker.track_inputs((x,))
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                y = model(x)                               # (b, s/(cp t), h) -> (b, s/(cp t), h)
            snapshot = next(iter(tracker.get_tracker_snapshot().values()))
            kept = sum(st.nbytes() for st in saved.values())
            y.float().sum().backward()
    act = next(v for k, v in snapshot.items() if getattr(k, "value", k) == "Activation")
    return act, kept


def _cp_activations(layouts) -> list[dict]:
    """In this process: per (dp, cp, tp, variant), one and two blocks on a fake group of dp x cp x tp ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from course_lib.theory.planner import Layout, activation_bytes_per_gpu

    cfg, rows = GPT_70B_WIDTHS, []
    for dp, cp, tp, variant in layouts:
        t0 = time.perf_counter()
        world = dp * cp * tp
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
            (act1, kept1), (act2, kept2) = (_blocks(cfg, n, mesh, variant) for n in (1, 2))
        finally:
            dist.destroy_process_group()
        layout = Layout(dp=dp, tp=tp, pp=1, ckpt="none", micro_batch=1, cp=cp, cp_variant=variant)
        planned = activation_bytes_per_gpu(cfg.replace(n_layer=1), layout, accum=1, seq_len=cfg.seq_len)
        no_cp = activation_bytes_per_gpu(cfg.replace(n_layer=1), Layout(dp=dp * cp, tp=tp, pp=1), 1, cfg.seq_len)
        rows.append(dict(model=cfg.name, world=world, dp=dp, cp=cp, tp=tp, variant=variant, seq_len=cfg.seq_len,
                         tokens_per_rank=cfg.seq_len // cp, tracker_bytes=act2 - act1, saved_bytes=kept2 - kept1,
                         planner_bytes=planned, planner_no_cp_bytes=no_cp, error=(act2 - act1) / planned - 1,
                         seconds=round(time.perf_counter() - t0, 2)))
    return rows


def fake_group_cp_activations(layouts=CP_LAYOUTS, timeout_s: float = 300) -> list[dict]:
    """Run `_cp_activations` in a fresh Python process (the fake group is global state); one row per layout:
    activation bytes per layer per GPU from the memory tracker and autograd's saved tensors, and the planner's."""
    return simulate._in_fresh_process("_cp_activations", layouts, timeout_s, module=__name__)


def cp_activation_table(rows: list[dict]) -> str:
    lines = [f"{'model':<22} {'world':>5} {'dp':>3} {'cp':>3} {'tp':>3} {'variant':>10} {'tokens/rank':>11} "
             f"{'tracker MB':>10} {'saved MB':>9} {'planner MB':>10} {'error':>7} {'no-cp MB':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<22} {r['world']:>5} {r['dp']:>3} {r['cp']:>3} {r['tp']:>3} {r['variant']:>10} "
                     f"{r['tokens_per_rank']:>11,} {r['tracker_bytes'] / 1e6:>10.1f} {r['saved_bytes'] / 1e6:>9.1f} "
                     f"{r['planner_bytes'] / 1e6:>10.1f} {r['error']:>+7.2%} {r['planner_no_cp_bytes'] / 1e6:>9.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(cp_activation_table(fake_group_cp_activations()))
