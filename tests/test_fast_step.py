"""Tests of the one-device switches shared by lesson 12, lesson 01's GPU step and the training script
(course_lib/parallel/fast_step.py), of lesson 01's `train_step_mfu(fast=True)`, and of lesson 12's reader of the code
torch.compile generated (course_lib/lessons/l12_one_device/kernels.py), on the CPU formats and on the GPU's (Triton)
from a module of the form inductor writes there."""

from __future__ import annotations

import pytest
import torch

from course_lib.config import get_preset
from course_lib.lessons.l01_bottlenecks import experiments as bottleneck_lab
from course_lib.lessons.l12_one_device import kernels
from course_lib.parallel import fast_step
from course_lib.theory import flops

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name, flags", [("default", (None, None)), ("for-loop", (False, None)),
                                         ("foreach", (True, None)), ("fused", (None, True))])
def test_each_implementation_builds_the_optimizer_it_names_and_the_same_update(name, flags):
    torch.manual_seed(0)
    ref, p = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3, requires_grad=True)
    with torch.no_grad():
        p.copy_(ref)
    grad = torch.randn(5, 3)
    opts = []
    for param, kw in ((ref, dict(foreach=False)), (p, fast_step.optimizer_impl(name))):
        opt = torch.optim.AdamW([param], lr=0.1, weight_decay=0.1, **kw)
        for _ in range(3):
            param.grad = grad.clone()
            opt.step()
        opts.append(opt)
    assert (opts[1].defaults["foreach"], opts[1].defaults["fused"]) == flags
    assert fast_step.implementation_of(opts[1]) == name                # read back: the inverse of optimizer_impl
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)      # the same AdamW, in other kernels


def test_an_unknown_implementation_names_the_choices():
    with pytest.raises(ValueError, match="'turbo' is unknown: pick one of 'default', 'for-loop', 'foreach', 'fused'"):
        fast_step.optimizer_impl("turbo")


def test_best_switches_read_what_the_device_supports(monkeypatch):
    cpu = fast_step.best_switches(torch.device("cpu"))
    assert cpu["autocast"] is True and cpu["vocab_multiple"] == 128
    assert cpu["optimizer"] == ("fused" if fast_step.fused_optimizer_support(torch.device("cpu"))[0] else "foreach")
    assert cpu["compile"] is fast_step.compile_support(torch.device("cpu"))[0]
    # a GPU, as the device would answer (no CUDA here): every switch on; without fused AdamW, foreach
    monkeypatch.setattr(fast_step, "fused_optimizer_support", lambda d: (d.type == "cuda", ""))
    monkeypatch.setattr(fast_step, "compile_support", lambda d: (True, ""))
    assert fast_step.best_switches(torch.device("cuda")) == dict(autocast=True, vocab_multiple=128, optimizer="fused",
                                                                 compile=True)
    monkeypatch.setattr(fast_step, "fused_optimizer_support", lambda d: (False, "refused"))
    assert fast_step.best_switches(torch.device("cuda"))["optimizer"] == "foreach"


def test_lesson01_fast_step_pads_the_vocabulary_and_counts_the_unpadded_flops(monkeypatch):
    cfg = get_preset("tiny").replace(vocab_size=200)
    seen = []
    real_pad = bottleneck_lab.pad_vocab
    monkeypatch.setattr(bottleneck_lab, "pad_vocab", lambda m, k: seen.append(real_pad(m, k)) or seen[-1])
    switches = dict(autocast=False, vocab_multiple=128, optimizer="fused", compile=False)
    step = bottleneck_lab.train_step_mfu(cfg, 2, "cpu", warmup=1, repeats=1, fast=True, switches=switches)
    assert step["switches"] == switches and seen[0].cfg.vocab_size == 256
    assert step["step_flops"] == flops.step_flops(cfg, 2)           # model FLOPs: the unpadded model's
    plain = bottleneck_lab.train_step_mfu(cfg, 2, "cpu", warmup=1, repeats=1)
    assert plain["switches"]["vocab_multiple"] is None and plain["switches"]["autocast"] is False


# ---------------------------------------------------------------------------------------- what inductor wrote

CPU_MODULE = '''
cpp_fused_add_native_layer_norm_1 = async_compile.cpp_pybinding(['float*', 'const float*'], r\'\'\'
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0)
{
}
\'\'\')

async_compile.wait(globals())

class Runner:
    def call(self, args):
        extern_kernels.addmm(arg4_1, buf3, arg3_1, alpha=1, beta=1, out=buf4)
        buf5 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf4, buf4, buf4, 0.0, True)
        cpp_fused_add_native_layer_norm_1(buf1, arg2_1)
        extern_kernels.mm(buf6, arg5_1, out=buf8)
'''

GPU_MODULE = '''
triton_per_fused_add_native_layer_norm_1 = async_compile.triton('triton_per_fused_add_native_layer_norm_1', \'\'\'
import triton
@triton.jit
def triton_per_fused_add_native_layer_norm_1(in_out_ptr0, xnumel, r0_numel):
    xoffset = tl.program_id(0) * XBLOCK
\'\'\', device_str='cuda')

triton_poi_fused_gelu_2 = async_compile.triton('triton_poi_fused_gelu_2', \'\'\'
@triton.jit
def triton_poi_fused_gelu_2(in_out_ptr0, xnumel):
    pass
\'\'\', device_str='cuda')

class Runner:
    def call(self, args):
        extern_kernels.addmm(arg4_1, buf3, arg3_1, alpha=1, beta=1, out=buf4)
        triton_per_fused_add_native_layer_norm_1.run(buf1, 128, 768, stream=stream0)
'''


def test_read_generated_finds_kernels_and_library_calls_on_both_backends():
    generated, library = kernels.read_generated([CPU_MODULE])
    assert list(generated) == ["cpp_fused_add_native_layer_norm_1"]
    assert generated["cpp_fused_add_native_layer_norm_1"].startswith("#include")
    assert library == ["addmm", "_scaled_dot_product_flash_attention_for_cpu", "mm"]
    generated, library = kernels.read_generated([GPU_MODULE])
    assert list(generated) == ["triton_per_fused_add_native_layer_norm_1", "triton_poi_fused_gelu_2"]
    assert "@triton.jit" in generated["triton_poi_fused_gelu_2"] and library == ["addmm"]


def test_eager_ops_sees_the_backward_and_views_are_told_apart():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    ops = kernels.eager_ops(lambda: torch.nn.functional.gelu(lin(x)).sum().backward())
    assert "addmm" in ops and "gelu" in ops and "gelu_backward" in ops and "mm" in ops
    assert "t" in ops and "t" in kernels.VIEW_OPS                     # Linear's weight transpose: no kernel
    assert kernels.is_library_op("addmm") and kernels.is_library_op("_scaled_dot_product_flash_attention_for_cpu")
    assert not kernels.is_library_op("gelu_backward")
    text = "\n".join(f"line {i}" for i in range(50))
    assert kernels.excerpt(text, 45).endswith("... (5 more lines)") and kernels.excerpt(text, 60) == text
