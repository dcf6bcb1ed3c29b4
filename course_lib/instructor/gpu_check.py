"""``course gpu-check``: the instructor's self-test of a node before class (lessons 00-05 on the hardware at hand).

On a GPU node it prints a table (check, expected, measured, pass) and exits non-zero when anything fails:

- inventory: torch, CUDA, NCCL, every GPU with the datasheet row it gets (`course_lib.measure.hardware.gpu_spec`: a wrong
  row would make every MFU of the course wrong), the CPU and its 16-bit support;
- the launcher on 1, 2 and all GPUs (NCCL), and on GPUs + 1 ranks, which must fall back to gloo on the CPU;
- exact results of every collective the course uses (all_reduce, all_gather, reduce_scatter, broadcast, and
  point-to-point messages in a ``batch_isend_irecv``), every run checked against NCCL's rules
  (`course_lib.runtime.nccl_rules`);
- hang canaries, each launch limited to a short timeout: ring all-reduce at 2 and 4 ranks, naive / GPipe / 1F1B
  pipelines at p = 2 and 4, with messages larger than NCCL's buffers (where a wrong order really hangs);
- a bf16 matmul at 50-95 % of the datasheet row's peak (over 100 % means the row is wrong);
- the model state of an AdamW step equal to the formula (16 bytes per parameter, lesson 01);
- the bf16 speed-up of a matmul over fp32.

Without GPUs the same checks run on CPU ranks over gloo (CI runs it so); the datasheet checks then say "not a GPU".
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib import dist as cdist
from course_lib import theory
from course_lib.measure import hardware, memory_stats, speed
from course_lib.runtime import nccl_rules, pool
from course_lib.config import get_preset
from course_lib.runtime.launch import DistributedRunError, run
from course_lib.runtime.procs import usable_cores

__all__ = ["Check", "inventory", "run_checks", "format_report", "main"]


@dataclasses.dataclass
class Check:
    """One line of the report: ``ok`` is True, False, or None (does not apply here / not run)."""

    name: str
    expected: str
    measured: str
    ok: bool | None


# ------------------------------------------------------------------------------------------ inventory

def inventory() -> list[tuple[str, str]]:
    """What this node has: versions, GPUs with their datasheet row, the CPU."""
    rows = [("torch", torch.__version__), ("python", sys.version.split()[0])]
    if torch.cuda.is_available():
        nccl = "not built in"
        if dist.is_nccl_available():
            v = torch.cuda.nccl.version()                    # (2, 21, 5) in recent torch, 22105 in older ones
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        rows += [("CUDA", str(torch.version.cuda)), ("NCCL", nccl)]
        for i in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(i)
            gib = torch.cuda.get_device_properties(i).total_memory / 2 ** 30
            spec = hardware.gpu_spec(name)
            row = f"datasheet row {spec.name!r}: {spec.bf16_tflops:g} TFLOP/s bf16 dense" if spec else \
                "no datasheet row: the course measures its peak"
            rows.append((f"GPU {i}", f"{name}, {gib:.0f} GiB; {row}"))
    else:
        rows.append(("GPUs", "none: the checks run on CPU ranks over gloo"))
    rows.append(("CPU", f"{usable_cores()} cores; {hardware.describe_cpu_precision()}"))
    return rows


# ------------------------------------------------------------------------------------------ on every rank

def _rank_job() -> dict:
    return {"backend": dist.get_backend(), "device": str(cdist.device()), "pid": os.getpid()}


def _exact(t: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(t.detach().cpu(), expected)


def _rank_checks(big: bool) -> dict:
    """The collectives, the ring canary and the pipeline canaries on this world size; seconds of each canary."""
    from course_lib.config import small_config
    from course_lib.data import random_batches
    from course_lib.model import build_model
    from course_lib.one_process import train_reference
    from course_lib.parallel.collectives import ring_all_reduce, send_recv
    from course_lib.parallel.pipeline import P2P, build_stage, run_schedule, split_microbatches
    from course_lib.parallel.pipeline_schedules import schedule_orders

    dev, r, n = cdist.device(), dist.get_rank(), dist.get_world_size()
    ar = torch.arange(6, dtype=torch.float32)
    out = {}
    x = (ar + 10 * r).to(dev)
    t = x.clone()
    dist.all_reduce(t)
    out["all_reduce (sum, fp32)"] = _exact(t, ar * n + 10 * n * (n - 1) / 2)
    i = torch.tensor([3 ** 30 + r], dtype=torch.int64, device=dev)
    dist.all_reduce(i)
    out["all_reduce (sum, int64)"] = int(i.item()) == n * 3 ** 30 + n * (n - 1) // 2
    g = torch.empty(6 * n, device=dev)
    dist.all_gather_into_tensor(g, x)
    out["all_gather"] = _exact(g, torch.cat([ar + 10 * k for k in range(n)]))
    full = (torch.arange(3 * n, dtype=torch.float32) * (r + 1)).to(dev)
    part = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(part, full)
    out["reduce_scatter"] = _exact(part, torch.arange(3 * r, 3 * r + 3, dtype=torch.float32) * (n * (n + 1) / 2))
    b = x.clone()
    dist.broadcast(b, src=0)
    out["broadcast"] = _exact(b, ar)
    send, recv = torch.full((4,), float(r), device=dev), torch.empty(4, device=dev)
    send_recv(send, (r + 1) % n, recv, (r - 1) % n)
    out["send/recv (batch_isend_irecv)"] = _exact(recv, torch.full((4,), float((r - 1) % n)))
    seconds = {}
    t0 = time.perf_counter()
    ring = torch.full((1 << 22 if big else 1 << 12,), float(r + 1), device=dev)   # 16 MB: past NCCL's buffers
    ring_all_reduce(ring)
    out[f"ring all-reduce, {n} ranks"] = bool((ring == n * (n + 1) / 2).all())
    seconds[f"ring all-reduce, {n} ranks"] = time.perf_counter() - t0
    big_sizes = dict(d_model=512, n_head=8, seq_len=256) if big else {}
    cfg = small_config(n_layer=2 * n, tie_embeddings=False, name="pipeline-test", **big_sizes)  # untied: 2 stages
    micro = 16 if big else 2                                   # big: (16, 256, 512) fp32 messages, 8 MB each
    for kind in ("naive", "gpipe", "1f1b"):
        m = 1 if kind == "naive" else 2 * n
        x_, y_ = random_batches(cfg, micro * m, seed=1)[0]
        t0 = time.perf_counter()
        stage = build_stage(build_model(cfg).to(dev), r, n)              # this rank's blocks of the seeded model
        res = run_schedule(stage, schedule_orders(kind, n, m)[r], split_microbatches(x_.to(dev), m),
                           split_microbatches(y_.to(dev), m), P2P(r, n, dev))
        name = f"{kind} pipeline, p = {n}"
        seconds[name] = time.perf_counter() - t0
        if r == n - 1:                                         # the last stage has the losses: one process agrees?
            ref = train_reference(cfg, [(x_, y_)], optimizer=None, device=dev)["losses"][0]
            out[name] = abs(sum(res["losses"]) / m - ref) <= 1e-4 * abs(ref)
        else:
            out[name] = True
    flags = torch.tensor([float(v) for v in out.values()], device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)                # every rank must agree
    return {"ok": dict(zip(out, (bool(v) for v in flags.tolist()))), "seconds": seconds}


# ------------------------------------------------------------------------------------------ the checks

def _launcher_checks(n_gpu: int) -> list[Check]:
    out = []
    sizes = sorted({1, 2, n_gpu, n_gpu + 1}) if n_gpu else [1, 2]
    for n in sizes:
        want = "nccl" if n <= n_gpu else "gloo"
        where = f"{n} GPUs" if want == "nccl" else "CPU ranks"
        try:
            res = run(_rank_job, n, stream=False, timeout_s=120, fresh=True)
            got = {r["backend"] for r in res.returns}
            out.append(Check(f"launcher, {n} rank(s)", f"{want} on {where}", f"{'/'.join(got)} in {res.wall_s:.1f} s",
                             got == {want}))
        except DistributedRunError as exc:
            out.append(Check(f"launcher, {n} rank(s)", f"{want} on {where}", str(exc).splitlines()[0][:80], False))
    n = max(2, min(n_gpu, 4)) if n_gpu >= 2 else 2
    if not pool.enabled():
        out.append(Check(f"warm ranks, {n} rank(s)", "same answers from the same ranks", "pool off (COURSE_POOL=0)",
                         None))
        return out
    try:                                      # warm ranks (course_lib.runtime.pool): the same ranks answer twice
        first, again = (run(_rank_job, n, stream=False, timeout_s=120) for _ in range(2))
        same = first.pooled and again.pooled and first.returns == again.returns
        out.append(Check(f"warm ranks, {n} rank(s)", "same answers from the same ranks",
                         f"{again.backend}, re-run in {again.wall_s:.2f} s (first {first.wall_s:.1f} s)",
                         same))
    except DistributedRunError as exc:
        out.append(Check(f"warm ranks, {n} rank(s)", "same answers", str(exc).splitlines()[0][:80], False))
    return out


def _distributed_checks(n_gpu: int, timeout_s: float) -> list[Check]:
    out = []
    for n in (2, 4):
        if n_gpu and n > n_gpu:
            out.append(Check(f"collectives and canaries, {n} ranks", f"needs {n} GPUs", f"{n_gpu} GPU(s)", None))
            continue
        env = {nccl_rules.ENV_VAR: "1"}
        try:
            res = run(_rank_checks, n, args=(bool(n_gpu),), env=env, stream=False, timeout_s=timeout_s, fresh=True)
        except DistributedRunError as exc:         # a hang (timeout), an NCCL rule broken, a wrong collective
            out.append(Check(f"collectives and canaries, {n} ranks", f"done within {timeout_s:g} s",
                             " ".join(str(exc).split())[:160], False))
            continue
        ok, seconds = res.value["ok"], res.value["seconds"]
        for name, good in ok.items():
            measured = f"{seconds[name]:.2f} s, " if name in seconds else ""
            out.append(Check(f"{name}" + ("" if name in seconds else f", {n} ranks"), "exact, no hang",
                             measured + ("exact" if good else "WRONG"), good))
    return out


def _matmul_checks(device: torch.device) -> list[Check]:
    out = []
    gpu = device.type == "cuda"
    n = 8192 if gpu else 512
    tflops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        s = speed.time_fn(lambda: a @ a, warmup=2, repeats=5, device=device)
        tflops[dtype] = 2 * n ** 3 / s / 1e12
    spec = hardware.gpu_spec(torch.cuda.get_device_name(device)) if gpu else None
    if spec is not None:
        frac = tflops[torch.bfloat16] / spec.bf16_tflops
        out.append(Check(f"bf16 matmul n={n} vs {spec.name}", f"50-95 % of {spec.bf16_tflops:g} TFLOP/s",
                         f"{tflops[torch.bfloat16]:.1f} TFLOP/s = {frac:.0%}", 0.5 <= frac <= 0.95))
    else:
        why = "no datasheet row for this GPU" if gpu else "not a GPU (CPU: no datasheet peak)"
        out.append(Check(f"bf16 matmul n={n} vs datasheet", why, f"{tflops[torch.bfloat16] * 1e3:.1f} GFLOP/s", None))
    ratio = tflops[torch.bfloat16] / tflops[torch.float32]
    if gpu:
        out.append(Check(f"bf16 / fp32 matmul speed, n={n}", ">= 2x (tensor cores)", f"{ratio:.1f}x", ratio >= 2))
    else:
        native = hardware.cpu_features()["bf16"]
        out.append(Check(f"bf16 / fp32 matmul speed, n={n}", "> 1x with native bf16, < 1x without" if native
                         else "< 1x (no native bf16 instructions)", f"{ratio:.2f}x", None))
    return out


def _take_blas_workspace(device: torch.device) -> None:
    """Run a linear layer forward and backward once, so that cuBLAS takes its workspace now.

    cuBLAS and cuBLASLt take their workspaces from PyTorch's caching allocator at the first matrix products of a
    process, and `memory_allocated` counts them. On an H200 (torch 2.11, CUDA 13.0, 2026-11-27) this took 65.00 MiB
    in a fresh process. The first version of this check left them in. It measured 2028.84 MB for gpt2-124m against
    16 bytes/param = 1991.04 MB, and so failed. With the workspaces taken first it measured 1995.68 MB (+0.23 %)."""
    a = torch.ones(64, 64, device=device, requires_grad=True)
    torch.nn.functional.linear(a, a, a[0]).sum().backward()
    (a.detach() @ a.detach()).sum().item()
    del a
    torch.cuda.synchronize(device)


def _memory_check(device: torch.device) -> Check:
    """An AdamW step of a GPT: model state measured (CUDA allocator / tensors counted on a CPU) vs 16P bytes."""
    from course_lib.model import build_model

    gpu = device.type == "cuda"
    cfg = get_preset("gpt2-124m" if gpu else "tiny")
    if gpu:
        _take_blas_workspace(device)
    before = torch.cuda.memory_allocated(device) if gpu else 0
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(cfg.vocab_size, (2, 64), device=device)
    model.loss(x, x).backward()
    opt.step()
    P = cfg.num_params()
    counters = theory.memory.num_param_tensors(cfg)
    if gpu:                                     # torch's AdamW keeps its step counters on the CPU
        measured = torch.cuda.memory_allocated(device) - before
        expected = theory.memory.training_memory_bytes(cfg, "adamw")["total"]
    else:
        measured = memory_stats.model_state_bytes(model, opt)["total"]
        expected = theory.memory.training_memory_bytes(cfg, "adamw", step_counters=counters)["total"]
    return Check(f"model state of an AdamW step, {cfg.name} ({P / 1e6:.1f} M params)", f"{expected / 1e6:.2f} MB "
                 f"(16 bytes/param{'' if gpu else ' + step counters'})", f"{measured / 1e6:.2f} MB",
                 abs(measured - expected) <= 0.01 * expected)


def run_checks(timeout_s: float = 90.0) -> list[Check]:
    """Every check of the module docstring, in order."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if n_gpu else torch.device("cpu")
    checks = _launcher_checks(n_gpu)
    checks += _distributed_checks(n_gpu, timeout_s)
    checks += _matmul_checks(device)
    checks.append(_memory_check(device))
    return checks


