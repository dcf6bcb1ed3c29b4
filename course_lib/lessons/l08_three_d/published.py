"""The planner against published training runs, and the seed's two tables re-derived from it (lesson 08).

- :data:`PUBLISHED`: layouts of real runs as data (Megatron-LM's GPT-3 175B, BLOOM-176B, Llama 3 405B at 8K and 16K
  GPUs), each with its cluster, batch, reported throughput, gradient dtype and source (table or section, quoted in
  ``note``). :func:`check_published` plans the paper's cluster and batch with `theory.planner.plan` and returns
  whether the published layout fits, its rank, the top 5 and the planner's MFU beside the reported one;
  ``Check.why_not`` says what the planner leaves out for that run, with the planner's numbers filled in.
- :func:`method_by_size`: which strategy families fit 1B-1T GPT models on 80 GiB GPUs (seed: data parallel < 10B,
  ZeRO 10-100B, tensor and pipeline parallel > 100B, 3D > 1T).
- :func:`efficiency_estimates`: each seed method's scaling efficiency on a stated cluster, by the planner's
  formulas, beside the seed's range (seed: DP 85-95 %, tensor 75-85 %, PP 80-90 %, ZeRO-2 80-90 %, ZeRO-3 70-80 %,
  FSDP 85-95 %).

    for c in check_all():
        print(c.run.name, c.feasible, c.shape_rank, f"{c.planner_mfu:.0%} vs {c.reported_mfu:.0%}")

- :data:`WEAK_SCALING` (Narayanan et al. 2021's table 1, each row's micro-batch, schedule and DDP read from the
  paper's artifact) and :data:`THROUGHPUT_RUNS` (those plus :data:`PUBLISHED`): :func:`throughput_table` calibrates
  the A100's matmul efficiency (an HFU) on the ONE row :data:`CALIBRATION` and predicts every other run's TFLOP/s per
  GPU with it held fixed, in the source's FLOP count, beside a constant baseline (the calibration row's fraction of
  peak); :func:`throughput_text` prints the table `benchmarks/bench_planner.py` prints.
  :func:`interleaving_gain`: the planner's gain of interleaved 1F1B over 1F1B on torchtitan's 405B layout beside the
  reported 100 -> 128 tokens/s per GPU.
- :data:`LONG_CONTEXT` (issue 31): Llama 3 405B's 128K row, context parallelism 16 (all-gather), kept out of the two
  tables above so that lesson 08's outputs stay as they are; :func:`long_context` places its shape among the
  planner's layouts with cp (`planner.plan(cps=...)`) and says why it ranks where it does; the benchmark adds it to
  its throughput table (not scored).

:func:`check_published` runs the planner as a learner first meets it (1F1B, no overlap, matmuls only, efficiency
0.4): its MFU is then a lower bound, and a published layout that relies on what that leaves out ranks lower than the
paper's result suggests. :func:`throughput_table` prices each run as its software ran it (schedule, overlap, the
memory-bound kernels of its block).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

from course_lib.config import ModelConfig, get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory import flops
from course_lib.theory.planner import (CKPT, CP_VARIANTS, SCHEDULES, Cluster, Estimate, GiB, Layout, MoESpec,
                                       estimate, korthikanti_layer_bytes, plan, stage_in_flight, step_flops)

__all__ = ["Source", "PublishedRun", "PUBLISHED", "WEAK_SCALING", "THROUGHPUT_RUNS", "CALIBRATION", "TORCHTITAN_405B",
           "LONG_CONTEXT", "long_context", "long_context_text", "DEEPSEEK_V3", "MOE_RUNS", "moe_run", "moe_run_text",
           "interleaving_gain", "layout_of", "source_flops", "predict", "predicted_tflops", "calibrate", "Throughput",
           "rank_among_layouts", "throughput_table", "throughput_summary", "throughput_text", "Check",
           "check_published", "check_all", "published_table",
           "LEFT_OUT", "SIZES", "family", "method_by_size", "method_table", "SEED_EFFICIENCY",
           "efficiency_estimates", "efficiency_table"]

# What the planner leaves out (its module docstring); every why_not names at least one of them.
# (The planner now has interleaved 1F1B and ZB-H1, and overlap of DP and TP with compute: `planner.estimate`.)
LEFT_OUT = ("uneven stages", "scatter/gather", "selective recomputation", "sequence parallelism", "kernel efficiency",
            "FSDP with a pipeline", "activation count")


@dataclasses.dataclass(frozen=True)
class Source:
    title: str
    authors: str
    year: int
    arxiv: str
    where: str                          # table / section the numbers come from


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published run. ``zero``, ``ckpt``, ``micro_batch``: None where the source does not state them in the
    planner's terms (the check then takes the planner's best feasible choice for the published dp x tp x pp).
    ``reported_tflops``: per GPU, as the source counts them; ``counts_recompute``: True when that count includes the
    recomputed forward (a hardware FLOPs count, 8 FLOPs per parameter per token where the model does 6), so that
    model FLOPs are 6/8 = 3/4 of it. ``grad_bytes``: the gradient dtype the check gives the planner, with its
    source in ``note``."""

    name: str
    preset: str
    gpu: str                            # key of hardware.GPU_SPECS
    nodes: int
    gpus_per_node: int
    inter_gbs_per_gpu: float            # GB/s per GPU between nodes, one way
    network: str
    global_batch: int                   # sequences
    seq_len: int
    dp: int
    tp: int
    pp: int
    zero: int | None
    ckpt: str | None
    micro_batch: int | None
    schedule: str
    reported_tflops: float
    counts_recompute: bool
    stated_mfu: float                   # fraction of peak as the source states it
    grad_bytes: int                     # 4: fp32 gradients, 2: bf16 (what the check passes to the planner)
    source: Source
    note: str                           # what was checked where, what was not
    why_not: str                        # what the planner leaves out that this run relies on ({...}: computed)
    alibi: bool = False                 # ALiBi positions: no position table (the preset counts a learned one)
    pipeline: str = "1f1b"              # the schedule in the planner's terms: "1f1b", "interleaved", "zb-h1"
    v: int = 1                          # model chunks per rank (interleaved)
    overlap: str = "none"               # what the run's software overlapped: "none", "dp", "dp+tp"
    kernels: str = "unfused"            # its elementwise kernels: "unfused" (2021 Megatron block) or "fused"
    flop_count: str = "megatron"        # how the source counts FLOPs: "megatron" (96 B s l h^2 (...)) or "model"
    scored: bool = True                 # False: shown, but out of the error summary (``note`` says why)
    model: ModelConfig | None = None    # the model when it is not a preset (Narayanan et al.'s table 1 shapes)
    cp: int = 1                         # context-parallel ranks (world = dp x tp x pp x cp)
    cp_variant: str = "ring"            # "ring", "all_gather" (Llama 3) or "ulysses" (`planner.CP_VARIANTS`)
    moe: MoESpec | None = None          # the mixture of experts (None: dense)
    ep: int = 1                         # expert-parallel ranks, borrowed from dp (x cp)

    @property
    def config(self) -> ModelConfig:
        """The model (or the preset); with ALiBi, no position parameters (like RoPE: `planner.position_params`
        counts none)."""
        cfg = self.model if self.model is not None else get_preset(self.preset)
        return cfg.replace(pos="rope") if self.alibi else cfg

    @property
    def cluster(self) -> Cluster:
        return Cluster(f"{self.nodes} x {self.gpus_per_node} {self.gpu}, {self.network}", self.nodes,
                       self.gpus_per_node, self.inter_gbs_per_gpu)

    @property
    def reported_mfu(self) -> float:
        """Model FLOPs utilisation of the reported throughput (recomputation taken out where it was counted)."""
        return self.reported_tflops * (0.75 if self.counts_recompute else 1.0) / GPU_SPECS[self.gpu].bf16_tflops


NARAYANAN = Source("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
                   "D. Narayanan, M. Shoeybi, J. Casper, P. LeGresley, M. Patwary, V. Korthikanti, D. Vainbrand, "
                   "P. Kashinkunti, J. Bernauer, B. Catanzaro, A. Phanishayee, M. Zaharia", 2021, "2104.04473",
                   "table 2 (PTD-P, 174.6B, 1,536 GPUs), section 5.1 and the appendix's FLOP count")
BLOOM = Source("BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", "BigScience Workshop (T. Le Scao, "
               "A. Fan, C. Akiki, et al.)", 2022, "2211.05100", "section 3.4 (engineering)")
LLAMA3 = Source("The Llama 3 Herd of Models", "Llama Team, AI @ Meta (A. Grattafiori, A. Dubey, et al.)", 2024,
                "2407.21783", "table 4, sections 3.3.1 and 3.3.2")

