"""The 3D-parallelism planner (lesson 08): every layout of a model on a cluster, its memory per GPU and step time.

    rows = plan(get_preset("gpt3-175b"), GPU_SPECS["A100"], Cluster("128 x 8 A100", 128, 8, 25.0), global_batch=1536)
    best = [r for r in rows if r.feasible][:5]

A layout is (dp, tp, pp, ZeRO stage, activation checkpointing, micro-batch); dp x tp x pp = the cluster's GPUs,
ranks ordered as `course_lib.dist.ProcessGrid` orders them (TP innermost, then DP, then PP), so a dimension's group
stays inside a node when ``stride x size <= gpus_per_node``. For each layout, by formula (mixed precision bf16 with
Adam, Megatron-style TP with sequence parallelism, 1F1B pipeline):

- **memory per GPU**: model states of the largest stage's TP shard, sharded over dp as ZeRO says
  (`memory.zero_model_state_bytes`); activations per layer in 16-bit counted as Korthikanti et al. (2022) do, for
  what today's blocks keep (`layer_activation_bytes`: fused attention, GELU or SwiGLU, GQA, LayerNorm or RMSNorm;
  GPT-3 175B at t = 8: ``4.0 sbh`` where the paper's ``sbh (34/t + 5as/(ht))`` gives ``14.25 sbh``), ``2sbh/t`` per
  layer held with full recomputation plus one layer's activations while it is recomputed, for the ``min(pp, m)``
  micro-batches that 1F1B's first stage holds; the last stage's logits (bf16 + their fp32 log-softmax,
  ``b s V / t``); with ZeRO-3, two layers' gathered 16-bit parameters (the one in use, the one prefetched); a
  reserve for the CUDA context, NCCL's buffers and fragmentation (``reserve_gb``, an assumption).
- **step time**: compute = model FLOPs x recomputation factor / (GPUs x peak x MFU) (``mfu`` assumed); the 1F1B
  bubble ``(pp - 1) / m`` of it; TP's 4 all-reduce-sized collectives per layer per micro-batch of ``b s h`` bf16 (6
  with full recomputation); PP's two activation messages per micro-batch; DP's gradient all-reduce (ZeRO-1/2: the
  same volume as reduce-scatter + all-gather; ZeRO-3: an all-gather of the parameters in forward and in backward
  and a reduce-scatter, per micro-batch) on the alpha-beta model of lesson 01. No overlap of communication with
  compute: the estimate is an upper bound, and ranks layouts by what they must move.

Infeasible layouts come with the reason (memory, divisibility, a pipeline with ZeRO-2/3, which Megatron and
DeepSpeed refuse). What it leaves out, so that a published layout may rank lower than the paper's: overlap of DP
and PP communication with compute, interleaved schedules, kernel efficiency that changes with the matmul sizes
(TP makes them smaller), and the memory allocator's behaviour.
"""

from __future__ import annotations

import dataclasses
import math

from course_lib.config import ModelConfig
from course_lib.theory import comm, flops
from course_lib.theory.memory import zero_model_state_bytes

__all__ = ["Cluster", "Layout", "Estimate", "estimate", "plan", "link", "layer_params", "stage_params",
           "layer_activation_bytes", "activation_bytes_per_gpu", "CKPT"]

CKPT = ("none", "selective", "full")
GB = 1e9


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

    def label(self) -> str:
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero} ckpt={self.ckpt} "
                f"mb{self.micro_batch}")


@dataclasses.dataclass
class Estimate:
    """One layout's memory per GPU (bytes) and step time (s); ``why`` says why it is infeasible ('' if it fits)."""

    layout: Layout
    accum: int                         # micro-batches per DP rank per step (m)
    memory: dict                       # model_states, activations, logits, reserve, total
    time: dict                         # compute, bubble, tp, pp, dp, total
    why: str = ""
    tokens_per_s: float = 0.0
    mfu: float = 0.0                   # model FLOPs / (GPUs x peak x step time)

    @property
    def feasible(self) -> bool:
        return not self.why


# ----------------------------------------------------------------------------------------------- parameters

