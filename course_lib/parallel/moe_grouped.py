"""Dropless experts in grouped GEMMs, the router's z-loss and an fp32 router (lesson 11).

    model = apply_grouped_experts(apply_moe(build_model(cfg, 0), n_experts=4, top_k=2))   # capacity_factor=None
    apply_router_options(model, z_loss_coef=1e-3, fp32=True)
    loss = moe_loss(model, idx, targets) + moe_z_loss(model)

**Grouped GEMM** (Megatron-LM ``--moe-grouped-gemm``, its ``GroupedMLP``; torchtitan's MoE): after the dispatch
permutation (`moe.dispatch_permutation`) the A rows sit grouped by expert, counts[e] rows for expert e. A dropless MoE
(``capacity_factor=None``) has ragged groups, so the E matmuls cannot be one ``bmm``; `moe.SwiGLUExperts` runs them as
a Python loop of E small matmuls. torch's ``torch._grouped_mm(x, w, offs=offs)`` (also ``F.grouped_mm``) runs them
in one call: x (A, K), w (E, K, N), offs (E,) int32 CUMULATIVE ENDS (offs[e] = counts[0] + ... + counts[e], not the
counts, not the starts) -> (A, N), rows offs[e-1]:offs[e] times w[e]. `GroupedSwiGLUExperts` makes each of the three
SwiGLU matmuls one such call; with capacity infinity it equals the capacity version, and both equal the loop.

What ``torch._grouped_mm`` does on the CPU with torch 2.14.1 (probed by hand; tests/test_moe_grouped.py holds them):
- dtypes: fp32, bf16 and fp16 run forward; fp64 raises "Expected mat_a to be Float32, BFloat16 or Float16"; mixed
  fp32 x bf16 raises; ``out_dtype`` must equal mat_a's dtype. On a GPU (not run here: this task had none) torch's
  meta function accepts bf16, fp16 only with cuBLASLt's grouped GEMM (sm90-110, CUDA >= 13.3), and no fp32, and
  ``F.grouped_mm``'s docstring asks for bf16 on sm >= 80: expect fp32 to take the loop there; the probe decides.
- offs must be int32 ("Offsets have to be int32"), 1-D, stride 1, one per expert ("matrix batch sizes have to
  match"). Nothing else is checked: offs = counts or starts run and return wrong numbers; offs[-1] < A leaves the
  rows past it uninitialised (1e34 seen); offs[-1] > A and decreasing offs run without a word. Hence the
  ``sum(counts) == A`` check below.
- strides: every operand needs one unit stride and the other a multiple of 16 bytes ("strides should be multiple of
  16 bytes"): d_model and d_ff multiples of 4 in fp32, of 8 in bf16 (else the loop runs); the weights may be the
  transposed view ``w.transpose(-2, -1)`` of nn.Linear's (E, N, K) layout.
- backward (``GroupedMmBackward0``): right for x and w, fp32 and bf16 (and fp16), with empty experts (their weight
  gradient is 0), all rows on one expert, zero rows. It fails when the output's gradient is an EXPANDED tensor, as
  ``y.sum().backward()`` gives (strides (0, 0): "Invalid strides/sizes, got [0, 0] for strides"), or a transposed one
  with an unaligned stride; ``(2 * y).sum()`` and ``(y * col).sum()`` pass. `_ContiguousGrad` makes it contiguous
  (with zero rows an expanded gradient stays (0, 0)-strided under ``.contiguous()``: fresh zeros then).
- on the CPU the results equal the loop's bit for bit (fp32 and bf16): the kernel is a loop of matmuls in C++.

**Router z-loss** (Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert Models", eq. 5):
``c_z * mean_t (logsumexp_i logits[t, i])^2`` with c_z = 1e-3, in fp32: it pulls each token's logsumexp towards 0,
so that no logit grows to where exp() and bf16 rounding lose the router's choice. Its minimum is logsumexp = 0, not
logits = 0: near-uniform logits go to -ln E, so |logit| need not shrink (`lessons.l11_experts.grouped.z_loss_run`).
Megatron-LM ``--moe-z-loss-coeff`` (its ``z_loss_func``).

**fp32 router** (Megatron-LM ``--moe-router-dtype fp32``; DeepSeek-V3's report, section 3.3.1, keeps "MoE gating
modules" out of FP8, in their "original precision (e.g., BF16 or FP32)"; transformers' ``DeepseekV3TopkRouter``
holds an fp32 weight and casts the input to fp32):
the router's linear in fp32 even when the model runs in bf16, so that the top-k choice is not decided by bf16
rounding of near-equal logits. `FP32Router` is a `moe.TopKRouter` (same state dict) whose forward does that.

Shapes: A rows (assignments) grouped by expert, C d_model, F an expert's hidden size, E local experts, T tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel import moe

__all__ = ["grouped_mm_available", "offsets_of", "grouped_matmul", "GroupedSwiGLUExperts", "apply_grouped_experts",
           "router_z_loss", "FP32Router", "apply_router_options", "moe_z_loss", "moe_loss_with_z", "Z_LOSS_COEF"]

Z_LOSS_COEF = 1e-3          # ST-MoE's c_z
ALIGN_BYTES = 16            # every operand's non-unit stride: a multiple of 16 bytes


def offsets_of(counts, device=None) -> torch.Tensor:
    """counts (E,) rows per expert -> offs (E,) int32 cumulative ends, as ``torch._grouped_mm`` takes them."""
    return torch.cumsum(torch.as_tensor(counts, dtype=torch.int64), 0).to(torch.int32).to(device)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (an expanded one breaks GroupedMmBackward0)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if grad.numel() == 0:                     # an empty tensor counts as contiguous whatever its strides
            return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
        return grad.contiguous()


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (A, K) grouped by expert, w (E, N, K) nn.Linear-style, offs (E,) int32 ends -> (A, N): x_e w_e^T per expert."""
    y = torch._grouped_mm(x.contiguous(), w.transpose(-2, -1), offs=offs)     # (A, K) x (E, K, N) -> (A, N)
    return _ContiguousGrad.apply(y)