# Every {name} in a why_not is computed by the planner when the run is checked (`Check.why_not`, `facts`).
_LLAMA3_WHY = (
    "Llama 3 trained 8K sequences without activation checkpointing (section 3.3.2: \"we could pre-train Llama 3 on "
    "sequences of 8K tokens without activation checkpointing\") after freeing each stage's input and output tensors "
    "and taking one layer off the first and the last stage. The planner has none of that: under plain 1F1B the "
    "first stage holds {in_flight} micro-batches of {layers} layers, and without recomputation its count (TP + SP "
    "for Llama's blocks, checked against PyTorch's memory tracker) needs {none_gib:.0f} GiB per GPU > {capacity:g} "
    "GiB, so its best row of this shape is {shape_best} ({shape_best_gib:.0f} GiB). Its interleaved schedule "
    "does not fit the planner's (Megatron-LM's) rule that v divides the layers per stage: 126 layers on 16 stages "
    "are uneven stages (Llama 3 took a layer off the first and the last), so 1F1B stands in, and with {m} "
    "micro-batches per DP rank its bubble (pp-1)/m is {bubble:.0%} of the compute where Llama 3's (PP-1)/(V M) "
    "divides it by V. FSDP with a pipeline is not modelled (DeepSpeed and Megatron refuse it; torchtitan does it): "
    "ZeRO-1 stands in. Its compute runs at the assumed {kernel_efficiency:.0%} kernel efficiency (an HFU; "
    "`throughput_table` calibrates it on one A100 row instead). Not scored in the published-throughput table.")

PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Megatron-LM GPT-3 175B", "gpt3-175b", "A100", 192, 8, 25.0, "8 x 200 Gb/s HDR InfiniBand per node",
        global_batch=1536, seq_len=2048, dp=16, tp=8, pp=12, zero=0, ckpt="full", micro_batch=1,
        schedule="1F1B (table 2 does not say whether interleaved)", reported_tflops=141.0, counts_recompute=True,
        stated_mfu=141 / 312, grad_bytes=4, source=NARAYANAN, pipeline="1f1b", overlap="none", kernels="unfused",
        note="Table 2, PTD-P row of the 174.6B model on 1,536 GPUs: model-parallel size 96, batch 1,536, micro-batch "
             "1, 141 TFLOP/s per GPU (23 days for 300B tokens); 96 = tensor 8 x pipeline 12 as "
             "third-party reproductions (cli99/llm-analysis, examples/megatron-lm/run_train.sh: --tp_size 8 "
             "--pp_size 12 --total_num_gpus 1536 --achieved_tflops 141) read it. Read here from a transcription of "
             "the table, not from the paper's PDF; so were section 5.1's '1,024 A100s at 140 TFLOP/s: 34 days' and "
             "the appendix's FLOP count, 96 B s l h^2 (...) with activation recomputation (72 without), so that the "
             "141 TFLOP/s count the recomputed forward. Table 1 has no 175B row (its 145.6B row: t 8, p 8, 1,536 "
             "GPUs, 148 TFLOP/s). 192 nodes of 8 A100 80GB with 8 x 200 Gb/s HDR InfiniBand each (section 5). "
             "ZeRO-0: data parallelism all-reduces gradients (our reading; Megatron-LM's distributed optimizer came "
             "later). Gradients: fp32 assumed (Megatron-LM's main gradients; the paper does not say). Vocabulary "
             "51,200 in the paper, 50,257 in the preset. Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh "
             "(tp 8, pp 16, micro-batch 1, batch 1,536) publishes no throughput and is not this run.",
        why_not="The paper's row recomputes every layer; the planner's best row of this dp x tp x pp is {shape_best} "
                "({shape_best_gib:.0f} GiB per GPU), because it counts sequence parallelism (Korthikanti et al. "
                "2022), which Megatron-LM did not have in 2021. Without it a layer keeps sbh (10 + 24/t + 5as/(ht)) "
                "= {no_sp_sbh:.0f} sbh = {no_sp_layer_gib:.2f} GiB per micro-batch (Korthikanti et al., table 2): "
                "x {layers} layers x {in_flight} micro-batches in flight = {no_sp_acts_gib:.0f} GiB, plus "
                "{states_gib:.0f} GiB of ZeRO-0 model states and the reserve: {no_sp_total_gib:.0f} GiB > "
                "{capacity:g} GiB, so full recomputation was needed then. Table 2 does not say whether this run "
                "interleaved: priced as 1F1B (the planner's interleaved v = 2 would halve the bubble, (p-1)/(v m)), "
                "with uneven stages (the first holds the embedding, the last the head) left out."),
    PublishedRun(
        "BLOOM-176B", "bloom-176b", "A100", 48, 8, 6.25, "4 x 100 Gb/s Omni-Path per node",
        global_batch=2048, seq_len=2048, dp=8, tp=4, pp=12, zero=1, ckpt="full", micro_batch=2,
        schedule="1F1B (DeepSpeed pipeline engine)", reported_tflops=150.0, counts_recompute=True,
        stated_mfu=150 / 312, grad_bytes=4, source=BLOOM, alibi=True, pipeline="1f1b", overlap="none",
        kernels="unfused",
        note="Re-checked against bigscience-workshop/bigscience train/tr11-176B-ml (README.md and "
             "tr11-176B-ml.slurm): TP 4, PP 12, DP 8, micro-batch 2, global batch 2,048, seq 2,048, "
             "--checkpoint-activations, bf16 with DeepSpeed's BF16_Optimizer (its own ZeRO stage 1; it accumulates "
             "gradients in fp32 buffers, grad_bytes 4), 48 nodes of 8 A100 80GB, 4 Omni-Path links per node; the "
             "README counts TFLOP/s with the recomputed forward (4 x 2 coefficient). 'Training throughput: about "
             "150 TFLOPs' is BigScience's model page (bigscience.notion.site, BigScience 176B Model); GENCI's news "
             "release gives 156 TFLOP/s sustained (50 % of peak). The paper's own figure (section 3.4) and the 100 "
             "Gb/s per Omni-Path link are not re-checked here. ALiBi positions: no position table.",
        why_not="The dp x tp x pp ranks {shape_rank} among the planner's shapes, the exact row (full recomputation) "
                "{rank} among its rows: the planner's best row of this shape is {shape_best} ({shape_best_gib:.0f} "
                "GiB per GPU), because it counts sequence parallelism (Korthikanti et al. 2022), which BLOOM's "
                "Megatron-DeepSpeed fork did not have (without it, this layout keeps {no_sp_total_gib:.0f} GiB per "
                "GPU with no recomputation). Its predicted MFU stays below the reported because compute runs at the "
                "assumed {kernel_efficiency:.0%} kernel efficiency while BLOOM's 150 TFLOP/s, which count the "
                "recomputed forward, are {stated_mfu:.0%} of peak; DeepSpeed's pipeline engine overlaps no DP "
                "communication, as the planner prices it (overlap='none')."),
    PublishedRun(
        "Llama 3 405B, 16K GPUs", "llama3-405b", "H100", 2048, 8, 50.0, "400 Gb/s RoCE per GPU",
        global_batch=2048, seq_len=8192, dp=128, tp=8, pp=16, zero=None, ckpt=None, micro_batch=None,
        schedule="interleaved 1F1B (flexible number of micro-batches)", reported_tflops=400.0,
        counts_recompute=False, stated_mfu=0.41, grad_bytes=4, source=LLAMA3, overlap="dp", kernels="fused",
        flop_count="model", scored=False,
        note="Table 4, row 2: 16,384 GPUs, TP 8, CP 1, PP 16, DP 128, sequence 8,192, batch size/DP 16, 16M tokens "
             "per batch (2,048 sequences), 400 TFLOP/s per GPU, 41 % BF16 MFU. Section 3.3.1: H100 80GB HBM3, "
             "eight per server on NVLink, RoCE with 400 Gbps between GPUs. Section 3.3.2: FSDP that shards "
             "optimizer states and gradients but keeps the parameters after the forward; 'FP32 gradient "
             "accumulation ... and also reduce-scatter gradients in FP32' (grad_bytes 4); no activation "
             "checkpointing at 8K tokens; an interleaved schedule with bubble (PP-1)/(V*M); parallelism ordered "
             "[TP, CP, PP, DP] (DP outermost; the planner puts PP outermost, both cross nodes here). Read from a "
             "transcription of the paper (arXiv 2407.21783).",
        why_not=_LLAMA3_WHY),
    PublishedRun(
        "Llama 3 405B, 8K GPUs", "llama3-405b", "H100", 1024, 8, 50.0, "400 Gb/s RoCE per GPU",
        global_batch=2048, seq_len=8192, dp=64, tp=8, pp=16, zero=None, ckpt=None, micro_batch=None,
        schedule="interleaved 1F1B (flexible number of micro-batches)", reported_tflops=430.0,
        counts_recompute=False, stated_mfu=0.43, grad_bytes=4, source=LLAMA3, overlap="dp", kernels="fused",
        flop_count="model", scored=False,
        note="Table 4, row 1: 8,192 GPUs, TP 8, CP 1, PP 16, DP 64, sequence 8,192, batch size/DP 32, 16M tokens, "
             "430 TFLOP/s per GPU, 43 % BF16 MFU; cluster, FSDP, fp32 gradients (grad_bytes 4), no activation "
             "checkpointing and the schedule as the 16K row.",
        why_not=_LLAMA3_WHY),
)