def layer_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (`ModelConfig.num_params` without embeddings, head and final norm)."""
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    norm_f = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    return (cfg.num_params(include_embeddings=False) - head - norm_f) // cfg.n_layer


def stage_params(cfg: ModelConfig, tp: int, pp: int) -> int:
    """Parameters on one GPU of the largest stage before ZeRO: ceil(L/pp) blocks / tp, plus the embedding
    (first stage) or the head (last stage), split along the vocabulary over tp. Replicated norms are counted as
    split (a < 0.1 % difference at these sizes)."""
    blocks = math.ceil(cfg.n_layer / pp) * layer_params(cfg)
    vocab = cfg.vocab_size * cfg.d_model
    ends = vocab if pp > 1 else (vocab if cfg.tie_embeddings else 2 * vocab)
    return (blocks + ends) // tp


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

    GPT-3 175B at t = 8: ``32 sbh/t + 4asb/t`` = 4.00 sbh, against Korthikanti's 14.25 sbh (34 sbh/t without the
    scores: their two dropout masks). Left out (< 0.1 %): a norm's mean and 1/std per token, RoPE's cos and sin
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


def activation_bytes_per_gpu(cfg: ModelConfig, layout: Layout, accum: int, seq_len: int | None = None) -> int:
    """Activations of the first pipeline stage (it holds the most micro-batches), bytes per GPU.

    Per layer `layer_activation_bytes` (Korthikanti et al. 2022's count redone for fused attention, SwiGLU, GQA and
    RMSNorm). ``ckpt="selective"`` recomputes the attention core as Korthikanti et al. do: with a fused kernel that
    frees only its log-sum-exp (the kernel already recomputes the scores in backward).
    ``ckpt="full"`` keeps each layer's input, ``2sbh/t``, plus one layer's activations while it is recomputed. 1F1B's
    first stage holds ``min(pp, m)`` micro-batches of ceil(L/pp) layers.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    b, h, t = layout.micro_batch, cfg.d_model, layout.tp
    layers = math.ceil(cfg.n_layer / layout.pp)
    parts = layer_activation_bytes(cfg, t, s, b)
    full_layer = sum(parts.values())
    if layout.ckpt == "none":
        per_mb = layers * full_layer
    elif layout.ckpt == "selective":
        per_mb = layers * (full_layer - parts["logsumexp"])
    else:                                                               # full: each layer's input, 2sbh/t
        per_mb = layers * 2 * s * b * h / t
    in_flight = min(layout.pp, accum) if layout.pp > 1 else 1
    extra = full_layer if layout.ckpt == "full" else 0                  # the layer being recomputed
    return int(per_mb * in_flight + extra)


# ------------------------------------------------------------------------------------------------- estimate

def link(cluster: Cluster, gpu, stride: int, size: int) -> tuple[float, float]:
    """(alpha in s, bandwidth in bytes/s) of a group of ``size`` ranks ``stride`` apart."""
    if size == 1 or stride * size <= cluster.gpus_per_node or cluster.inter_gbs_per_gpu is None:
        return cluster.alpha_us * 1e-6, gpu.link_gbs * 1e9
    return cluster.inter_alpha_us * 1e-6, min(gpu.link_gbs, cluster.inter_gbs_per_gpu) * 1e9


