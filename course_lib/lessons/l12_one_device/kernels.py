"""What torch.compile wrote (lesson 12): one transformer block of the course's GPT run eagerly and compiled by
inductor, with the ATen operators of the eager forward + backward beside the kernels inductor generated for them.

    k = block_kernels(cfg)                    # one block, forward + backward, batch 2
    k["eager"]         # ATen operators that read or write memory, in order (views, transposes, splits left out)
    k["generated"]     # {kernel name: its source}: C++ (OpenMP loops) on a CPU, Triton on a GPU
    k["library"]       # the calls inductor left to a library: matmuls (extern_kernels.mm / addmm) and attention
    print(excerpt(k["generated"][name]))

The generated code is read with ``torch._inductor.utils.run_and_get_code`` (torch 2.14): it returns the Python
module inductor wrote for every graph compiled while the function ran (here the forward's and the backward's); it
also resets torch.compile's caches of the process first (``torch._dynamo.reset()``), so a function compiled earlier
compiles again on its next call. A kernel's name lists, alphabetically, the ATen operators its code came from, views
included (``torch._inductor.utils.get_fused_kernel_name``): ``cpp_fused_add_native_layer_norm_view_1`` is the
residual add and the next layer norm in one kernel, whose loops recompute the sum instead of storing it and reading
it back; a name that holds a library operator (``..._flash_attention_for_cpu_backward_transpose_view_0``) is a copy
into the layout that library call wants.
"""

from __future__ import annotations

import re
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.config import ModelConfig
from course_lib.model import build_model

__all__ = ["VIEW_OPS", "is_library_op", "eager_ops", "read_generated", "block_kernels", "excerpt"]

# Operators that only relabel memory (a new shape or stride over the same storage): no kernel, nothing to fuse.
VIEW_OPS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "split", "split_with_sizes", "reshape",
                      "expand", "unsqueeze", "squeeze", "as_strided", "slice", "select", "detach", "alias",
                      "unbind", "chunk", "narrow"})

_KERNEL = re.compile(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\((.*?)'''(.*?)'''", re.S | re.M)
_LIBRARY = re.compile(r"(extern_kernels\.\w+|torch\.ops\.aten\.\w+)\.?(?:default)?\(")


def is_library_op(op: str) -> bool:
    """A matmul (mm, addmm, bmm, baddbmm) or an attention kernel: work inductor leaves to a library by default."""
    return op.endswith("mm") or "attention" in op


class _OpLog(TorchDispatchMode):
    """Every ATen operator dispatched while active (the backward's too: autograd carries the mode to its engine)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def eager_ops(fn) -> list[str]:
    """The ATen operators that ``fn()`` dispatches, in order, views included."""
    with _OpLog() as log:
        fn()
    return log.ops


def read_generated(sources: list[str]) -> tuple[dict[str, str], list[str]]:
    """({kernel name: source}, [library calls in launch order]) from the modules inductor wrote."""
    kernels, library = {}, []
    for graph, src in enumerate(sources):
        for name, _, code in _KERNEL.findall(src):       # each graph numbers its kernels from 0: keep both
            kernels[name if name not in kernels else f"{name} (graph {graph})"] = code.strip("\n")
        body = src[src.find("def call("):] if "def call(" in src else ""
        library += [m.replace("extern_kernels.", "").replace("torch.ops.aten.", "") for m in _LIBRARY.findall(body)]
    return kernels, library


def block_kernels(cfg: ModelConfig, batch: int = 2, device=None, seed: int = 0) -> dict:
    """One block of ``GPT(cfg)`` (``cfg.seq_len`` tokens, ``batch`` sequences), forward + backward from a given
    output gradient: the eager operators (``eager``: those that touch memory; ``eager_all`` with views) and what
    inductor generated (``generated``, ``library``, ``compile_s``: the first compiled call, compilation included)."""
    from torch._inductor.utils import run_and_get_code

    device = torch.device(device or "cpu")
    block = build_model(cfg.replace(n_layer=1), seed).blocks[0].to(device)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)
    dy = torch.randn(batch, cfg.seq_len, cfg.d_model, device=device)      # no loss: only the block's own operators

    def step(module):
        module(x).backward(dy)

    ops = eager_ops(lambda: step(block))
    compiled = torch.compile(block, dynamic=False)
    t0 = time.perf_counter()
    _, sources = run_and_get_code(lambda: step(compiled))
    generated, library = read_generated(sources)
    return dict(eager=[op for op in ops if op not in VIEW_OPS], eager_all=ops, generated=generated,
                library=library, compile_s=time.perf_counter() - t0, device=str(device),
                shape=f"batch {batch} x {cfg.seq_len} tokens, d_model {cfg.d_model}, {cfg.n_head} heads")


def excerpt(code: str, lines: int = 40) -> str:
    """The first ``lines`` lines of a kernel's source, and how many were left out."""
    rows = code.splitlines()
    more = len(rows) - lines
    return "\n".join(rows[:lines]) + (f"\n... ({more} more lines)" if more > 0 else "")