# Llama 3's long-context row (issue 31): context parallelism 16. Not in PUBLISHED nor THROUGHPUT_RUNS (lesson 08's
# tables stay as they are); benchmarks/bench_planner.py adds it to its table and prints `long_context_text`.
LLAMA3_128K = PublishedRun(
    "Llama 3 405B, 128K context", "llama3-405b", "H100", 2048, 8, 50.0, "400 Gb/s RoCE per GPU",
    global_batch=128, seq_len=131072, dp=8, tp=8, pp=16, zero=None, ckpt=None, micro_batch=None,
    schedule="interleaved 1F1B (flexible number of micro-batches)", reported_tflops=380.0,
    counts_recompute=False, stated_mfu=0.38, grad_bytes=4, source=LLAMA3, overlap="dp", kernels="fused",
    flop_count="model", scored=False, cp=16, cp_variant="all_gather",
    note="Table 4, row 3: 16,384 GPUs, TP 8, CP 16, PP 16, DP printed as 4 or 8 (see below), sequence 131,072, batch size/DP 16, "
         "16M tokens per batch, 380 TFLOP/s per GPU, 38 % BF16 MFU (380 / 989.4 = 38.4 %). DP is printed 4 in some "
         "versions (the arXiv HTML; transcriptions of the v3 PDF print 8); 4 contradicts the row's own GPUs and tokens: 8 x 16 x 16 x 4 = 8,192 GPUs, not 16,384, and 4 x 16 = 64 "
         "sequences of 131,072 = 8.4M tokens, not 16M. Both give DP 8 (16,384 / (8 x 16 x 16); 8 x 16 = 128 "
         "sequences of 131,072 = 16,777,216 tokens, as the 8K rows' 2,048 x 8,192), which the course uses, derived. "
         "The GPUs, TP, CP, PP, tokens per batch and TFLOP/s agree with a second transcription (P. Balaji's SC'24 "
         "slide as glennklockwood.com/garden/llama-3.1 quotes it). Section 3.3.2: context parallelism that all-gathers K and V "
         "and attends the local queries (cp_variant 'all_gather'), ranks ordered [TP, CP, PP, DP]. Cluster, FSDP "
         "(ZeRO-1 stands in), fp32 gradients (grad_bytes 4) and schedule as the 8K rows; the paper does not say "
         "whether the 128K stage checkpoints activations (ckpt unstated: the throughput row prices none, as the 8K "
         "rows; `long_context` takes the planner's best feasible choice of the shape). Read from a transcription of "
         "the paper (arXiv 2407.21783), as the 8K rows.",
    why_not="The published shape fits with {shape_best} ({shape_best_gib:.0f} GiB per GPU): without recomputation "
            "its pipeline schedule keeps {in_flight} micro-batches of {layers} layers on the first stage, "
            "{none_gib:.0f} GiB > {capacity:g} GiB (Llama 3's freed stage tensors and uneven stages are left out, "
            "as for the 8K rows), so its best row recomputes, which costs {recompute_share:.0%} of its step. The "
            "all-gather is not overlapped in the planner: {cp_share:.1%} of the step, where the ring hides its "
            "transfers behind the blocks ({ring_cp_share:.1%} exposed at the same shape). The planner's best, "
            "{best} ({best_gib:.0f} GiB), runs {speedup:.2f}x faster: {best_why}.")
LONG_CONTEXT: tuple[PublishedRun, ...] = (LLAMA3_128K,)


# DeepSeek-V3 (issue 32): a mixture of experts with expert parallelism 64. Not in PUBLISHED nor THROUGHPUT_RUNS
# (lesson 08's tables stay as they are); benchmarks/bench_planner.py adds it to its table and prints `moe_run_text`.
DEEPSEEK = Source("DeepSeek-V3 Technical Report", "DeepSeek-AI", 2024, "2412.19437",
                  "sections 2.1-2.2 (MLA, DeepSeekMoE, multi-token prediction), 3.1-3.3 (infrastructure, training "
                  "framework, FP8), 4.2 (hyper-parameters), table 1 (cost)")
# The model as the planner prices it: a ModelConfig of DeepSeek-V3's width, depth, vocabulary and dense MLP (its 128
# heads of 56 are what a ModelConfig can hold; the planner's activation count reads them), and a MoESpec with what a
# ModelConfig cannot hold: 3 dense blocks of d_ff 18,432, then 58 blocks of 256 routed experts + 1 shared, top-8; MLA
# in every block (128 heads, q.k over 128 + 64 RoPE dimensions, v 128, KV latent 512, query latent 1,536: report
# section 4.2, transformers 5.24's DeepseekV3Config defaults), which replaces the config's attention in parameters and
# FLOPs; one multi-token prediction module (section 2.2 / 4.2: D = 1), in FLOPs. bf16 (FP8 left out).
DEEPSEEK_V3_CFG = ModelConfig(vocab_size=129280, seq_len=4096, n_layer=61, n_head=128, d_model=7168, d_ff=18432,
                              bias=False, tie_embeddings=False, norm="rmsnorm", mlp="swiglu", pos="rope",
                              name="deepseek-v3")
DEEPSEEK_V3_MHA = DEEPSEEK_V3_CFG                  # its former name (tests/test_planner_experts.py imports it)
DEEPSEEK_V3_MLA = flops.MLASpec(n_head=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V3_MOE = MoESpec(n_experts=256, top_k=8, expert_d_ff=2048, n_shared=1, first_dense_layers=3,
                          mla=DEEPSEEK_V3_MLA, mtp_depth=1)
# Throughput is not stated: it is derived from "180K H800 GPU hours" per trillion tokens (tokens per GPU-second) and
# the FLOPs per token of the model above (`MoESpec.flops_per_token`: 6 N_active + MLA's attention core over the full
# s x s matrix + the MTP module): an average over the pre-training's GPU hours, the batch-size ramp included.
DEEPSEEK_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)                        # 1,543 tokens/s per H800
_DSV3_TFLOPS = DEEPSEEK_TOKENS_PER_GPU_S * DEEPSEEK_V3_MOE.flops_per_token(DEEPSEEK_V3_CFG, 4096) / 1e12
# Hopper's dense FP8 tensor-core peak is twice its bf16 peak: NVIDIA's H100 SXM datasheet lists 3,958 (FP8) and 1,979
# (BF16) TFLOPS "with sparsity", 1,979 and 989 dense; the H800 row takes the H100 SXM5's compute (measure/hardware.py).
H800_FP8_TFLOPS = 2 * GPU_SPECS["H800"].bf16_tflops
DEEPSEEK_V3 = PublishedRun(
    "DeepSeek-V3 671B MoE", "deepseek-v3", "H800", 256, 8, 50.0, "InfiniBand, 50 GB/s per GPU",
    global_batch=15360, seq_len=4096, dp=128, tp=1, pp=16, zero=1, ckpt="full", micro_batch=None,
    schedule="DualPipe", reported_tflops=_DSV3_TFLOPS, counts_recompute=False,
    stated_mfu=_DSV3_TFLOPS / GPU_SPECS["H800"].bf16_tflops, grad_bytes=4, source=DEEPSEEK, pipeline="zb-h1",
    overlap="dp", kernels="fused", flop_count="model", scored=False, model=DEEPSEEK_V3_CFG, moe=DEEPSEEK_V3_MOE,
    ep=64,
    note="DeepSeek-V3 technical report (DeepSeek-AI 2024, arXiv 2412.19437), as issue 32 transcribes it and issue "
         "43 corrects its attention (checked against the arXiv v2 HTML in issue 43's review). Section 3.1: 2,048 NVIDIA H800 GPUs, 8 per node "
         "on NVLink/NVSwitch, InfiniBand across nodes. Section 3.2: HAI-LLM, 16-way pipeline parallelism (PP, "
         "DualPipe), 64-way expert parallelism (EP) spanning 8 nodes, ZeRO-1 data parallelism (DP); 'without using "
         "costly Tensor Parallelism (TP)' (tp 1); section 3.2.2: NVLink 160 GB/s, IB 50 GB/s (inter_gbs_per_gpu 50); "
         "section 3.2.3: recomputation of all RMSNorm operations and the MLA up-projections (and, section 3.3.3, the MoE SwiGLU's output from cached FP8 inputs). Section 4.2: 61 layers, hidden 7,168, "
         "MLA with 128 heads of 128 (q.k adds 64 decoupled RoPE dimensions: 192), KV compression 512, query "
         "compression 1,536 (the same numbers are transformers 5.24's DeepseekV3Config defaults); first 3 layers "
         "dense (FFN 18,432), then 1 shared + 256 routed experts of 2,048, 8 activated; 671B total, 37B active; "
         "multi-token prediction depth 1 (section 2.2: one more transformer block and a projection, sharing the "
         "embedding and the output head; deepseek-ai/DeepSeek-V3's README_WEIGHTS.md: its block, layer 61, is "
         "structured as the main model's, 11.5B unique parameters); sequence 4,096; batch ramped up to 15,360 "
         "sequences (the planner prices 15,360). Table 1 / section 1: 14.8T tokens, 2.788M H800 GPU hours (2.664M "
         "pre-training), 180K GPU hours per trillion tokens. dp = 2,048 / 16 = 128, ep 64 borrowed from it "
         "(expert-dp 2). NOT re-checked / NOT stated: the TFLOP/s and MFU are derived (1e12 tokens / (180K x 3,600 "
         "s) = 1,543 tokens/s per GPU times the FLOPs per token of MoESpec.flops_per_token: 6 N_active, MLA's score "
         "and value matmuls over the full 4,096 x 4,096 matrix, the MTP module), not stated by the paper: an average "
         "over all the pre-training's GPU hours, the batch ramp included, in bf16-peak terms although the GEMMs ran "
         "in FP8 (most of them: section 3.3); the micro-batch (1 stands in). Not modelled, so priced as the planner can and shown, "
         "not scored (as the Llama rows): MLA's activations (the planner keeps those of 128 heads of 56; its "
         "parameters and FLOPs are MLA's), FP8 matmuls (priced in bf16 at the A100's calibrated matmul efficiency, "
         "against the H800's bf16 peak), DualPipe (ZB-H1 stands in; its overlap of the all-to-alls with another "
         "micro-batch's compute is not priced), its recomputation (full stands in), BF16 optimizer moments (12 bytes "
         "per parameter priced), the MTP module's memory, node-limited routing (at most 4 nodes per token) and the "
         "two-hop all-to-all.",
    why_not="The published shape's best feasible row is {shape_best} ({shape_best_gib:.0f} GiB per GPU); without "
            "recomputation it needs {none_gib:.0f} GiB > {capacity:g} GiB ({in_flight} micro-batches of {layers} "
            "layers in flight on the first stage; DeepSeek recomputes only RMSNorm, the MLA up-projections and the MoE SwiGLU output, "
            "which the planner cannot express), so its row recomputes ({recompute_share:.0%} of its step). The "
            "all-to-alls of ep {ep} cross nodes (ep x tp = {ep_span} ranks > 8 per node) and are exposed: "
            "{ep_share:.0%} of the step, where DualPipe hides them behind another micro-batch's compute. The "
            "planner's best, {best} ({best_gib:.0f} GiB), runs {speedup:.2f}x faster than the planner's own price of "
            "the published shape, a price {planner_error:+.0%} off the derived throughput ({planner_tflops:.0f} vs "
            "{derived_tflops:.0f} TFLOP/s per GPU): {best_why}.")
