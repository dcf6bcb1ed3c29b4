"""Step time of a layout (lesson 08; `course_lib.theory.planner`): the matmuls at one efficiency, the memory-bound
kernels on a roofline, the bubble of the schedule, TP / PP / DP / CP / EP communication on the alpha-beta model and
what of it hides behind compute (`step_time`). The rules are in the package docstring.
"""

from __future__ import annotations

import math

from course_lib.config import ModelConfig
from course_lib.reference import reference_for
from course_lib.theory import comm, flops, pipeline
from course_lib.theory import context as cp_theory
from course_lib.theory import experts as moe_theory
from course_lib.theory.experts import MoESpec
from course_lib.theory.planner.layouts import (DDP_BUCKET_BYTES, ELEMENTWISE, MATMULS, TRAFFIC_PASSES, Cluster, Layout,
                                               block_of, link, resolve_block)
from course_lib.theory.planner.matmuls import matmul_seconds
from course_lib.theory.planner.stage_memory import layer_kept_bytes

__all__ = ["step_flops", "elementwise_bytes", "gemm_intensity", "cp_layer_time", "ep_layer_time", "step_time",
           "tp_backward_exposed"]

def ep_layer_time(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, moe: MoESpec | None, seq_len: int) -> float:
    """Seconds of one of a MoE block's all-to-alls per micro-batch on one GPU (dispatch or combine; 4 per block
    and micro-batch in a training step): payload T k C x 2 bytes (`experts.uniform_layer_comm`, bf16), T = b s /
    (cp tp) tokens of the rank; ``comm.collective_time("all_to_all")`` moves (ep-1)/ep of it on `link` (stride tp,
    size ep). 0 at ep = 1 (the experts are local)."""
    if moe is None or layout.ep == 1:
        return 0.0
    tokens = layout.micro_batch * seq_len // (layout.cp * layout.tp)
    payload = moe_theory.uniform_layer_comm(tokens, moe.top_k, cfg.d_model, layout.ep, 2)["payload"]
    alpha, bw = link(cluster, gpu, layout.tp, layout.ep)
    return comm.collective_time("all_to_all", payload, layout.ep, alpha, bw)


def step_flops(cfg: ModelConfig, global_batch: int, seq_len: int, moe: MoESpec | None = None) -> float:
    """Model FLOPs of a step: `flops.step_flops`, or with ``moe`` `MoESpec.flops_per_token` (6 N_active + attention,
    MLA's and the multi-token prediction modules' where given) per token."""
    if moe is None:
        return flops.step_flops(cfg, global_batch, seq_len)
    return moe.flops_per_token(cfg, seq_len) * global_batch * seq_len



def elementwise_bytes(cfg: ModelConfig, tp: int, seq_len: int | None = None, micro_batch: int = 1,
                      ckpt: str = "full", kernels: str = "fused", sp: bool | None = None,
                      attention: str | None = None) -> float:
    """HBM bytes one layer's memory-bound kernels (norms, activation functions, softmax, dropout, residual adds,
    bias adds) move per micro-batch on one GPU in a training step: a roofline for everything that is not a matmul.

    The rule (an assumption, stated, not fitted): what a layer keeps for backward is what its elementwise kernels
    write; each kept byte crosses HBM ``TRAFFIC_PASSES[ckpt]`` times: written in forward, read in backward, its
    gradient written and read in backward (4), and written once more by the recomputed forward with full
    recomputation (5). What a layer keeps: `layer_kept_bytes` of its block, sequence parallelism ``sp`` and the
    attention kernel ``attention`` where given, else as ``kernels`` says: ``"fused"``, today's blocks (SP, fused
    attention, `layer_activation_bytes`); ``"unfused"``, Megatron-LM's 2021 block, Korthikanti et al.'s count
    without sequence parallelism, whose ``5as/(ht)`` term is the ``a s x s`` scores, softmax and dropout mask
    (`korthikanti_layer_bytes`). These kernels run between the matmuls, so their time adds to the matmuls' time."""
    if kernels == "none":
        return 0.0
    if kernels not in ("fused", "unfused"):
        raise ValueError(f"kernels={kernels!r}: choose one of {', '.join(ELEMENTWISE)}")
    s = cfg.seq_len if seq_len is None else seq_len
    return TRAFFIC_PASSES[ckpt] * layer_kept_bytes(cfg, tp, s, micro_batch, *resolve_block(sp, attention, kernels))


