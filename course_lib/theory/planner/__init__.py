"""The 3D-parallelism planner (lesson 08): every layout of a model on a cluster, its memory per GPU and step time.

    rows = plan(get_preset("gpt3-175b"), GPU_SPECS["A100"], Cluster("128 x 8 A100", 128, 8, 25.0), global_batch=1536)
    best = [r for r in rows if r.feasible][:5]

The package, by concept: `layouts` (Cluster, Layout, Estimate, the choices, `link`, the refusals), `stage_memory`
(parameters, model states, activations, a stage's memory), `step_time` (compute, memory-bound kernels, bubble,
communication and overlap), `search` (`estimate` = the three for one layout, `plan` = every layout). Every name is
importable from here.

A layout is (dp, tp, pp, ZeRO stage, activation checkpointing, micro-batch, pipeline schedule with its v, overlap;
sequence parallelism and the attention kernel where set, `block_of`);
dp x tp x pp = the cluster's GPUs,
ranks ordered as `course_lib.dist.ProcessGrid` orders them (TP innermost, then DP, then PP), so a dimension's group
stays inside a node when ``stride x size`` divides ``gpus_per_node`` (`link`). For each layout, by formula (mixed
precision bf16 with Adam, Megatron-style TP with sequence parallelism, the layout's pipeline schedule):

- **memory per GPU**, in GiB (2^30 bytes: an "80 GB" A100 or H100 holds 80 GiB, `GiB`), of the stage that needs
  the most (the first or the last; `Estimate.memory_stage`), not the sum of maxima of different stages:
  model states of the stage's TP shard (`stage_params`, with a learned position table on the first stage,
  replicated over TP), sharded over dp as ZeRO says, with gradients of ``grad_bytes`` bytes (`model_state_bytes`:
  4, fp32, by default, as Megatron-LM's main gradients and Llama 3's FSDP keep them: 2 + 4 + 12 bytes per
  parameter; ``grad_bytes=2`` gives lesson 05's 2 + 2 + 12); activations per layer in 16-bit counted as Korthikanti
  et al. (2022) do, for what today's blocks keep (`layer_activation_bytes`: fused attention, GELU or SwiGLU, GQA,
  LayerNorm or RMSNorm; GPT-3 175B at t = 8: ``4.0 sbh`` where the paper's ``sbh (34/t + 5as/(ht))`` gives
  ``14.25 sbh``, `korthikanti_layer_bytes`), ``2sbh/t`` per layer held with full recomputation plus one layer's
  activations while it is recomputed, for the micro-batches the schedule keeps in flight on the stage
  (`pipeline.peak_microbatches_in_flight`: 1F1B and ZB-H1 ``min(pp, m)`` on the first, 1 on the last; interleaved
  1F1B ``p + (p - 1)/v`` on the first); the last stage's logits (bf16 + their fp32 log-softmax, ``b s V / t``);
  with ZeRO-3, two layers' gathered 16-bit parameters (the one in use, the one prefetched); a reserve for the CUDA
  context, NCCL's buffers and fragmentation (``reserve_gib``, an assumption).
- **step time**: compute = the FLOPs the GPUs execute (model FLOPs x the recomputation factor: 8/6 with full
  recomputation, since the recomputed forward adds 2 FLOPs per parameter per token to the 6 of forward + backward)
  / (GPUs x peak x ``kernel_efficiency``). That efficiency is the fraction of peak the *matmuls* reach, a hardware
  FLOPs utilisation (HFU: executed FLOPs over peak), not the model FLOPs utilisation (MFU: model FLOPs only,
  recomputation left out), which `Estimate.mfu` reports for the whole step; the default 0.4 is an assumption,
  `lessons.l08_three_d.published.calibrate` sets it from one published run. With ``elementwise="fused"`` or
  ``"unfused"`` the memory-bound kernels (norms, activation functions, softmax, dropout, residual adds) and the
  optimizer step add their HBM bytes / the GPU's memory bandwidth (`elementwise_bytes`: a roofline; the weight
  matmuls of the published shapes lie above the ridge point, `gemm_intensity`, so one efficiency prices them all).
  The bubble, per schedule, from lesson 03's formulas (`theory.pipeline`): 1F1B ``(pp - 1) / m`` of the busy time
  (Narayanan et al. 2021's bubble time over ideal time, `pipeline.bubble_ratio`; ``(pp - 1) / (m + pp - 1)`` of the
  step, `pipeline.bubble_fraction`), interleaved 1F1B with v chunks per rank ``(pp - 1) / (v m)``
  (`pipeline.interleaved_bubble_fraction`; Megatron-LM's rules: pp x v divides the layers, m a multiple of pp), ZB-H1
  (Qi et al. 2023) ``(pp - 1)(t_F + t_B - t_W)`` with the micro-batch's F, B (input gradient, plus the recomputed
  forward) and W (weight gradient) in the ratio of their FLOPs (`pipeline.zero_bubble_idle_time`: a third of 1F1B's
  without recomputation). TP's 4 all-reduce-sized collectives per layer per micro-batch of ``b s h`` bf16 (6 with
  full recomputation); PP's ``2 v`` activation messages per micro-batch on a rank
  (`pipeline.p2p_messages_per_microbatch`);
  DP: ZeRO-0 all-reduces the gradients (``grad_bytes`` each), ZeRO-1/2 reduce-scatter them and all-gather the bf16
  parameters, ZeRO-3 all-gathers the parameters in forward and in backward and reduce-scatters the gradients for
  every micro-batch; all on the alpha-beta model of lesson 01.
- **overlap** (``layout.overlap``), a stated rule: ``"none"`` exposes every collective (the step is then the upper
  bound, `Estimate.no_overlap_s`, which is kept beside ``time["total"]`` in every case); ``"dp"``: DDP's buckets and
  ZeRO-1/2's reduce-scatter hide behind the last micro-batch's backward, ZeRO-1/2's parameter all-gather behind the
  next forward (Megatron-LM's ``--overlap-grad-reduce --overlap-param-gather``), ZeRO-3's gathers behind the same
  micro-batch's forward and backward layer by layer; what cannot hide is ``max(t - compute behind it, last part)``,
  the last part being the last bucket (at least the token embedding's gradient, complete only when the backward
  reaches the first layer; 25 MiB, DDP's ``bucket_cap_mb``, otherwise) or ZeRO-3's first layer; ``"dp+tp"``: also
  TP's collectives behind the matmuls (Megatron-Core's ``--tp-comm-overlap``, PyTorch's async TP), all but one
  chunk in tp; ``"tp-bwd"`` and ``"dp+tp-bwd"`` (without and with DP's overlap): only TP's backward collectives hide,
  each column-parallel linear's behind its own weight-gradient GEMM (Megatron-LM's asynchronous tensor-model-parallel
  all-reduce, `tp_backward_exposed`). Pipeline messages are never overlapped. `Estimate.exposed` holds what is left
  of each.

Infeasible layouts come with the reason (memory, divisibility). A pipeline with ZeRO-2/3 is **not modelled**
(`Estimate.not_modelled`): DeepSpeed and Megatron-LM refuse it (gradients are accumulated over micro-batches),
but torchtitan composes FSDP2 with its pipeline and Llama 3 ran FSDP inside its pipeline; the planner has no
schedule for its per-micro-batch gathers. What it leaves out, so that a published layout may rank lower than the
paper's (and its step time may err; `benchmarks/bench_planner.py` holds it against 14 published runs): uneven
stages (the first holds the embedding, the last the head and the loss; Llama 3 took a layer off each), overlap of
pipeline messages and Megatron-LM's scatter/gather of them, ZB-H2 and ZBV, a matmul efficiency that changes with
shapes (unless asked: ``estimate(..., matmuls="shapes")`` prices each GEMM by its tile and wave quantization and the
roofline, `matmuls`), Float8, the cross-entropy's memory traffic, stragglers and the memory allocator. The
defaults (1F1B, no overlap, ``elementwise="none"``) are lesson 08's first planner, which its exercises reproduce.

**Context parallelism** (``layout.cp``, default 1: every number above unchanged; lesson 10, `theory.context`): the
world is dp x tp x pp x cp, ranks ordered TP innermost, then CP, then DP, then PP (Llama 3 orders [TP, CP, PP, DP];
its PP and DP both cross nodes, as here), so a CP group is ``cp`` ranks ``tp`` apart (`link`). Each rank holds s/cp
tokens of every sequence: activations, logits, the TP and PP messages and the memory-bound kernels' bytes are those
of s/cp tokens, plus what the variant keeps beyond them (`context.extra_activation_bytes`: the all-gather's K/V of
the whole sequence, Ulysses' second copy of the output). The CP ranks hold the same parameters: gradients are reduced
and ZeRO shards over dp x cp (Megatron-LM's data-parallel group with CP, torchtitan's ``dp_shard_cp`` mesh), on
`link` (stride tp, size dp x cp). The K/V exchange per layer and micro-batch (`context.layer_comm`, K/V ``n_kv_head x
head_dim / tp`` wide, bf16) on the alpha-beta model of the CP group, forward (twice with recomputation: the recomputed
forward exchanges again) and backward: ``time["cp"]``, the no-overlap bound. What hides (``exposed["cp"]``), an
assumption stated: ring (``cp_variant="ring"``, Liu et al. 2023) posts each of its cp-1 forward transfers before a
step's block of attention and hides it behind that block, the rank's causal attention forward / cp
(`context.causal_work_per_rank`, balanced split: equal on every rank and nearly so at every step); in backward each
step's K/V and dK/dV transfers hide behind that step's block backward (2x its forward), the last dK/dV hop home stays
exposed (Megatron-LM's CP pipelines them so); all-gather (``"all_gather"``, Llama 3 section 3.3.2) and Ulysses
(``"ulysses"``, Jacobs et al. 2023) are exposed whole. Refused with the field and the fix: s not divisible by 2 cp
(the load-balanced split, `context.causal_work_per_rank`), s/cp not divisible by tp (sequence parallelism inside the
TP group), Ulysses where tp x cp does not divide n_head and n_kv_head (each rank attends with n_head / (tp cp) heads
of the whole sequence). `plan` adds cp only when asked (``cps=``); left out: the attention work imbalance of a
contiguous split (the balanced split is assumed), CP with the 2021 block.

**Expert parallelism** (``layout.ep``, default 1: every number above unchanged; lesson 11, `theory.experts`; issue
32). The model is a mixture of experts when ``estimate(..., moe=MoESpec(...))`` says so (`ModelConfig` describes
only dense blocks; ``cfg.d_ff`` is then the MLP of the first dense blocks). EP does not multiply the world size: it
borrows ranks of dp x cp. Refused with the field and the fix (`ep_refusals`): ep > 1 without ``moe``, n_experts not
divisible by ep, ep not dividing dp x cp. Memory: the dense parameters (attention, norms, router, shared experts,
embeddings) as before, ZeRO over dp x cp; the routed experts of the stage's MoE blocks (3 C F E each, split over
tp as Megatron-LM's expert tensor parallelism = tp does) / ep, ZeRO over the expert-data-parallel ranks dp x cp / ep
(`moe_stage_params`). Activations: a MoE block keeps what a SwiGLU MLP of hidden size k F + F_s keeps
(`MoESpec.active_d_ff`), plus the dispatched rows and the experts' outputs before the weighted sum, ``2 x 2 k s b
h / t`` (`moe_extra_layer_bytes`). Time: FLOPs of the active parameters (`MoESpec.flops_per_token`: 6 N_active +
attention), so MFU counts active FLOPs; per MoE block and micro-batch 2 all-to-alls forward (dispatch, combine) and 2
backward (4 forward with full recomputation), each of `experts.uniform_layer_comm`'s payload T k C x 2 bytes (bf16,
T = b s / (cp tp) tokens of the rank, uniform routing, no drops), (ep-1)/ep of it leaving the rank, on the
alpha-beta model (`comm.collective_time("all_to_all")`), all exposed (``time["ep"]`` = ``exposed["ep"]``:
DeepSeek-V3's DualPipe hides them behind another micro-batch's compute; the planner does not). The experts'
gradients are reduced (ZeRO-0: all-reduced; ZeRO-1/2: reduce-scattered, parameters all-gathered; ZeRO-3 per
micro-batch) over dp x cp / ep ranks, beside the dense ones over dp x cp. Where the ep group lies (the rule):
inside the data-parallel line (stride tp), ep groups are blocks of ep consecutive ranks (Megatron-LM's expert grid
"tp-ep-dp-pp" folds cp into ep x edp; `parallel.experts.ExpertGroups` builds blocks of consecutive dp ranks), so an
ep group spans tp x ep ranks and stays inside a node when tp x ep divides the GPUs per node (`link(stride=tp,
size=ep)`); the expert-dp group is ep x tp apart. Left out: load imbalance and dropped tokens (uniform routing),
the router's auxiliary losses, the all-to-all's two hops (NVLink then IB, DeepSeek-V3's node-limited routing),
FP8, and the first dense blocks' own MLP width in the activation count (DeepSeek-V3: 18,432 = 8 x 2,048 + 2,048,
equal). Multi-head latent attention (``moe.mla``, `flops.MLASpec`) enters the parameters and the FLOPs (compute and
the recomputed attention core), not the activation count or the K/V width of CP, which read the config's heads; the
multi-token prediction modules (``moe.mtp_depth``) enter the FLOPs only, not the memory.
"""