MOE_RUNS: tuple[PublishedRun, ...] = (DEEPSEEK_V3,)


NARAYANAN_T1 = Source(NARAYANAN.title, NARAYANAN.authors, 2021, "2104.04473",
                      "table 1 (weak scaling, 1.7B-1T); each row's micro-batch, schedule and DDP from the paper's "
                      "artifact, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh")

# Narayanan et al. 2021, table 1, as issue 30 transcribes it: (params, heads, hidden, layers, TP, PP, GPUs, batch,
# TFLOP/s per GPU, % of peak), with what examples/sc21/run_table_1.sh sets for the row: micro-batch (MBS),
# --num-layers-per-virtual-pipeline-stage (v = layers per stage / that), --DDP-impl (torch: PyTorch DDP, whose
# buckets overlap the backward; local: Megatron's, which all-reduced after the backward in 2021).
_TABLE_1 = (
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44, 16, 1, "torch"),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44, 16, 1, "torch"),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46, 16, 1, "torch"),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 8, 1, "torch"),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 4, 1, "local"),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 2, 3, "local"),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 2, 2, "local"),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 1, 2, "local"),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 1, 3, "local"),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 1, 1, "local"),
)
_TABLE_1_NOTE = (
    "Narayanan et al. 2021, table 1 (A100 80GB, 8 per node, 8 x 200 Gb/s HDR InfiniBand per node, vocabulary "
    "51,200, sequence 2,048, full activation recomputation, mixed precision; TFLOP/s per GPU count the recomputed "
    "forward by 96 B s l h^2 (1 + s/(6h) + V/(16 l h))), values as issue 30 transcribes them: the paper's PDF was "
    "not reachable here. Checked: each row's shape, TP, PP, GPUs (nodes x 8) and batch equal the paper's artifact "
    "(NVIDIA/Megatron-LM examples/sc21/run_table_1.sh, 'Table 1 showing weak-scaling throughput for GPT models "
    "ranging from 1 billion to 1 trillion parameters' in examples/sc21/README.md), which also sets the micro-batch "
    "(MBS), the interleaved schedule (--num-layers-per-virtual-pipeline-stage) and the DDP ('DDP=torch' for pp 1, "
    "'DDP=local' otherwise) used here; the 1T row's 163 TFLOP/s equal the abstract's '502 petaFLOP/s on 3072 GPUs' "
    "(52 % of peak). Assumed: gradients all-reduced in fp32 (Megatron-LM's main gradients; the scripts' CONFIG.sh "
    "is not in the index, and with --fp16 2021's Megatron reduced them in fp16 unless "
    "--accumulate-allreduce-grads-in-fp32), ZeRO-0 (no distributed optimizer in 2021), no TP overlap, the "
    "positions learned (GPT).")
_TABLE_1_WHY = (
    "Interleaved schedule, DP overlap, and the memory-bound kernels are modelled; left out: the scatter/gather "
    "optimisation of cross-node p2p, uneven stages (the first and last hold the embedding and the head), kernel "
    "efficiency that changes with matmul shapes (the roofline puts every matmul of this table above the ridge "
    "point), and the activation count without sequence parallelism for memory.")


def _table_1_run(row) -> PublishedRun:
    name, a, h, L, tp, pp, gpus, batch, tflops, pct, mbs, v, ddp = row
    cfg = ModelConfig(vocab_size=51200, seq_len=2048, n_layer=L, n_head=a, d_model=h, name=f"gpt-{name.lower()}")
    return PublishedRun(
        f"Megatron-LM {name} (table 1)", cfg.name, "A100", gpus // 8, 8, 25.0, "8 x 200 Gb/s HDR InfiniBand per node",
        global_batch=batch, seq_len=2048, dp=gpus // (tp * pp), tp=tp, pp=pp, zero=0, ckpt="full", micro_batch=mbs,
        schedule=(f"interleaved, v = {v}" if v > 1 else "1F1B") + f" (run_table_1.sh, MBS {mbs}, DDP {ddp})",
        reported_tflops=float(tflops), counts_recompute=True, stated_mfu=pct / 100, grad_bytes=4,
        source=NARAYANAN_T1, note=_TABLE_1_NOTE, why_not=_TABLE_1_WHY, pipeline="interleaved" if v > 1 else "1f1b",
        v=v, overlap="dp" if ddp == "torch" else "none", kernels="unfused", flop_count="megatron", model=cfg)


WEAK_SCALING: tuple[PublishedRun, ...] = tuple(_table_1_run(r) for r in _TABLE_1)
# every run whose layout and throughput are both stated, in one GPU type's table (A100 first, then H100)
THROUGHPUT_RUNS: tuple[PublishedRun, ...] = WEAK_SCALING + PUBLISHED
CALIBRATION = "Megatron-LM 145.6B (table 1)"   # the one row that sets the A100's efficiency (chosen before looking)

# A schedule change that a source reports both sides of: torchtitan's docs/performance.md, table 5.
TORCHTITAN_405B = dict(
    source="pytorch/torchtitan docs/performance.md (versions: torchtitan 9dec370, torch 1963fc8, 2024-12-26)",
    quote="Table 5 3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B model. 512 "
          "GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full activation checkpointing. | "
          "1F1B | 100 | 82.5 | Interleaved 1F1B | 128 | 72.7 |",
    tokens_per_s={"1f1b": 100.0, "interleaved": 128.0},
    # what the table does not say, read from torchtitan's code of that time: generate_split_points gives a looped
    # schedule 2 stages per rank ("num_stages_per_rank = 2"), and pipeline_parallel_microbatches unset gives
    # n_microbatches = pipeline_parallel_degree = 8
    preset="llama3-405b", gpu="H100", nodes=64, dp=8, tp=8, pp=8, global_batch=256, seq_len=8192, v=2, m=8,
    assumed="v = 2 (torchtitan's default for a looped schedule) and m = 8 micro-batches of 4 sequences for both "
            "schedules (n_microbatches defaults to the pipeline degree in torchtitan's build_pipeline_schedule of "
            "late 2024; a later version defaults to pp x stages per rank); Float8 and async TP as in the table, "
            "priced as bf16 at the A100's calibrated matmul efficiency with TP overlapped (the gain moves by < 0.5 "
            "points for efficiencies 0.3-0.8); FSDP as ZeRO-1 (FSDP with a pipeline is not modelled); torchtitan "
            "splits the 126 layers into 16 chunks of 7-8 (generate_split_points), which Megatron-LM's rule, and so "
            "the planner, refuses (v = 2 does not divide 126 / 8 layers per stage): the interleaved row is priced "
            "anyway, with ceil(126 / 8) = 16 layers per stage, its refusal shown beside it")


