"""One device at full speed: the switches of lesson 12's ladder that a training step takes from the course, in one
place for lesson 12 (which measures each), the training script (``[model] vocab_multiple`` and ``compile``,
``[optimizer] implementation``) and lesson 01's GPU step (`best_switches`).

    opt = torch.optim.AdamW(params, lr=3e-4, **optimizer_impl("fused"))   # 'default' | 'for-loop' | 'foreach' | 'fused'
    ok, why = fused_optimizer_support(device)      # fused=True steps here? (tried on one element)
    ok, why = compile_support(device)              # can inductor generate code here? (a C++ compiler / Triton)
    switches = best_switches(device)               # {'autocast', 'vocab_multiple': 128, 'optimizer', 'compile'}

The padded vocabulary itself is `course_lib.model.pad_vocab` (extra rows zero) and `ModelConfig.padded_vocab`; bf16
weights with fp32 master state are `parallel.precision.MasterWeightOptimizer` (lesson 06) or, sharded, FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16)`` (the training script's ``[precision] weights``).
"""

from __future__ import annotations

import shutil

import torch

__all__ = ["OPTIMIZER_IMPLS", "optimizer_impl", "implementation_of", "fused_optimizer_support", "compile_support",
           "best_switches"]

# torch.optim's three implementations of one update (the same formula; fused computes it in another order, so its
# results may differ in the last bits): 'for-loop' one kernel per parameter and operation, 'foreach' one per operation
# over a list of tensors, 'fused' the whole update in one operator call (on a GPU, one launch per group of tensors:
# multi_tensor_apply); 'default' leaves the choice to torch (foreach when every tensor is on a GPU, else the for-loop:
# torch.optim.optimizer._default_to_fused_or_foreach in torch 2.14).
OPTIMIZER_IMPLS = {"default": {}, "for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(fused=True)}


def optimizer_impl(name: str) -> dict:
    """The keyword arguments of torch.optim.Adam / AdamW / SGD that pick the implementation ``name``."""
    if name not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer implementation {name!r} is unknown: pick one of "
                         f"{', '.join(map(repr, OPTIMIZER_IMPLS))}")
    return dict(OPTIMIZER_IMPLS[name])


def implementation_of(optimizer: torch.optim.Optimizer) -> str:
    """The inverse of `optimizer_impl`: the name of the implementation ``optimizer`` was built with, read from its
    defaults ('default' where neither foreach nor fused was asked for)."""
    for name, kw in OPTIMIZER_IMPLS.items():
        if kw and all(optimizer.defaults.get(k) == v for k, v in kw.items()):
            return name
    return "default"


def fused_optimizer_support(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.optim.AdamW(fused=True)`` steps on this device (tried on a one-element parameter)."""
    try:
        p = torch.zeros(1, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], fused=True).step()
        return True, "fused=True (the whole update in one operator call)"
    except (RuntimeError, ValueError) as e:
        return False, f"fused AdamW refused here ({str(e).splitlines()[0][:80]}): foreach=True instead"


def compile_support(device: torch.device) -> tuple[bool, str]:
    """Whether inductor can generate code here: a C++ compiler on a CPU, Triton on a GPU."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "torch.compile on a GPU needs Triton (pip install triton)"
        return True, ""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        cxx = get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - inductor says why it has no compiler
        return False, f"no C++ compiler for inductor's CPU kernels ({str(e).splitlines()[0][:80]})"
    if shutil.which(cxx) is None:
        return False, f"no C++ compiler for inductor's CPU kernels ({cxx} not found)"
    return True, f"inductor C++ kernels ({cxx})"


def best_switches(device: torch.device) -> dict:
    """The switches of lesson 12's ladder that lesson 01's GPU step turns on together: bf16 autocast, the vocabulary
    padded to a multiple of 128, fused AdamW (foreach where fused is refused) and torch.compile (where inductor can
    generate code). That is every rung short of bf16 weights with fp32 masters, fp8 and CUDA graphs (SDPA is the
    model's default; the micro-batch stays the caller's). Whether each pays on a given GPU is what the ladder
    measures (no GPU has run it yet: docs/GPU_RUNS.md); lesson 01 prints the plain and the switched step side by
    side. A CPU gets the same list; lesson 01 keeps its CPU step plain fp32 eager."""
    device = torch.device(device)
    return dict(autocast=True, vocab_multiple=128,
                optimizer="fused" if fused_optimizer_support(device)[0] else "foreach",
                compile=compile_support(device)[0])
