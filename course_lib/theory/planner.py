"""The 3D-parallelism planner (lesson 08): every layout of a model on a cluster, its memory per GPU and step time.

    rows = plan(get_preset("gpt3-175b"), GPU_SPECS["A100"], Cluster("128 x 8 A100", 128, 8, 25.0), global_batch=1536)
    best = [r for r in rows if r.feasible][:5]

A layout is (dp, tp, pp, ZeRO stage, activation checkpointing, micro-batch, pipeline schedule with its v, overlap);
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
  chunk in tp. Pipeline messages are never overlapped. `Estimate.exposed` holds what is left of each.

Infeasible layouts come with the reason (memory, divisibility). A pipeline with ZeRO-2/3 is **not modelled**
(`Estimate.not_modelled`): DeepSpeed and Megatron-LM refuse it (gradients are accumulated over micro-batches),
but torchtitan composes FSDP2 with its pipeline and Llama 3 ran FSDP inside its pipeline; the planner has no
schedule for its per-micro-batch gathers. What it leaves out, so that a published layout may rank lower than the
paper's (and its step time may err; `benchmarks/bench_planner.py` holds it against 14 published runs): uneven
stages (the first holds the embedding, the last the head and the loss; Llama 3 took a layer off each), overlap of
pipeline messages and Megatron-LM's scatter/gather of them, ZB-H2 and ZBV, a matmul efficiency that changes with
shapes below the ridge point, Float8, the cross-entropy's memory traffic, stragglers and the memory allocator. The
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

from __future__ import annotations

import dataclasses
import math

from course_lib.config import ModelConfig
from course_lib.reference import reference_for
from course_lib.theory import comm, flops, pipeline
from course_lib.theory import context as cp_theory
from course_lib.theory import experts as moe_theory
from course_lib.theory.experts import MoESpec

__all__ = ["Cluster", "Layout", "Estimate", "estimate", "plan", "link", "layer_params", "position_params",
           "stage_params", "model_state_bytes", "layer_activation_bytes", "korthikanti_layer_bytes",
           "activation_bytes_per_gpu", "CKPT", "GiB", "NOT_MODELLED", "SCHEDULES", "OVERLAPS", "ELEMENTWISE",
           "DDP_BUCKET_BYTES", "TRAFFIC_PASSES", "elementwise_bytes", "gemm_intensity", "CP_VARIANTS", "cp_refusals",
           "cp_layer_time", "MoESpec", "ep_refusals", "moe_stage_params", "moe_extra_layer_bytes", "ep_layer_time",
           "step_flops"]

CKPT = ("none", "selective", "full")
GiB = 2 ** 30           # GPU memory: an "80 GB" A100 holds 80 GiB (nvidia-smi: 81,920 MiB), not 80 x 10^9 bytes
NOT_MODELLED = "not modelled (DeepSpeed and Megatron refuse it; torchtitan does it)"
SCHEDULES = ("1f1b", "interleaved", "zb-h1")     # pipeline schedules (lesson 03; `theory.pipeline`)
OVERLAPS = ("none", "dp", "dp+tp")              # what communication hides behind compute (`estimate`)
ELEMENTWISE = ("none", "fused", "unfused")      # the memory-bound kernels' HBM traffic (`elementwise_bytes`)
DDP_BUCKET_BYTES = 25 * 2 ** 20                 # PyTorch DDP's bucket_cap_mb=25: the last bucket cannot hide
TRAFFIC_PASSES = {"none": 4, "selective": 4, "full": 5}   # HBM passes over what a layer keeps (`elementwise_bytes`)
CP_VARIANTS = cp_theory.VARIANTS                         # "ring", "all_gather", "ulysses" (lesson 10)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes x gpus_per_node`` GPUs; ``inter_gbs_per_gpu``: bandwidth between nodes per GPU (GB/s, one way; None
    inside one node); ``alpha_us``, ``inter_alpha_us``: latency of one message in a node and across nodes (orders of
    magnitude, assumptions)."""

    name: str
    nodes: int
    gpus_per_node: int
    inter_gbs_per_gpu: float | None = None
    alpha_us: float = 10.0
    inter_alpha_us: float = 20.0

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 1
    ckpt: str = "none"
    micro_batch: int = 1
    schedule: str = "1f1b"              # "1f1b", "interleaved" (v model chunks per rank) or "zb-h1"
    v: int = 1                          # model chunks per rank (interleaved only; 1 otherwise)
    overlap: str = "none"               # "none", "dp" (DP/ZeRO buckets), "dp+tp" (also TP: --tp-comm-overlap)
    cp: int = 1                         # context-parallel ranks: each holds s/cp tokens of every sequence
    cp_variant: str = "ring"            # "ring", "all_gather" (Llama 3) or "ulysses" (`CP_VARIANTS`)
    ep: int = 1                         # expert-parallel ranks, borrowed from dp x cp (a MoE model only)

    def label(self) -> str:
        """``dp16 tp8 pp12 zero0 ckpt=full mb1``, then the schedule and overlap where they are not the defaults;
        ``cp16`` (and the variant unless ring) after pp where cp > 1; ``ep64`` after them where ep > 1."""
        cp = f" cp{self.cp}" + (f" {self.cp_variant}" if self.cp_variant != "ring" else "") if self.cp > 1 else ""
        cp += f" ep{self.ep}" if self.ep > 1 else ""
        out = f"dp{self.dp} tp{self.tp} pp{self.pp}{cp} zero{self.zero} ckpt={self.ckpt} mb{self.micro_batch}"
        if self.schedule != "1f1b":
            out += f" {self.schedule}" + (f" v{self.v}" if self.schedule == "interleaved" else "")
        return out + (f" overlap={self.overlap}" if self.overlap != "none" else "")