def interleaving_gain(kernel_efficiency: float = 0.4) -> dict:
    """The planner's throughput gain of interleaved 1F1B over 1F1B on torchtitan's 405B layout (table 5 of its
    docs/performance.md), beside the reported 100 -> 128 tokens/s per GPU."""
    t = TORCHTITAN_405B
    cfg, gpu = get_preset(t["preset"]), GPU_SPECS[t["gpu"]]
    cluster = Cluster("64 x 8 H100", t["nodes"], 8, 50.0)
    mb = t["global_batch"] // (t["dp"] * t["m"])
    rows = {sch: estimate(cfg, gpu, cluster, Layout(t["dp"], t["tp"], t["pp"], 1, "full", mb, sch, v, "dp+tp"),
                          t["global_batch"], t["seq_len"], kernel_efficiency, elementwise="fused")
            for sch, v in (("1f1b", 1), ("interleaved", t["v"]))}
    predicted = rows["1f1b"].time["total"] / rows["interleaved"].time["total"] - 1
    reported = t["tokens_per_s"]["interleaved"] / t["tokens_per_s"]["1f1b"] - 1
    within_tenth = abs(predicted / reported - 1) <= 0.1      # +25.2 % to +30.8 % against the reported +28 %
    return dict(predicted=predicted, reported=reported, rows=rows, within_tenth=within_tenth)


# ------------------------------------------------------------------------------------- published throughput

def layout_of(run: PublishedRun) -> Layout:
    """The run's layout in the planner's terms (unstated ZeRO / recomputation / micro-batch: ZeRO-1, none, 1)."""
    return Layout(run.dp, run.tp, run.pp, 1 if run.zero is None else run.zero, run.ckpt or "none",
                  run.micro_batch or 1, run.pipeline, run.v, run.overlap, run.cp, run.cp_variant, run.ep)


def _cps(run: PublishedRun) -> tuple:
    """The cp degrees a run's ranking enumerates: 1 alone without CP (lesson 08's layouts); with CP, 1 and every
    power of two up to 2 cp."""
    return (1,) if run.cp == 1 else tuple(2 ** k for k in range(int(math.log2(2 * run.cp)) + 1))


def source_flops(run: PublishedRun) -> float:
    """FLOPs of one step as the source counts them: Megatron-LM's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with the
    recomputed forward (`flops.megatron_flops_per_token`), or model FLOPs (`flops.step_flops`)."""
    cfg = run.config
    if run.flop_count == "megatron":
        return flops.megatron_flops_per_token(cfg, run.seq_len, recompute=True) * run.global_batch * run.seq_len
    return step_flops(cfg, run.global_batch, run.seq_len, run.moe)


def _eps(run: PublishedRun) -> tuple:
    """The ep degrees a run's ranking enumerates: 1 alone for a dense model; with experts, every power of two up to
    the experts (`planner.plan` drops those dp x cp cannot take)."""
    return (1,) if run.moe is None else tuple(2 ** k for k in range(int(math.log2(run.moe.n_experts)) + 1))


def predict(run: PublishedRun, kernel_efficiency: float) -> Estimate:
    """The planner's estimate of exactly the published layout, schedule and overlap."""
    return estimate(run.config, GPU_SPECS[run.gpu], run.cluster, layout_of(run), run.global_batch, run.seq_len,
                    kernel_efficiency, grad_bytes=run.grad_bytes, elementwise=run.kernels, moe=run.moe)


def tflops_of(run: PublishedRun, est: Estimate) -> float:
    """TFLOP/s per GPU of the run at the step time of ``est``, counted as the source counts them."""
    return source_flops(run) / (run.cluster.n_gpus * est.time["total"]) / 1e12


def predicted_tflops(run: PublishedRun, kernel_efficiency: float) -> float:
    """TFLOP/s per GPU the planner predicts, counted as the source counts them."""
    return tflops_of(run, predict(run, kernel_efficiency))


def calibrate(run: PublishedRun) -> float:
    """The matmul efficiency (an HFU) at which the planner reproduces the run's reported TFLOP/s (bisection)."""
    lo, hi = 0.05, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted_tflops(run, mid) < run.reported_tflops else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass
class Throughput:
    """One published run against the planner: ``predicted`` (TFLOP/s per GPU, the source's count) at the calibrated
    efficiency, ``baseline``: the calibration row's fraction of peak applied as is; errors relative to
    ``reported``; ``rank``: the published layout among the planner's feasible layouts (None: not ranked)."""

    run: PublishedRun
    estimate: Estimate
    predicted: float
    baseline: float
    rank: int | None = None
    n_feasible: int = 0
    best: str = ""

    @property
    def reported(self) -> float:
        return self.run.reported_tflops

    @property
    def error(self) -> float:
        return self.predicted / self.reported - 1

    @property
    def baseline_error(self) -> float:
        return self.baseline / self.reported - 1


def rank_among_layouts(run: PublishedRun, kernel_efficiency: float) -> tuple[int | None, int, str]:
    """Where the published layout ranks among the planner's feasible layouts of the same cluster and batch (every
    tp, pp, micro-batch, and the ZeRO stages, recomputation and schedules the run's software had: 2021's Megatron-LM
    had no ZB-H1, no selective recomputation, no distributed optimizer; the run's overlap and kernels, and so 2021's
    activations without sequence parallelism). Returns (rank or None, feasible layouts, the best layout and the
    published layout's step time over the best's)."""
    mine = layout_of(run)
    old = run.kernels == "unfused"      # 2021's Megatron-LM: no ZB-H1, no selective recomputation, no ZeRO
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                micro_batches=sorted({1, 2, 4, 8, mine.micro_batch}), zeros=sorted({0, mine.zero} if old else {0, 1}),
                ckpts=("none", "full") if old else CKPT, grad_bytes=run.grad_bytes,
                schedules=("1f1b", "interleaved") if old else SCHEDULES, vs=sorted({2, 3, 4, mine.v} - {1}),
                overlaps=(run.overlap,), elementwise=run.kernels, cps=_cps(run),
                cp_variants=CP_VARIANTS if run.cp > 1 else ("ring",), eps=_eps(run), moe=run.moe)
    feasible = [r for r in rows if r.feasible]
    rank = next((i + 1 for i, r in enumerate(feasible) if r.layout == mine), None)
    if not feasible:
        return rank, 0, "none"
    mine_s = predict(run, kernel_efficiency).time["total"]
    ratio = mine_s / feasible[0].time["total"]
    return rank, len(feasible), f"{feasible[0].layout.label()} (published step / best step = {ratio:.2f})"


def _placed(run: PublishedRun, rows: list, shape, kernel_efficiency: float, **kw) -> dict:
    """A published run's shape among the planner's ``rows`` (`long_context`, `moe_run`): its best feasible row, its
    rank among the feasible rows and among the shapes (``shape(layout)`` -> a tuple; the run's is
    ``shape(run)``), the planner's best, the same row without recomputation, and the facts its ``why_not`` needs that
    every such run shares. ``kw`` goes to `estimate` (the run's own options, e.g. ``moe=``)."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    feasible = [r for r in rows if r.feasible]
    mine = shape(run)
    row = next((r for r in feasible if shape(r.layout) == mine), None)
    if row is None:
        raise ValueError(f"{run.name}: no feasible layout of the published shape {mine}")
    shapes = list(dict.fromkeys(shape(r.layout) for r in feasible))
    best = feasible[0]
    one = lambda lay: estimate(cfg, gpu, run.cluster, lay, run.global_batch, run.seq_len, kernel_efficiency,
                               grad_bytes=run.grad_bytes, elementwise=run.kernels, **kw)
    none = one(dataclasses.replace(row.layout, ckpt="none"))
    tot = row.time["total"]
    recompute = row.time["compute"] * (1 - row.mfu / row.hfu)          # the recomputed forward's share of compute
    facts = dict(shape_best=row.layout.label(), shape_best_gib=row.memory["total"] / GiB,
                 in_flight=stage_in_flight(row.layout, row.accum), layers=math.ceil(cfg.n_layer / run.pp),
                 none_gib=none.memory["total"] / GiB, capacity=gpu.mem_gb, recompute_share=recompute / tot,
                 best=best.layout.label(), best_gib=best.memory["total"] / GiB, speedup=tot / best.time["total"])
    return dict(run=run, row=row, rank=feasible.index(row) + 1, shape_rank=shapes.index(mine) + 1,
                n_feasible=len(feasible), n_shapes=len(shapes), n_layouts=len(rows), best=best, none=none,
                facts=facts, estimate=one, predicted_tflops=tflops_of(run, row))


def _explained(out: dict, diffs: list[str], t0: float, **facts) -> dict:
    """`_placed`'s result with the run-specific facts and the planner's best's differences filled into ``why``."""
    out["facts"].update(facts, best_why="; ".join(diffs) or "the same shape")
    del out["estimate"]
    return dict(out, why=out["run"].why_not.format(**out["facts"]), seconds=time.perf_counter() - t0)


