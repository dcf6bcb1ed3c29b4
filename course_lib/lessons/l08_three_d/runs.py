"""Published training runs as data (lesson 08): each source, each run's model, cluster, batch, layout and reported
throughput with the lines it was read from (``note``), and what the planner leaves out for it (``why_not``).
`course_lib.lessons.l08_three_d.published` checks them against the planner; `.throughput` prices their throughput.

- :data:`PUBLISHED`: Megatron-LM's GPT-3 175B, BLOOM-176B, Llama 3 405B at 8K and 16K GPUs.
- :data:`WEAK_SCALING`: Narayanan et al. 2021's table 1; :data:`THROUGHPUT_RUNS`: those plus :data:`PUBLISHED`;
  :data:`CALIBRATION`: the one row that sets the A100's matmul efficiency; :data:`CALIBRATIONS`: one row per GPU
  generation (:data:`GENERATION` maps a GPU to its generation).
- :data:`LONG_CONTEXT` (Llama 3's 128K row, CP 16), :data:`MOE_RUNS` (DeepSeek-V3, EP 64), :data:`TORCHTITAN_405B`.
"""

from __future__ import annotations

import dataclasses

from course_lib.config import ModelConfig, get_preset
from course_lib.measure.hardware import GPU_SPECS
from course_lib.theory import flops
from course_lib.theory.planner import Cluster, MoESpec

__all__ = ["LEFT_OUT", "Source", "PublishedRun", "PUBLISHED", "LLAMA3_128K", "LONG_CONTEXT", "DEEPSEEK_V3_CFG",
           "DEEPSEEK_V3_MHA", "DEEPSEEK_V3_MLA", "DEEPSEEK_V3_MOE", "DEEPSEEK_TOKENS_PER_GPU_S", "H800_FP8_TFLOPS",
           "DEEPSEEK_V3", "MOE_RUNS", "WEAK_SCALING", "THROUGHPUT_RUNS", "CALIBRATION", "TORCHTITAN_405B",
           "CALIBRATIONS", "GENERATION"]

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
    assumed: str = ""                   # what the pricing assumes where the source is silent (bench_planner prints it)
    matmuls: str = "flat"               # its GEMMs priced at one efficiency, or by their shapes (`planner.matmuls`)

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
    "`throughput_table` calibrates one per GPU generation instead, the H100's on the 8K row). Not scored in the "
    "published-throughput table.")

_LLAMA3_ASSUMED = ("1F1B for its interleaved schedule on uneven stages; FSDP as ZeRO-1; no recomputation (stated "
                   "at 8K) and micro-batch 1 (not stated); DP overlapped, TP collectives exposed (not stated)")

PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(
        "Megatron-LM GPT-3 175B", "gpt3-175b", "A100", 192, 8, 25.0, "8 x 200 Gb/s HDR InfiniBand per node",
        global_batch=1536, seq_len=2048, dp=16, tp=8, pp=12, zero=0, ckpt="full", micro_batch=1,
        schedule="1F1B (table 2 does not say whether interleaved)", reported_tflops=141.0, counts_recompute=True,
        stated_mfu=141 / 312, grad_bytes=4, source=NARAYANAN, pipeline="1f1b", overlap="none", kernels="unfused",
        assumed="1F1B (table 2 does not say whether interleaved); ZeRO-0 and fp32 gradients; DP and TP collectives "
                "exposed (no overlap stated)",
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
        assumed="DP and TP collectives exposed (DeepSpeed's pipeline engine; no TP overlap stated); no sequence "
                "parallelism (the fork had none)",
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
        why_not=_LLAMA3_WHY, assumed=_LLAMA3_ASSUMED),
    PublishedRun(
        "Llama 3 405B, 8K GPUs", "llama3-405b", "H100", 1024, 8, 50.0, "400 Gb/s RoCE per GPU",
        global_batch=2048, seq_len=8192, dp=64, tp=8, pp=16, zero=None, ckpt=None, micro_batch=None,
        schedule="interleaved 1F1B (flexible number of micro-batches)", reported_tflops=430.0,
        counts_recompute=False, stated_mfu=0.43, grad_bytes=4, source=LLAMA3, overlap="dp", kernels="fused",
        flop_count="model", scored=False,
        note="Table 4, row 1: 8,192 GPUs, TP 8, CP 1, PP 16, DP 64, sequence 8,192, batch size/DP 32, 16M tokens, "
             "430 TFLOP/s per GPU, 43 % BF16 MFU; cluster, FSDP, fp32 gradients (grad_bytes 4), no activation "
             "checkpointing and the schedule as the 16K row.",
        why_not=_LLAMA3_WHY, assumed=_LLAMA3_ASSUMED),
)


