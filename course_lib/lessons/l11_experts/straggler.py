"""The straggler of expert parallelism (lesson 11): a router skewed towards some experts makes the rank holding them
receive more rows, compute longer and keep more activations, and every other rank waits for it at the all-to-all.

    out = launch_straggler(StragglerSizes(), SKEWS, repeats=5)     # 2 gloo ranks, ep = 2: one list of rank results
    rows = straggler_table(out)                                     # per skew level: loads, times, bytes, formulas

On each rank (`rank_straggler`): one `MoELayer` (the same weights on every rank), sharded by `ExpertParallelMoE`
over ep = world ranks; for each skew level a router bias (`skew_bias`, DeepSeek-V3's bias used as a knob: it picks,
never weighs) on rank 0's experts, found by bisection on the global batch so that a chosen fraction of all
assignments goes to rank 0; then one forward + backward of the layer, ``repeats`` times after a warm-up, with
timestamps read around the pieces that matter:

- expert compute, forward and backward (wall clock and this thread's CPU time: a rank computes on one thread, so its
  CPU time does not count the moments another process held the core);
- the wait in the forward's combine all-to-all (from the call to its return) and in the backward's dispatch
  all-to-all (the reverse of the dispatch comes after the experts' backward: the idle rank waits there);
- rows received (the rank's experts' load) and the bytes its experts save for backward
  (`course_lib.measure.memory_stats.SavedActivations`), with the formula of `course_lib.theory.moe_imbalance`.

Timings are presented only where the ranks do not outnumber the cores (``timed``); with more ranks than cores count
rows and bytes, do not time. Shapes: T tokens a rank, C d_model, F d_ff of an expert, E experts, k top_k, R rows
received by a rank.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F

from course_lib.config import ModelConfig, check_positive_ints
from course_lib.measure.collective_counter import LayerCounter
from course_lib.measure.memory_stats import SavedActivations
from course_lib.parallel.moe import MoELayer
from course_lib.theory.moe_imbalance import expert_activation_bytes, straggler_step_time

__all__ = ["StragglerSizes", "SKEWS", "sizes_of", "straggler_setup", "skew_bias", "routed_rows", "rank_straggler",
           "launch_straggler", "straggler_table"]

SKEWS = {"uniform": 0.5, "moderate": 0.75, "strong": 0.9}    # fraction of all assignments sent to rank 0's experts


@dataclasses.dataclass(frozen=True)
class StragglerSizes:
    """One MoE layer's shape for the straggler: ``tokens`` per rank, d_model, an expert's d_ff, E, k."""

    tokens: int = 2048
    d_model: int = 128
    d_ff: int = 512
    n_experts: int = 4
    top_k: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(tokens=self.tokens, d_model=self.d_model, d_ff=self.d_ff, n_experts=self.n_experts,
                            top_k=self.top_k)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} > n_experts={self.n_experts}: pick top_k <= n_experts")


def sizes_of(cfg_or_sizes) -> StragglerSizes:
    """A `StragglerSizes` as given, or one from a `ModelConfig` (tokens = seq_len, its d_model and d_ff)."""
    if isinstance(cfg_or_sizes, StragglerSizes):
        return cfg_or_sizes
    if isinstance(cfg_or_sizes, ModelConfig):
        return StragglerSizes(tokens=cfg_or_sizes.seq_len, d_model=cfg_or_sizes.d_model, d_ff=cfg_or_sizes.d_ff)
    raise TypeError(f"cfg_or_sizes={type(cfg_or_sizes).__name__}: give a StragglerSizes or a ModelConfig")


def straggler_setup(sizes: StragglerSizes, world: int):
    """The layer every rank starts from and the global batch: (MoELayer, x (world T, C), dy (world T, C)); the same
    in every process (a one-process reference rebuilds them)."""
    torch.manual_seed(sizes.seed)
    layer = MoELayer(sizes.d_model, sizes.n_experts, sizes.top_k, sizes.d_ff)
    g = torch.Generator().manual_seed(sizes.seed + 1)
    x = torch.randn(world * sizes.tokens, sizes.d_model, generator=g)
    dy = torch.randn(world * sizes.tokens, sizes.d_model, generator=g)
    return layer, x, dy


@torch.no_grad()
def _choices(router, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    probs = F.linear(x, router.weight.to(x.device)).float().softmax(-1)    # (T, C) -> (T, E), as TopKRouter
    return torch.topk(probs + bias.to(x.device), router.top_k, -1).indices  # (T, k)


def routed_rows(router, x: torch.Tensor, bias: torch.Tensor, ep: int) -> list[int]:
    """Rows each of ep ranks receives when ``router`` with ``bias`` routes the tokens ``x`` (all ranks' tokens)."""
    local = router.n_experts // ep
    return torch.bincount((_choices(router, x, bias) // local).reshape(-1), minlength=ep).tolist()


@torch.no_grad()
def skew_bias(router, x: torch.Tensor, ep: int, fraction: float, steps: int = 60) -> torch.Tensor:
    """A bias (E,) equal to b on rank 0's experts (0 .. E/ep - 1) and 0 elsewhere, b the smallest found by bisection
    such that at least ``fraction`` of the assignments of ``x`` go to rank 0's experts."""
    local, k = router.n_experts // ep, router.top_k
    most = min(1.0, local / k)                                        # k choices, only E/ep experts on rank 0
    if not 0.0 <= fraction <= most:
        raise ValueError(f"fraction={fraction}: rank 0 holds {local} experts and a token picks k={k} distinct ones, "
                         f"so at most {most:.2f} of the assignments can go there; pick fraction <= {most:.2f}")
    hot = torch.zeros(router.n_experts)
    hot[:local] = 1.0

    def share(b: float) -> float:
        return routed_rows(router, x, b * hot, ep)[0] / (x.shape[0] * k)

    lo, hi = -1.0, 1.0                                                # probabilities are in [0, 1]: share(1) = most
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if share(mid) >= fraction else (mid, hi)
    return hi * hot


class _Stamps:
    """(wall, thread CPU) times by name; CUDA work is waited for first."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t: dict[str, tuple[float, float]] = {}
        self.rows, self.saved = 0, 0

    def stamp(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t[name] = (time.perf_counter(), time.thread_time())

    def wall(self, a: str, b: str) -> float:
        return self.t[b][0] - self.t[a][0]

    def cpu(self, a: str, b: str) -> float:
        return self.t[b][1] - self.t[a][1]


class _StampingCounter(LayerCounter):
    """`ExpertCounter` that also stamps the moment each all-to-all is called ("forward/combine", ...)."""

    def __init__(self, stamps: _Stamps):
        super().__init__()
        self.stamps = stamps

    def record(self, phase: str, op: str, t: torch.Tensor) -> None:
        super().record(phase, op, t)
        self.stamps.stamp(f"{phase}/{op}")


class _TimedExperts(torch.nn.Module):
    """The rank's experts, timed (forward in the call, backward by hooks on their output and input) and their saved
    bytes counted."""

    def __init__(self, inner: torch.nn.Module, stamps: _Stamps):
        super().__init__()
        self.inner, self.stamps = inner, stamps
        self.first = inner.first

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        s = self.stamps
        if x.requires_grad:
            x.register_hook(lambda g: s.stamp("backward/experts_end"))     # its gradient: the experts are done
        with SavedActivations(self.inner) as acts:
            s.stamp("forward/experts_start")
            y = self.inner(x, counts)                                       # (R, C) -> (R, C)
            s.stamp("forward/experts_end")
        s.rows, s.saved = x.shape[0], acts.bytes
        if y.requires_grad:
            y.register_hook(lambda g: s.stamp("backward/experts_start"))   # the experts' backward starts
        return y


def _instrument(layer, stamps: _Stamps) -> None:
    """Wrap the layer's experts, counter and compute (on this instance only): the combine all-to-all's return is the
    return of ``compute``; the backward dispatch's return is the gradient of compute's input."""
    layer.experts = _TimedExperts(layer.experts, stamps)
    layer.counter = _StampingCounter(stamps)
    compute = layer.compute

    def timed_compute(rows, d):
        if rows.requires_grad:
            rows.register_hook(lambda g: stamps.stamp("backward/dispatch_end"))
        out = compute(rows, d)
        stamps.stamp("forward/combine_end")
        return out

    layer.compute = timed_compute


def _one_step(layer, x: torch.Tensor, dy: torch.Tensor, s: _Stamps) -> dict:
    """One forward + backward of the layer on this rank's x (T, C) with output gradient dy (T, C)."""
    xin = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    layer.counter.reset()
    s.t.clear()
    s.stamp("step/start")
    y = layer(xin.view(1, *x.shape))                                    # (1, T, C) -> (1, T, C)
    (y.view_as(dy) * dy).sum().backward()
    s.stamp("step/end")
    fwd, bwd = ("forward/experts_start", "forward/experts_end"), ("backward/experts_start", "backward/experts_end")
    return dict(expert_fwd_s=s.wall(*fwd), expert_bwd_s=s.wall(*bwd), expert_s=s.wall(*fwd) + s.wall(*bwd),
                expert_cpu_s=s.cpu(*fwd) + s.cpu(*bwd),
                combine_wait_s=s.wall("forward/combine", "forward/combine_end"),
                dispatch_wait_s=s.wall("backward/dispatch", "backward/dispatch_end"),
                step_s=s.wall("step/start", "step/end"), rows=s.rows, saved_bytes=s.saved,
                out=y.detach().view_as(dy).cpu(), dx=xin.grad.cpu())


def rank_straggler(cfg_or_sizes=None, skew: dict | None = None, repeats: int = 5) -> dict:
    """On every rank of an ep = world group: the straggler at each skew level {name: fraction of the assignments on
    rank 0's experts} (module docstring). {"rank", "world", "timed" (ranks <= cores), "hardware", "levels": [{"name",
    "fraction" (target), "achieved", "bias", "rows", "saved_bytes", "formula_bytes", medians of "expert_fwd_s",
    "expert_bwd_s", "expert_s", "expert_cpu_s", "combine_wait_s", "dispatch_wait_s", "step_s"; "samples" (each
    repeat), "out" and "dx" of the first repeat}]}."""
    import torch.distributed as dist

    from course_lib import dist as cdist
    from course_lib.measure.hardware import hardware_label
    from course_lib.parallel.experts import ExpertGroups, ExpertParallelMoE
    from course_lib.runtime.procs import usable_cores

    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    sizes = sizes_of(cfg_or_sizes if cfg_or_sizes is not None else StragglerSizes())
    skew = SKEWS if skew is None else skew
    dev, rank, world = cdist.device(), dist.get_rank(), dist.get_world_size()
    layer, x, dy = straggler_setup(sizes, world)
    ep_layer = ExpertParallelMoE(layer.to(dev), ExpertGroups(world, n_experts=sizes.n_experts))
    stamps = _Stamps(dev)
    _instrument(ep_layer, stamps)
    mine = slice(rank * sizes.tokens, (rank + 1) * sizes.tokens)
    xs, dys = x[mine].to(dev), dy[mine].to(dev)
    for _ in range(2):                                                  # warm-up: the allocator, gloo's buffers
        _one_step(ep_layer, xs, dys, stamps)
    levels = []
    for name, fraction in skew.items():
        bias = skew_bias(layer.router, x, world, fraction)              # the global batch: the same on every rank
        ep_layer.router.expert_bias.copy_(bias)
        loads = routed_rows(layer.router, x, bias, world)
        samples = [_one_step(ep_layer, xs, dys, stamps) for _ in range(repeats + 1)][1:]   # the first: a warm-up
        times = {key: statistics.median(s[key] for s in samples) for key in samples[0] if key.endswith("_s")}
        first = samples[0]
        levels.append(dict(name=name, fraction=fraction, achieved=loads[0] / sum(loads), bias=float(bias[0]),
                           rows=first["rows"], saved_bytes=first["saved_bytes"],
                           formula_bytes=expert_activation_bytes(first["rows"], sizes.d_model, sizes.d_ff,
                                                                 xs.element_size()),
                           **times, out=first["out"], dx=first["dx"],
                           samples=[{k: v for k, v in s.items() if k not in ("out", "dx")} for s in samples]))
    return dict(rank=rank, world=world, timed=world <= usable_cores(), sizes=dataclasses.asdict(sizes),
                hardware=hardware_label(cdist.backend(), dev), levels=levels)


def launch_straggler(cfg_or_sizes=None, skew: dict | None = None, repeats: int = 5, nprocs: int = 2,
                     timeout_s: float = 300.0) -> list[dict]:
    """`rank_straggler` on ``nprocs`` gloo ranks, one thread each (`course_lib.runtime.launch.run`): every rank's
    result."""
    from course_lib.runtime.launch import run

    return run(rank_straggler, nprocs, args=(cfg_or_sizes, skew, repeats), backend="gloo", timeout_s=timeout_s,
               stream=False, threads_per_rank=1).returns


def straggler_table(returns: list[dict]) -> list[dict]:
    """Per skew level, from every rank's result: {"name", "fraction", "rows" per rank, "load_ratio" (max / mean rows),
    "expert_s" and "expert_cpu_s" per rank (medians), "time_ratio" (max / mean of expert_cpu_s: the measured side
    of load_ratio), "combine_wait_s", "dispatch_wait_s" and their sum "wait_s" per rank, "predicted_wait_s"
    (`straggler_step_time` with the
    seconds per row of the ranks' total CPU time over their total rows), "saved_bytes", "formula_bytes" per rank,
    "timed"}."""
    rows = []
    for i, level in enumerate(returns[0]["levels"]):
        per = [r["levels"][i] for r in returns]
        loads = [p["rows"] for p in per]
        cpu = [p["expert_cpu_s"] for p in per]
        model = straggler_step_time(loads, sum(cpu) / max(1, sum(loads)))
        rows.append(dict(name=level["name"], fraction=level["fraction"], achieved=level["achieved"], rows=loads,
                         load_ratio=model["ratio"], expert_s=[p["expert_s"] for p in per], expert_cpu_s=cpu,
                         time_ratio=max(cpu) / (sum(cpu) / len(cpu)),
                         combine_wait_s=[p["combine_wait_s"] for p in per],
                         dispatch_wait_s=[p["dispatch_wait_s"] for p in per],
                         wait_s=[p["combine_wait_s"] + p["dispatch_wait_s"] for p in per],
                         predicted_wait_s=model["wait"], step_s=[p["step_s"] for p in per],
                         saved_bytes=[p["saved_bytes"] for p in per], formula_bytes=[p["formula_bytes"] for p in per],
                         timed=all(r["timed"] for r in returns)))
    return rows