@dataclasses.dataclass
class Estimate:
    """One layout's memory per GPU (bytes) and step time (s); ``why`` says why it is infeasible ('' if it fits)."""

    layout: Layout
    accum: int                         # micro-batches per DP rank per step (m)
    memory: dict                       # model_states, activations, logits, reserve, total
    time: dict                         # compute, bubble, tp, pp, dp, cp, total
    why: str = ""
    tokens_per_s: float = 0.0
    mfu: float = 0.0                   # model FLOPs / (GPUs x peak x step time)
    hfu: float = 0.0                   # executed FLOPs (recomputation included) / (GPUs x peak x step time)
    memory_stage: str = "first"        # the stage whose memory is reported: "first", "last" or "only" (pp = 1)
    not_modelled: str = ""             # a layout the planner has no schedule for (pipeline with ZeRO-2/3)
    exposed: dict = dataclasses.field(default_factory=dict)   # tp, pp, dp, cp (ep): seconds left after overlap
    in_flight: float = 1.0             # micro-batches (of a whole stage) the first stage holds at its peak
    p2p_messages: int = 0              # point-to-point messages per micro-batch on the busiest rank
    p2p_bytes: float = 0.0             # bytes a rank sends to its pipeline neighbours per step

    @property
    def no_overlap_s(self) -> float:
        """The step time if no communication hid behind compute: the upper bound beside ``time["total"]``."""
        t = self.time
        return (t["total"] - sum(self.exposed.values()) + t["tp"] + t["pp"] + t["dp"] + t.get("cp", 0.0)
                + t.get("ep", 0.0))

    @property
    def feasible(self) -> bool:
        return not self.why and not self.not_modelled

    @property
    def status(self) -> str:
        """"feasible", "infeasible" (``why`` says why) or "not modelled" (``not_modelled`` says why)."""
        return "not modelled" if self.not_modelled else ("infeasible" if self.why else "feasible")


# ----------------------------------------------------------------------------------------------- parameters

def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (`ModelConfig.num_params` without embeddings, head and final norm)."""
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    norm_f = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    return (cfg.num_params(include_embeddings=False) - head - norm_f) // cfg.n_layer


def position_params(cfg: ModelConfig) -> int:
    """A learned position table, ``seq_len x d_model`` (GPT-3: 2,048 x 12,288 = 25.2 M); 0 with RoPE (or ALiBi)."""
    return cfg.seq_len * cfg.d_model if cfg.pos == "learned" else 0


@reference_for("08-stage-memory")
def stage_params(cfg: ModelConfig, tp: int, pp: int, stage: str = "first") -> int:
    """Parameters on one GPU of a pipeline stage before ZeRO (lesson 08).

    ``stage="first"`` (the largest): ceil(L/pp) blocks / tp, plus the token embedding split along the vocabulary over
    tp, plus the learned position table (`position_params`), which Megatron-LM and DTensor keep whole on every TP
    rank (replicated, not split); with one stage, also the head unless it is tied. ``stage="last"`` (pp > 1):
    ceil(L/pp) blocks and the head (a copy of the embedding when tied, as Megatron-LM keeps it), split over tp.
    Replicated norms are counted as split (a < 0.1 % difference at these sizes). The position table is 0.9-1.8 % of
    GPT-3's first stage at pp 8-16."""
    blocks = math.ceil(cfg.n_layer / pp) * layer_params(cfg)
    vocab = cfg.vocab_size * cfg.d_model
    if stage == "last":
        return (blocks + vocab) // tp
    if stage != "first":
        raise ValueError(f"stage={stage!r}: 'first' or 'last'")
    ends = vocab if pp > 1 else (vocab if cfg.tie_embeddings else 2 * vocab)
    return (blocks + ends) // tp + position_params(cfg)