from course_lib.theory.experts import MoESpec
from course_lib.theory.planner.layouts import (ATTENTION, CKPT, CP_VARIANTS, DDP_BUCKET_BYTES, ELEMENTWISE, MATMULS,
                                               NOT_MODELLED, OVERLAPS, SCHEDULES, TRAFFIC_PASSES, Cluster, Estimate,
                                               GiB, Layout, block_of, cp_refusals, ep_refusals, layout_refusals, link,
                                               resolve_block)
from course_lib.theory.planner.matmuls import (Gemm, gemm_seconds, head_gemm, implied_efficiency, layer_gemms,
                                               matmul_seconds, quantization)
from course_lib.theory.planner.search import estimate, plan
from course_lib.theory.planner.stage_memory import (activation_bytes_per_gpu, cp_extra_layer_bytes,
                                                    korthikanti_layer_bytes, layer_activation_bytes, layer_kept_bytes,
                                                    layer_params,
                                                    model_state_bytes, moe_extra_layer_bytes, moe_stage_params,
                                                    position_params, stage_in_flight, stage_memory, stage_params)
from course_lib.theory.planner.step_time import (cp_layer_time, elementwise_bytes, ep_layer_time, gemm_intensity,
                                                 step_flops, step_time, tp_backward_exposed)

__all__ = ["Cluster", "Layout", "Estimate", "estimate", "plan", "link", "layer_params", "position_params",
           "stage_params", "model_state_bytes", "layer_activation_bytes", "korthikanti_layer_bytes",
           "activation_bytes_per_gpu", "CKPT", "GiB", "NOT_MODELLED", "SCHEDULES", "OVERLAPS", "ELEMENTWISE",
           "DDP_BUCKET_BYTES", "TRAFFIC_PASSES", "elementwise_bytes", "gemm_intensity", "CP_VARIANTS", "cp_refusals",
           "cp_layer_time", "MoESpec", "ep_refusals", "moe_stage_params", "moe_extra_layer_bytes", "ep_layer_time",
           "step_flops", "layout_refusals", "stage_memory", "step_time", "stage_in_flight", "cp_extra_layer_bytes",
           "ATTENTION", "MATMULS", "block_of", "resolve_block", "layer_kept_bytes", "Gemm", "gemm_seconds", "head_gemm",
           "implied_efficiency", "layer_gemms", "matmul_seconds", "quantization", "tp_backward_exposed"]
