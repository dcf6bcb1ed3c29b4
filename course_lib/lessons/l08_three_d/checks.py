"""What the graded exercises of lesson 08 call (solutions/08_three_d_parallelism.ipynb).

Each ``check_*`` runs the learner's code against the course's grid, the planner, real ranks or PyTorch's own shards
on a fake process group, and raises ``course_lib.grading.check.CheckFailed`` (one line: what, expected, got, a hint)
at the first difference. tests/test_three_d_lesson.py calls them on wrong variants.
"""

from __future__ import annotations

from typing import Callable

from course_lib import dist as cdist
from course_lib.config import get_preset
from course_lib.grading.check import check_close, check_equal, check_true
from course_lib.measure.hardware import GPU_SPECS
from course_lib.runtime.launch import run
from course_lib.reference import reference_for
from course_lib.theory import planner
from course_lib.theory.planner import GiB

__all__ = ["GRID_SHAPES", "check_grid", "check_stage_memory", "check_step_time", "check_choose_layout",
           "choose_reference", "CHOICE_CASES"]

GRID_SHAPES = ((2, 2, 2), (4, 2, 8), (3, 1, 2), (1, 4, 1), (2, 3, 4), (1, 1, 8))       # (dp, pp, tp)
DIMS = ("tp", "pp", "dp")


def _rank_learner_groups(group_members: Callable, dp: int, pp: int, tp: int) -> dict:
    """On each rank: a process group per line of the learner's groups (every rank creates every group in the same
    order), then an all-reduce of the rank ids over this rank's group of each dimension."""
    import torch
    import torch.distributed as dist

    world, me, sums = dp * pp * tp, cdist.rank(), {}
    for dim in DIMS:
        lines = sorted({tuple(group_members(r, dim, dp, pp, tp)) for r in range(world)})
        mine = None
        for line in lines:
            group = dist.new_group(list(line))
            if me in line:
                mine = group
        t = torch.tensor([float(me)], device=cdist.device())
        dist.all_reduce(t, group=mine)
        sums[dim] = int(t.item())
    return sums


def check_grid(grid_coords: Callable, group_members: Callable) -> dict:
    """``grid_coords(rank, dp, pp, tp)`` and ``group_members(rank, dim, dp, pp, tp)`` equal `dist.GridLayout`'s for
    every rank of several grids; then 8 real ranks (2 x 2 x 2, gloo) build process groups from the learner's lines
    and all-reduce their rank ids over each: every sum must be that of the rank's true group."""
    for dp, pp, tp in GRID_SHAPES:
        ref = cdist.GridLayout(dp=dp, pp=pp, tp=tp)
        for r in range(ref.world_size):
            got = grid_coords(r, dp, pp, tp)
            check_equal(f"grid_coords({r}, dp={dp}, pp={pp}, tp={tp})", dict(got) if isinstance(got, dict) else got,
                        ref.coords_of(r), hint="TP innermost, then DP, PP outermost: undo the exercise's formula from "
                                               "the innermost coordinate out")
            for dim in DIMS:
                got = group_members(r, dim, dp, pp, tp)
                check_equal(f"group_members({r}, {dim!r}, dp={dp}, pp={pp}, tp={tp})",
                            list(got) if isinstance(got, (list, tuple)) else got, ref.members(r, dim),
                            hint=f"the ranks whose coordinates equal rank {r}'s in every dimension but {dim}, "
                                 f"ordered by their {dim} coordinate")
    res = run(_rank_learner_groups, 8, args=(group_members, 2, 2, 2), backend="gloo", stream=False, timeout_s=300)
    ref = cdist.GridLayout(dp=2, pp=2, tp=2)
    for r, sums in enumerate(res.returns):
        for dim in DIMS:
            check_equal(f"on 8 gloo ranks, rank {r}: sum of the rank ids all-reduced over its {dim} group",
                        sums[dim], sum(ref.members(r, dim)), hint="the groups built from group_members")
    return {"ranks": len(res.returns), "grids": len(GRID_SHAPES), "sums": res.returns}


