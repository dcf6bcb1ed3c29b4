"""Lesson 05's side-by-side comparison, its chart and the ZeRO memory calculator.

    rows, hw = compare(cfg, nprocs=2, steps=5)      # own ZeRO-1/2/3, DeepSpeed 0-3, FSDP2, DDP: real runs
    print(format_table(rows, hw)); comparison_chart(rows, hw)
    zero_calculator()                                # ipywidgets: preset, N, stage, offload, precision

Predicted memory is `course_lib.theory.memory.zero_model_state_bytes` (fp32 here: the runs train in fp32 so
that every variant can be compared with DDP exactly).
"""

from __future__ import annotations

from course_lib.config import PRESETS, ModelConfig
from course_lib.launch import run
from course_lib.theory.memory import activation_bytes, num_param_tensors, zero_model_state_bytes

__all__ = ["STAGE_OF", "LABELS", "pick_backend", "compare", "format_table", "comparison_chart", "calculator_bytes",
           "zero_calculator", "rank_compare"]

STAGE_OF = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3, "ds0": 0, "ds1": 1, "ds2": 2, "ds3": 3,
            "ds2-offload": 2, "ds3-offload": 3, "ds2-bf16": 2, "zero1-bf16": 1, "zero2-bf16": 2, "zero3-bf16": 3}
LABELS = {"ddp": "PyTorch DDP", "zero1": "own ZeRO-1", "zero2": "own ZeRO-2", "zero3": "own ZeRO-3",
          "fsdp2": "FSDP2 fully_shard", "ds0": "DeepSpeed stage 0", "ds1": "DeepSpeed ZeRO-1",
          "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3", "ds2-offload": "DeepSpeed ZeRO-2 + offload",
          "ds3-offload": "DeepSpeed ZeRO-3 + offload", "ds2-bf16": "DeepSpeed ZeRO-2 bf16",
          "zero1-bf16": "own ZeRO-1 bf16", "zero2-bf16": "own ZeRO-2 bf16", "zero3-bf16": "own ZeRO-3 bf16"}
DEFAULT_MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "ds0", "ds1", "ds2", "ds3", "ds2-offload", "ds3-offload",
                 "zero1-bf16", "zero2-bf16", "zero3-bf16", "ds2-bf16")


def rank_compare(cfg: ModelConfig, batches, modes) -> dict:
    """Runs on every rank: every mode on the same data, plus the hardware label."""
    from course_lib import dist as cdist
    from course_lib.measure import hardware_label
    from course_lib.parallel import zero_experiments as Z

    out = {m: Z.rank_train(cfg, batches, m) for m in modes}
    return {"runs": out, "hardware": hardware_label(cdist.backend(), cdist.device())}


def pick_backend(nprocs: int) -> str:
    """'auto' (NCCL, one GPU per rank) when there are enough GPUs for `nprocs` ranks, else 'gloo' (CPU ranks):
    a lesson runs the same experiment on a laptop, a one-GPU machine and a GPU node."""
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() < nprocs:
        return "gloo"
    return "auto"


