"""Fine-grained and shared experts at equal parameters (lesson 11; DeepSeekMoE, Dai et al. 2024, "DeepSeekMoE: Towards
Ultimate Expert Specialization in Mixture-of-Experts Language Models", section 3).

**Fine-grained expert segmentation**: each of N experts of hidden size F is split into m experts of F/m and a token is
routed to mK of the mN instead of K of N: the expert parameters, total (3 C F N) and active (3 C F K), stay the same.
**Shared expert isolation**: K_s of the mN fine experts take every token; the router picks mK - K_s of the other
mN - K_s, so that the totals and the active count stay the same again.

Per MoE layer, routed (E, k, F) plus shared experts of hidden size F_s together, a router C x E:

    expert params   total 3 C F E + 3 C F_s         active 3 C F k + 3 C F_s
    layer params    total  + C E (the router)        active  + C E

The router grows with E: at equal expert parameters the fine-grained layer has (mN - N) C more parameters, read by
every token (`course_lib.theory.experts.moe_params` counts the same for a whole GPT).

**Flexibility** (DeepSeekMoE's argument): a token chooses one of C(E, k) combinations of routed experts. N = 16,
top-2: C(16, 2) = 120; split m = 4: C(64, 8) = 4,426,165,368; with one of the 64 shared: C(63, 7) = 553,270,671.
"""

from __future__ import annotations

import dataclasses
import math

from course_lib.config import check_positive_ints, divisors_hint
from course_lib.theory.experts import moe_layer_params

__all__ = ["MoEShape", "fine_grained", "expert_params", "active_params", "total_params", "routing_combinations"]


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer: ``n_experts`` routed experts of hidden size ``d_ff``, ``top_k`` chosen per token, and
    ``shared_d_ff`` hidden features of shared experts (K_s of size F: K_s F; one SwiGLU MLP in `MoELayer`)."""

    n_experts: int
    top_k: int
    d_ff: int
    shared_d_ff: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(n_experts=self.n_experts, top_k=self.top_k, d_ff=self.d_ff)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} > n_experts={self.n_experts}: pick top_k <= n_experts")
        if self.shared_d_ff < 0:
            raise ValueError(f"shared_d_ff={self.shared_d_ff} must be >= 0")


def fine_grained(n_experts: int, top_k: int, d_ff: int, m: int, n_shared: int = 0) -> MoEShape:
    """DeepSeekMoE's segmentation of (N, K, F): mN experts of F/m, top mK; ``n_shared`` = K_s of them isolated as
    shared experts: mN - K_s routed, top mK - K_s, shared hidden size K_s F/m."""
    check_positive_ints(m=m, d_ff=d_ff)
    if d_ff % m:
        raise ValueError(f"d_ff={d_ff} is not divisible by m={m} (each expert splits into m of d_ff/m): pick m in "
                         f"{divisors_hint(d_ff, None)}")
    if not 0 <= n_shared < top_k * m:
        raise ValueError(f"n_shared={n_shared} must be in 0 .. top_k x m - 1 = {top_k * m - 1}: a token keeps at "
                         f"least one routed expert")
    f = d_ff // m
    return MoEShape(n_experts * m - n_shared, top_k * m - n_shared, f, n_shared * f)


def active_params(d_model: int, shape: MoEShape) -> int:
    """Parameters one token uses in one MoE layer: 3 C F k + 3 C F_s + C E (the router;
    `course_lib.theory.experts.moe_layer_params`)."""
    return moe_layer_params(d_model, shape.n_experts, shape.top_k, shape.d_ff, shape.shared_d_ff)


def total_params(d_model: int, shape: MoEShape) -> int:
    """Parameters of one MoE layer: 3 C F E + 3 C F_s + C E."""
    return moe_layer_params(d_model, shape.n_experts, shape.n_experts, shape.d_ff, shape.shared_d_ff)


def expert_params(d_model: int, shape: MoEShape) -> dict:
    """{"total": 3 C F E + 3 C F_s, "active": 3 C F k + 3 C F_s}: the experts' weights, router left out."""
    router = d_model * shape.n_experts
    return {"total": total_params(d_model, shape) - router, "active": active_params(d_model, shape) - router}


def routing_combinations(n_experts: int, top_k: int) -> int:
    """C(E, k): the sets of k routed experts a token can be sent to."""
    return math.comb(n_experts, top_k)
