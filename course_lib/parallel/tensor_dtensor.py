"""The library version of lesson 04: PyTorch DTensor's `parallelize_module` on the same plain GPT.

    mesh = DeviceMesh(device_type, ranks)                      # the tensor-parallel ranks
    apply_dtensor_tp(model, mesh, sequence_parallel=False)     # ColwiseParallel / RowwiseParallel / SequenceParallel

`ColwiseParallel` shards a Linear's weight along dim 0 in contiguous blocks. Our qkv weight stacks q, k and v,
so its rows are first permuted to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: each rank's block is then its own heads,
exactly the shard `ColumnParallelLinear(n_fused=3)` holds. The plain attention reads the number of heads from
the config; on a rank it must use the local heads (as torchtitan's attention does with ``view(B, T, -1, D)``),
so each block's attention gets a forward that infers them from its input width.

Without sequence parallelism the whole GPT is parallelized (embedding and head stay replicated). With it,
`parallelize_blocks` does the transformer blocks only: the residual stream between them is (B, T/t, C).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.config import ConfigError

__all__ = ["block_plan", "parallelize_blocks", "apply_dtensor_tp", "permute_qkv_rows", "unpermute_qkv_rows"]


def permute_qkv_rows(t: torch.Tensor, tp: int) -> torch.Tensor:
    """[q; k; v] (3C, ...) -> [q_0; k_0; v_0; q_1; ...]: contiguous block r = rank r's heads of q, k and v."""
    q, k, v = t.chunk(3, 0)
    return torch.cat([torch.cat([q.chunk(tp, 0)[r], k.chunk(tp, 0)[r], v.chunk(tp, 0)[r]]) for r in range(tp)])


def unpermute_qkv_rows(t: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of `permute_qkv_rows`: [q_0; k_0; v_0; q_1; ...] -> [q; k; v] (a full DTensor back in the plain
    model's order)."""
    return torch.cat([torch.cat(part) for part in zip(*[c.chunk(3, 0) for c in t.chunk(tp, 0)])])


def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads: their number comes from the (local) qkv output."""
    qkv = self.qkv(x)                                                        # (B, T, 3C/t), a local tensor
    B, T, _ = qkv.shape
    q, k, v = (u.reshape(B, T, -1, self.head_dim).transpose(1, 2) for u in qkv.chunk(3, dim=-1))  # (B, H/t, T, D)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
    y = y.transpose(1, 2).reshape(B, T, -1)                                  # (B, T, C/t)
    return self.resid_drop(self.proj(y))


def block_plan(sequence_parallel: bool) -> dict:
    """The `parallelize_module` plan of one block (Megatron's layout, in DTensor's words)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return {"ln1": SequenceParallel(), "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(), "mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


@torch.no_grad()
def parallelize_blocks(blocks: nn.ModuleList, mesh, sequence_parallel: bool = False) -> nn.ModuleList:
    """Apply DTensor tensor parallelism to every block of a plain GPT, in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    for block in blocks:
        attn = block.attn
        attn.qkv.weight.copy_(permute_qkv_rows(attn.qkv.weight, tp))
        if attn.qkv.bias is not None:
            attn.qkv.bias.copy_(permute_qkv_rows(attn.qkv.bias, tp))
        attn.forward = types.MethodType(_local_heads_forward, attn)
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    return blocks


def apply_dtensor_tp(model: nn.Module, mesh) -> nn.Module:
    """DTensor tensor parallelism on a whole plain GPT (blocks split, embeddings and head replicated)."""
    if getattr(model.cfg, "qk_norm", False):
        raise ConfigError("qk_norm=True is not supported by the DTensor tensor parallelism here: set qk_norm=False")
    parallelize_blocks(model.blocks, mesh, sequence_parallel=False)
    return model
