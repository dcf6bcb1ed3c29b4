"""Apply tensor (and sequence) parallelism to a plain `course_lib.model.GPT` (lesson 04).

    model = build_model(cfg, seed=0)                       # the same seed on every rank: the same full weights
    tp_model = apply_tensor_parallel(model, group)         # group: the tensor-parallel ranks (default: all)
    loss = tp_model.loss(idx, targets); loss.backward()    # idx, targets (B, T), the same on every rank
    tp_model.sync_sequence_parallel_grads()                # only needed with sequence_parallel=True

The model knows nothing of parallelism: `apply_tensor_parallel` slices its full weights into this rank's
shards (Megatron-LM, Shoeybi et al. 2019), so the result equals one process exactly. Any process group
works (default: WORLD); in 3D parallelism it is `course_lib.dist.ProcessGrid`'s ``group("tp")``.

* every block: attention heads split (`ParallelAttention`), MLP column then row (`ParallelMLP`);
* token embedding and the tied head split along the vocabulary; `loss` is vocab-parallel cross-entropy,
  so no rank holds the full (B, T, V) logits (`forward` returns this rank's (B, T, V/t) slice);
* ``sequence_parallel=True`` (Korthikanti et al. 2022): between the layers the activations are
  (B, T/t, C), all-reduces become reduce-scatter + all-gather. LayerNorm weights, row-parallel biases and
  the position embedding then see T/t tokens per rank: `sync_sequence_parallel_grads` sums their gradients
  over the group (one all-reduce; Megatron does it with the data-parallel gradient reduction).

Dropout: the comparisons with one process use dropout 0. With dropout > 0 the replicated regions need the same
random mask on every rank (same seed) and the sharded ones different masks (Megatron's RNG tracker), which this
course does not implement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.config import ConfigError, ModelConfig
from course_lib.parallel.tensor import ColumnParallelLinear, ParallelAttention, ParallelMLP
from course_lib.parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["validate_tensor_parallel", "apply_tensor_parallel", "tensor_parallel_blocks", "TensorParallelGPT",
           "sync_sequence_parallel_grads", "shard_like", "local_param_bytes"]


def validate_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int | None = None,
                          sequence_parallel: bool = False) -> None:
    """Raise ConfigError when tp cannot split cfg: it must divide n_head, d_ff and vocab_size (and the
    sequence length with sequence parallelism). E.g. "tp=3 does not divide n_head=4: pick tp in {1, 2, 4}"."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be a positive int (the number of tensor-parallel ranks)")
    if getattr(cfg, "qk_norm", False):
        raise ConfigError("qk_norm=True is not supported by the course's tensor parallelism (its q/k norms would need their gradients all-reduced over tp): set qk_norm=False")
    sizes = [("n_head", cfg.n_head), ("d_ff", cfg.d_ff), ("vocab_size", cfg.vocab_size)]
    if sequence_parallel:
        sizes.append(("seq_len", cfg.seq_len if seq_len is None else seq_len))
    for name, n in sizes:
        if n % tp:
            common = [d for d in range(1, n + 1) if all(m % d == 0 for _, m in sizes)]
            raise ConfigError(f"tp={tp} does not divide {name}={n}: pick tp in {{{', '.join(map(str, common))}}}")


