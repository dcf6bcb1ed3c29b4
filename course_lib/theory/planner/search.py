"""One layout priced (`estimate`: memory per GPU and step time) and every layout of a cluster searched (`plan`), lesson
08; `course_lib.theory.planner`. The rules are in the package docstring.
"""

from __future__ import annotations

import itertools

from course_lib.config import ModelConfig
from course_lib.reference import reference_for
from course_lib.theory.experts import MoESpec
from course_lib.theory.planner.layouts import (CKPT, DDP_BUCKET_BYTES, Cluster, Estimate, GiB, Layout, ep_refusals,
                                               layout_refusals)
from course_lib.theory.planner.stage_memory import stage_in_flight, stage_memory
from course_lib.theory.planner.step_time import step_time

__all__ = ["estimate", "plan"]


@reference_for("08-stage-memory", "08-step-time")
def estimate(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, global_batch: int,
             seq_len: int | None = None, kernel_efficiency: float = 0.4, reserve_gib: float = 2.0,
             grad_bytes: int = 4, elementwise: str = "none", bucket_bytes: float = DDP_BUCKET_BYTES,
             moe: MoESpec | None = None, matmuls: str = "flat") -> Estimate:
    """Memory per GPU and step time of one layout (see the package docstring). ``gpu``: a `hardware.GPUSpec` (its
    ``mem_gb`` read as GiB); ``kernel_efficiency``: the assumed fraction of peak at which the GPUs execute their
    matmul FLOPs (recomputation included: a hardware FLOPs utilisation); ``grad_bytes``: 4 (fp32 gradients, the
    default of Megatron-LM and Llama 3) or 2 (bf16); ``elementwise``: "none" (matmuls only, the default), "fused"
    or "unfused": add the memory-bound kernels' time at the GPU's HBM bandwidth (`elementwise_bytes`) and the
    optimizer step's (it reads and writes each model-state byte once); "unfused" is Megatron-LM's 2021 block, whose
    activations are then counted without sequence parallelism (`activation_bytes_per_gpu`, ``block="2021"``);
    ``bucket_bytes``: the gradient bucket that cannot hide when ``layout.overlap`` overlaps DP; ``moe``: the
    model's mixture of experts (`MoESpec`; None: dense), which ``layout.ep`` shards (the package docstring);
    ``matmuls``: "flat" (every FLOP at ``kernel_efficiency``) or "shapes" (each GEMM by its shape,
    `matmuls.matmul_seconds`)."""
    s = cfg.seq_len if seq_len is None else seq_len
    why, not_modelled, accum = layout_refusals(cfg, cluster, layout, global_batch, s, moe)
    memory, memory_stage, split = stage_memory(cfg, layout, accum, s, moe, grad_bytes, reserve_gib,
                                               "2021" if elementwise == "unfused" else "today")
    if memory["total"] > gpu.mem_gb * GiB:
        why.append(f"needs {memory['total'] / GiB:.1f} GiB per GPU ({memory_stage} stage) > {gpu.mem_gb:g} GiB")
    t = step_time(cfg, gpu, cluster, layout, global_batch, accum, s, memory, split, kernel_efficiency, grad_bytes,
                  elementwise, bucket_bytes, moe, matmuls)
    time, p2p = t["time"], t["p2p_messages"]
    est = Estimate(layout, accum, memory, time, "; ".join(why), memory_stage=memory_stage, not_modelled=not_modelled,
                   exposed=t["exposed"], in_flight=stage_in_flight(layout, accum, "first"), p2p_messages=p2p,
                   p2p_bytes=accum * p2p * t["act_msg"] / layout.tp)
    est.tokens_per_s = global_batch * s / time["total"]
    peak = cluster.n_gpus * gpu.bf16_tflops * 1e12 * time["total"]
    est.mfu = t["model_flops"] / peak
    est.hfu = t["model_flops"] * t["recompute"] / peak
    return est


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cfg: ModelConfig, gpu, cluster: Cluster, global_batch: int, seq_len: int | None = None,
         kernel_efficiency: float = 0.4, micro_batches=(1, 2, 4, 8), zeros=(0, 1, 2, 3), ckpts=CKPT,
         reserve_gib: float = 2.0, grad_bytes: int = 4, schedules=("1f1b",), vs=(2, 3, 4), overlaps=("none",),
         elementwise: str = "none", cps=(1,), cp_variants=("ring",), eps=(1,),
         moe: MoESpec | None = None, matmuls: str = "flat", sps=(None,), attentions=(None,)) -> list[Estimate]:
    """Every layout (tp a divisor of a node's GPUs, pp any divisor of the rest, dp what remains; each ZeRO stage,
    recomputation, micro-batch, schedule and overlap asked for): feasible ones first by step time, then the
    infeasible ones with their reasons, then those not modelled (a pipeline with ZeRO-2/3). A tp that does not divide
    a node's GPUs (tp = 64 on 8-GPU nodes) is not listed: `estimate` prices such a layout when asked. With
    ``"interleaved"`` in ``schedules``, each v of ``vs`` such that pp x v divides the layers is listed (a v that does
    not is a layout nobody can run; `estimate` says why when asked); a pipeline schedule only where pp > 1.

    pp is not only a power of two: BLOOM ran pp=12 on 384 GPUs (`lessons.l08_three_d.published`), and on
    3 x 2^k GPUs with a batch of 2^k sequences every power-of-two pp leaves a dp that does not divide the batch.

    Context parallelism joins only when asked: each cp of ``cps`` (default 1, lesson 08's layouts) that divides the
    GPUs left by tp, with each variant of ``cp_variants`` (lesson 10; `estimate` refuses a cp the sequence or the
    heads cannot take, and says why).

    Expert parallelism likewise (``eps``, default 1; a MoE model, ``moe``): each ep of ``eps`` that divides dp x cp
    and the experts (`ep_refusals`). ``sps`` and ``attentions``: the sequence parallelism and attention kernels to
    list (default None: as ``elementwise`` implies, `block_of`); ``matmuls`` goes to `estimate`."""
    n = cluster.n_gpus
    rows = []
    shapes = [(tp, cp, variant) for tp in [d for d in _divisors(min(cluster.gpus_per_node, n)) if n % d == 0]
              for cp in cps if n % (tp * cp) == 0 for variant in (cp_variants if cp > 1 else ("ring",))]
    for tp, cp, variant in shapes:
        for pp in _divisors(n // (tp * cp)):
            dp = n // (tp * pp * cp)
            kinds = [("1f1b", 1)] if pp == 1 else (
                [(sch, 1) for sch in schedules if sch != "interleaved"]
                + [("interleaved", v) for v in vs if "interleaved" in schedules and cfg.n_layer % (pp * v) == 0])
            for zero in zeros:
                for ckpt in ckpts:
                    for b in micro_batches:
                        for sch, v in kinds:
                            for ov in overlaps:
                                for ep, sp, att in itertools.product(eps, sps, attentions):
                                    layout = Layout(dp, tp, pp, zero, ckpt, b, sch, v, ov, cp, variant, ep, sp, att)
                                    if ep > 1 and ep_refusals(layout, moe):
                                        continue
                                    rows.append(estimate(cfg, gpu, cluster, layout, global_batch, seq_len,
                                                         kernel_efficiency, reserve_gib, grad_bytes, elementwise,
                                                         moe=moe, matmuls=matmuls))
    order = {"feasible": 0, "infeasible": 1, "not modelled": 2}
    return sorted(rows, key=lambda e: (order[e.status], e.time["total"], e.memory["total"]))