def long_context(run: PublishedRun = LLAMA3_128K, kernel_efficiency: float = 0.4) -> dict:
    """A context-parallel run among the planner's layouts of its model, cluster, batch and sequence (every tp, pp,
    cp of `_cps`, CP variant, ZeRO 0-1, recomputation, micro-batch, schedule; the run's overlap and kernels). The
    published shape (dp, tp, pp, cp, variant) at its best feasible row, its rank among all feasible rows and among
    shapes, the planner's best, and ``why``: the run's ``why_not`` with these numbers filled in."""
    t0 = time.perf_counter()
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                zeros=(0, 1), schedules=SCHEDULES, grad_bytes=run.grad_bytes, overlaps=(run.overlap,),
                elementwise=run.kernels, cps=_cps(run), cp_variants=CP_VARIANTS)
    shape = lambda lay: (lay.dp, lay.tp, lay.pp, lay.cp, lay.cp_variant if lay.cp > 1 else "ring")
    out = _placed(run, rows, shape, kernel_efficiency)
    row, best, tot = out["row"], out["best"], out["row"].time["total"]
    ring = out["estimate"](dataclasses.replace(row.layout, cp_variant="ring"))
    diffs = []
    if best.layout.cp != run.cp:
        diffs.append(f"cp {best.layout.cp} leaves {run.seq_len // best.layout.cp:,} tokens per GPU, which fit "
                     f"without recomputation" if best.layout.ckpt == "none" else f"cp {best.layout.cp}")
    if best.layout.cp_variant != run.cp_variant:
        diffs.append(f"the {best.layout.cp_variant} variant ({best.exposed['cp'] / best.time['total']:.1%} of its "
                     f"step exposed)")
    if best.layout.schedule != row.layout.schedule:
        diffs.append(f"{best.layout.schedule} (bubble {best.time['bubble'] / best.time['total']:.0%} of its step, "
                     f"{row.time['bubble'] / tot:.0%} here)")
    out["ring"] = ring
    return _explained(out, diffs, t0, cp_share=row.exposed["cp"] / tot,
                      ring_cp_share=ring.exposed["cp"] / ring.time["total"])


def moe_run(run: PublishedRun = DEEPSEEK_V3, kernel_efficiency: float = 0.4) -> dict:
    """A MoE run among the planner's layouts of its model, cluster, batch and sequence (every tp, pp, ep of `_eps`,
    ZeRO 0-1, recomputation, micro-batch 1-4, 1F1B and ZB-H1; the run's overlap and kernels). The published shape
    (dp, tp, pp, ep) at its best feasible row, its rank among all feasible rows and among shapes, the planner's
    best, and ``why``: the run's ``why_not`` with these numbers filled in."""
    t0 = time.perf_counter()
    rows = plan(run.config, GPU_SPECS[run.gpu], run.cluster, run.global_batch, run.seq_len, kernel_efficiency,
                micro_batches=(1, 2, 4), zeros=(0, 1), schedules=("1f1b", "zb-h1"), grad_bytes=run.grad_bytes,
                overlaps=(run.overlap,), elementwise=run.kernels, eps=_eps(run), moe=run.moe)
    out = _placed(run, rows, lambda lay: (lay.dp, lay.tp, lay.pp, lay.ep), kernel_efficiency, moe=run.moe)
    row, best, tot = out["row"], out["best"], out["row"].time["total"]
    diffs = [f"{name} {getattr(best.layout, name)} instead of {getattr(row.layout, name)}"
             for name in ("tp", "pp", "ep") if getattr(best.layout, name) != getattr(row.layout, name)]
    diffs.append(f"all-to-all {best.exposed['ep'] / best.time['total']:.0%} of its step, bubble "
                 f"{best.time['bubble'] / best.time['total']:.0%} (here {row.time['bubble'] / tot:.0%}), "
                 f"recomputation {best.layout.ckpt}")
    return _explained(out, diffs, t0, ep=run.ep, ep_span=run.ep * run.tp, ep_share=row.exposed["ep"] / tot,
                      planner_error=out["predicted_tflops"] / run.reported_tflops - 1,
                      planner_tflops=out["predicted_tflops"], derived_tflops=run.reported_tflops)


def _placed_text(out: dict, published: str, exchange: str, mfu_note: str = "") -> str:
    """What `moe_run` or `long_context` found, in a few lines: ``published`` (the run as published) and ``exchange``
    (its own communication) are the lines that differ."""
    row, best = out["row"], out["best"]
    return "\n".join([
        published,
        f"  feasible as {row.layout.label()}: {row.memory['total'] / GiB:.1f} GiB per GPU, step {row.time['total']:.1f}"
        f" s, {out['predicted_tflops']:.0f} TFLOP/s per GPU (MFU {row.mfu:.1%}{mfu_note}); rank {out['rank']} of "
        f"{out['n_feasible']} feasible layouts, its shape {out['shape_rank']} of {out['n_shapes']} shapes; {exchange}",
        f"  the planner's best: {best.layout.label()} (step {best.time['total']:.1f} s, MFU {best.mfu:.1%})",
        f"  why: {out['why']}"])


def moe_run_text(out: dict) -> str:
    """What `moe_run` found, in a few lines."""
    r, row = out["run"], out["row"]
    return _placed_text(
        out,
        f"{r.name}: published dp {r.dp} x tp {r.tp} x pp {r.pp}, ep {r.ep} (borrowed from dp), batch "
        f"{r.global_batch:,} x {r.seq_len:,} tokens on {r.cluster.n_gpus:,} {r.gpu}s; derived {r.reported_tflops:.0f}"
        f" TFLOP/s per GPU, an average over the pre-training's GPU hours (from tokens and GPU hours, not stated): "
        f"{r.stated_mfu:.0%} of the {r.gpu}'s dense bf16 peak ({GPU_SPECS[r.gpu].bf16_tflops:,.0f} TFLOP/s), "
        f"{r.reported_tflops / H800_FP8_TFLOPS:.0%} of its dense FP8 peak ({H800_FP8_TFLOPS:,.0f} TFLOP/s; most of "
        f"its GEMMs ran in FP8)",
        f"all-to-all {row.time['ep']:.1f} s per step, exposed", mfu_note=", active FLOPs")


def long_context_text(out: dict) -> str:
    """What `long_context` found, in a few lines."""
    r, row = out["run"], out["row"]
    return _placed_text(
        out,
        f"{r.name}: published dp {r.dp} x tp {r.tp} x pp {r.pp} x cp {r.cp} ({r.cp_variant}), batch {r.global_batch}"
        f" x {r.seq_len:,} tokens on {r.cluster.n_gpus:,} {r.gpu}s; reported {r.reported_tflops:g} TFLOP/s per GPU "
        f"({r.stated_mfu:.0%} MFU)",
        f"CP exchange {row.time['cp']:.2f} s per step, {row.exposed['cp']:.2f} s exposed")


def throughput_table(runs=THROUGHPUT_RUNS, calibration: str = CALIBRATION, rank: bool = True) -> tuple[float, list]:
    """Calibrate the A100's efficiency on the one ``calibration`` row, then predict every run with it held fixed.
    Returns (efficiency, [Throughput]). ``rank=False`` skips the planner's search over layouts (seconds)."""
    cal = next(r for r in runs if r.name == calibration)
    eff = calibrate(cal)
    cal_fraction = cal.reported_tflops / GPU_SPECS[cal.gpu].bf16_tflops
    out = []
    for r in runs:
        est = predict(r, eff)
        t = Throughput(r, est, tflops_of(r, est), cal_fraction * GPU_SPECS[r.gpu].bf16_tflops)
        if rank:
            t.rank, t.n_feasible, t.best = rank_among_layouts(r, eff)
        out.append(t)
    return eff, out


def throughput_summary(rows: list, calibration: str = CALIBRATION) -> str:
    """The benchmark's last line: scored runs without the calibration row."""
    scored = [t for t in rows if t.run.scored and t.run.name != calibration]
    err = [abs(t.error) * 100 for t in scored]
    base = [abs(t.baseline_error) * 100 for t in scored]
    return (f"published throughput: {len(scored)} runs, median |error| {statistics.median(err):.1f} %, max |error| "
            f"{max(err):.1f} % (constant baseline: median {statistics.median(base):.1f} %, max {max(base):.1f} %)")


