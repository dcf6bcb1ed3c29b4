"""The planner's vocabulary (lesson 08; `course_lib.theory.planner`): a cluster, a layout, an estimate, the choices
each field takes, where a group of ranks lies (`link`), and why a layout cannot run (`layout_refusals`,
`cp_refusals`, `ep_refusals`: every reason names the field and the fix). The rules are in the package docstring.
"""

from __future__ import annotations

import dataclasses

from course_lib.config import ModelConfig
from course_lib.theory import context as cp_theory
from course_lib.theory.experts import MoESpec

__all__ = ["Cluster", "Layout", "Estimate", "link", "layout_refusals", "cp_refusals", "ep_refusals", "CKPT", "GiB",
           "NOT_MODELLED", "SCHEDULES", "OVERLAPS", "ELEMENTWISE", "DDP_BUCKET_BYTES", "TRAFFIC_PASSES", "CP_VARIANTS",
           "ATTENTION", "MATMULS", "block_of", "resolve_block"]

CKPT = ("none", "selective", "full")
GiB = 2 ** 30           # GPU memory: an "80 GB" A100 holds 80 GiB (nvidia-smi: 81,920 MiB), not 80 x 10^9 bytes
NOT_MODELLED = "not modelled (DeepSpeed and Megatron refuse it; torchtitan does it)"
SCHEDULES = ("1f1b", "interleaved", "zb-h1")     # pipeline schedules (lesson 03; `theory.pipeline`)
OVERLAPS = ("none", "dp", "dp+tp", "tp-bwd", "dp+tp-bwd")   # what communication hides behind compute (`step_time`)
ELEMENTWISE = ("none", "fused", "unfused")      # the memory-bound kernels' HBM traffic (`elementwise_bytes`)
DDP_BUCKET_BYTES = 25 * 2 ** 20                 # PyTorch DDP's bucket_cap_mb=25: the last bucket cannot hide
TRAFFIC_PASSES = {"none": 4, "selective": 4, "full": 5}   # HBM passes over what a layer keeps (`elementwise_bytes`)
CP_VARIANTS = cp_theory.VARIANTS                         # "ring", "all_gather", "ulysses" (lesson 10)
ATTENTION = ("flash", "naive")          # a fused kernel (no s x s scores kept) or the scores kept for backward
MATMULS = ("flat", "shapes")            # one efficiency for every FLOP, or each GEMM by its shape (`matmuls`)


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
    overlap: str = "none"               # "none", "dp" (DP/ZeRO buckets), "dp+tp" (also TP: --tp-comm-overlap),
                                        # "tp-bwd" / "dp+tp-bwd" (TP's backward collectives behind weight gradients)
    cp: int = 1                         # context-parallel ranks: each holds s/cp tokens of every sequence
    cp_variant: str = "ring"            # "ring", "all_gather" (Llama 3) or "ulysses" (`CP_VARIANTS`)
    ep: int = 1                         # expert-parallel ranks, borrowed from dp x cp (a MoE model only)
    sp: bool | None = None              # sequence parallelism (None: as ``elementwise`` implies, `block_of`)
    attention: str | None = None        # "flash" or "naive" (None: as ``elementwise`` implies, `block_of`)

    def label(self) -> str:
        """``dp16 tp8 pp12 zero0 ckpt=full mb1``, then the schedule and overlap where they are not the defaults;
        ``cp16`` (and the variant unless ring) after pp where cp > 1; ``ep64`` after them where ep > 1."""
        cp = f" cp{self.cp}" + (f" {self.cp_variant}" if self.cp_variant != "ring" else "") if self.cp > 1 else ""
        cp += f" ep{self.ep}" if self.ep > 1 else ""
        out = f"dp{self.dp} tp{self.tp} pp{self.pp}{cp} zero{self.zero} ckpt={self.ckpt} mb{self.micro_batch}"
        if self.schedule != "1f1b":
            out += f" {self.schedule}" + (f" v{self.v}" if self.schedule == "interleaved" else "")
        out += f" sp={'on' if self.sp else 'off'}" if self.sp is not None else ""
        out += f" attention={self.attention}" if self.attention is not None else ""
        return out + (f" overlap={self.overlap}" if self.overlap != "none" else "")


def resolve_block(sp: bool | None, attention: str | None, elementwise: str = "none") -> tuple[bool, str]:
    """(sequence parallelism, attention kernel): ``sp`` and ``attention`` where set, else what ``elementwise`` has
    always meant: "unfused" is Megatron-LM's 2021 block (no sequence parallelism, the ``a s x s`` scores kept),
    "fused" and "none" today's (sequence parallelism, a fused kernel). Megatron-LM's 2022 runs (Korthikanti et al.)
    are ``sp=True, attention="naive"``."""
    old = elementwise == "unfused"
    return (not old if sp is None else sp, ("naive" if old else "flash") if attention is None else attention)


def block_of(layout: Layout, elementwise: str = "none") -> tuple[bool, str]:
    """(sequence parallelism, attention kernel) of the layout's transformer block (`resolve_block` of its own
    ``sp`` and ``attention``)."""
    return resolve_block(layout.sp, layout.attention, elementwise)


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



def link(cluster: Cluster, gpu, stride: int, size: int) -> tuple[float, float]:
    """(alpha in s, bandwidth in bytes/s) of a group of ``size`` ranks ``stride`` apart: NVLink (the GPU's link)
    when every such group lies inside one node, i.e. when ``stride x size`` divides the GPUs per node (a group of 3
    consecutive ranks on 8-GPU nodes has one group across two nodes), else the network between nodes."""
    span = stride * size
    if size == 1 or cluster.inter_gbs_per_gpu is None or cluster.gpus_per_node % span == 0:
        return cluster.alpha_us * 1e-6, gpu.link_gbs * 1e9
    return cluster.inter_alpha_us * 1e-6, min(gpu.link_gbs, cluster.inter_gbs_per_gpu) * 1e9



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



def layout_refusals(cfg: ModelConfig, cluster: Cluster, layout: Layout, global_batch: int, seq_len: int,
                    moe: MoESpec | None = None) -> tuple[list[str], str, int]:
    """(why the layout cannot run, what is not modelled, m = micro-batches per DP rank per step). A value that is
    none of a field's choices raises ValueError; a layout that does not fit the model, the cluster or the batch
    gets its reasons, each naming the field and the fix (memory is `estimate`'s to judge)."""
    s = seq_len
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
    if layout.sp not in (None, True, False):
        raise ValueError(f"sp={layout.sp!r}: True (sequence parallelism), False or None (as elementwise implies)")
    if layout.attention not in (None, *ATTENTION):
        raise ValueError(f"attention={layout.attention!r}: choose one of {', '.join(ATTENTION)} (or None: as "
                         f"elementwise implies)")
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
    return why, not_modelled, accum