def format_report(checks: list[Check], hardware: str) -> str:
    """The table: check, expected, measured, pass / FAIL / - (does not apply), and a verdict line."""
    lines = [f"measured on {hardware}"]
    w = max(len(c.name) for c in checks)
    lines.append(f"  {'check':<{w}}  {'expected':<40}  {'measured':<34}  result")
    for c in checks:
        verdict = {True: "pass", False: "FAIL", None: "-"}[c.ok]
        lines.append(f"  {c.name:<{w}}  {c.expected:<40}  {c.measured:<34}  {verdict}")
    failed = [c.name for c in checks if c.ok is False]
    lines.append("")
    lines.append(f"FAILED: {', '.join(failed)}" if failed else
                 f"OK: {sum(c.ok is True for c in checks)} checks passed ({sum(c.ok is None for c in checks)} "
                 f"do not apply here)")
    return "\n".join(lines)


def main(timeout_s: float = 90.0) -> int:
    """Print the inventory and the table; 1 when a check failed, else 0."""
    print("course gpu-check")
    print("\n".join(f"  {k:<8} {v}" for k, v in inventory()), flush=True)
    print("\nrunning the checks (launches of 1, 2 and 4 ranks; about a minute) ...", flush=True)
    checks = run_checks(timeout_s)
    label = hardware.hardware_label("nccl" if torch.cuda.is_available() else "gloo")
    print("\n" + format_report(checks, label))
    return 1 if any(c.ok is False for c in checks) else 0