def tensor_parallel_blocks(blocks: nn.ModuleList, group=None, sequence_parallel: bool = False) -> nn.ModuleList:
    """Swap, in place, every block's attention and MLP for their tensor-parallel versions (heads split;
    MLP column then row). With sequence parallelism each block maps (B, T/t, C) -> (B, T/t, C)."""
    for block in blocks:
        block.attn = ParallelAttention.from_attention(block.attn, group, sequence_parallel=sequence_parallel)
        block.mlp = ParallelMLP.from_mlp(block.mlp, group, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            for p in list(block.ln1.parameters()) + list(block.ln2.parameters()):
                p.sequence_parallel = True
    return blocks


class TensorParallelGPT(nn.Module):
    """The tensor-parallel version of a GPT: same attribute names (tok_emb, pos_emb, blocks[i].attn.qkv, ...),
    each holding this rank's shard. Build it with `apply_tensor_parallel`."""

    def __init__(self, model: nn.Module, group=None, sequence_parallel: bool = False):
        super().__init__()
        cfg = model.cfg
        self.group, self.tp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        validate_tensor_parallel(cfg, self.tp, sequence_parallel=sequence_parallel)
        if not cfg.tie_embeddings:
            raise ConfigError("apply_tensor_parallel expects tie_embeddings=True (the head shares the vocab shard)")
        self.cfg, self.sequence_parallel = cfg, sequence_parallel
        sp = dict(sequence_parallel=sequence_parallel)
        self.tok_emb = VocabParallelEmbedding.from_embedding(model.tok_emb, group, **sp)       # (V/t, C)
        self.pos_emb, self.drop, self.ln_f = model.pos_emb, model.drop, model.ln_f             # replicated
        self.blocks = tensor_parallel_blocks(model.blocks, group, sequence_parallel)
        self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, group, bias=False, **sp)
        self.head.weight = self.tok_emb.weight                                                 # tied: (V/t, C)
        if sequence_parallel:        # these see T/t tokens per rank: their gradients are partial sums
            for m in [self.pos_emb, self.ln_f]:
                for p in m.parameters():
                    p.sequence_parallel = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T), the same on every rank -> this rank's logits (B, T, V/t)."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length T={T} exceeds cfg.seq_len={self.cfg.seq_len}")
        if self.sequence_parallel:
            if T % self.tp:
                raise ValueError(f"sequence parallelism splits the sequence: T={T} is not divisible by tp={self.tp}")
            n = T // self.tp
            pos = torch.arange(self.rank * n, (self.rank + 1) * n, device=idx.device)   # this rank's positions
        else:
            pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))      # (B, T) -> (B, T, C), or (B, T/t, C) with SP
        for block in self.blocks:
            x = block(x)                                          # (B, T, C) or (B, T/t, C)
        return self.head(self.ln_f(x))                            # -> (B, T, V/t)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, computed from the vocab shards (the same value on every rank)."""
        return vocab_parallel_cross_entropy(self(idx), targets, self.group)

    def sync_sequence_parallel_grads(self) -> None:
        """Sum over the group the gradients of parameters that saw only T/t tokens (sequence parallelism)."""
        if self.tp > 1:
            sync_sequence_parallel_grads(self, self.group)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V/t) -> (B, T, V) on every rank (for checks only: the point of TP is never to need it)."""
        parts = [torch.empty_like(local_logits) for _ in range(self.tp)]
        dist.all_gather(parts, local_logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@torch.no_grad()
def sync_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """Sum over ``group`` the gradients of ``module``'s parameters marked ``sequence_parallel`` (LayerNorm weights,
    row-parallel biases, position embeddings: each rank saw T/t tokens), in one all-reduce."""
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def apply_tensor_parallel(model: nn.Module, group=None, sequence_parallel: bool = False) -> TensorParallelGPT:
    """Convert a plain GPT (built with the same seed on every rank of `group`) into its tensor-parallel
    version, slicing the full weights. `group` defaults to all ranks; lesson 08 passes its grid's tp group.
    The plain model's blocks are changed in place (their attn and mlp are replaced)."""
    return TensorParallelGPT(model, group, sequence_parallel)


def shard_like(tp_model: nn.Module, full: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Slice full tensors {name: tensor} (e.g. the gradients of one process) the way `tp_model` sliced its
    parameters, so they can be compared with this rank's shards name by name. ``group``: the tp group (default
    ``tp_model.group``; a plain model whose blocks were made tensor-parallel in place, as in 3D, has none)."""
    from course_lib.parallel.tensor import shard

    group = group if group is not None else getattr(tp_model, "group", None)
    modules = dict(tp_model.named_modules())
    out = {}
    for name, t in full.items():
        mod_name, _, attr = name.rpartition(".")
        spec = getattr(modules.get(mod_name), "shard_dims", {}).get(attr)
        if spec is None:
            out[name] = t
        else:
            dim, fused = spec
            out[name] = shard(t, dim, dist.get_rank(group), dist.get_world_size(group), fused)
    return out


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