def _loop_matmul(x, w, counts):
    return torch.cat([r @ w[e].t() for e, r in enumerate(torch.split(x, counts))])   # E x (count_e, K) -> (A, N)


def _output_and_grads(mm, x0, w0, device, dtype):
    x, w = (t.to(device, dtype).requires_grad_() for t in (x0, w0))
    y = mm(x, w)
    y.sum().backward()                                        # an expanded output gradient, on purpose
    return y.detach(), x.grad, w.grad


@functools.lru_cache(maxsize=None)
def _probe(dtype: torch.dtype, device: str) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm"
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5]                                        # an expert with no rows
    x0, w0 = torch.randn(8, 16, generator=g), torch.randn(3, 16, 16, generator=g)
    try:
        with torch.inference_mode(False), torch.enable_grad():   # a first call under no_grad must not cache a failure
            offs = offsets_of(counts, device)
            got = _output_and_grads(lambda x, w: grouped_matmul(x, w, offs), x0, w0, device, dtype)
            want = _output_and_grads(lambda x, w: _loop_matmul(x, w, counts), x0, w0, device, dtype)
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    tol = 1e-4 if dtype == torch.float32 else 0.1             # O(4) values; bf16 keeps 8 bits of mantissa
    for name, a, b in zip(("forward", "dx", "dw"), got, want):
        err = (a.float() - b.float()).abs().max().item()
        if err > tol:
            return False, f"{name} differs from the loop by {err:.3g} on {device} {dtype}"
    return True, f"forward and backward equal the loop on {device} {dtype}"


def grouped_mm_available(dtype: torch.dtype, device) -> tuple[bool, str]:
    """(ok, reason): does ``torch._grouped_mm`` run forward and backward and agree with the per-expert loop for this
    dtype on this device (an empty expert and an expanded output gradient included)? Probed once per (dtype, device)."""
    return _probe(dtype, str(torch.device(device)))