@reference_for("08-stage-memory")
def model_state_bytes(n_params: float, dp: int, zero: int, grad_bytes: int = 4) -> dict:
    """Model-state bytes per GPU of ``n_params`` parameters in bf16 mixed precision with Adam, ZeRO stage ``zero``
    over ``dp`` ranks: bf16 parameters (2), gradients of ``grad_bytes`` (4: fp32, as Megatron-LM's main gradients
    and DeepSpeed's BF16_Optimizer (``grad_acc_dtype`` fp32 buffers) keep them, and as Llama 3 accumulates and
    reduce-scatters them: "we use FP32 gradient accumulation ... and also reduce-scatter gradients in FP32", Llama 3
    team 2024, section 3.3.2; 2: bf16), fp32 master weights, momentum and variance (12). ZeRO-1 shards the 12,
    ZeRO-2 also the gradients, ZeRO-3 also the parameters (Rajbhandari et al. 2020, section 5). With
    ``grad_bytes=2`` this is `memory.zero_model_state_bytes` (2 + 2 + 12 = 16 bytes per parameter, lesson 05); the
    default gives 2 + 4 + 12 = 18 (ZeRO-0) and 6 + 12/dp (ZeRO-1, Megatron-LM's distributed optimizer)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero}: ZeRO stages are 0, 1, 2 or 3")
    P = n_params
    out = dict(params=2 * P / dp if zero >= 3 else 2 * P,
               grads=grad_bytes * P / dp if zero >= 2 else grad_bytes * P,
               optimizer=12 * P / dp if zero >= 1 else 12 * P)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# ---------------------------------------------------------------------------------------------- activations

def layer_activation_bytes(cfg: ModelConfig, tp: int, seq_len: int | None = None, micro_batch: int = 1) -> dict:
    """Bytes that autograd keeps for backward of one transformer block on one GPU, by what keeps them (lesson 08).

    The base is Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
    2205.05198, section 4): per layer ``sbh (34/t + 5as/(ht))`` bytes in 16-bit with TP + SP, for s tokens, micro-batch
    b, width h, a heads, TP degree t. Their block is GPT-3's as Megatron-LM ran it in 2022; today's blocks (the
    course's GPT, transformers' Llama; bf16, TP + SP) keep something else:

    - attention by a fused kernel (SDPA: FlashAttention on GPUs): no ``a s x s`` scores, softmax or dropout mask
      (Korthikanti's ``5as/h``); it keeps q, k, v (k and v of ``n_kv_head`` heads with GQA), its output (which is also
      the output projection's input) and an fp32 log-sum-exp per head and token: ``(4 + 4 n_kv/a) sbh/t + 4asb/t``;
    - the MLP keeps the input and the output of its activation function, ``2 x 2 s b d_ff / t`` with GELU; SwiGLU
      keeps four ``(s, b, d_ff/t)`` tensors (gate output, SiLU output, up output, their product), ``8 s b d_ff / t``;
    - the norms keep their input sharded along the sequence: LayerNorm its bf16 input, ``2sbh/t`` each; transformers'
      ``LlamaRMSNorm`` computes in fp32 and keeps an fp32 copy of its input and its bf16 output, ``6sbh/t`` each;
    - the norm's output, all-gathered along the sequence before the first matmuls of attention (q, k, v) and of the
      MLP, is kept as its shard and gathered again in backward (Korthikanti et al. 4.2.2, Megatron-LM,
      `parallel.sequence.SequenceParallelLinear`): ``2 x 2sbh/t``. PyTorch's DTensor SP keeps the gathered
      ``(b, s, h)`` copy instead, ``2 x 2sbh``: ``4sbh (1 - 1/t)`` more per layer (3.5 sbh at t = 8) unless those
      layers are checkpointed;
    - no dropout in the presets (large-model pretraining runs without); with ``cfg.dropout > 0`` Korthikanti's two
      residual-dropout masks, ``2sbh/t`` (1 byte per element; not measured here).

    GPT-3 175B at t = 8: ``32 sbh/t + 4asb/t`` = 4.00 sbh, against Korthikanti's ``sbh (34/t + 5as/(ht))`` = 14.25
    sbh with TP + SP (`korthikanti_layer_bytes`; 34/t = 4.25 sbh is their count without the scores, i.e. with
    selective recomputation). Left out (< 0.1 %): a norm's mean and 1/std per token, RoPE's cos and sin
    (shared by all layers). Checked against PyTorch's memory tracker on a fake process group in
    `lessons.l08_three_d.simulate.fake_group_activations`.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    b, h, a, t, f = micro_batch, cfg.d_model, cfg.n_head, tp, cfg.d_ff
    sbh = s * b * h
    norm = 6 if cfg.norm == "rmsnorm" else 2                            # bytes kept per element of a norm's input
    return dict(
        norms=2 * norm * sbh / t,                                       # (b, s/t, h) each
        gathered=2 * 2 * sbh / t,                                       # (b, s/t, h) each, gathered in backward
        attention=(4 + 4 * cfg.n_kv_head / a) * sbh / t,                # q, output (b, a/t, s, h/a); k, v: n_kv heads
        logsumexp=4 * a * s * b / t,                                    # fp32 (b, a/t, s)
        mlp=(8 if cfg.mlp == "swiglu" else 4) * s * b * f / t,          # (b, s, d_ff/t) each
        dropout=2 * sbh / t if cfg.dropout else 0,                      # bool (b, s/t, h) masks
    )


def korthikanti_layer_bytes(cfg: ModelConfig, tp: int, seq_len: int | None = None, micro_batch: int = 1,
                            sequence_parallel: bool = True, selective: bool = False) -> float:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198,
    table 2): bytes one transformer layer keeps for backward, in 16-bit with dropout and attention that stores its
    ``a s x s`` scores: ``sbh (10 + 24/t + 5as/(ht))`` with TP, ``sbh (34/t + 5as/(ht))`` with TP + SP; selective
    recomputation drops the ``5as/(ht)`` term of the scores. GPT-3 175B (a = 96, s = 2,048, h = 12,288) at t = 8:
    23 sbh with TP, 14.25 sbh with TP + SP, 4.25 sbh with TP + SP + selective recomputation."""
    s = cfg.seq_len if seq_len is None else seq_len
    b, h, a, t = micro_batch, cfg.d_model, cfg.n_head, tp
    scores = 0 if selective else 5 * a * s / (h * t)
    per_sbh = (34 / t if sequence_parallel else 10 + 24 / t) + scores
    return s * b * h * per_sbh


def activation_bytes_per_gpu(cfg: ModelConfig, layout: Layout, accum: int, seq_len: int | None = None,
                             stage: str = "first", block: str = "today", moe: MoESpec | None = None) -> int:
    """Activations of a pipeline stage, bytes per GPU: the first (``stage="first"``, it holds the most
    micro-batches) or the last (``"last"``, one micro-batch in flight).

    Per layer `layer_activation_bytes` (Korthikanti et al. 2022's count redone for fused attention, SwiGLU, GQA and
    RMSNorm). ``ckpt="selective"`` recomputes the attention core as Korthikanti et al. do, which in their count frees
    the ``a s x s`` scores, softmax output and dropout mask (``5as/(ht)`` sbh, 10 sbh of their 14.25 for GPT-3 at
    t = 8). A fused attention kernel never keeps those (it recomputes the scores in its own backward), so here
    selective recomputation frees only the kernel's fp32 log-sum-exp (``4asb/t`` bytes, 0.004 sbh for GPT-3 at t = 8,
    0.1 % of the layer's 4.0 sbh) and pays for recomputing the attention core: kept in the table to show that it saves
    almost nothing once attention is fused. ``ckpt="full"`` keeps each layer's input, ``2sbh/t``, plus one layer's
    activations while it is recomputed. The stage holds `stage_in_flight` micro-batches of ceil(L/pp) layers: under
    1F1B and ZB-H1 ``min(pp, m)`` on the first stage and one on the last; interleaved 1F1B holds more.
    ``block="2021"``: Megatron-LM's block of 2021 (no sequence parallelism, attention that keeps its ``a s x s``
    scores): Korthikanti et al.'s ``sbh (10 + 24/t + 5as/(ht))`` per layer (`korthikanti_layer_bytes`), and with
    full recomputation a layer input of ``2sbh`` (whole on every TP rank).

    With context parallelism (``layout.cp > 1``) every count is of the rank's s/cp tokens, and a layer also keeps
    what its variant keeps beyond them (`cp_extra_layer_bytes`; the ring nothing).

    With ``moe`` every layer is counted as a MoE block: a SwiGLU MLP of hidden size k F + F_s
    (`MoESpec.active_d_ff`) plus `moe_extra_layer_bytes`.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    if moe is not None:
        cfg = cfg.replace(d_ff=moe.active_d_ff)
    b, h, t = layout.micro_batch, cfg.d_model, layout.tp
    layers = math.ceil(cfg.n_layer / layout.pp)
    full_s, s = s, s // layout.cp                                       # the rank's s/cp tokens
    parts = layer_activation_bytes(cfg, t, s, b)
    full_layer = (sum(parts.values()) + cp_extra_layer_bytes(cfg, layout, full_s)
                  + moe_extra_layer_bytes(cfg, moe, t, s, b))
    if block == "2021":
        full_layer = korthikanti_layer_bytes(cfg, t, s, b, sequence_parallel=False)
        kept = {"none": full_layer, "full": 2 * s * b * h,
                "selective": korthikanti_layer_bytes(cfg, t, s, b, sequence_parallel=False, selective=True)}
        return int(layers * kept[layout.ckpt] * stage_in_flight(layout, accum, stage)
                   + (full_layer if layout.ckpt == "full" else 0))
    if block != "today":
        raise ValueError(f"block={block!r}: 'today' or '2021'")
    if layout.ckpt == "none":
        per_mb = layers * full_layer
    elif layout.ckpt == "selective":
        per_mb = layers * (full_layer - parts["logsumexp"])
    else:                                                               # full: each layer's input, 2sbh/t
        per_mb = layers * 2 * s * b * h / t
    in_flight = stage_in_flight(layout, accum, stage)
    extra = full_layer if layout.ckpt == "full" else 0                  # the layer being recomputed
    return int(per_mb * in_flight + extra)


