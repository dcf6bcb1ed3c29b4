"""Memory per GPU of a pipeline stage (lesson 08; `course_lib.theory.planner`): parameters per stage, model states
with ZeRO, activations as Korthikanti et al. count them (for the 2021 block and for today's blocks), the
micro-batches a schedule keeps in flight, what context and expert parallelism add, and `stage_memory`, the largest
stage's total. The rules are in the package docstring.
"""

from __future__ import annotations

import math

from course_lib.config import ModelConfig
from course_lib.reference import reference_for
from course_lib.theory import context as cp_theory
from course_lib.theory import pipeline
from course_lib.theory.experts import MoESpec
from course_lib.theory.planner.layouts import GiB, Layout, block_of

__all__ = ["layer_params", "position_params", "stage_params", "model_state_bytes", "layer_activation_bytes",
           "korthikanti_layer_bytes", "layer_kept_bytes", "activation_bytes_per_gpu", "cp_extra_layer_bytes",
           "moe_stage_params", "moe_extra_layer_bytes", "stage_in_flight", "stage_memory"]

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


def layer_kept_bytes(cfg: ModelConfig, tp: int, seq_len: int, micro_batch: int = 1, sp: bool = True,
                     attention: str = "flash", ckpt: str = "none") -> float:
    """Bytes one layer keeps for backward on one GPU under each of Korthikanti et al.'s combinations (2022, table
    2): sequence parallelism on or off, the attention kernel (``"naive"`` keeps the ``a s x s`` scores, softmax
    output and dropout mask, ``5as/(ht)`` sbh; ``"flash"`` keeps none), recomputation none or selective (full is
    the layer input, counted by `activation_bytes_per_gpu`).

    ``"naive"``: their GPT-block count, `korthikanti_layer_bytes` (``sbh (34/t + 5as/(ht))`` with SP, ``sbh (10 +
    24/t + 5as/(ht))`` without; selective drops the scores' term). ``"flash"``: `layer_activation_bytes` (today's
    blocks, SP), and without SP the parts SP shards (the norms' inputs, the gathered norm outputs, the dropout
    masks: Korthikanti's ``10 sbh`` that TP alone replicates) whole on every TP rank; selective frees the kernel's
    log-sum-exp."""
    s, b, t = seq_len, micro_batch, tp
    if attention == "naive":
        return korthikanti_layer_bytes(cfg, t, s, b, sequence_parallel=sp, selective=ckpt == "selective")
    parts = layer_activation_bytes(cfg, t, s, b)
    if not sp:
        for name in ("norms", "gathered", "dropout"):
            parts[name] *= t
    return sum(parts.values()) - (parts["logsumexp"] if ckpt == "selective" else 0)


def activation_bytes_per_gpu(cfg: ModelConfig, layout: Layout, accum: int, seq_len: int | None = None,
                             stage: str = "first", block: str = "today", moe: MoESpec | None = None) -> int:
    """Activations of a pipeline stage, bytes per GPU: the first (``stage="first"``, it holds the most
    micro-batches) or the last (``"last"``, one micro-batch in flight).

    Per layer `layer_kept_bytes` of the layout's block: sequence parallelism and the attention kernel are the
    layout's ``sp`` and ``attention`` where set, else ``block`` says: ``"today"`` (SP, fused attention: Korthikanti
    et al. 2022's count redone for fused attention, SwiGLU, GQA and RMSNorm, `layer_activation_bytes`) or
    ``"2021"`` (Megatron-LM's block of 2021: no SP, attention that keeps its ``a s x s`` scores, Korthikanti et
    al.'s ``sbh (10 + 24/t + 5as/(ht))``). ``ckpt="selective"`` recomputes the attention core as Korthikanti et al.
    do, which frees the scores, softmax output and dropout mask of naive attention (``5as/(ht)`` sbh, 10 sbh of
    their 14.25 for GPT-3 at t = 8). A fused attention kernel never keeps those (it recomputes the scores in its own
    backward), so there selective recomputation frees only the kernel's fp32 log-sum-exp (``4asb/t`` bytes, 0.004
    sbh for GPT-3 at t = 8) and pays for recomputing the attention core: kept in the table to show that it saves
    almost nothing once attention is fused. ``ckpt="full"`` keeps each layer's input, ``2sbh/t`` with SP (``2sbh``
    without: whole on every TP rank), plus one layer's activations while it is recomputed. The stage holds
    `stage_in_flight` micro-batches of ceil(L/pp) layers: under 1F1B and ZB-H1 ``min(pp, m)`` on the first stage
    and one on the last; interleaved 1F1B holds more.

    With context parallelism (``layout.cp > 1``) every count is of the rank's s/cp tokens, and a layer also keeps
    what its variant keeps beyond them (`cp_extra_layer_bytes`; the ring nothing).

    With ``moe`` every layer is counted as a MoE block: a SwiGLU MLP of hidden size k F + F_s
    (`MoESpec.active_d_ff`) plus `moe_extra_layer_bytes`.
    """
    if block not in ("today", "2021"):
        raise ValueError(f"block={block!r}: 'today' or '2021'")
    sp, attention = block_of(layout, "unfused" if block == "2021" else "fused")
    s = cfg.seq_len if seq_len is None else seq_len
    if moe is not None:
        cfg = cfg.replace(d_ff=moe.active_d_ff)
    b, h, t = layout.micro_batch, cfg.d_model, layout.tp
    layers = math.ceil(cfg.n_layer / layout.pp)
    full_s, s = s, s // layout.cp                                       # the rank's s/cp tokens
    extra = cp_extra_layer_bytes(cfg, layout, full_s) + moe_extra_layer_bytes(cfg, moe, t, s, b)
    full_layer = layer_kept_bytes(cfg, t, s, b, sp, attention) + extra
    if layout.ckpt == "full":                                           # each layer's input
        per_layer = 2 * s * b * h / (t if sp else 1)
    else:
        per_layer = layer_kept_bytes(cfg, t, s, b, sp, attention, layout.ckpt) + extra
    in_flight = stage_in_flight(layout, accum, stage)
    recomputed = full_layer if layout.ckpt == "full" else 0             # the layer being recomputed
    return int(layers * per_layer * in_flight + recomputed)