# Llama 3's long-context row (issue 31): context parallelism 16. Not in PUBLISHED nor THROUGHPUT_RUNS (lesson 08's
# tables stay as they are); benchmarks/bench_planner.py adds it to its table and prints `long_context_text`.
LLAMA3_128K = PublishedRun(
    "Llama 3 405B, 128K context", "llama3-405b", "H100", 2048, 8, 50.0, "400 Gb/s RoCE per GPU",
    global_batch=128, seq_len=131072, dp=8, tp=8, pp=16, zero=None, ckpt=None, micro_batch=None,
    schedule="interleaved 1F1B (flexible number of micro-batches)", reported_tflops=380.0,
    counts_recompute=False, stated_mfu=0.38, grad_bytes=4, source=LLAMA3, overlap="dp", kernels="fused",
    flop_count="model", scored=False, cp=16, cp_variant="all_gather",
    assumed=_LLAMA3_ASSUMED.replace("(stated at 8K)", "(not stated at 128K)") + "; the all-gather exposed",
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
# Hopper's dense FP8 tensor-core peak, twice its bf16 peak (measure/hardware.py, GPUSpec.fp8_tflops)
H800_FP8_TFLOPS = GPU_SPECS["H800"].fp8_tflops
DEEPSEEK_V3 = PublishedRun(
    "DeepSeek-V3 671B MoE", "deepseek-v3", "H800", 256, 8, 50.0, "InfiniBand, 50 GB/s per GPU",
    global_batch=15360, seq_len=4096, dp=128, tp=1, pp=16, zero=1, ckpt="full", micro_batch=None,
    schedule="DualPipe", reported_tflops=_DSV3_TFLOPS, counts_recompute=False,
    stated_mfu=_DSV3_TFLOPS / GPU_SPECS["H800"].bf16_tflops, grad_bytes=4, source=DEEPSEEK, pipeline="zb-h1",
    overlap="dp", kernels="fused", flop_count="model", scored=False, model=DEEPSEEK_V3_CFG, moe=DEEPSEEK_V3_MOE,
    ep=64, matmuls="shapes", assumed="micro-batch 1 (not stated); ZB-H1 for DualPipe; full recomputation for its partial one; the "
                   "all-to-alls exposed; FP8 GEMMs priced as bf16",
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
         "parameters and FLOPs are MLA's), FP8 matmuls (priced in bf16, each GEMM by its shape, at the H100's matmul "
         "efficiency calibrated on Llama 3's 8K row, against the H800's bf16 peak), DualPipe (ZB-H1 stands in; its overlap of the all-to-alls with another "
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
    "optimisation of cross-node p2p, uneven stages (the first and last hold the embedding and the head), and a "
    "kernel efficiency that changes with matmul shapes (priced only on request, matmuls='shapes': its tile and wave "
    "quantization and roofline do not explain this table's small rows, lesson 08 section 5.2; the projections and "
    "the MLP sit above the A100's ridge point, the unfused attention core below it).")


def _table_1_run(row) -> PublishedRun:
    name, a, h, L, tp, pp, gpus, batch, tflops, pct, mbs, v, ddp = row
    cfg = ModelConfig(vocab_size=51200, seq_len=2048, n_layer=L, n_head=a, d_model=h, name=f"gpt-{name.lower()}")
    return PublishedRun(
        f"Megatron-LM {name} (table 1)", cfg.name, "A100", gpus // 8, 8, 25.0, "8 x 200 Gb/s HDR InfiniBand per node",
        global_batch=batch, seq_len=2048, dp=gpus // (tp * pp), tp=tp, pp=pp, zero=0, ckpt="full", micro_batch=mbs,
        schedule=(f"interleaved, v = {v}" if v > 1 else "1F1B") + f" (run_table_1.sh, MBS {mbs}, DDP {ddp})",
        reported_tflops=float(tflops), counts_recompute=True, stated_mfu=pct / 100, grad_bytes=4,
        source=NARAYANAN_T1, note=_TABLE_1_NOTE, why_not=_TABLE_1_WHY, pipeline="interleaved" if v > 1 else "1f1b",
        assumed="ZeRO-0 and fp32 gradients; TP collectives exposed (run_table_1.sh sets no TP overlap flag; its "
                "CONFIG.sh is not in the index)",
        v=v, overlap="dp" if ddp == "torch" else "none", kernels="unfused", flop_count="megatron", model=cfg)


WEAK_SCALING: tuple[PublishedRun, ...] = tuple(_table_1_run(r) for r in _TABLE_1)
# every run whose layout and throughput are both stated, in one GPU type's table (A100 first, then H100)
THROUGHPUT_RUNS: tuple[PublishedRun, ...] = WEAK_SCALING + PUBLISHED
CALIBRATION = "Megatron-LM 145.6B (table 1)"   # the one row that sets the A100's efficiency (chosen before looking)
# One constant per GPU generation (issue 44), each set by ONE row. The H100's: Llama 3's 8K-GPU row, the H100 row on
# the smaller cluster (8,192 GPUs, half the 16K row's network), chosen after the A100 constant's errors on both Llama
# rows were known (-14.5 % and -29.3 %, bench_planner.py before this change): a choice made with the results in view,
# said here. Its constant absorbs what the planner cannot express for that row (an interleaved schedule on uneven
# stages, for which 1F1B stands in, with a too-large bubble; freed stage tensors), so it is likely above the H100
# matmuls' real fraction of peak, and not a measurement of it. The H800 takes the H100's (the same GH100 die and bf16 peak,
# `hardware.GPU_SPECS`; no H800 row states its layout and throughput).
CALIBRATIONS = {"A100": CALIBRATION, "H100": "Llama 3 405B, 8K GPUs"}
GENERATION = {"A100": "A100", "H100": "H100", "H800": "H100"}

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
    # power-capped: not the H100 SXM5 80GB at 700 W that GPU_SPECS["H100"] describes
    hardware="H100s with 96GB HBM2e at 2.4 TB/sec, 'the default 500W power limit' (the same docs/performance.md, "
             "since moved to benchmarks/llama3_h100_202412_torchtitan.md): "
             "power-capped, priced as the H100 SXM5 80GB (3,350 GB/s, 700 W), so only the ratio of the two "
             "schedules is compared",
    assumed="v = 2 (torchtitan's default for a looped schedule) and m = 8 micro-batches of 4 sequences for both "
            "schedules (n_microbatches defaults to the pipeline degree in torchtitan's build_pipeline_schedule of "
            "late 2024; a later version defaults to pp x stages per rank); Float8 and async TP as in the table, "
            "priced as bf16 at the H100's calibrated matmul efficiency with TP overlapped (the gain moves by < 0.5 "
            "points for efficiencies 0.3-0.8); FSDP as ZeRO-1 (FSDP with a pipeline is not modelled); torchtitan "
            "splits the 126 layers into 16 chunks of 7-8 (generate_split_points), which Megatron-LM's rule, and so "
            "the planner, refuses (v = 2 does not divide 126 / 8 layers per stage): the interleaved row is priced "
            "anyway, with ceil(126 / 8) = 16 layers per stage, its refusal shown beside it")

