"""The experiments of lesson 05 (ZeRO and sharded data parallelism): every variant side by side.

    rows, hw = compare(cfg, nprocs=2, steps=5)      # own ZeRO-1/2/3, DeepSpeed 0-3, FSDP2, DDP: real runs
    print(report.format_table(rows, hw)); report.comparison_chart(rows, hw)

Every variant trains with `course_lib.lessons.variants.train_variant` (shared with lessons 06 and 07): the same
model, data and optimizer, so that each can be compared with PyTorch DDP exactly. Predicted memory is
`course_lib.theory.memory.zero_model_state_bytes` (fp32 here, bf16 for the mixed-precision variants).
"""

from __future__ import annotations

from course_lib import dist as cdist
from course_lib.config import ModelConfig
from course_lib.data import random_batches
from course_lib.measure.hardware import hardware_label
from course_lib.runtime.launch import run
from course_lib.lessons.variants import VARIANTS, train_variant
from course_lib.model import build_model
from course_lib.theory.memory import zero_model_state_bytes

__all__ = ["DEFAULT_VARIANTS", "rank_compare", "compare"]

DEFAULT_VARIANTS = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "ds0", "ds1", "ds2", "ds3", "ds2-offload",
                    "ds3-offload", "zero1-bf16", "zero2-bf16", "zero3-bf16", "ds2-bf16")


def rank_compare(cfg: ModelConfig, batches, variants) -> dict:
    """Runs on every rank: every variant on the same data, plus the hardware label."""
    out = {v: train_variant(cfg, batches, v) for v in variants}
    return {"runs": out, "hardware": hardware_label(cdist.backend(), cdist.device())}


def compare(cfg: ModelConfig, nprocs: int = 2, steps: int = 5, global_batch: int = 8,
            variants=DEFAULT_VARIANTS, timeout_s: float = 300) -> tuple[list[dict], str]:
    """Train every variant for `steps` steps on `nprocs` ranks; one row per variant (rank 0's numbers):
    variant, label, stage, bf16, measured (model-state bytes counted from tensors; None for DeepSpeed), live
    (every live tensor: what the library really holds), predicted (formula), step_s, loss (last), dloss / dparam
    (largest difference from DDP), ok (losses within 1e-5 of DDP's, parameters within 1e-4: Adam divides by
    sqrt(v) + eps, which turns last-bit differences of gradients near 0 into weight changes of ~1e-5; bf16 runs:
    losses within 2e-2), comm (own ZeRO: payload bytes per collective over all steps), padded_numel, steps."""
    batches = random_batches(cfg, global_batch, steps)
    variants = ("ddp",) + tuple(v for v in variants if v != "ddp")
    res = run(rank_compare, nprocs, args=(cfg, batches, variants), timeout_s=timeout_s, stream=False)
    runs, hw = res.value["runs"], res.value["hardware"]
    P = cfg.num_params()
    T = len(list(build_model(cfg).parameters()))
    ref = runs["ddp"]
    rows = []
    for name in variants:
        r, v = runs[name], VARIANTS[name]
        dloss = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        dparam = max((r["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        pred = zero_model_state_bytes(P, nprocs, v.stage, mixed=v.bf16, offload="optimizer" if v.offload else None,
                                      step_counters=T)
        rows.append(dict(variant=name, label=v.label, stage=v.stage, bf16=v.bf16, n=nprocs,
                         measured=r["state"]["total"] if r["state"] else None, live=r["live_bytes"],
                         predicted=pred["total"] + pred["cpu"], step_s=r["step_s"], loss=r["losses"][-1],
                         dloss=dloss, dparam=dparam,
                         ok=dloss <= 2e-2 if v.bf16 else (dloss <= 1e-5 and dparam <= 1e-4),
                         comm=r["comm"], padded_numel=r["padded_numel"], steps=steps))
    return rows, f"{hw} ({res.backend}, {nprocs} ranks)"