def cp_extra_layer_bytes(cfg: ModelConfig, layout: Layout, seq_len: int) -> int:
    """Bytes a layer keeps on one GPU beyond its own s/cp tokens under the layout's CP variant, in bf16, of the
    rank's 1/tp of the heads (`context.extra_activation_bytes`: all-gather 2 b s kv_dim / tp, the whole sequence's
    K/V; Ulysses b (s/cp) h / tp; ring 0). ``kv_dim = n_kv_head x head_dim`` (GQA)."""
    t = layout.tp
    return cp_theory.extra_activation_bytes(layout.cp_variant, layout.micro_batch, seq_len, cfg.d_model // t,
                                            layout.cp, 2, kv_dim=cfg.n_kv_head * cfg.head_dim // t)



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



def stage_in_flight(layout: Layout, accum: int, stage: str = "first") -> float:
    """Micro-batches (of a whole stage's layers) that a stage holds at its peak under the layout's schedule:
    `pipeline.peak_microbatches_in_flight` for the first rank (``stage="first"``) or the last: 1F1B and ZB-H1
    ``min(pp - rank, m)``, interleaved 1F1B `pipeline.interleaved_in_flight` (``p + (p - 1)/v`` on the first rank
    when m > p); 1 without a pipeline."""
    if layout.pp == 1:
        return 1
    rank = 0 if stage == "first" else layout.pp - 1
    return pipeline.peak_microbatches_in_flight(layout.schedule, layout.pp, accum, rank, layout.v)



@reference_for("08-stage-memory")
def stage_memory(cfg: ModelConfig, layout: Layout, accum: int, seq_len: int, moe: MoESpec | None = None,
                 grad_bytes: int = 4, reserve_gib: float = 2.0, block: str = "today") -> tuple[dict, str, dict]:
    """(memory of the stage that needs the most, bytes by part and ``total``; its name, "only", "first" or "last";
    each stage's parameters, `moe_stage_params`). Parts: model_states, activations, logits (the last stage),
    zero3_buffers, reserve."""
    s, tp, pp, b, cp, ep, dp = seq_len, layout.tp, layout.pp, layout.micro_batch, layout.cp, layout.ep, layout.dp
    n = s // cp                                                         # tokens of a sequence on one GPU
    logits = b * n * cfg.vocab_size / tp * (2 + 4)
    # ZeRO-3 / FSDP gathers each layer's 16-bit parameters before using it, and prefetches the next: two layers
    # whole (of the TP shard) beside the shards, in forward and again in backward (the unsharded gradient of the
    # layer in backward, before its reduce-scatter, is left out)
    # (a MoE block's dense part and its ep rank's experts)
    one_block = layer_params(cfg) if moe is None else (
        layer_params(cfg) + moe.dense_delta(cfg) + moe.attention_delta(cfg) + moe.expert_params(cfg) // ep)
    gathered = 2 * 2 * one_block / tp if layout.zero == 3 else 0
    edp = max(1, dp * cp // ep)                                         # expert-data-parallel ranks
    split = {}
    stages = {}                                                         # each stage's memory; the largest counts
    for stage in (("only",) if pp == 1 else ("first", "last")):
        which = "last" if stage == "last" else "first"
        split[stage] = moe_stage_params(cfg, moe, tp, pp, which)
        states = model_state_bytes(split[stage]["dense"], dp * cp, layout.zero, grad_bytes)["total"]
        if split[stage]["experts"]:                                     # the ep rank's experts, ZeRO over edp
            states += model_state_bytes(split[stage]["experts"] / ep, edp, layout.zero, grad_bytes)["total"]
        acts = activation_bytes_per_gpu(cfg, layout, accum, s, which, block, moe)
        parts = dict(model_states=states, activations=acts, logits=0 if stage == "first" else logits,
                     zero3_buffers=gathered, reserve=reserve_gib * GiB)
        parts["total"] = sum(parts.values())
        stages[stage] = parts
    memory_stage = max(stages, key=lambda k: stages[k]["total"])
    memory = stages[memory_stage]
    return memory, memory_stage, split
