"""The experiments of lesson 01: matmul FLOP/s, memory bandwidth, roofline points, collectives, a profiled DDP
step, MFU and the anatomy of training memory.

Each function returns plain rows (lists of dicts) that name the hardware and backend they came from,
so a lesson can print them, plot them (`report`) and compare them with `course_lib.theory`.
Sizes adapt to the device: small on a CPU (a lesson runs in minutes on 2 cores), realistic on a GPU.
Distributed benchmarks start their ranks through `course_lib.runtime.launch.run` (gloo on CPU, NCCL on GPUs):
the same code runs on both.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import dist as cdist
from course_lib.measure import hardware, memory_stats, speed
from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.dist import pick_backend
from course_lib.runtime.launch import run
from course_lib.measure.speed import interval_union, intervals_length
from course_lib.model import build_model, pad_vocab
from course_lib.parallel.fast_step import best_switches, optimizer_impl
from course_lib.theory import comm, flops

KB, MB = 1024, 1024 ** 2


def _device(device=None) -> torch.device:
    return torch.device(device) if device is not None else hardware.default_device()


def _dtype(device: torch.device, dtype=None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---------------------------------------------------------------------------------------------
# Compute and memory bandwidth on one device
# ---------------------------------------------------------------------------------------------


def time_kernel(fn, device=None, repeats: int = 5, min_s: float = 2e-3) -> float:
    """Best (minimum) seconds per call of a short kernel over ``repeats``, as STREAM reports its best rate.
    Calls are batched so that each timed repeat lasts at least ``min_s`` (a small matmul takes
    microseconds, less than the timer's resolution and overhead). The best repeat measures what the
    hardware can do; on a shared machine the others include time when another process had the core.
    (Training steps use the median instead: :func:`course_lib.measure.speed.time_fn`.)"""
    fn()  # warm-up
    with speed.Timer(device) as t:
        fn()
    inner = max(1, min(1000, int(min_s / max(t.seconds, 1e-7))))

    def many():
        for _ in range(inner):
            fn()

    return min(speed.time_fn(many, warmup=0, repeats=repeats, device=device, return_all=True)) / inner


def matmul_sweep(sizes=None, device=None, dtype=None, repeats: int = 5) -> list[dict]:
    """Achieved FLOP/s of square matmuls ``(n x n) @ (n x n)`` (2 n^3 FLOPs each) over ``sizes``."""
    device = _device(device)
    dtype = _dtype(device, dtype)
    if sizes is None:
        sizes = [64, 128, 256, 512, 1024] if device.type == "cpu" else [256, 512, 1024, 2048, 4096, 8192]
    rows = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        s = time_kernel(lambda: torch.mm(a, b), device, repeats)
        rows.append(dict(n=n, flops=2 * n ** 3, seconds=s, flop_s=2 * n ** 3 / s, dtype=str(dtype)))
        speed.record_matmul_flops(device, dtype, 2 * n ** 3 / s)
    return rows


def copy_bandwidth(sizes_bytes=None, device=None, repeats: int = 5) -> list[dict]:
    """Memory bandwidth of ``dst.copy_(src)``: bytes moved = 2 x size (read ``src``, write ``dst``).
    Small sizes fit in the CPU caches and look faster; the largest size measures main memory (DRAM/HBM).
    """
    device = _device(device)
    if sizes_bytes is None:
        sizes_bytes = [MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB] if device.type == "cpu" else \
            [16 * MB, 64 * MB, 256 * MB, 1024 * MB]
    rows = []
    for size in sizes_bytes:
        src = torch.ones(size // 4, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        s = time_kernel(lambda: dst.copy_(src), device, repeats)
        rows.append(dict(bytes=size, seconds=s, bytes_moved=2 * size, bw=2 * size / s))
    return rows


def _layernorm_flops(n_elements: int) -> int:
    # mean (1), variance (2: subtract, square-add), normalise (2), affine (2), plus ~1 for the rest: ~8 FLOPs/element
    return 8 * n_elements


def roofline_points(device=None, dtype=None, repeats: int = 5) -> list[dict]:
    """Measured (arithmetic intensity, FLOP/s) of a few kernels, for a roofline plot.
    FLOPs and the *minimum* bytes each kernel must move (read its inputs and write its output once):
    - matmul n x n: 2 n^3 FLOPs, 3 n^2 elements  -> intensity n / 6 FLOP/byte in fp32 (grows with n)
    - elementwise add of N elements: N FLOPs, 3N elements -> 1/12 FLOP/byte in fp32 (memory-bound)
    - layer norm over rows of d: ~8 FLOPs/element (see ``_layernorm_flops``), read + write each element
    - attention (SDPA, B x H x T x D, no mask): 4 B H T^2 D FLOPs, q, k, v and the output moved once
    """
    device = _device(device)
    dtype = _dtype(device, dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    gpu = device.type == "cuda"
    rows = []

    def add(name, kind, flops, nbytes, fn):
        s = time_kernel(fn, device, repeats)
        rows.append(dict(name=name, kind=kind, flops=flops, bytes=nbytes, intensity=flops / nbytes,
                         seconds=s, flop_s=flops / s))

    for n in ([256, 1024, 4096, 8192] if gpu else [32, 128, 512, 1024]):
        a = torch.randn(n, n, device=device, dtype=dtype)
        add(f"matmul {n}", "matmul", 2 * n ** 3, 3 * n * n * esize, lambda a=a: torch.mm(a, a))
        speed.record_matmul_flops(device, dtype, rows[-1]["flop_s"])
    N = (64 if gpu else 4) * MB
    x = torch.randn(N, device=device, dtype=dtype)
    y = torch.randn(N, device=device, dtype=dtype)
    add(f"add {N // MB}M", "elementwise", N, 3 * N * esize, lambda: torch.add(x, y))
    rows_, d = (32768 if gpu else 4096), 1024
    h = torch.randn(rows_, d, device=device, dtype=dtype)
    ln = torch.nn.LayerNorm(d, device=device, dtype=dtype)
    with torch.no_grad():
        add(f"layernorm {rows_}x{d}", "layernorm", _layernorm_flops(rows_ * d), 2 * rows_ * d * esize,
            lambda: ln(h))
    B, H, T, D = (8, 16, 2048, 64) if gpu else (2, 4, 256, 64)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(3))
    add(f"attention T={T}", "attention", 4 * B * H * T * T * D, 4 * B * H * T * D * esize,
        lambda: F.scaled_dot_product_attention(q, k, v))
    return rows


# ---------------------------------------------------------------------------------------------
# Collectives (run through course_lib.runtime.launch: gloo on CPU, NCCL on GPUs)
# ---------------------------------------------------------------------------------------------


def collective_sizes(min_bytes: int = KB, max_bytes: int = 64 * MB, factor: int = 4) -> list[int]:
    """Message sizes from ``min_bytes`` to ``max_bytes`` in steps of ``factor`` (1 KB ... 64 MB)."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def _repeats_for(nbytes: int) -> int:
    return 20 if nbytes <= 64 * KB else 10 if nbytes <= MB else 5 if nbytes <= 16 * MB else 3


def _collective_worker(world_sizes, ops, sizes):
    """Runs on every rank: times each collective on the first ``ws`` ranks, for each ws in world_sizes."""



    rank, total = dist.get_rank(), dist.get_world_size()
    dev = cdist.device()
    label = hardware.hardware_label(cdist.backend(), dev)
    rows = []
    for ws in world_sizes:
        group = dist.new_group(list(range(ws))) if ws < total else None  # every rank must call new_group
        if rank < ws:
            for op in ops:
                for S in sizes:
                    n_el = S // 4  # float32 elements of the full buffer S (nccl-tests' "size")
                    if op == "all_reduce" or op == "broadcast":
                        buf = torch.ones(n_el, device=dev)
                        fn = (lambda b=buf: dist.all_reduce(b, group=group)) if op == "all_reduce" else \
                            (lambda b=buf: dist.broadcast(b, src=0, group=group))
                    elif op == "all_gather":  # each rank contributes S/ws, everyone receives S
                        out, inp = torch.empty(n_el, device=dev), torch.ones(n_el // ws, device=dev)
                        fn = lambda o=out, i=inp: dist.all_gather_into_tensor(o, i, group=group)
                    elif op == "reduce_scatter":  # each rank contributes S, receives its reduced S/ws
                        out, inp = torch.empty(n_el // ws, device=dev), torch.ones(n_el, device=dev)
                        fn = lambda o=out, i=inp: dist.reduce_scatter_tensor(o, i, group=group)
                    else:
                        raise ValueError(f"unknown collective {op!r}: use one of {comm.OPS}")
                    fn()  # warm-up (also creates the connections)
                    reps = _repeats_for(S)
                    dist.barrier(group=group)
                    speed.synchronize(dev)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    speed.synchronize(dev)
                    t = torch.tensor([(time.perf_counter() - t0) / reps], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank decides
                    sec = float(t.item())
                    rows.append(dict(op=op, world_size=ws, bytes=S, time_s=sec,
                                     algbw=comm.alg_bandwidth(S, sec),
                                     busbw=comm.bus_bandwidth(op, S, sec, ws),
                                     backend=cdist.backend(), hardware=label))
        dist.barrier()
    return rows if rank == 0 else None


def collective_benchmark(world_sizes=(2, 4), ops=comm.OPS, sizes=None, timeout_s: float = 300,
                         stream: bool = False) -> list[dict]:
    """Time all_reduce / all_gather / reduce_scatter / broadcast over 2 and 4 ranks, 1 KB ... 64 MB.
    One job of ``max(world_sizes)`` ranks (one launch, one import of torch per rank); each smaller
    world size runs on a sub-group of the first ranks while the others wait. Returns rows with
    ``op, world_size, bytes, time_s, algbw, busbw (bytes/s), backend, hardware``; busbw follows
    nccl-tests (see `course_lib.theory.comm`). NCCL with one GPU per rank where there are enough GPUs,
    else gloo on the CPU.
    """
    sizes = collective_sizes() if sizes is None else list(sizes)
    nprocs = max(world_sizes)
    res = run(_collective_worker, nprocs=nprocs, args=(tuple(world_sizes), tuple(ops), sizes),
              timeout_s=timeout_s, stream=stream)
    return res.value


def fit_collectives(rows: list[dict]) -> dict:
    """alpha-beta fit per (op, world_size): ``{(op, ws): (alpha_s, bandwidth_bytes_per_s)}``."""
    fits = {}
    for key in sorted({(r["op"], r["world_size"]) for r in rows}):
        pts = [r for r in rows if (r["op"], r["world_size"]) == key]
        fits[key] = comm.fit_alpha_beta([r["bytes"] for r in pts], [r["time_s"] for r in pts])
    return fits


# ---------------------------------------------------------------------------------------------
# One data-parallel step under torch.profiler: compute / communication / idle
# ---------------------------------------------------------------------------------------------

COMM_MARKERS = ("gloo:", "nccl", "c10d::", "allreduce", "all_reduce", "broadcast", "allgather",
                "reduce_scatter", "record_param_comms")
STEP_NAME = "train_step"


def is_comm_event(name: str) -> bool:
    """Whether a profiler event is communication (gloo / NCCL collectives and their c10d wrappers)."""
    low = name.lower()
    return any(m in low for m in COMM_MARKERS)


def _intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def breakdown(events: list[tuple], window: tuple[float, float]) -> dict:
    """Split the ``window`` (start, end) of a step into compute, communication, overlap and idle time.
    ``events``: (name, start, end) of the profiled activity that counts as work (CPU ops of the
    training thread and the collective threads on CPU; GPU kernels on CUDA). Communication = union of
    the intervals of :func:`is_comm_event` events; compute = union of the others. Returns seconds if
    the times are in seconds (torch.profiler gives microseconds: convert first):

        compute_only + comm_only + overlap + idle == window length
    """
    w0, w1 = window
    clip = lambda iv: [[max(s, w0), min(e, w1)] for s, e in iv if min(e, w1) > max(s, w0)]
    comm_iv = interval_union(clip([(s, e) for n, s, e in events if is_comm_event(n)]))
    comp_iv = interval_union(clip([(s, e) for n, s, e in events if not is_comm_event(n)]))
    both = intervals_length(_intersect(comp_iv, comm_iv))
    compute, communication = intervals_length(comp_iv), intervals_length(comm_iv)
    total = w1 - w0
    busy = compute + communication - both
    return dict(total=total, compute=compute, communication=communication, overlap=both,
                compute_only=compute - both, comm_only=communication - both, idle=total - busy,
                comm_intervals=comm_iv, compute_intervals=comp_iv)


def _ddp_profile_worker(preset: str, batch_size: int, steps: int):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, record_function


    dev = cdist.device()
    cfg = get_preset(preset)
    model = build_model(cfg, seed=0).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x, y = (t.to(dev) for t in random_batches(cfg, batch_size, seed=1 + dist.get_rank())[0])   # each rank its own

    def step():
        logits = ddp(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()   # DDP all-reduces gradient buckets during backward
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    results = []
    for _ in range(steps):
        dist.barrier()
        speed.synchronize(dev)
        with profile(activities=acts) as prof:
            with record_function(STEP_NAME):
                step()
                speed.synchronize(dev)
        evs = prof.events()
        win = next(e for e in evs if e.name == STEP_NAME)
        window = (win.time_range.start / 1e6, win.time_range.end / 1e6)
        if dev.type == "cuda":  # GPU time: kernels on the device
            work = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in evs
                    if e.device_type == torch.autograd.DeviceType.CUDA]
        else:  # CPU time: every op except the step label itself (all threads: gloo runs in its own)
            work = [(e.name, e.time_range.start / 1e6, e.time_range.end / 1e6) for e in evs
                    if e.name != STEP_NAME]
        results.append(breakdown(work, window))
    tokens = batch_size * cfg.seq_len
    return dict(steps=results, tokens_per_rank=tokens, params=cfg.num_params(), preset=preset,
                backend=cdist.backend(), hardware=hardware.hardware_label(cdist.backend(), dev))


def profile_ddp_step(nprocs: int = 2, preset: str | None = None, batch_size: int | None = None,
                     steps: int = 3, timeout_s: float = 240, stream: bool = False) -> dict:
    """Profile ``steps`` data-parallel training steps (torch DDP) on ``nprocs`` ranks; return rank 0's breakdowns.
    Returns ``dict(steps=[breakdown, ...], median=breakdown of the median-length step, hardware, backend, ...)``.
    Defaults: the tiny preset on CPU (gloo), gpt2-124m on GPUs (NCCL, one GPU per rank; with fewer GPUs
    than ranks the CPU version runs).
    """
    backend = pick_backend(nprocs)
    gpu = backend == "nccl"
    preset = preset or ("gpt2-124m" if gpu else "tiny")
    batch_size = batch_size or 8
    res = run(_ddp_profile_worker, nprocs=nprocs, args=(preset, batch_size, steps), timeout_s=timeout_s,
              stream=stream, backend=backend)
    out = res.value
    ordered = sorted(out["steps"], key=lambda b: b["total"])
    out["median"] = ordered[len(ordered) // 2]
    out["nprocs"] = nprocs
    return out


# ---------------------------------------------------------------------------------------------
# One training step of the course GPT on one device: MFU and the anatomy of memory
# ---------------------------------------------------------------------------------------------


def _train_setup(cfg, batch_size: int, device, seed: int = 0, vocab_multiple: int | None = None,
                 optimizer: str = "default"):
    """The model (its vocabulary padded to ``vocab_multiple`` if given), Adam (the ``optimizer`` implementation,
    `parallel.fast_step.OPTIMIZER_IMPLS`) and one batch (B, T)."""
    model = build_model(cfg, seed=seed)
    if vocab_multiple:
        model = pad_vocab(model, vocab_multiple)
    model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **optimizer_impl(optimizer))
    x, y = random_batches(cfg, batch_size, seed=seed)[0]                   # (B, T) each
    return model, opt, x.to(device), y.to(device)


def train_step_mfu(cfg, batch_size: int, device=None, warmup: int = 2, repeats: int = 5, fast: bool = False,
                   switches: dict | None = None) -> dict:
    """Time one Adam training step of ``course_lib.model.GPT(cfg)`` and compute its MFU.
    Model FLOPs per step come from the formula (``theory.flops.step_flops``: 6N + attention, of the unpadded model),
    the peak from :func:`course_lib.measure.speed.peak_flops` (datasheet bf16 on known GPUs, measured fp32 matmul on
    a CPU). ``fast=False``: the plain step, fp32 on a CPU and bf16 autocast on a GPU (to be comparable with the bf16
    peak). ``fast=True``: switches of lesson 12's ladder turned on together (``switches``, default
    `parallel.fast_step.best_switches`: bf16 autocast, the vocabulary padded to a multiple of 128, fused Adam,
    torch.compile), the warm-up steps compiling. ``switches`` in the result says what ran.
    """
    device = _device(device)
    if fast:
        on = dict(best_switches(device) if switches is None else switches)
        if on.get("compile"):
            warmup = max(warmup, 2)                                       # the first compiled steps compile
    else:
        on = dict(autocast=device.type == "cuda", vocab_multiple=None, optimizer="default", compile=False)
    model, opt, x, y = _train_setup(cfg, batch_size, device, vocab_multiple=on.get("vocab_multiple"),
                                    optimizer=on.get("optimizer", "default"))
    loss_of = torch.compile(model.loss, dynamic=False) if on.get("compile") else model.loss

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(on.get("autocast"))):
            loss = loss_of(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = speed.time_fn(step, warmup=warmup, repeats=repeats, device=device)
    step_flops = flops.step_flops(cfg, batch_size)
    peak, source = speed.peak_flops(device)
    return dict(seconds=seconds, tokens=batch_size * cfg.seq_len,
                tokens_per_s=speed.tokens_per_s(batch_size * cfg.seq_len, seconds),
                step_flops=step_flops, flop_s=step_flops / seconds, peak=peak, peak_source=source,
                mfu=speed.mfu(step_flops / seconds, peak), hardware=hardware.hardware_label(device=device),
                switches=on)


def training_memory(cfg, batch_size: int, device=None) -> dict:
    """Measured memory of one Adam training step of ``GPT(cfg)`` (fp32), counted from tensors.
    ``params, grads, optimizer`` (after one step, :func:`course_lib.measure.memory_stats.model_state_bytes`) and
    ``activations`` (bytes saved for backward, :class:`course_lib.measure.memory_stats.SavedActivations`), plus
    ``rss`` on CPU or the CUDA allocator's ``peak_allocated`` on GPU, for comparison.
    """
    device = _device(device)
    model, opt, x, y = _train_setup(cfg, batch_size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with memory_stats.SavedActivations(model) as acts:
        loss = model.loss(x, y)
    loss.backward()
    opt.step()
    state = memory_stats.model_state_bytes(model, opt)
    out = dict(params=state["params"], grads=state["grads"], optimizer=state["optimizer"],
               optimizer_scalars=state["optimizer_scalars"], activations=acts.bytes,
               params_saved_for_backward=acts.params_saved_bytes, hardware=hardware.hardware_label(device=device))
    if device.type == "cuda":
        out.update(cuda=memory_stats.cuda_memory_stats(device))
    else:
        out.update(rss=memory_stats.rss_bytes())
    return out


# ---------------------------------------------------------------------------------------------
# FLOPs per token: what FlopCounterMode counts (section 1.5)
# ---------------------------------------------------------------------------------------------


def counted_flops(cfg, batch: int = 1, seed: int = 0) -> dict:
    """FLOPs per token of one real forward + backward of the course GPT on the CPU, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` with :func:`speed.flop_counter_mapping` (the CPU attention kernel
    counted, its backward 2 x forward): ``total``, and its ``matmul`` (mm/addmm/bmm: projections, MLP, LM head) and
    ``attention`` (the SDPA kernels) parts. (The stock counter, ``speed.count_flops(..., model_flops=False)``,
    has no formula for the CPU attention kernel: on a CPU it counts ``matmul`` only.)

    FlopCounterMode counts only ops it has a formula for: matmuls (2 m k n), convolutions and SDPA (Q K^T and P V
    over the full s x s matrix: torch's ``sdpa_flop`` says "NB: We aren't accounting for causal attention here").
    Softmax, norms, GELU, the loss and the optimizer are not counted.
    """
    torch.manual_seed(seed)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    by_op = speed.count_flops(lambda: model.loss(idx, idx).backward(), by_op=True)
    attention = sum(v for op, v in by_op.items() if "attention" in op)
    total = sum(by_op.values())
    n = idx.numel()
    return {"total": total / n, "matmul": (total - attention) / n, "attention": attention / n,
            "preset": cfg.name, "tokens": n, "hardware": hardware.hardware_label(device="cpu")}


def causal_attention_flops(batch: int = 2, heads: int = 4, seq_len: int = 64, head_dim: int = 16) -> dict:
    """FlopCounterMode's count of one attention forward + backward with and without the causal mask.

    ``math``: PyTorch's reference path (``SDPBackend.MATH``), which really multiplies the full s x s matrix and
    masks it, counted by the stock counter from its bmm ops; ``kernel``: the fused CPU kernel, counted with the
    course's mapping (the SDPA formula). Both count the causal case as the full matrix; ``formula_full`` and
    ``formula_causal`` are 2 x 2 x b h s^2 d x 3 (forward + backward) and half of it.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step(q, k, v, causal: bool) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

    out = {}
    for causal in (False, True):
        for path in ("math", "kernel"):
            q, k, v = (torch.randn(batch, heads, seq_len, head_dim, requires_grad=True) for _ in range(3))
            with sdpa_kernel(SDPBackend.MATH if path == "math" else SDPBackend.FLASH_ATTENTION):
                out[(path, causal)] = speed.count_flops(lambda: step(q, k, v, causal), model_flops=path == "kernel")
    full = 3 * 2 * 2 * batch * heads * seq_len ** 2 * head_dim
    return {"math_full": out[("math", False)], "math_causal": out[("math", True)],
            "kernel_full": out[("kernel", False)], "kernel_causal": out[("kernel", True)],
            "formula_full": full, "formula_causal": full / 2}