def throughput_text(eff: float, rows: list, calibration: str = CALIBRATION) -> str:
    """Per run: the published layout, the planner's TFLOP/s per GPU, the reported, the error, the constant
    baseline and its error, the bubble and the exposed communication (shares of the step), the rank among the
    planner's feasible layouts (where ranked); then the summary line."""
    head = (f"{'run':<30} {'GPUs':>5} {'dp x tp x pp':>13} {'mb':>3} {'schedule':>14} {'overlap':>7} "
            f"{'planner':>8} {'reported':>8} {'error':>7} {'baseline':>8} {'error':>7} {'bubble':>6} {'comm':>5}"
            + (f" {'rank':>9}" if any(t.n_feasible for t in rows) else ""))
    lines = [f"A100 matmul efficiency (HFU) calibrated on {calibration}: {eff:.3f} of peak; TFLOP/s per GPU as each "
             f"source counts them", head]
    for t in rows:
        r, e = t.run, t.estimate
        sched = r.pipeline + (f" v{r.v}" if r.v > 1 else "")
        tot = e.time["total"]
        comm = sum(e.exposed.values())
        mark = " (calibration)" if r.name == calibration else ("" if r.scored else " (not scored)")
        rank = (f" {f'{t.rank}/{t.n_feasible}' if t.rank else f'-/{t.n_feasible}':>9}" if t.n_feasible else "")
        shape = f"{r.dp}x{r.tp}x{r.pp}" + (f"cp{r.cp}" if r.cp > 1 else "") + (f"ep{r.ep}" if r.ep > 1 else "")
        lines.append(f"{r.name:<30} {r.cluster.n_gpus:>5} {shape:>13} {layout_of(r).micro_batch:>3} "
                     f"{sched:>14} {r.overlap:>7} {t.predicted:>8.1f} {t.reported:>8.1f} {t.error:>+7.1%} "
                     f"{t.baseline:>8.1f} {t.baseline_error:>+7.1%} {e.time['bubble'] / tot:>6.1%} "
                     f"{comm / tot:>5.1%}{rank}{mark}")
    return "\n".join(lines + [throughput_summary(rows, calibration)])


# --------------------------------------------------------------------------------------------- published runs

@dataclasses.dataclass
class Check:
    """A published run in the planner. ``row``: the published layout (unstated fields filled with the planner's
    best feasible choice); ``rank``: its place among all feasible rows by step time (1 = fastest; None if
    infeasible or not enumerated); ``shape_rank``: its dp x tp x pp among all shapes, each at its best row;
    ``top5``: the best row of each of the five fastest shapes; ``facts``: the numbers its ``why_not`` quotes."""

    run: PublishedRun
    row: Estimate
    rank: int | None
    shape_rank: int | None
    top5: list
    n_layouts: int
    seconds: float                      # time plan() took
    facts: dict = dataclasses.field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.row.feasible

    @property
    def in_top5(self) -> bool:
        return self.shape_rank is not None and self.shape_rank <= 5

    @property
    def planner_mfu(self) -> float:
        return self.row.mfu

    @property
    def reported_mfu(self) -> float:
        return self.run.reported_mfu

    @property
    def mfu_without_bubble_and_dp(self) -> float:
        """What the planner's MFU would be if the pipeline bubble and the DP communication were hidden (an upper
        bound for interleaving plus overlap; recomputation and the assumed kernel efficiency stay)."""
        t = self.row.time
        return self.row.mfu * t["total"] / (t["total"] - t["bubble"] - t["dp"])

    @property
    def why_not(self) -> str:
        """The run's ``why_not`` with the planner's numbers filled in."""
        return self.run.why_not.format(**self.facts)


def _shape(layout: Layout) -> tuple[int, int, int]:
    return layout.dp, layout.tp, layout.pp


def facts(run: PublishedRun, row: Estimate, best_of_shape: Estimate | None, rank, shape_rank,
          kernel_efficiency: float) -> dict:
    """The numbers a run's ``why_not`` quotes, each computed here: the best row of the published shape, the
    published shape without recomputation, and its memory with Korthikanti et al.'s activations without sequence
    parallelism (`planner.korthikanti_layer_bytes`), in GiB."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    lay = row.layout
    layers = math.ceil(cfg.n_layer / lay.pp)
    in_flight = stage_in_flight(lay, row.accum)
    none = estimate(cfg, gpu, run.cluster, dataclasses.replace(lay, ckpt="none"), run.global_batch, run.seq_len,
                    kernel_efficiency=kernel_efficiency, grad_bytes=run.grad_bytes)
    no_sp_layer = korthikanti_layer_bytes(cfg, lay.tp, run.seq_len, lay.micro_batch, sequence_parallel=False)
    no_sp_acts = no_sp_layer * layers * in_flight
    states = none.memory["model_states"]
    no_sp_total = states + no_sp_acts + none.memory["logits"] + none.memory["zero3_buffers"] + none.memory["reserve"]
    sbh = run.seq_len * lay.micro_batch * cfg.d_model
    return dict(m=row.accum, bubble=(lay.pp - 1) / row.accum, layers=layers, in_flight=in_flight,
                kernel_efficiency=kernel_efficiency, stated_mfu=run.stated_mfu, capacity=gpu.mem_gb,
                rank=rank or "-", shape_rank=shape_rank or "-",
                shape_best=best_of_shape.layout.label() if best_of_shape else "none",
                shape_best_gib=best_of_shape.memory["total"] / GiB if best_of_shape else float("nan"),
                none_gib=none.memory["total"] / GiB, states_gib=states / GiB,
                no_sp_sbh=no_sp_layer / sbh, no_sp_layer_gib=no_sp_layer / GiB, no_sp_acts_gib=no_sp_acts / GiB,
                no_sp_total_gib=no_sp_total / GiB)


def check_published(run: PublishedRun, kernel_efficiency: float = 0.4) -> Check:
    """Plan the run's cluster and batch; place the published layout among the feasible ones."""
    cfg, gpu = run.config, GPU_SPECS[run.gpu]
    t0 = time.perf_counter()
    rows = plan(cfg, gpu, run.cluster, run.global_batch, run.seq_len, kernel_efficiency=kernel_efficiency,
                grad_bytes=run.grad_bytes)
    seconds = time.perf_counter() - t0
    feasible = [r for r in rows if r.feasible]
    stated = {k: getattr(run, k) for k in ("zero", "ckpt", "micro_batch") if getattr(run, k) is not None}
    mine = [r for r in feasible if _shape(r.layout) == (run.dp, run.tp, run.pp)
            and all(getattr(r.layout, k) == v for k, v in stated.items())]
    if mine:
        row, rank = mine[0], feasible.index(mine[0]) + 1
    else:                               # infeasible: the planner's reason for the stated (or default) choices
        layout = Layout(run.dp, run.tp, run.pp, **{"zero": 1, "ckpt": "none", "micro_batch": 1, **stated})
        row, rank = estimate(cfg, gpu, run.cluster, layout, run.global_batch, run.seq_len,
                             kernel_efficiency=kernel_efficiency, grad_bytes=run.grad_bytes), None
    best_of_shape: dict = {}
    for r in feasible:
        best_of_shape.setdefault(_shape(r.layout), r)
    shapes = list(best_of_shape)
    shape = (run.dp, run.tp, run.pp)
    shape_rank = shapes.index(shape) + 1 if shape in best_of_shape else None
    return Check(run, row, rank, shape_rank, [best_of_shape[s] for s in shapes[:5]], len(rows), seconds,
                 facts(run, row, best_of_shape.get(shape), rank, shape_rank, kernel_efficiency))


def check_all(runs=PUBLISHED, kernel_efficiency: float = 0.4) -> list[Check]:
    return [check_published(r, kernel_efficiency) for r in runs]


def published_table(checks: list[Check]) -> str:
    """One line per run: published layout, feasible, ranks, planner vs reported MFU (model FLOPs), and the reported
    TFLOP/s per GPU as the source counts them."""
    lines = [f"{'run':<24} {'GPUs':>6} {'published dp x tp x pp':>22} {'feasible':>8} {'rank':>5} {'shape':>5} "
             f"{'MFU planner':>11} {'no bubble/dp':>12} {'reported':>8} {'TFLOP/s':>8}"]
    for c in checks:
        r = c.run
        lines.append(f"{r.name:<24} {r.cluster.n_gpus:>6} {f'{r.dp} x {r.tp} x {r.pp}':>22} {str(c.feasible):>8} "
                     f"{c.rank or '-':>5} {c.shape_rank or '-':>5} {c.planner_mfu:>11.1%} "
                     f"{c.mfu_without_bubble_and_dp:>12.1%} {c.reported_mfu:>8.1%} {r.reported_tflops:>8.0f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- method by size

def _gpt(name: str, n_layer: int, d_model: int, n_head: int) -> ModelConfig:
    """Narayanan et al. (2021, table 1)'s GPT shapes: vocabulary 51,200, sequence 2,048."""
    return ModelConfig(vocab_size=51200, seq_len=2048, n_layer=n_layer, n_head=n_head, d_model=d_model, name=name)


# ~12 L h^2 parameters each: 1.3B (GPT-3 XL's shape), 10B (32 heads, so that tp=32 divides them), 100B and
# Narayanan's 1T (128 layers, h 25,600, 160 heads).
SIZES = {"1B": _gpt("gpt-1.3b", 24, 2048, 16), "10B": _gpt("gpt-10b", 32, 5120, 32),
         "100B": _gpt("gpt-100b", 80, 10240, 80), "1T": _gpt("gpt-1t", 128, 25600, 160)}
SEED_METHOD = {"1B": "DP", "10B": "ZeRO", "100B": "TP/PP", "1T": "3D"}
FAMILIES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "TP+DP", "PP+DP", "TP+PP+DP")