MEMORY_CASES = (  # (preset, dp, tp, pp, zero, gradient bytes)
    ("gpt3-175b", 128, 8, 1, 1, 4), ("gpt3-175b", 8, 8, 16, 1, 4), ("gpt3-175b", 64, 4, 4, 0, 2),
    ("llama3-70b", 32, 8, 4, 1, 4), ("llama3-70b", 128, 8, 1, 3, 2), ("llama3-405b", 8, 8, 16, 2, 4),
    ("llama3-405b", 64, 8, 8, 3, 4), ("llama-7b", 16, 2, 2, 2, 2), ("gpt2-1.5b", 8, 1, 1, 2, 4))
FAKE_LAYOUTS = (("gpt3-175b", 1024, 8, 8), ("llama3-70b", 1024, 8, 4))     # (preset, world, tp, pp), ZeRO-3


_SHARDS: dict = {}


def _fake_group_shards(layouts) -> list[dict]:
    """`simulate.fake_group_shards(layouts)`, measured once per process: PyTorch's shards do not depend on the
    learner's code, and the measurement starts a fresh Python (tens of seconds on a busy CPU)."""
    from course_lib.lessons.l08_three_d.simulate import fake_group_shards

    if layouts not in _SHARDS:
        _SHARDS[layouts] = fake_group_shards(layouts)
    return _SHARDS[layouts]


def check_stage_memory(params_per_gpu: Callable, state_bytes_per_gpu: Callable, fake_group: bool = True) -> list:
    """``params_per_gpu(cfg, tp, pp)`` equals the planner's count for the largest stage (learned position table
    included, whole on every TP rank); ``state_bytes_per_gpu(cfg, dp, tp, pp, zero, grad_bytes)`` the ZeRO formula
    over it with ``grad_bytes``-byte gradients (`planner.model_state_bytes`), and with the default fp32 gradients when
    ``grad_bytes`` is not passed; and for ZeRO-3 (FSDP2) both within 2 % of the local shards that DTensor TP + FSDP2
    really create for GPT-3 175B and Llama-3 70B on a fake process group of 1,024 ranks."""
    rows = []
    for name, dp, tp, pp, zero, grad_bytes in MEMORY_CASES:
        cfg = get_preset(name)
        want = planner.stage_params(cfg, tp, pp)      # with pp > 1 it counts the head apart, tied or not
        got = params_per_gpu(cfg, tp, pp)
        check_close(f"params_per_gpu({cfg.name}, tp={tp}, pp={pp})", got, want, rtol=1e-6, atol=tp,
                    hint="the exercise's list: blocks, embedding, position table, head; which of them TP splits")
        want_b = planner.model_state_bytes(want, dp, zero, grad_bytes)["total"]
        got_b = state_bytes_per_gpu(cfg, dp, tp, pp, zero, grad_bytes=grad_bytes)
        check_close(f"state_bytes_per_gpu({cfg.name}, dp={dp}, tp={tp}, pp={pp}, zero={zero}, "
                    f"grad_bytes={grad_bytes})", got_b, want_b, rtol=1e-6, atol=18 * tp,
                    hint="lesson 05, section 1 (the ZeRO table), with this exercise's bytes per parameter; which "
                         "part each stage shards")
        if grad_bytes == 4:
            check_close(f"state_bytes_per_gpu({cfg.name}, dp={dp}, tp={tp}, pp={pp}, zero={zero}) without "
                        f"grad_bytes: fp32 gradients by default", state_bytes_per_gpu(cfg, dp, tp, pp, zero), want_b,
                        rtol=1e-6, atol=18 * tp, hint="grad_bytes defaults to 4 (fp32 gradients)")
        rows.append(dict(model=cfg.name, dp=dp, tp=tp, pp=pp, zero=zero, grad_bytes=grad_bytes, params=got,
                         bytes=got_b))
    if fake_group:
        for r in _fake_group_shards(FAKE_LAYOUTS):
            cfg = get_preset(r["model"])
            got_b = state_bytes_per_gpu(cfg, r["dp"], r["tp"], r["pp"], 3, grad_bytes=4)
            shard_bytes = r["local_state_bytes"]            # (2 + 4 + 12) x the parameters FSDP2 left here
            check_close(f"ZeRO-3 state bytes per GPU of {r['model']} on {r['world']} fake ranks (tp={r['tp']}, "
                        f"pp={r['pp']}, fp32 gradients) against FSDP2's real shards", got_b, shard_bytes, rtol=0.02,
                        hint="lesson 08, section 4: the shards FSDP2 and DTensor create, and ZeRO-3's row of lesson 05")
            rows.append(dict(model=r["model"], dp=r["dp"], tp=r["tp"], pp=r["pp"], zero=3, grad_bytes=4,
                             params=None, bytes=got_b, shard_bytes=shard_bytes))
    return rows