def cp_extra_layer_bytes(cfg: ModelConfig, layout: Layout, seq_len: int) -> int:
    """Bytes a layer keeps on one GPU beyond its own s/cp tokens under the layout's CP variant, in bf16, of the
    rank's 1/tp of the heads (`context.extra_activation_bytes`: all-gather 2 b s kv_dim / tp, the whole sequence's
    K/V; Ulysses b (s/cp) h / tp; ring 0). ``kv_dim = n_kv_head x head_dim`` (GQA)."""
    t = layout.tp
    return cp_theory.extra_activation_bytes(layout.cp_variant, layout.micro_batch, seq_len, cfg.d_model // t,
                                            layout.cp, 2, kv_dim=cfg.n_kv_head * cfg.head_dim // t)


def cp_refusals(cfg: ModelConfig, layout: Layout, seq_len: int) -> list[str]:
    """Why cp ranks cannot split this layout's sequence (empty if they can; nothing to say at cp = 1): each reason
    names the field and the fix (lesson 10, `parallel.context.validate_context_parallel` for one CP group)."""
    cp, t, s = layout.cp, layout.tp, seq_len
    if cp == 1:
        return []
    why = []
    if s % (2 * cp):
        ok = max((c for c in range(1, cp) if cp % c == 0 and s % (2 * c) == 0), default=1)
        why.append(f"seq_len={s} is not divisible by 2 x cp = {2 * cp} (the load-balanced split cuts each sequence "
                   f"into 2cp chunks, rank i holding chunks i and 2cp-1-i): use cp={ok} or a seq_len multiple of "
                   f"{2 * cp}")
    elif (s // cp) % t:
        why.append(f"seq_len/cp = {s // cp} tokens per CP rank are not divisible by tp={t} (sequence parallelism "
                   f"splits them over the TP group, ordered inside the CP group): use a smaller cp or tp")
    if layout.cp_variant == "ulysses" and (cfg.n_head % (t * cp) or cfg.n_kv_head % (t * cp)):
        kv = cfg.n_kv_head // t if cfg.n_kv_head % t == 0 else 0
        ok = ", ".join(str(c) for c in range(1, kv + 1) if kv % c == 0) or "none"
        why.append(f"cp_variant='ulysses' needs tp x cp = {t * cp} to divide n_head={cfg.n_head} and n_kv_head="
                   f"{cfg.n_kv_head} (TP first gives each rank n_head/tp heads, Ulysses' all-to-all then 1/cp of "
                   f"those): use cp in {{{ok}}} or cp_variant='ring' or 'all_gather'")
    return why


def cp_layer_time(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, seq_len: int,
                  kernel_efficiency: float = 0.4) -> dict:
    """Seconds of one layer's K/V exchange per micro-batch on one GPU, and what of it the attention does not hide
    (the module docstring's rule): ``forward``, ``backward`` (no overlap) and ``forward_exposed``,
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


def ep_refusals(layout: Layout, moe: MoESpec | None) -> list[str]:
    """Why ep cannot shard this model's experts over this layout's ranks (empty if it can; nothing at ep = 1): each
    reason names the field and the fix (`parallel.experts.validate_expert_parallel` for one group)."""
    ep, dp_cp = layout.ep, layout.dp * layout.cp
    if ep == 1:
        return []
    if moe is None:
        return [f"ep={ep} needs a mixture-of-experts model: pass moe=MoESpec(n_experts, top_k, expert_d_ff) or use "
                f"ep=1"]
    why = []
    if moe.n_experts % ep:
        ok = ", ".join(str(d) for d in range(1, moe.n_experts + 1) if moe.n_experts % d == 0 and dp_cp % d == 0)
        why.append(f"n_experts={moe.n_experts} is not divisible by ep={ep} (each ep rank holds n_experts/ep "
                   f"experts): pick ep in {{{ok}}}")
    if dp_cp % ep:
        why.append(f"ep={ep} does not divide dp x cp = {layout.dp} x {layout.cp} = {dp_cp}: expert parallelism "
                   f"borrows data-parallel ranks and does not multiply the world size; pick ep dividing {dp_cp}")
    return why


def moe_stage_params(cfg: ModelConfig, moe: MoESpec | None, tp: int, pp: int, stage: str = "first") -> dict:
    """{"dense", "experts"}: parameters on one GPU of a pipeline stage before ep and ZeRO. ``dense``: `stage_params`
    with each MoE block's MLP replaced by its router and shared experts (and every block's attention by ``moe.mla``'s
    where given); ``experts``: the routed experts of the stage's MoE blocks, 3 C F E each, / tp. The first stage
    holds blocks 0 .. ceil(L/pp) - 1 (the first dense blocks among them), the last the last ceil(L/pp). Without ``moe``: (`stage_params`, 0)."""
    dense = stage_params(cfg, tp, pp, stage)
    if moe is None:
        return dict(dense=dense, experts=0)
    per = math.ceil(cfg.n_layer / pp)
    n = moe.moe_layers(cfg, 0 if stage == "first" else cfg.n_layer - per, per)
    blocks = min(per, cfg.n_layer)
    return dict(dense=dense + (n * moe.dense_delta(cfg) + blocks * moe.attention_delta(cfg)) // tp,
                experts=n * moe.expert_params(cfg) // tp)


def moe_extra_layer_bytes(cfg: ModelConfig, moe: MoESpec | None, tp: int, seq_len: int, micro_batch: int = 1) -> int:
    """Bytes a MoE block keeps beyond a SwiGLU MLP of hidden size k F + F_s: the k dispatched copies of each token's
    row (the experts' input) and the experts' outputs before the weighted sum, bf16, ``2 x 2 k s b h / t``."""
    return 0 if moe is None else 2 * 2 * moe.top_k * seq_len * micro_batch * cfg.d_model // tp


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


def stage_in_flight(layout: Layout, accum: int, stage: str = "first") -> float:
    """Micro-batches (of a whole stage's layers) that a stage holds at its peak under the layout's schedule:
    `pipeline.peak_microbatches_in_flight` for the first rank (``stage="first"``) or the last: 1F1B and ZB-H1
    ``min(pp - rank, m)``, interleaved 1F1B `pipeline.interleaved_in_flight` (``p + (p - 1)/v`` on the first rank
    when m > p); 1 without a pipeline."""
    if layout.pp == 1:
        return 1
    rank = 0 if stage == "first" else layout.pp - 1
    return pipeline.peak_microbatches_in_flight(layout.schedule, layout.pp, accum, rank, layout.v)


def elementwise_bytes(cfg: ModelConfig, tp: int, seq_len: int | None = None, micro_batch: int = 1,
                      ckpt: str = "full", kernels: str = "fused") -> float:
    """HBM bytes one layer's memory-bound kernels (norms, activation functions, softmax, dropout, residual adds,
    bias adds) move per micro-batch on one GPU in a training step: a roofline for everything that is not a matmul.

    The rule (an assumption, stated, not fitted): what a layer keeps for backward is what its elementwise kernels
    write; each kept byte crosses HBM ``TRAFFIC_PASSES[ckpt]`` times: written in forward, read in backward, its
    gradient written and read in backward (4), and written once more by the recomputed forward with full
    recomputation (5). ``kernels="fused"``: today's blocks (fused attention, the planner's count,
    `layer_activation_bytes`); ``"unfused"``: Megatron-LM's 2021 block, Korthikanti et al.'s count without sequence
    parallelism, whose ``5as/(ht)`` term is the ``a s x s`` scores, softmax and dropout mask
    (`korthikanti_layer_bytes`). These kernels run between the matmuls, so their time adds to the matmuls' time."""
    if kernels == "none":
        return 0.0
    if kernels == "unfused":
        kept = korthikanti_layer_bytes(cfg, tp, seq_len, micro_batch, sequence_parallel=False)
    elif kernels == "fused":
        kept = sum(layer_activation_bytes(cfg, tp, seq_len, micro_batch).values())
    else:
        raise ValueError(f"kernels={kernels!r}: choose one of {', '.join(ELEMENTWISE)}")
    return TRAFFIC_PASSES[ckpt] * kept


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


# ------------------------------------------------------------------------------------------------- estimate

def link(cluster: Cluster, gpu, stride: int, size: int) -> tuple[float, float]:
    """(alpha in s, bandwidth in bytes/s) of a group of ``size`` ranks ``stride`` apart: NVLink (the GPU's link)
    when every such group lies inside one node, i.e. when ``stride x size`` divides the GPUs per node (a group of 3
    consecutive ranks on 8-GPU nodes has one group across two nodes), else the network between nodes."""
    span = stride * size
    if size == 1 or cluster.inter_gbs_per_gpu is None or cluster.gpus_per_node % span == 0:
        return cluster.alpha_us * 1e-6, gpu.link_gbs * 1e9
    return cluster.inter_alpha_us * 1e-6, min(gpu.link_gbs, cluster.inter_gbs_per_gpu) * 1e9


@reference_for("08-stage-memory", "08-step-time")
def estimate(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, global_batch: int,
             seq_len: int | None = None, kernel_efficiency: float = 0.4, reserve_gib: float = 2.0,
             grad_bytes: int = 4, elementwise: str = "none", bucket_bytes: float = DDP_BUCKET_BYTES,
             moe: MoESpec | None = None) -> Estimate:
    """Memory per GPU and step time of one layout (see the module docstring). ``gpu``: a `hardware.GPUSpec` (its
    ``mem_gb`` read as GiB); ``kernel_efficiency``: the assumed fraction of peak at which the GPUs execute their
    matmul FLOPs (recomputation included: a hardware FLOPs utilisation); ``grad_bytes``: 4 (fp32 gradients, the
    default of Megatron-LM and Llama 3) or 2 (bf16); ``elementwise``: "none" (matmuls only, the default), "fused"
    or "unfused": add the memory-bound kernels' time at the GPU's HBM bandwidth (`elementwise_bytes`) and the
    optimizer step's (it reads and writes each model-state byte once); "unfused" is Megatron-LM's 2021 block, whose
    activations are then counted without sequence parallelism (`activation_bytes_per_gpu`, ``block="2021"``);
    ``bucket_bytes``: the gradient bucket that cannot hide when ``layout.overlap`` overlaps DP; ``moe``: the
    model's mixture of experts (`MoESpec`; None: dense), which ``layout.ep`` shards (the module docstring)."""
    s = cfg.seq_len if seq_len is None else seq_len
    dp, tp, pp, b, cp, ep = layout.dp, layout.tp, layout.pp, layout.micro_batch, layout.cp, layout.ep
    why, not_modelled = [], ""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive int (the number of context-parallel ranks; 1: none)")
    if layout.cp_variant not in CP_VARIANTS:
        raise ValueError(f"cp_variant={layout.cp_variant!r}: choose one of {', '.join(CP_VARIANTS)}")
    if cp == 1 and dp * tp * pp != cluster.n_gpus:
        why.append(f"dp x tp x pp = {dp * tp * pp}, not the cluster's {cluster.n_gpus} GPUs")
    elif cp > 1 and dp * tp * pp * cp != cluster.n_gpus:
        why.append(f"dp x tp x pp x cp = {dp * tp * pp * cp}, not the cluster's {cluster.n_gpus} GPUs: pick dp = "
                   f"{cluster.n_gpus} / (tp x pp x cp)")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive int (the number of expert-parallel ranks; 1: none)")
    why += cp_refusals(cfg, layout, s)
    why += ep_refusals(layout, moe)
    if cfg.n_head % tp or cfg.d_ff % tp:
        why.append(f"tp={tp} does not divide n_head={cfg.n_head} and d_ff={cfg.d_ff}")
    if pp > cfg.n_layer:
        why.append(f"pp={pp} > {cfg.n_layer} layers")
    if global_batch % (dp * b):
        why.append(f"global batch {global_batch} is not a multiple of dp x micro-batch = {dp * b}")
    if pp > 1 and layout.zero >= 2:
        not_modelled = f"ZeRO-{layout.zero} with a pipeline: {NOT_MODELLED}"
    if layout.ckpt not in CKPT:
        raise ValueError(f"ckpt={layout.ckpt!r}: choose one of {', '.join(CKPT)}")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"schedule={layout.schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if layout.overlap not in OVERLAPS:
        raise ValueError(f"overlap={layout.overlap!r}: choose one of {', '.join(OVERLAPS)}")
    accum = max(1, global_batch // (dp * b))
    if layout.schedule == "interleaved":        # Megatron-LM's rules (--num-layers-per-virtual-pipeline-stage)
        if pp < 2 or layout.v < 2:
            why.append(f"interleaved needs pp >= 2 and v >= 2 model chunks per rank; got pp={pp}, v={layout.v} "
                       f"(use schedule='1f1b')")
        elif cfg.n_layer % (pp * layout.v):
            why.append(f"v={layout.v} does not divide the layers per stage ({cfg.n_layer} layers / pp {pp}): "
                       f"pick v so that pp x v divides {cfg.n_layer}")
        if pp >= 2 and accum % pp:
            why.append(f"interleaved needs the micro-batches per DP rank (m = {accum}) to be a multiple of pp = {pp} "
                       f"(Megatron-LM asserts it): change the global batch or the micro-batch")
    elif layout.v != 1:
        why.append(f"v={layout.v} model chunks need schedule='interleaved' (schedule={layout.schedule!r} has 1)")
    n = s // cp                                                         # tokens of a sequence on one GPU
    logits = b * n * cfg.vocab_size / tp * (2 + 4)
    # ZeRO-3 / FSDP gathers each layer's 16-bit parameters before using it, and prefetches the next: two layers
    # whole (of the TP shard) beside the shards, in forward and again in backward (the unsharded gradient of the
    # layer in backward, before its reduce-scatter, is left out)
    # (a MoE block's dense part and its ep rank's experts)
    block = layer_params(cfg) if moe is None else (
        layer_params(cfg) + moe.dense_delta(cfg) + moe.attention_delta(cfg) + moe.expert_params(cfg) // ep)
    gathered = 2 * 2 * block / tp if layout.zero == 3 else 0
    edp = max(1, dp * cp // ep)                                         # expert-data-parallel ranks
    split = {}
    stages = {}                                                         # each stage's memory; the largest counts
    for stage in (("only",) if pp == 1 else ("first", "last")):
        which = "last" if stage == "last" else "first"
        split[stage] = moe_stage_params(cfg, moe, tp, pp, which)
        states = model_state_bytes(split[stage]["dense"], dp * cp, layout.zero, grad_bytes)["total"]
        if split[stage]["experts"]:                                     # the ep rank's experts, ZeRO over edp
            states += model_state_bytes(split[stage]["experts"] / ep, edp, layout.zero, grad_bytes)["total"]
        acts = activation_bytes_per_gpu(cfg, layout, accum, s, which, "2021" if elementwise == "unfused" else "today",
                                        moe)
        parts = dict(model_states=states, activations=acts, logits=0 if stage == "first" else logits,
                     zero3_buffers=gathered, reserve=reserve_gib * GiB)
        parts["total"] = sum(parts.values())
        stages[stage] = parts
    memory_stage = max(stages, key=lambda k: stages[k]["total"])
    memory = stages[memory_stage]
    if memory["total"] > gpu.mem_gb * GiB:
        why.append(f"needs {memory['total'] / GiB:.1f} GiB per GPU ({memory_stage} stage) > {gpu.mem_gb:g} GiB")

    model_flops = step_flops(cfg, global_batch, s, moe)
    # attention core, forward, per sequence and layer: 4 s^2 d, or MLA's (`flops.MLASpec.core_flops_per_token`)
    mla = None if moe is None else moe.mla
    attn = 4 * s * s * cfg.d_model if mla is None else mla.core_flops_per_token(s, training=False) * s
    layer_fwd = 24 * s * cfg.d_model ** 2 + attn
    # executed / model FLOPs: full recomputation runs the forward twice, 2 + 2 + 4 = 8 FLOPs per parameter per
    # token instead of 2 + 4 = 6 (Narayanan et al. 2021, appendix: 96 B s l h^2 with recomputation, 72 without)
    recompute = {"none": 1.0, "selective": 1 + attn / (3 * layer_fwd), "full": 8 / 6}[layout.ckpt]
    compute = model_flops * recompute / (cluster.n_gpus * gpu.bf16_tflops * 1e12 * kernel_efficiency)
    layers = math.ceil(cfg.n_layer / pp)
    # memory-bound kernels: HBM bytes / bandwidth, per layer per micro-batch, for the stage's layers
    acfg = cfg if moe is None else cfg.replace(d_ff=moe.active_d_ff)   # a token's MLP width (MoE: k F + F_s)
    memory_bound = layers * accum * elementwise_bytes(acfg, tp, n, b, layout.ckpt, elementwise) / (gpu.mem_bw_gbs * 1e9)
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
    overlap_dp = layout.overlap in ("dp", "dp+tp")

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
    tp_exposed = max(tp_time - compute, tp_time / tp) if layout.overlap == "dp+tp" and tp > 1 else tp_time
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
    est = Estimate(layout, accum, memory, time, "; ".join(why), memory_stage=memory_stage, not_modelled=not_modelled,
                   exposed=exposed, in_flight=stage_in_flight(layout, accum, "first"), p2p_messages=p2p_messages,
                   p2p_bytes=accum * p2p_messages * act_msg / tp)
    est.tokens_per_s = global_batch * s / time["total"]
    peak = cluster.n_gpus * gpu.bf16_tflops * 1e12 * time["total"]
    est.mfu = model_flops / peak
    est.hfu = model_flops * recompute / peak
    return est


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cfg: ModelConfig, gpu, cluster: Cluster, global_batch: int, seq_len: int | None = None,
         kernel_efficiency: float = 0.4, micro_batches=(1, 2, 4, 8), zeros=(0, 1, 2, 3), ckpts=CKPT,
         reserve_gib: float = 2.0, grad_bytes: int = 4, schedules=("1f1b",), vs=(2, 3, 4), overlaps=("none",),
         elementwise: str = "none", cps=(1,), cp_variants=("ring",), eps=(1,),
         moe: MoESpec | None = None) -> list[Estimate]:
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
    and the experts (`ep_refusals`)."""
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
                                for ep in eps:
                                    layout = Layout(dp, tp, pp, zero, ckpt, b, sch, v, ov, cp, variant, ep)
                                    if ep > 1 and ep_refusals(layout, moe):
                                        continue
                                    rows.append(estimate(cfg, gpu, cluster, layout, global_batch, seq_len,
                                                         kernel_efficiency, reserve_gib, grad_bytes, elementwise,
                                                         moe=moe))
    order = {"feasible": 0, "infeasible": 1, "not modelled": 2}
    return sorted(rows, key=lambda e: (order[e.status], e.time["total"], e.memory["total"]))