def family(layout: Layout) -> str:
    """The strategy family of a layout: data parallel alone (by ZeRO stage), or which model dimensions it uses."""
    if layout.tp == 1 and layout.pp == 1:
        return "DP" if layout.zero == 0 else f"ZeRO-{layout.zero}"
    return "TP+DP" if layout.pp == 1 else ("PP+DP" if layout.tp == 1 else "TP+PP+DP")


def method_by_size(gpu: str = "H100", nodes=(1, 8, 64), gpus_per_node: int = 8, inter_gbs_per_gpu: float = 50.0,
                   global_batch: int = 1024, kernel_efficiency: float = 0.4) -> list[dict]:
    """For each size in :data:`SIZES` and each cluster of ``nodes x gpus_per_node`` GPUs: the fastest feasible
    layout of every strategy family (None: no layout of that family fits), and the planner's overall choice.
    ZeRO-3's working buffers (two layers' gathered 16-bit parameters: the one in use and the prefetched one) are
    counted: 29 GiB for the 1T model without TP (tests/test_published_layouts.py)."""
    out = []
    for size, cfg in SIZES.items():
        for n in nodes:
            cluster = Cluster(f"{n} x {gpus_per_node} {gpu}, {inter_gbs_per_gpu:g} GB/s per GPU", n, gpus_per_node,
                              inter_gbs_per_gpu)
            best: dict = {f: None for f in FAMILIES}
            for r in plan(cfg, GPU_SPECS[gpu], cluster, global_batch, kernel_efficiency=kernel_efficiency):
                if r.feasible and best[family(r.layout)] is None:
                    best[family(r.layout)] = r
            fits = [f for f in FAMILIES if best[f] is not None]
            fastest = min(fits, key=lambda f: best[f].time["total"]) if fits else None
            out.append(dict(size=size, params=cfg.num_params(), nodes=n, gpus=cluster.n_gpus, best=best, fits=fits,
                            fastest=fastest, seed=SEED_METHOD[size]))
    return out


def method_table(rows: list[dict]) -> str:
    lines = [f"{'size':<5} {'GPUs':>5} {'seed':>6}  " + " ".join(f"{f:>8}" for f in FAMILIES) + "  fastest"]
    for r in rows:
        cells = " ".join(f"{r['best'][f].mfu:>8.0%}" if r["best"][f] else f"{'-':>8}" for f in FAMILIES)
        lines.append(f"{r['size']:<5} {r['gpus']:>5} {r['seed']:>6}  {cells}  {r['fastest'] or 'nothing fits'}")
    return "\n".join(lines) + "\n(cells: the family's best MFU by the planner; '-': no layout of it fits)"


# -------------------------------------------------------------------------------------------- efficiency

SEED_EFFICIENCY = {"DP": (0.85, 0.95), "TP": (0.75, 0.85), "PP": (0.80, 0.90), "ZeRO-2": (0.80, 0.90),
                   "ZeRO-3": (0.70, 0.80), "FSDP": (0.85, 0.95)}

# (seed method, what is run, model, (dp, tp, pp, zero) of n GPUs, on one node?, why it scores what it scores)
_METHOD_RUNS = (
    ("DP", "DDP over all GPUs", "1B", lambda n: (n, 1, 1, 0), False,
     "one gradient all-reduce per step, not overlapped here; DDP's buckets overlap it with the backward"),
    ("TP", "tensor parallel 8, one node", "10B", lambda n: (1, n, 1, 0), True,
     "4 all-reduces of (b, s, h) per layer per micro-batch on NVLink, on the critical path"),
    ("TP", "tensor parallel over all GPUs", "10B", lambda n: (1, n, 1, 0), False,
     "the same all-reduces over InfiniBand: the seed's range holds inside a node only"),
    ("PP", "pipeline over all GPUs", "10B", lambda n: (1, 1, n, 0), False,
     "the 1F1B bubble (p-1)/m falls with more micro-batches per step; each micro-batch's (b, s, h) activation "
     "crosses the stage boundaries on the critical path"),
    ("ZeRO-2", "ZeRO-2 over all GPUs", "10B", lambda n: (n, 1, 1, 2), False,
     "DP's volume (reduce-scatter + all-gather), not overlapped"),
    ("ZeRO-3", "ZeRO-3 over all GPUs", "10B", lambda n: (n, 1, 1, 3), False,
     "parameters all-gathered in forward and backward and gradients reduce-scattered for every micro-batch, where "
     "ZeRO-1/2 reduce-scatter and all-gather once per step; none of it prefetched or overlapped here"),
    ("FSDP", "FSDP full shard over all GPUs", "10B", lambda n: (n, 1, 1, 3), False,
     "FSDP's full shard is ZeRO-3: the same number; the seed's higher range for FSDP can only come from "
     "prefetching and overlap (or SHARD_GRAD_OP, which is ZeRO-2), not from the algorithm"),
)


def efficiency_estimates(gpu: str = "H100", nodes: int = 4, gpus_per_node: int = 8, inter_gbs_per_gpu: float = 50.0,
                         global_batch: int = 512, kernel_efficiency: float = 0.4) -> list[dict]:
    """Each seed method alone on ``nodes x gpus_per_node`` GPUs (400 Gb/s InfiniBand = 50 GB/s per GPU by default):
    scaling efficiency = time of the model FLOPs at the assumed kernel efficiency / step time (= planner MFU /
    kernel_efficiency), for the best feasible recomputation and micro-batch. No communication overlaps compute in
    the planner, so these are lower bounds for implementations that overlap (DDP, FSDP, DeepSpeed)."""
    cluster = Cluster(f"{nodes} x {gpus_per_node} {gpu}, {inter_gbs_per_gpu:g} GB/s per GPU", nodes, gpus_per_node,
                      inter_gbs_per_gpu)
    node = Cluster(f"1 x {gpus_per_node} {gpu}", 1, gpus_per_node, inter_gbs_per_gpu)
    out = []
    for method, what, size, layout_of, one_node, why in _METHOD_RUNS:
        on = node if one_node else cluster
        n, cfg = on.n_gpus, SIZES[size]
        dp, tp, pp, zero = layout_of(n)
        rows = [estimate(cfg, GPU_SPECS[gpu], on, Layout(dp, tp, pp, zero, ckpt, b), global_batch,
                         kernel_efficiency=kernel_efficiency)
                for ckpt in ("none", "selective", "full") for b in (1, 2, 4, 8)]
        feasible = sorted((r for r in rows if r.feasible), key=lambda r: r.time["total"])
        if not feasible:
            raise ValueError(f"{what}: no feasible layout for {size} on {on.name}: {rows[0].why}")
        best = feasible[0]
        eff = best.mfu / kernel_efficiency
        lo, hi = SEED_EFFICIENCY[method]
        t = best.time
        model_time = flops.step_flops(cfg, global_batch) / (n * GPU_SPECS[gpu].bf16_tflops * 1e12 * kernel_efficiency)
        overheads = {"recomputation": t["compute"] - model_time, "bubble": t["bubble"], "tp": t["tp"], "pp": t["pp"],
                     "dp": t["dp"]}
        top = sorted((k for k in overheads if overheads[k] > 0.01 * t["total"]), key=overheads.get, reverse=True)
        shares = ", ".join(f"{k} {overheads[k] / t['total']:.0%}" for k in top[:2]) or "no overhead"
        where = "within" if lo <= eff <= hi else ("below" if eff < lo else "above")
        verdict = f"{where} the seed's {lo:.0%}-{hi:.0%}: {shares} of the step; {why}"
        out.append(dict(method=method, what=what, model=size, gpus=n, layout=best.layout, efficiency=eff,
                        seed=(lo, hi), verdict=verdict, estimate=best))
    return out


def efficiency_table(rows: list[dict]) -> str:
    lines = [f"{'seed method':<7} {'run':<31} {'model':>5} {'GPUs':>4} {'planner':>8} {'seed':>9}  verdict"]
    for r in rows:
        lo, hi = r["seed"]
        lines.append(f"{r['method']:<7} {r['what']:<31} {r['model']:>5} {r['gpus']:>4} {r['efficiency']:>8.0%} "
                     f"{f'{lo:.0%}-{hi:.0%}':>9}  {r['verdict'].split(':')[0]}")
    return "\n".join(lines)