def estimate(cfg: ModelConfig, gpu, cluster: Cluster, layout: Layout, global_batch: int,
             seq_len: int | None = None, mfu: float = 0.4, reserve_gb: float = 2.0) -> Estimate:
    """Memory per GPU and step time of one layout (see the module docstring). ``gpu``: a `measure.GPUSpec`."""
    s = cfg.seq_len if seq_len is None else seq_len
    dp, tp, pp, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    why = []
    if dp * tp * pp != cluster.n_gpus:
        why.append(f"dp x tp x pp = {dp * tp * pp}, not the cluster's {cluster.n_gpus} GPUs")
    if cfg.n_head % tp or cfg.d_ff % tp:
        why.append(f"tp={tp} does not divide n_head={cfg.n_head} and d_ff={cfg.d_ff}")
    if pp > cfg.n_layer:
        why.append(f"pp={pp} > {cfg.n_layer} layers")
    if global_batch % (dp * b):
        why.append(f"global batch {global_batch} is not a multiple of dp x micro-batch = {dp * b}")
    if pp > 1 and layout.zero >= 2:
        why.append(f"ZeRO-{layout.zero} with a pipeline: Megatron-LM and DeepSpeed refuse it (gradients are "
                   f"accumulated over micro-batches)")
    if layout.ckpt not in CKPT:
        raise ValueError(f"ckpt={layout.ckpt!r}: choose one of {', '.join(CKPT)}")
    accum = max(1, global_batch // (dp * b))
    P_gpu = stage_params(cfg, tp, pp)
    states = zero_model_state_bytes(P_gpu, dp, layout.zero)["total"]
    acts = activation_bytes_per_gpu(cfg, layout, accum, s)
    logits = b * s * cfg.vocab_size / tp * (2 + 4)
    # ZeRO-3 / FSDP gathers each layer's 16-bit parameters before using it, and prefetches the next: two layers
    # whole (of the TP shard) beside the shards, in forward and again in backward (the unsharded gradient of the
    # layer in backward, before its reduce-scatter, is left out)
    gathered = 2 * 2 * layer_params(cfg) / tp if layout.zero == 3 else 0
    memory = dict(model_states=states, activations=acts, logits=logits, zero3_buffers=gathered,
                  reserve=reserve_gb * GB)
    memory["total"] = sum(memory.values())
    if memory["total"] > gpu.mem_gb * GB:
        why.append(f"needs {memory['total'] / GB:.1f} GB per GPU > {gpu.mem_gb:g} GB")

    model_flops = flops.step_flops(cfg, global_batch, s)
    attn = 4 * s * s * cfg.d_model                                      # attention core, forward, per sequence
    layer_fwd = 24 * s * cfg.d_model ** 2 + attn
    recompute = {"none": 1.0, "selective": 1 + attn / (3 * layer_fwd), "full": 4 / 3}[layout.ckpt]
    compute = model_flops * recompute / (cluster.n_gpus * gpu.bf16_tflops * 1e12 * mfu)
    bubble = compute * (pp - 1) / accum
    act_msg = b * s * cfg.d_model * 2                                   # bf16 (b, s, h)
    layers = math.ceil(cfg.n_layer / pp)
    alpha, bw = link(cluster, gpu, 1, tp)
    per_ar = comm.collective_time("all_reduce", act_msg, tp, alpha, bw)
    tp_time = layers * accum * (6 if layout.ckpt == "full" else 4) * per_ar
    alpha, bw = link(cluster, gpu, tp * dp, pp)
    pp_time = accum * 2 * (alpha + act_msg / tp / bw) if pp > 1 else 0.0
    alpha, bw = link(cluster, gpu, tp, dp)
    grads = 2 * P_gpu
    if layout.zero == 3:
        dp_time = accum * (2 * comm.collective_time("all_gather", grads, dp, alpha, bw)
                           + comm.collective_time("reduce_scatter", grads, dp, alpha, bw))
    else:
        dp_time = comm.collective_time("all_reduce", grads, dp, alpha, bw)
    time = dict(compute=compute, bubble=bubble, tp=tp_time, pp=pp_time, dp=dp_time)
    time["total"] = sum(time.values())
    est = Estimate(layout, accum, memory, time, "; ".join(why))
    est.tokens_per_s = global_batch * s / time["total"]
    est.mfu = model_flops / (cluster.n_gpus * gpu.bf16_tflops * 1e12 * time["total"])
    return est


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cfg: ModelConfig, gpu, cluster: Cluster, global_batch: int, seq_len: int | None = None,
         mfu: float = 0.4, micro_batches=(1, 2, 4, 8), zeros=(0, 1, 2, 3), ckpts=CKPT,
         reserve_gb: float = 2.0) -> list[Estimate]:
    """Every layout (tp a divisor of a node's GPUs, pp any divisor of the rest, dp what remains), feasible ones
    first by step time, then the infeasible ones with their reasons.

    pp is not only a power of two: BLOOM ran pp=12 on 384 GPUs (`lessons.l08_three_d.published`), and on
    3 x 2^k GPUs with a batch of 2^k sequences every power-of-two pp leaves a dp that does not divide the batch."""
    n = cluster.n_gpus
    rows = []
    for tp in [d for d in _divisors(min(cluster.gpus_per_node, n)) if n % d == 0]:
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            for zero in zeros:
                for ckpt in ckpts:
                    for b in micro_batches:
                        rows.append(estimate(cfg, gpu, cluster, Layout(dp, tp, pp, zero, ckpt, b), global_batch,
                                             seq_len, mfu, reserve_gb))
    return sorted(rows, key=lambda e: (not e.feasible, e.time["total"], e.memory["total"]))