def gemm_intensity(cfg: ModelConfig, tp: int, seq_len: int | None = None, micro_batch: int = 1) -> float:
    """The lowest arithmetic intensity (FLOPs per HBM byte, bf16) of a layer's weight matmuls on one GPU: for an
    ``(M, K) @ (K, N)`` GEMM, ``2 M K N / (2 (M K + K N + M N))``, with M = b s tokens and the TP shard's K, N (QKV
    and up-projection split N by tp, output and down-projection split K). Above the GPU's ridge point (peak / HBM
    bandwidth: 153 FLOP/B on an A100, 295 on an H100) the roofline says a matmul is compute-bound, so its speed does
    not depend on its shape; the planner then charges matmuls at one efficiency (``kernel_efficiency``)."""
    s = cfg.seq_len if seq_len is None else seq_len
    M, h, f = micro_batch * s, cfg.d_model, cfg.d_ff
    shapes = [(M, h, 3 * h // tp), (M, h // tp, h), (M, h, f // tp), (M, f // tp, h)]
    return min(M * K * N / (M * K + K * N + M * N) for M, K, N in shapes)



def cp_layer_time(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, seq_len: int,
                  kernel_efficiency: float = 0.4) -> dict:
    """Seconds of one layer's K/V exchange per micro-batch on one GPU, and what of it the attention does not hide
    (the package docstring's rule): ``forward``, ``backward`` (no overlap) and ``forward_exposed``,
    ``backward_exposed``. Bytes: `context.layer_comm` of the rank's 1/tp of the heads in bf16, K/V ``n_kv_head x
    head_dim / tp`` wide; a send costs alpha + bytes / bandwidth, a collective `comm.collective_time`, on `link`
    (stride tp, size cp). Ring: forward, cp-1 steps each hide one K/V chunk's send behind one block of attention
    (the rank's causal attention forward, `context.causal_work_per_rank` balanced, / cp, at ``kernel_efficiency``);
    backward, each step's K/V and dK/dV sends behind the step's block backward (2x its forward), the last dK/dV hop
    home exposed."""
    cp, t, b = layout.cp, layout.tp, layout.micro_batch
    zero = dict(forward=0.0, backward=0.0, forward_exposed=0.0, backward_exposed=0.0)
    if cp == 1:
        return zero
    variant, kv_dim = layout.cp_variant, cfg.n_kv_head * cfg.head_dim // t
    table = cp_theory.layer_comm(variant, b, seq_len, cfg.d_model // t, cp, 2, kv_dim=kv_dim)
    alpha, bw = link(cluster, gpu, t, cp)

    def seconds(phase: str) -> float:
        out = 0.0
        for (ph, op), row in table.items():
            if ph == phase:
                one = row["bytes"] / row["calls"]
                out += row["calls"] * (alpha + one / bw if op == "send" else
                                       comm.collective_time(op, one, cp, alpha, bw))
        return out

    fwd, bwd = seconds("forward"), seconds("backward")
    if variant != "ring":
        return dict(forward=fwd, backward=bwd, forward_exposed=fwd, backward_exposed=bwd)
    heads = cfg.n_head // t
    scores = cp_theory.causal_work_per_rank(seq_len, cp, "balanced", b, heads)[0]   # score elements, forward
    block_fwd = 4 * cfg.head_dim * scores / cp / (gpu.bf16_tflops * 1e12 * kernel_efficiency)  # QK^T and PV
    send = alpha + cp_theory.kv_chunk_bytes(b, seq_len, 0, cp, 2, kv_dim) / bw                # one K/V chunk
    fwd_exposed = (cp - 1) * max(0.0, send - block_fwd)
    bwd_exposed = (cp - 1) * max(0.0, 2 * send - 2 * block_fwd) + send   # K/V + dK/dV per step; the last hop home
    return dict(forward=fwd, backward=bwd, forward_exposed=min(fwd, fwd_exposed),
                backward_exposed=min(bwd, bwd_exposed))



def tp_backward_exposed(cfg: ModelConfig, gpu, layout: Layout, tokens: int, per_collective: float,
                        kernel_efficiency: float) -> float:
    """Seconds of one layer's TP collectives per micro-batch that stay exposed when each column-parallel linear's
    backward collective (the input gradient's all-reduce, or its reduce-scatter with sequence parallelism) runs
    while that linear's weight-gradient GEMM does: Megatron-LM's asynchronous tensor-model-parallel all-reduce (on by
    default in later versions, whose ``--no-async-tensor-model-parallel-allreduce`` turns it off). The forward's two
    collectives (four with full recomputation, whose forward runs twice) stay exposed; each of the backward's two
    (QKV's and the MLP's first linear's) hides behind its weight gradient, ``2 b s h N / t`` FLOPs at
    ``kernel_efficiency`` (N: QKV's ``h + 2 kv``; the MLP's ``d_ff``, ``2 d_ff`` with SwiGLU), all but what is
    longer than it. A mixture of experts' and MLA's own linears are priced as the config's dense
    ones (an approximation)."""
    M, h = layout.micro_batch * tokens, cfg.d_model
    rate = gpu.bf16_tflops * 1e12 * kernel_efficiency
    up = cfg.d_ff * (2 if cfg.mlp == "swiglu" else 1)
    wgrad = [2 * M * h * (h + 2 * cfg.n_kv_head * cfg.head_dim) / layout.tp / rate, 2 * M * h * up / layout.tp / rate]
    forward = (4 if layout.ckpt == "full" else 2) * per_collective
    return forward + sum(max(0.0, per_collective - w) for w in wgrad)


@reference_for("08-step-time")
def step_time(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, global_batch: int, accum: int, seq_len: int,
              memory: dict, split: dict, kernel_efficiency: float = 0.4, grad_bytes: int = 4,
              elementwise: str = "none", bucket_bytes: float = DDP_BUCKET_BYTES, moe: MoESpec | None = None,
              matmuls: str = "flat") -> dict:
    """{time (seconds by part, ``total``), exposed (what no compute hides, by part), model_flops, recompute (executed
    / model FLOPs), p2p_messages, act_msg (bytes of one activation message before TP)}: the package docstring's
    time model for one layout; ``memory`` and ``split`` are `stage_memory`'s. ``matmuls="flat"``: every executed
    FLOP at ``kernel_efficiency``; ``"shapes"``: each GEMM by its shape (`matmuls.matmul_seconds`: tile and wave
    quantization, the roofline, the LM head never recomputed), FLOPs the GEMM list does not hold (multi-token
    prediction) at ``kernel_efficiency``."""
    s, dp, tp, pp, b, cp, ep = seq_len, layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.cp, layout.ep
    n = s // cp                                                         # tokens of a sequence on one GPU
    edp = max(1, dp * cp // ep)                                         # expert-data-parallel ranks
    model_flops = step_flops(cfg, global_batch, s, moe)
    # attention core, forward, per sequence and layer: 4 s^2 d, or MLA's (`flops.MLASpec.core_flops_per_token`)
    mla = None if moe is None else moe.mla
    attn = 4 * s * s * cfg.d_model if mla is None else mla.core_flops_per_token(s, training=False) * s
    layer_fwd = 24 * s * cfg.d_model ** 2 + attn
    # executed / model FLOPs: full recomputation runs the forward twice, 2 + 2 + 4 = 8 FLOPs per parameter per
    # token instead of 2 + 4 = 6 (Narayanan et al. 2021, appendix: 96 B s l h^2 with recomputation, 72 without)
    recompute = {"none": 1.0, "selective": 1 + attn / (3 * layer_fwd), "full": 8 / 6}[layout.ckpt]
    sp, attention = block_of(layout, elementwise)
    if matmuls == "flat":
        compute = model_flops * recompute / (cluster.n_gpus * gpu.bf16_tflops * 1e12 * kernel_efficiency)
    elif matmuls == "shapes":
        mm = matmul_seconds(cfg, gpu, tp, pp, n, s, b, layout.ckpt, kernel_efficiency, attention, moe, ep)
        rest = max(0.0, model_flops / (cluster.n_gpus * accum) - mm["model_flops"])   # per micro-batch
        compute = accum * (mm["seconds"] + rest * recompute / (gpu.bf16_tflops * 1e12 * kernel_efficiency))
        recompute = (mm["flops"] + rest * recompute) / (mm["model_flops"] + rest)
    else:
        raise ValueError(f"matmuls={matmuls!r}: choose one of {', '.join(MATMULS)}")
    layers = math.ceil(cfg.n_layer / pp)
    # memory-bound kernels: HBM bytes / bandwidth, per layer per micro-batch, for the stage's layers
    acfg = cfg if moe is None else cfg.replace(d_ff=moe.active_d_ff)   # a token's MLP width (MoE: k F + F_s)
    memory_bound = layers * accum * elementwise_bytes(acfg, tp, n, b, layout.ckpt, elementwise, sp,
                                                      attention) / (gpu.mem_bw_gbs * 1e9)
    # the optimizer step is memory-bound too: it reads and writes each model-state byte of the GPU once
    optimizer = 0.0 if elementwise == "none" else 2 * memory["model_states"] / (gpu.mem_bw_gbs * 1e9)
    work = compute + memory_bound                                       # one GPU's busy time per step
    # the bubble, per schedule, from lesson 03's formulas (`theory.pipeline`)
    if pp == 1:
        bubble = 0.0
    elif layout.schedule == "interleaved":      # idle fraction f of the step -> f / (1 - f) of the work
        f = pipeline.interleaved_bubble_fraction(pp, accum, layout.v)
        bubble = work * f / (1 - f)             # = work (pp - 1) / (v m)
    else:                                       # per micro-batch: F 2, B 2 (+ the recomputed forward), W 2 parts
        per_mb = work / accum
        t_f = t_w = per_mb * 2 / (6 * recompute)
        t_b = per_mb - t_f - t_w
        idle = pipeline.zero_bubble_idle_time if layout.schedule == "zb-h1" else pipeline.one_f_one_b_idle_time
        bubble = idle(pp, t_f, t_b, t_w)        # 1F1B: (pp - 1) x per_mb = work (pp - 1) / m
    act_msg = b * n * cfg.d_model * 2                                   # bf16 (b, s/cp, h)
    alpha, bw = link(cluster, gpu, 1, tp)
    per_ar = comm.collective_time("all_reduce", act_msg, tp, alpha, bw)
    tp_time = layers * accum * (6 if layout.ckpt == "full" else 4) * per_ar
    alpha, bw = link(cluster, gpu, tp * cp * dp, pp)
    # each chunk a rank holds sends its activations forward and their gradients backward: 2 v messages per
    # micro-batch on a middle rank (`pipeline.p2p_messages_per_microbatch` over the pp ranks, rounded up)
    p2p_messages = math.ceil(pipeline.p2p_messages_per_microbatch(pp, layout.v) / pp) if pp > 1 else 0
    pp_time = accum * p2p_messages * (alpha + act_msg / tp / bw)
    alpha, bw = link(cluster, gpu, tp, dp * cp)        # the ranks holding the same parameters: DP x CP
    dp_cp = dp * cp
    P_gpu = split["only" if pp == 1 else "first"]["dense"]             # = stage_params(cfg, tp, pp) when dense
    grads, params16 = grad_bytes * P_gpu, 2 * P_gpu
    # the last bucket holds at least the token embedding's shard: its gradient is complete only when the backward
    # reaches the first layer (a tied head adds to it first), and a parameter larger than a bucket is its own bucket
    last_bucket = max(bucket_bytes, grad_bytes * cfg.vocab_size * cfg.d_model / tp)
    fwd_mb = compute / accum * 2 / (6 * recompute)                      # one micro-batch's forward on the stage
    bwd_mb = compute / accum - fwd_mb                                   # its backward (and recomputed forward)
    overlap_dp = layout.overlap.startswith("dp")

    def hidden(t: float, behind: float, last_part: float) -> float:
        """Exposed seconds of a collective of ``t`` s issued bucket by bucket while ``behind`` s of compute run:
        everything hides but ``last_part`` of it (the last bucket, issued when the compute is done)."""
        return max(t - behind, t * min(1.0, last_part)) if overlap_dp else t

    if layout.zero == 3:                    # per micro-batch: gather for forward and backward, scatter the gradients
        ag, rs = (comm.collective_time("all_gather", params16, dp_cp, alpha, bw),
                  comm.collective_time("reduce_scatter", grads, dp_cp, alpha, bw))
        dp_time = accum * (2 * ag + rs)
        # prefetched layer by layer behind the same micro-batch's forward / backward, but the first layer's gather
        dp_exposed = accum * (hidden(ag, fwd_mb, 1 / layers) + hidden(ag + rs, bwd_mb, 1 / layers))
    elif layout.zero in (1, 2):             # reduce-scatter the gradients, all-gather the updated bf16 parameters
        rs = comm.collective_time("reduce_scatter", grads, dp_cp, alpha, bw)
        ag = comm.collective_time("all_gather", params16, dp_cp, alpha, bw)
        dp_time = rs + ag
        # gradients behind the last micro-batch's backward, parameters behind the next step's first forward
        # (Megatron-LM --overlap-grad-reduce --overlap-param-gather): all but the last bucket of each
        dp_exposed = hidden(rs, bwd_mb, last_bucket / grads) + hidden(ag, fwd_mb, last_bucket / grads)
    else:                                   # plain data parallelism: all-reduce the gradients
        dp_time = comm.collective_time("all_reduce", grads, dp_cp, alpha, bw)
        # DDP's buckets: all-reduced while the last micro-batch's backward runs, all but the last bucket
        dp_exposed = hidden(dp_time, bwd_mb, last_bucket / grads)
    E_gpu = max(part["experts"] for part in split.values()) / ep        # the ep rank's experts (the fullest stage)
    if E_gpu and edp > 1:                   # the experts' gradients over the expert-dp ranks, ep x tp apart
        alpha_e, bw_e = link(cluster, gpu, tp * ep, edp)
        eg, ep16 = grad_bytes * E_gpu, 2 * E_gpu
        if layout.zero == 3:
            ag = comm.collective_time("all_gather", ep16, edp, alpha_e, bw_e)
            rs = comm.collective_time("reduce_scatter", eg, edp, alpha_e, bw_e)
            e_time = accum * (2 * ag + rs)
            e_exposed = accum * (hidden(ag, fwd_mb, 1 / layers) + hidden(ag + rs, bwd_mb, 1 / layers))
        elif layout.zero in (1, 2):
            rs = comm.collective_time("reduce_scatter", eg, edp, alpha_e, bw_e)
            ag = comm.collective_time("all_gather", ep16, edp, alpha_e, bw_e)
            e_time = rs + ag
            e_exposed = hidden(rs, bwd_mb, bucket_bytes / eg) + hidden(ag, fwd_mb, bucket_bytes / eg)
        else:
            e_time = comm.collective_time("all_reduce", eg, edp, alpha_e, bw_e)
            e_exposed = hidden(e_time, bwd_mb, bucket_bytes / eg)
        dp_time, dp_exposed = dp_time + e_time, dp_exposed + e_exposed
    # TP: Megatron-Core --tp-comm-overlap / PyTorch async TP split each matmul into tp chunks and move one chunk while
    # the next multiplies: all hides behind the matmuls but one chunk in tp
    if tp > 1 and layout.overlap == "dp+tp":
        tp_exposed = max(tp_time - compute, tp_time / tp)
    elif tp > 1 and layout.overlap.endswith("tp-bwd"):
        tp_exposed = layers * accum * tp_backward_exposed(cfg, gpu, layout, n, per_ar, kernel_efficiency)
    else:
        tp_exposed = tp_time
    # CP: the K/V exchange of every layer and micro-batch, forward (again in a recomputed forward) and backward
    cpt = cp_layer_time(cfg, gpu, cluster, layout, s, kernel_efficiency)
    again = 2 if layout.ckpt in ("selective", "full") else 1           # the recomputed attention exchanges again
    cp_time = layers * accum * (again * cpt["forward"] + cpt["backward"])
    cp_exposed = layers * accum * (again * cpt["forward_exposed"] + cpt["backward_exposed"])
    exposed = dict(tp=tp_exposed, pp=pp_time, dp=dp_exposed, cp=cp_exposed)   # p2p is never overlapped here
    time = dict(compute=compute, bubble=bubble, tp=tp_time, pp=pp_time, dp=dp_time, cp=cp_time,
                memory_bound=memory_bound, optimizer=optimizer)
    if moe is not None:                     # EP: 2 all-to-alls forward (again when recomputed), 2 backward, exposed
        moe_blocks = max(moe.moe_layers(cfg, 0, layers), moe.moe_layers(cfg, cfg.n_layer - layers, layers))
        a2a = 4 + (2 if layout.ckpt == "full" else 0)
        time["ep"] = exposed["ep"] = moe_blocks * accum * a2a * ep_layer_time(cfg, gpu, cluster, layout, moe, s)
    time["total"] = compute + memory_bound + optimizer + bubble + sum(exposed.values())
    return dict(time=time, exposed=exposed, model_flops=model_flops, recompute=recompute, p2p_messages=p2p_messages,
                act_msg=act_msg)