def compare(cfg: ModelConfig, nprocs: int = 2, steps: int = 5, global_batch: int = 8,
            modes=DEFAULT_MODES, timeout_s: float = 300, backend: str | None = None) -> tuple[list[dict], str]:
    """Train every mode for `steps` steps on `nprocs` ranks; one row per mode (rank 0's numbers):
    mode, label, stage, measured (model-state bytes counted from tensors; None for DeepSpeed), live (every live
    tensor: what the library really holds), predicted (formula), step_s, loss (last), dloss / dparam (largest
    difference from DDP), ok (losses within 1e-5 of DDP's, parameters within 1e-4: Adam divides by
    sqrt(v) + eps, which turns last-bit differences of gradients near 0 into weight changes of ~1e-5; bf16 runs:
    losses within 2e-2), comm (own ZeRO: payload bytes per collective over all
    steps), padded_numel, steps."""
    from course_lib.model import build_model
    from course_lib.parallel import zero_experiments as Z

    batches = Z.make_batches(cfg, global_batch, steps)
    modes = ("ddp",) + tuple(m for m in modes if m != "ddp")
    res = run(rank_compare, nprocs, args=(cfg, batches, modes), timeout_s=timeout_s, stream=False,
              backend=backend or pick_backend(nprocs))
    runs, hw = res.value["runs"], res.value["hardware"]
    P = cfg.num_params()
    T = len(list(build_model(cfg).parameters()))
    ref = runs["ddp"]
    rows = []
    for m in modes:
        r = runs[m]
        dloss = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
        dparam = max((r["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        bf16 = m.endswith("bf16")                     # mixed precision: its own formula, a looser loss match
        pred = zero_model_state_bytes(P, nprocs, STAGE_OF[m], mixed=bf16,
                                      offload="optimizer" if m.endswith("offload") else None,
                                      step_counters=T)
        rows.append(dict(mode=m, label=LABELS[m], stage=STAGE_OF[m], n=nprocs,
                         measured=r["state"]["total"] if r["state"] else None, live=r["live_bytes"],
                         predicted=pred["total"] + pred["cpu"], step_s=r["step_s"], loss=r["losses"][-1],
                         dloss=dloss, dparam=dparam,
                         ok=dloss <= 2e-2 if bf16 else (dloss <= 1e-5 and dparam <= 1e-4),
                         comm=r["comm"], padded_numel=r["padded_numel"], steps=steps))
    return rows, f"{hw} ({res.backend}, {nprocs} ranks)"


def format_table(rows: list[dict], hardware: str) -> str:
    """The comparison as a fixed-width text table; bytes per rank in KB."""
    head = (f"{'variant':28s} {'stage':>5s} {'formula KB':>10s} {'state KB':>9s} {'live KB':>9s} "
            f"{'live/DDP':>8s} {'step ms':>8s} {'loss':>8s} {'max|dp| vs DDP':>14s}")
    ddp_live = next(r["live"] for r in rows if r["mode"] == "ddp")
    lines = [f"measured on {hardware}", head, "-" * len(head)]
    for r in rows:
        state = f"{r['measured'] / 1e3:9.1f}" if r["measured"] is not None else f"{'-':>9s}"
        lines.append(f"{r['label']:28s} {r['stage']:5d} {r['predicted'] / 1e3:10.1f} {state} {r['live'] / 1e3:9.1f} "
                     f"{r['live'] / ddp_live:8.2f} {r['step_s'] * 1e3:8.1f} {r['loss']:8.4f} {r['dparam']:14.1e}")
    return "\n".join(lines)


def comparison_chart(rows: list[dict], hardware: str):
    """Two panels: per-rank memory (formula vs state counted vs every live tensor) and median step time."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(rows))
    a.bar(x - 0.27, [r["predicted"] / 1e3 for r in rows], 0.27, label="formula (fp32 Adam)", color="#bbbbbb")
    a.bar(x, [(r["measured"] or 0) / 1e3 for r in rows], 0.27, label="model state counted", color="#1f77b4")
    a.bar(x + 0.27, [r["live"] / 1e3 for r in rows], 0.27, label="all live tensors", color="#ff7f0e")
    a.set_xticks(x, [r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
    a.set_ylabel("KB per rank")
    a.set_title("Memory per rank")
    a.legend(fontsize=8)
    b.bar(x, [r["step_s"] * 1e3 for r in rows], color="#2ca02c")
    b.set_xticks(x, [r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
    b.set_ylabel("ms (median)")
    b.set_title("Step time")
    fig.suptitle(hardware, fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------ the calculator

def calculator_bytes(preset: str, world_size: int, stage: int, offload: str | None = None, mixed: bool = True,
                     micro_batch: int = 1) -> dict:
    """Per-rank bytes by formula for a preset: params / grads / optimizer (on the device), offloaded (CPU),
    activations (one micro-batch, not sharded by ZeRO), total on the device."""
    cfg = PRESETS[preset]
    s = zero_model_state_bytes(cfg.num_params(), world_size, stage, mixed, offload)
    act = activation_bytes(cfg, micro_batch, dtype="bf16" if mixed else "fp32")["total"]
    out = dict(params=s["params"], grads=s["grads"], optimizer=s["optimizer"], activations=act, cpu=s["cpu"])
    out["device_total"] = s["total"] + act
    out["num_param_tensors"] = num_param_tensors(cfg)
    return out


def zero_calculator():
    """ipywidgets: model preset, N, stage, offload, precision, micro-batch; stacked bars for stages 0-3."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    preset = w.Dropdown(options=list(PRESETS), value="llama-7b", description="model")
    n = w.IntSlider(value=8, min=1, max=1024, description="ranks N")
    stage = w.Dropdown(options=[0, 1, 2, 3], value=2, description="stage")
    offload = w.Dropdown(options=[None, "optimizer", "param"], value=None, description="offload")
    mixed = w.Dropdown(options=[("bf16 mixed", True), ("fp32", False)], value=True, description="precision")
    mb = w.IntSlider(value=1, min=1, max=32, description="micro-batch")
    out = w.Output()

    def update(*_):
        with out:
            out.clear_output(wait=True)
            off = offload.value if (offload.value != "param" or stage.value == 3) else None
            cur = calculator_bytes(preset.value, n.value, stage.value, off, mixed.value, mb.value)
            print(f"{preset.value}, N={n.value}, stage {stage.value}, offload {off}: "
                  f"{cur['device_total'] / 1e9:.2f} GB per rank on the device "
                  f"(+{cur['cpu'] / 1e9:.2f} GB in CPU memory); formula, not measured")
            fig, ax = plt.subplots(figsize=(7, 3.2))
            parts = ("params", "grads", "optimizer", "activations")
            for s in range(4):
                b = calculator_bytes(preset.value, n.value, s, None, mixed.value, mb.value)
                bottom = 0.0
                for k, color in zip(parts, ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")):
                    ax.bar(f"stage {s}", b[k] / 1e9, bottom=bottom, color=color, label=k if s == 0 else None,
                           edgecolor="k" if s == stage.value else None)
                    bottom += b[k] / 1e9
            ax.set_ylabel("GB per rank")
            ax.set_title(f"{preset.value} on {n.value} ranks (formula)")
            ax.legend(fontsize=8)
            display(fig)
            plt.close(fig)

    for c in (preset, n, stage, offload, mixed, mb):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, n]), w.HBox([stage, offload, mixed]), mb, out])
