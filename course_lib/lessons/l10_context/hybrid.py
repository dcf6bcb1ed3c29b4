"""Lesson 10's hybrid context parallelism on every rank: Ulysses inside groups of u ranks, the ring across
(`course_lib.parallel.context_hybrid`; Megatron-LM's ``a2a+p2p``, USP).

- :func:`rank_hybrid_lab`: the tiny GPT with hybrid CP in every block over the whole world (cp = world size =
  ulysses x ring), one forward and backward: the global loss, the gathered logits, every gradient, the bytes per
  (phase, op) and the attention work of layer 0, next to `theory.context_hybrid.hybrid_layer_comm`.
"""

from __future__ import annotations

from course_lib import dist as cdist

__all__ = ["rank_hybrid_lab"]


def rank_hybrid_lab(cfg, batch, ulysses: int, groups: tuple | None = None) -> dict:
    """One step of the GPT over cp = the world size as a ulysses x (cp/ulysses) mesh. `batch`: (x, y) of (B, s), the
    same on every rank; `groups`: (ulysses_group, ring_group) to use instead of `hybrid_groups` (a wrong mesh, for
    the tests). Returns {"loss", "logits" (B, s, V), "grads" (CPU), "comm": {(phase, op): {"calls", "bytes"}} of
    layer 0, "work": its score elements, "coords": (g, j), "hardware": label}."""
    import torch.distributed as dist

    from course_lib.measure.hardware import hardware_label
    from course_lib.model import build_model, lm_loss
    from course_lib.one_process import grads_of
    from course_lib.parallel import context
    from course_lib.parallel.context_hybrid import apply_hybrid_context_parallel, hybrid_coords

    dev = cdist.device()
    model = apply_hybrid_context_parallel(build_model(cfg, 0).to(dev), ulysses, None, "balanced", groups)
    x, y = (context.split_sequence(t.to(dev), None) for t in batch)     # (B, s) -> (B, s/cp)
    logits = model(x)                                                   # (B, s/cp, V)
    loss = lm_loss(logits, y)
    loss.backward()
    context.sync_context_parallel_grads(model)
    attn = model.blocks[0].attn
    cp, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return dict(loss=context.context_parallel_loss(loss), logits=context.gather_sequence(logits.detach()).cpu(),
                grads={k: v.cpu() for k, v in grads_of(model).items()}, comm=attn.counter.table(),
                work=attn.counter.work, coords=hybrid_coords(rank, cp, ulysses),
                hardware=hardware_label(cdist.backend(), dev))