TIME_CASES = (  # (preset, GPU, nodes, GPUs per node, inter-node GB/s per GPU, global batch, dp, tp, pp, zero, mb)
    ("gpt3-175b", "A100", 128, 8, 25.0, 1536, 8, 8, 16, 1, 1),
    ("gpt3-175b", "A100", 128, 8, 25.0, 1536, 32, 8, 4, 1, 2),
    ("llama3-70b", "H100", 64, 8, 50.0, 512, 64, 8, 1, 2, 1),
    ("llama3-70b", "H100", 64, 8, 50.0, 512, 16, 4, 8, 0, 4),
    ("gpt2-1.5b", "A100 40GB", 2, 8, 25.0, 512, 16, 1, 1, 0, 8),
    ("llama3-405b", "H100", 16, 8, None, 64, 1, 8, 16, 1, 1))
TIME_HINTS = {
    "compute": "this exercise's text, the compute item (lesson 01, section 1.1: the model FLOPs of a step)",
    "bubble": "lesson 03, section 5 (the bubble) and lesson 08, section 3: count the micro-batches per DP rank first",
    "tp": "lesson 04, section 2 (the all-reduces of a TP layer) and this exercise's text: which link, how many, of "
          "what size",
    "pp": "lesson 08, section 2.1 (what each dimension sends) and this exercise's text: which link, and what "
          "sequence parallelism splits; none without a pipeline",
    "dp": "lesson 05, section 3 (ZeRO's collectives against an all-reduce) and this exercise's text: which link, "
          "which gradients' dtype",
}


def check_step_time(step_time: Callable) -> list:
    """``step_time(cfg, gpu, cluster, layout, global_batch, kernel_efficiency)`` returns the planner's compute,
    bubble, tp, pp and dp seconds (no recomputation, ZeRO 0-2, fp32 gradients) for layouts from one node to 1,024
    GPUs, each part on its own."""
    out = []
    for name, gpu, nodes, per_node, inter, batch, dp, tp, pp, zero, mb in TIME_CASES:
        cfg, spec = get_preset(name), GPU_SPECS[gpu]
        cluster = planner.Cluster(f"{nodes} x {per_node} {gpu}", nodes, per_node, inter)
        layout = planner.Layout(dp, tp, pp, zero, "none", mb)
        want = planner.estimate(cfg, spec, cluster, layout, batch, kernel_efficiency=0.4).time
        got = step_time(cfg, spec, cluster, layout, batch, 0.4)
        check_true(f"step_time returns a dict with {', '.join(TIME_HINTS)}",
                   isinstance(got, dict) and all(k in got for k in TIME_HINTS), hint="one entry per part, seconds")
        for part, hint in TIME_HINTS.items():
            check_close(f"{part} seconds of {layout.label()} for {name} on {cluster.name}, batch {batch}",
                        got[part], want[part], rtol=1e-6, atol=1e-12, hint=hint)
        out.append(dict(model=name, cluster=cluster.name, layout=layout.label(), **{k: want[k] for k in TIME_HINTS}))
    return out


