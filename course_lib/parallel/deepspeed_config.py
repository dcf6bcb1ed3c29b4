"""DeepSpeed as the course runs it (lessons 05-07 and the training script): imported for this machine (the CPU
accelerator and no compiled ops where there is no GPU), and configured in the syllabus's style (ZeRO stage, CPU
offload, precision) with the settings that make it train exactly what the course's own implementations train."""

from __future__ import annotations

import os

import torch

from course_lib import dist as cdist
from course_lib.measure.hardware import cpu_features

__all__ = ["import_deepspeed", "deepspeed_accepts_fp16", "deepspeed_config"]


def import_deepspeed():
    """Import DeepSpeed for this machine: the CPU accelerator when there is no GPU, and no compiled ops.

    On CPU DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce kernel with ninja
    (minutes, and a compiler the learner may not have); the course uses plain torch.distributed (gloo)
    instead, so that build is switched off here. The optimizer is torch's AdamW, never DeepSpeed's compiled
    CPUAdam."""
    if not cdist.is_cuda():                           # gloo ranks compute on the CPU, even on a GPU machine
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import sys

    import deepspeed
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None   # (deepspeed.comm.torch is torch itself)
    return deepspeed


def deepspeed_accepts_fp16() -> bool:
    """Whether DeepSpeed trains with ``"fp16"`` here: on a GPU, or on a CPU with native fp16 kernels (its CPU
    accelerator asks `torch.ops.mkldnn._is_mkldnn_fp16_supported`, as `course_lib.measure.hardware.cpu_features` does)."""
    return torch.cuda.is_available() or cpu_features()["fp16"]


def deepspeed_config(stage: int, micro_batch: int, offload: bool = False, precision: str = "fp32",
                     bucket_numel: int = 2 ** 16) -> dict:
    """A DeepSpeed config in the syllabus's style: ZeRO stage, optional CPU offload, precision.

    precision: 'fp32', 'bf16' or 'fp16'. fp16 needs a GPU or a CPU with native fp16 kernels (AVX512-FP16 / AMX-FP16:
    `course_lib.measure.hardware.cpu_features`); elsewhere DeepSpeed's CPU accelerator refuses it, and so does this function.
    Two settings differ from DeepSpeed's defaults, so that it trains exactly what the others train:
    ``gradient_clipping`` 0 (DeepSpeed 0.19 clips the global gradient norm at 1.0 unless told otherwise)
    and ``stage3_param_persistence_threshold`` 0 (by default parameters under 1e5 elements are not
    partitioned at all). Bucket sizes (elements) are ``bucket_numel`` instead of 5e8: DeepSpeed allocates
    its stage-3 buffers at that size, 2 GB in fp32, whatever the model."""
    if precision == "fp16" and not deepspeed_accepts_fp16():
        raise ValueError("fp16 is refused by DeepSpeed on this CPU, which has no native fp16 kernels ('Type fp16 is "
                         "not supported on your device'): use precision='bf16' or 'fp32' here, fp16 on a GPU")
    zero: dict = {"stage": stage, "reduce_bucket_size": bucket_numel, "allgather_bucket_size": bucket_numel}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_numel, stage3_param_persistence_threshold=0,
                    stage3_max_live_parameters=bucket_numel, stage3_max_reuse_distance=bucket_numel)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,     # torch AdamW with offload: no compiled CPUAdam
        "steps_per_print": 10 ** 9,
    }
