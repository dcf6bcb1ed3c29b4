"""What a training run costs and how often to checkpoint it, by formula (lesson 09).

Cost: a run of D tokens on a model of N parameters needs C = 6 N D FLOPs (`theory.flops.training_flops`);
on G GPUs of peak P FLOP/s running at model FLOPs utilisation MFU it takes C / (G P MFU) seconds, i.e.

    GPU-hours = 6 N D / (P x MFU) / 3600          money = GPU-hours x price per GPU-hour

Checkpoint interval (Young 1974, "A first order approximation to the optimum checkpoint interval"; Daly 2006,
"A higher order estimate of the optimum checkpoint interval for restart dumps"): writing a checkpoint costs
delta seconds; failures arrive with mean time between failures M (a job of G GPUs fails G times as often as one
GPU: M_job = M_gpu / G). Checkpointing every tau seconds loses delta / tau of the time to writing and, per failure,
on average tau / 2 of recomputation (plus the restart R): the waste per second is about

    delta / tau + (tau / 2 + R) / M        minimised at  tau* = sqrt(2 delta M)      (Young's first order)

Daly's higher-order optimum, tau* = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + delta / 18M] - delta for
delta < 2M, differs by a few percent when delta << M.

M from a published run (`gpu_hours_per_interruption`): Llama 3's pre-training (Llama 3 team 2024, section 3.3.4)
had 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s, from all causes (GPUs and their memory
58.7 % of them, then software bugs, network switches and cables, host maintenance, ...): one per ~50,700
GPU-hours of the job. Every interruption stops the job, whatever its cause, so that is the M to use.

delta from the checkpoint's size (`checkpoint_bytes`): a mixed-precision Adam run saves 14 bytes per parameter,
bf16 weights (2) + fp32 master weights (4) + Adam's two fp32 moments (4 + 4); the gradients are not saved.
"""

from __future__ import annotations

import math

__all__ = ["gpu_hours", "training_cost", "job_mtbf", "young_daly_interval", "daly_interval", "waste_fraction",
           "gpu_hours_per_interruption", "CHECKPOINT_BYTES_PER_PARAM", "checkpoint_bytes"]


def gpu_hours(total_flops: float, peak_flops_per_gpu: float, mfu: float) -> float:
    """GPU-hours to spend ``total_flops`` at ``mfu`` of a GPU's peak: C / (P x MFU) / 3600."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]: a fraction of the peak, e.g. 0.4")
    return total_flops / (peak_flops_per_gpu * mfu) / 3600


def training_cost(n_params: float, n_tokens: float, peak_flops_per_gpu: float, mfu: float,
                  usd_per_gpu_hour: float, n_gpus: int = 1) -> dict:
    """{'flops', 'gpu_hours', 'days' (on n_gpus), 'usd'} of training by the 6 N D rule."""
    from course_lib.theory.flops import training_flops

    flops = training_flops(n_params, n_tokens)
    hours = gpu_hours(flops, peak_flops_per_gpu, mfu)
    return {"flops": flops, "gpu_hours": hours, "days": hours / n_gpus / 24, "usd": hours * usd_per_gpu_hour}


def job_mtbf(gpu_mtbf_s: float, n_gpus: int) -> float:
    """Mean time between failures of a job that stops when any of its n_gpus fails (independent failures)."""
    return gpu_mtbf_s / n_gpus


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum checkpoint interval sqrt(2 delta M), seconds of work between checkpoints."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37) for delta < 2M; M itself beyond."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    r = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - checkpoint_s


def waste_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order fraction of a job's time lost to checkpoints and to recomputation after failures:
    delta / tau + (tau / 2 + R) / M."""
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def gpu_hours_per_interruption(interruptions: int, days: float, n_gpus: int) -> float:
    """GPU-hours of a job per interruption: n_gpus x days x 24 / interruptions (Llama 3: 419 in 54 days on 16,384
    GPUs, about 50,700). It counts every cause that stopped the job, not GPU failures alone."""
    if not interruptions > 0:
        raise ValueError(f"interruptions={interruptions!r} must be > 0")
    return n_gpus * days * 24 / interruptions


# What a mixed-precision Adam checkpoint holds per parameter (bytes); gradients are recomputed, not saved.
CHECKPOINT_BYTES_PER_PARAM = {"bf16 weights": 2, "fp32 master weights": 4, "Adam m (fp32)": 4, "Adam v (fp32)": 4}


def checkpoint_bytes(n_params: float, bytes_per_param: dict | None = None) -> float:
    """Bytes of a checkpoint of ``n_params`` parameters: 14 per parameter by default (`CHECKPOINT_BYTES_PER_PARAM`;
    a 175B model: 2.45e12 B)."""
    return n_params * sum((bytes_per_param or CHECKPOINT_BYTES_PER_PARAM).values())