@reference_for("08-choose-layout")
def choose_reference(rows, budget_gib: float, slack: float = 0.05):
    """The exercise's rule: feasible layouts that need at most ``budget_gib`` GiB per GPU; of those within ``slack``
    of the fastest step time, the fewest pipeline stages, then the smallest tp, then the least memory."""
    fits = [r for r in rows if r.feasible and r.memory["total"] <= budget_gib * GiB]
    if not fits:
        return None
    fastest = min(r.time["total"] for r in fits)
    near = [r for r in fits if r.time["total"] <= fastest * (1 + slack)]
    return min(near, key=lambda r: (r.layout.pp, r.layout.tp, r.memory["total"]))


CHOICE_CASES = (  # (preset, GPU, nodes, GPUs per node, inter-node GB/s per GPU, global batch, budget GiB, slack)
    ("gpt3-175b", "A100", 128, 8, 25.0, 1536, 80, 0.05), ("gpt3-175b", "A100", 128, 8, 25.0, 1536, 46, 0.05),
    ("llama3-70b", "H100", 64, 8, 50.0, 512, 50, 0.10), ("llama3-70b", "H100", 1, 8, None, 64, 80, 0.0),
    ("gpt2-1.5b", "A100 40GB", 2, 8, 25.0, 512, 20, 0.05), ("llama3-405b", "H100", 4, 8, 50.0, 64, 80, 0.05),
    # the fastest feasible layouts need more than the budget (the slack counts from the fastest that fits), and
    # near rows where less TP costs more memory (tp before memory): Llama-3 70B at 30 GiB, Llama 7B on 32 GPUs
    ("llama3-70b", "H100", 64, 8, 50.0, 512, 30, 0.30), ("llama-7b", "A100", 4, 8, 25.0, 256, 46, 0.10))


def check_choose_layout(choose_layout: Callable) -> list:
    """``choose_layout(rows, budget_gib, slack)`` picks what the rule picks from `planner.plan`'s rows, for clusters
    from one node to a thousand GPUs, including a budget nothing fits (then None)."""
    out = []
    for name, gpu, nodes, per_node, inter, batch, budget, slack in CHOICE_CASES:
        cluster = planner.Cluster(f"{nodes} x {per_node} {gpu}", nodes, per_node, inter)
        rows = planner.plan(get_preset(name), GPU_SPECS[gpu], cluster, batch)
        want = choose_reference(rows, budget, slack)
        got = choose_layout(rows, budget, slack)
        what = f"choose_layout for {name} on {cluster.name}, budget {budget} GiB, slack {slack:.0%}"
        if want is None:
            check_true(f"{what}: nothing fits, so None (got {got!r:.80})", got is None,
                       hint="no feasible layout needs at most the budget")
        else:
            check_true(f"{what}: returns one of the planner's rows (an Estimate)", isinstance(got, planner.Estimate),
                       hint="return the chosen Estimate itself")
            check_true(f"{what}: the chosen layout fits ({got.memory['total'] / GiB:.1f} GiB, feasible: "
                       f"{got.feasible})", got.feasible and got.memory["total"] <= budget * GiB,
                       hint="step 1 of this exercise's text: feasible, and within the budget in GiB (planner.GiB)")
            check_equal(f"{what}: the layout", got.layout.label(), want.layout.label(),
                        hint="steps 2 and 3 of this exercise's text, the preferences in their order")
        out.append(dict(case=what, layout=None if want is None else want.layout.label(),
                        step_s=None if want is None else want.time["total"],
                        gib=None if want is None else want.memory["total"] / GiB))
    return out