class GroupedSwiGLUExperts(moe.SwiGLUExperts):
    """`moe.SwiGLUExperts` (same w1, w3 (E, F, C), w2 (E, C, F), ``first``; same state dict) whose forward runs each
    of the three matmuls for all E experts as one ``torch._grouped_mm`` where it can, else the per-expert loop.
    After a forward ``path`` is "grouped_mm" or "loop" and ``reason`` says why. ``grouped=False`` forces the loop."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, first: int = 0, grouped: bool = True):
        super().__init__(n_experts, d_model, d_ff, first)
        self.grouped, self.path, self.reason = grouped, None, None

    @classmethod
    def holding(cls, experts: moe.SwiGLUExperts, grouped: bool = True) -> "GroupedSwiGLUExperts":
        """A `GroupedSwiGLUExperts` holding ``experts``' own parameters (no copy, no random numbers drawn)."""
        E, F_, C = experts.w1.shape
        with torch.device("meta"):
            new = cls(E, C, F_, experts.first, grouped)
        new.w1, new.w3, new.w2 = experts.w1, experts.w3, experts.w2
        return new

    def can_group(self, x: torch.Tensor) -> tuple[bool, str]:
        """(ok, reason) for this input: grouped=True, the probe passes, d_model and d_ff 16-byte aligned."""
        if not self.grouped:
            return False, "grouped=False"
        ok, why = grouped_mm_available(x.dtype, x.device)
        if not ok:
            return ok, why
        E, F_, C = self.w1.shape
        if (C * x.element_size()) % ALIGN_BYTES or (F_ * x.element_size()) % ALIGN_BYTES:
            return False, f"d_model={C} or d_ff={F_} is not a multiple of {ALIGN_BYTES} bytes in {x.dtype}"
        return True, why

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (A, C) grouped by expert, counts[e] rows for local expert e -> (A, C)."""
        if len(counts) != self.w1.shape[0] or sum(counts) != x.shape[0]:
            raise ValueError(f"counts={list(counts)}: need {self.w1.shape[0]} counts summing to the {x.shape[0]} rows")
        ok, self.reason = self.can_group(x)
        self.path = "grouped_mm" if ok else "loop"
        if not ok:
            return super().forward(x, counts)
        offs = offsets_of(counts, x.device)                                          # (E,) int32 ends
        h = F.silu(grouped_matmul(x, self.w1, offs)) * grouped_matmul(x, self.w3, offs)   # (A, C) -> (A, F)
        return grouped_matmul(h, self.w2, offs)                                      # (A, F) -> (A, C)


def apply_grouped_experts(model: nn.Module, grouped: bool = True) -> nn.Module:
    """Swap every MoE layer's ``experts`` for a `GroupedSwiGLUExperts` holding the same tensors, in place."""
    for m in moe.moe_layers(model):
        m.experts = GroupedSwiGLUExperts.holding(m.experts, grouped)
    return model


def router_z_loss(logits: torch.Tensor, coef: float = Z_LOSS_COEF) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5), fp32: logits (T, E) -> coef * mean_t logsumexp(logits_t)^2."""
    z = torch.logsumexp(logits.float(), dim=-1)                   # (T, E) -> (T,)
    return coef * z.square().mean()


class FP32Router(moe.TopKRouter):
    """`moe.TopKRouter` (same weight (E, C) and expert_bias, same state dict) computing its linear in fp32 whatever
    the dtype of x and of the weight (Megatron-LM ``--moe-router-dtype fp32``); the weights come back in x's dtype."""

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())                   # (T, C) -> (T, E), fp32
        probs = logits.softmax(-1)                                           # (T, E)
        _, indices = torch.topk(probs + self.expert_bias, self.top_k, -1)   # (T, k)
        weights = probs.gather(-1, indices)                                  # (T, k)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), indices

    @classmethod
    def holding(cls, router: moe.TopKRouter) -> "FP32Router":
        """An `FP32Router` holding ``router``'s own weight and bias (no copy)."""
        E, C = router.weight.shape
        with torch.device("meta"):
            new = cls(C, E, router.top_k, router.normalize)
        new.weight = router.weight
        new.register_buffer("expert_bias", router.expert_bias)
        return new


def apply_router_options(model: nn.Module, z_loss_coef: float = Z_LOSS_COEF, fp32: bool = False) -> nn.Module:
    """Every MoE layer: ``z_loss_coef`` for `moe_z_loss`; with ``fp32`` its router becomes an `FP32Router` holding
    the same tensors (call it before building the optimizer: the parameters stay the same objects). In place."""
    for m in moe.moe_layers(model):
        m.z_loss_coef = z_loss_coef
        if fp32 and not isinstance(m.router, FP32Router):
            m.router = FP32Router.holding(m.router)
    return model


def moe_z_loss(model: nn.Module) -> torch.Tensor:
    """The sum over every MoE layer of `router_z_loss` of its last forward's ``router_logits`` (T, E), each with its
    ``z_loss_coef`` (`apply_router_options`; default ST-MoE's 1e-3): 0-d fp32 tensor with the router's graph."""
    layers = moe.moe_layers(model)
    if not layers:
        return torch.zeros(())
    return sum(router_z_loss(m.router_logits, getattr(m, "z_loss_coef", Z_LOSS_COEF)) for m in layers)


def moe_loss_with_z(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`moe.moe_loss` (cross-entropy + balancing losses) + `moe_z_loss`: a ``loss_fn`` for `train_reference`."""
    return moe.moe_loss(model, idx, targets) + moe_z_loss(model)
