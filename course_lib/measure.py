"""Measuring what a training step costs: time, throughput, FLOPs, MFU and memory (lesson 01).

Everything a lesson prints as "measured" comes from here, always together with
:func:`hardware_label`, so that every number names the machine and backend it came from.

- Time: :class:`Timer` and :func:`time_fn` (warm-up, then the median of several repeats; on GPU
  ``torch.cuda.synchronize`` before reading the clock, because kernels run asynchronously).
- Compute: :func:`count_flops` (``torch.utils.flop_counter.FlopCounterMode`` with the CPU attention
  kernel registered), :func:`mfu`, the datasheet table :data:`GPU_SPECS` and
  :func:`measure_peak_matmul_flops` for a CPU (which has no datasheet number that matters).
- Memory: :func:`model_state_bytes` (parameters, gradients, optimizer state counted from the tensors
  themselves, exact), :class:`SavedActivations` (bytes that autograd keeps for the backward pass,
  counted with saved-tensor hooks), :func:`rss_bytes` and :func:`cuda_memory_stats`.

MFU (model FLOPs utilisation) follows PaLM (Chowdhery et al. 2022, appendix B): achieved *model*
FLOP/s (6N + attention per token, no recomputation) divided by the device's peak dense FLOP/s.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

# ---------------------------------------------------------------------------------------------
# Hardware: datasheet peaks and a label for every printed number
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet numbers of one accelerator (dense, i.e. without 2:4 structured sparsity).

    bf16_tflops: peak dense bf16 tensor-core TFLOP/s (V100 has no bf16: its fp16 tensor-core peak).
    mem_gb: memory (GB); mem_bw_gbs: memory bandwidth (GB/s);
    link_gbs: per-GPU, one-direction bandwidth of the node-local interconnect (GB/s), named in ``link``.
    """

    name: str
    bf16_tflops: float
    mem_gb: float
    mem_bw_gbs: float
    link_gbs: float  # per-GPU unidirectional bandwidth of the node-local interconnect (GB/s)
    link: str
    source: str


# Vendor datasheets (dense numbers; NVIDIA lists "with sparsity" figures, which are 2x these).
GPU_SPECS: dict[str, GPUSpec] = {
    "V100": GPUSpec("V100 SXM2 32GB", 125.0, 32, 900, 150, "NVLink 2 (300 GB/s bidirectional)",
                    "NVIDIA Tesla V100 datasheet (2020): 125 TFLOPS tensor (fp16); no bf16 support"),
    "A100": GPUSpec("A100 SXM4 80GB", 312.0, 80, 2039, 300, "NVLink 3 (600 GB/s bidirectional)",
                    "NVIDIA A100 datasheet (2021): BF16 tensor core 312 TFLOPS (624 with sparsity)"),
    "H100": GPUSpec("H100 SXM5 80GB", 989.4, 80, 3350, 450, "NVLink 4 (900 GB/s bidirectional)",
                    "NVIDIA H100 datasheet (2023): BF16 tensor core 1,979 TFLOPS with sparsity = 989 dense"),
    "H200": GPUSpec("H200 SXM 141GB", 989.4, 141, 4800, 450, "NVLink 4 (900 GB/s bidirectional)",
                    "NVIDIA H200 datasheet (2024): BF16 tensor core 1,979 TFLOPS with sparsity = 989 dense"),
    "L4": GPUSpec("L4 24GB", 121.0, 24, 300, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                  "NVIDIA L4 datasheet (2023): BF16 tensor core 242 TFLOPS with sparsity = 121 dense"),
    "RTX 4090": GPUSpec("GeForce RTX 4090 24GB", 165.2, 24, 1008, 32, "PCIe Gen4 x16 (64 GB/s bidirectional)",
                        "NVIDIA Ada Lovelace architecture whitepaper v1.0 (2022), table 2: "
                        "peak BF16 tensor TFLOPS with FP32 accumulate 165.2 (330.4 with sparsity)"),
}


def gpu_spec(device_name: str) -> GPUSpec | None:
    """The :data:`GPU_SPECS` entry whose key appears in a CUDA device name (e.g. "NVIDIA H100 80GB HBM3")."""
    name = device_name.upper().replace("GEFORCE ", "")
    # Longest key first so that "H100" does not swallow a longer, more specific key.
    for key in sorted(GPU_SPECS, key=len, reverse=True):
        if key.upper() in name:
            return GPU_SPECS[key]
    return None


def default_device() -> torch.device:
    """``cuda`` (the current device) when available, else ``cpu``."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux) or platform (elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_label(backend: str | None = None, device: torch.device | str | None = None) -> str:
    """A one-line description of where a number was measured.

    >>> hardware_label("gloo")   # doctest: +SKIP
    'CPU: AMD EPYC, 2 cores, 2 threads, torch 2.14.1, gloo'
    >>> hardware_label()         # on a GPU node  # doctest: +SKIP
    'NVIDIA H100 80GB HBM3, torch 2.14.1, CUDA 13.0, NCCL'
    """
    device = torch.device(device) if device is not None else default_device()
    tv = torch.__version__.split("+")[0]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        be = backend or "NCCL"
        return f"{name}, torch {tv}, CUDA {torch.version.cuda}, {be.upper() if be.lower() == 'nccl' else be}"
    cores = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    label = f"CPU: {cpu_model_name()}, {cores} cores, {torch.get_num_threads()} threads, torch {tv}"
    return f"{label}, {backend}" if backend else label


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize(device)


class Timer:
    """Wall-clock timer that synchronises the GPU at start and stop.

    >>> with Timer() as t:
    ...     _ = sum(range(1000))
    >>> t.seconds > 0
    True
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds = float("nan")

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._t0


def time_fn(fn: Callable[[], object], warmup: int = 2, repeats: int = 5,
            device: torch.device | str | None = None, return_all: bool = False):
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls.

    The median (not the mean) because a shared machine produces occasional slow outliers.
    With ``return_all=True`` returns the list of all timed repeats instead.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one timed repeat")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            fn()
        times.append(t.seconds)
    return times if return_all else statistics.median(times)


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Throughput in tokens per second."""
    return tokens / seconds


def mfu(flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (a fraction, 0..1)."""
    return flops_per_s / peak_flops_per_s


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def _sdpa_fwd_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_bwd_flops_no_recompute(grad_out_shape, query_shape, key_shape, value_shape, *args,
                                 out_shape=None, **kwargs) -> int:
    # Model FLOPs: backward of two matmuls = 2 x forward (grad w.r.t. both operands of QK^T and PV).
    from torch.utils.flop_counter import sdpa_flop_count
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter_mapping() -> dict:
    """Extra ``custom_mapping`` for ``FlopCounterMode`` used by :func:`count_flops`.

    Two things differ from the stock counter (torch 2.x):
    1. the CPU attention kernel ``_scaled_dot_product_flash_attention_for_cpu`` has no formula there,
       so attention would count as 0 FLOPs on CPU; we register the same formula as for the GPU kernels;
    2. the GPU flash/efficient backward formulas include recomputing ``Q K^T`` (hardware FLOPs); MFU
       uses *model* FLOPs (PaLM, appendix B), so we count attention backward as 2 x forward everywhere.
    """
    aten = torch.ops.aten
    mapping = {}
    fwd = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    for name in fwd:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_fwd_flops
        if hasattr(aten, name + "_backward"):
            mapping[getattr(aten, name + "_backward")] = _sdpa_bwd_flops_no_recompute
    return mapping


def count_flops(fn: Callable[[], object], model_flops: bool = True) -> int:
    """FLOPs executed by ``fn()`` as counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Counts matmuls (mm, addmm, bmm, attention) only: 2 FLOPs per multiply-add. Elementwise ops,
    softmax, layer norm, the loss and the optimizer step are not counted (they are a small
    fraction of a transformer's FLOPs, and are memory-bound anyway).
    With ``model_flops=True`` attention uses :func:`flop_counter_mapping` (CPU kernel counted,
    no recompute); with ``False`` the stock counter is used unchanged.
    """
    from torch.utils.flop_counter import FlopCounterMode
    mapping = flop_counter_mapping() if model_flops else None
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return int(counter.get_total_flops())


_BEST_MATMUL: dict[tuple[str, str], float] = {}  # best matmul FLOP/s seen in this process, per (device, dtype)


def record_matmul_flops(device, dtype: torch.dtype, flop_s: float) -> None:
    """Remember an achieved matmul FLOP/s (``course_lib.bench.matmul_sweep`` calls this): on a CPU the peak
    is the best matmul seen, so no measurement reads above 100% of "peak"."""
    key = (str(torch.device(device)), str(dtype).replace("torch.", ""))
    _BEST_MATMUL[key] = max(_BEST_MATMUL.get(key, 0.0), flop_s)


@functools.lru_cache(maxsize=None)
def _measured_peak_cached(device_str: str, dtype_str: str, sizes: tuple, threads: int) -> float:
    device = torch.device(device_str)
    dtype = getattr(torch, dtype_str)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = min(time_fn(lambda: torch.mm(a, b), warmup=2, repeats=7, device=device, return_all=True))
        best = max(best, 2 * n ** 3 / seconds)
    return best


def measure_peak_matmul_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                              n: int | None = None) -> float:
    """Achieved FLOP/s of large square matmuls: the practical peak of this device (cached per process).

    On a CPU there is no datasheet number worth quoting (it depends on cores, vector width, clock
    and what else runs), so the course measures it: fp32, the best of n = 256, 512, 1024 (or the given
    ``n``). On a GPU, bf16, n = 8192. Each size reports its best of 7 repeats (as STREAM reports its
    best rate): what the hardware can do when nothing else runs; a shared machine slows the others.
    A better matmul recorded earlier (:func:`record_matmul_flops`) raises it.
    """
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if n is not None:
        sizes = (n,)
    else:
        sizes = (8192,) if device.type == "cuda" else (256, 512, 1024)
    dtype_str = str(dtype).replace("torch.", "")
    measured = _measured_peak_cached(str(device), dtype_str, sizes, torch.get_num_threads())
    return max(measured, _BEST_MATMUL.get((str(device), dtype_str), 0.0))


def peak_flops(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) for the device: the datasheet for known GPUs, else measured."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        spec = gpu_spec(torch.cuda.get_device_name(device))
        if spec is not None:
            return spec.bf16_tflops * 1e12, f"datasheet bf16 dense ({spec.name})"
    return measure_peak_matmul_flops(device, dtype), "measured (best fp32 matmul)" if device.type == "cpu" \
        else "measured (bf16 matmul, GPU not in table)"


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of the whole storage it may be a view of)."""
    return t.numel() * t.element_size()


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Exact bytes of the model's training state, counted from the tensors.

    Returns ``dict(params=, grads=, optimizer=, optimizer_scalars=, total=)``; ``optimizer`` includes
    ``optimizer_scalars`` (0-dim tensors such as Adam's per-parameter ``step`` counter, 4 bytes each).
    Storages are deduplicated, so tied weights (embedding = LM head) count once.
    For Adam in fp32 after one step: params 4P, grads 4P, optimizer 8P + 4 x (number of parameter tensors).
    """
    seen: set = set()
    params = list(model.parameters())
    p_bytes = _unique_bytes(params, seen)
    g_bytes = _unique_bytes([p.grad for p in params], seen)
    o_bytes = o_scalars = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    b = _unique_bytes([v], seen)
                    o_bytes += b
                    if v.dim() == 0:
                        o_scalars += b
    return dict(params=p_bytes, grads=g_bytes, optimizer=o_bytes, optimizer_scalars=o_scalars,
                total=p_bytes + g_bytes + o_bytes)


class SavedActivations:
    """Count the bytes autograd saves for backward inside the ``with`` block (saved-tensor hooks).

    Storages are deduplicated by ``data_ptr`` (the input of a Linear that is also the output of
    the ReLU before it is one storage and counts once). Parameters saved for backward (a Linear
    saves its weight) are not activations: they are counted apart, in ``params_saved_bytes``.

    >>> lin = torch.nn.Linear(4, 3)
    >>> with SavedActivations() as acts:
    ...     y = torch.relu(lin(torch.randn(2, 4, requires_grad=True)))
    >>> acts.bytes    # input (2x4) + relu output (2x3), fp32
    56

    Attributes: ``bytes`` (activation bytes), ``params_saved_bytes``, ``n_saved`` (pack calls),
    ``by_shape`` (list of (shape, dtype, bytes) for each new storage).
    """

    def __init__(self, model: torch.nn.Module | None = None, exclude: Iterable[torch.Tensor] = ()):
        self._param_ptrs: set | None = None
        self._model = model
        self._exclude = list(exclude)
        self.bytes = 0
        self.params_saved_bytes = 0
        self.n_saved = 0
        self.by_shape: list[tuple] = []
        self._seen: set = set()

    def _is_param(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True  # a parameter, or a view of one (a Linear saves weight.t())
        return (t.device, t.untyped_storage().data_ptr()) in self._param_ptrs

    def _pack(self, t: torch.Tensor):
        self.n_saved += 1
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in self._seen:
            self._seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            if self._is_param(t):
                self.params_saved_bytes += nbytes
            else:
                self.bytes += nbytes
                self.by_shape.append((tuple(t.shape), t.dtype, nbytes))
        return t

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self) -> "SavedActivations":
        # Every parameter the block can see: the given model's, plus any nn.Parameter saved directly.
        tensors = list(self._model.parameters()) if self._model is not None else []
        tensors += self._exclude
        self._param_ptrs = {(t.device, t.untyped_storage().data_ptr()) for t in tensors}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def rss_bytes() -> int:
    """Resident set size of this process (bytes): everything, including the Python interpreter and torch."""
    import psutil
    return psutil.Process().memory_info().rss


def cuda_memory_stats(device: torch.device | str | None = None) -> dict:
    """Allocator statistics (bytes): allocated now, peak allocated, reserved now, peak reserved."""
    s = torch.cuda.memory_stats(device)
    return dict(allocated=s["allocated_bytes.all.current"], peak_allocated=s["allocated_bytes.all.peak"],
                reserved=s["reserved_bytes.all.current"], peak_reserved=s["reserved_bytes.all.peak"])


def fmt_bytes(n: float, binary: bool = False) -> str:
    """Bytes with a unit: decimal by default (``fmt_bytes(3.2e9) == '3.20 GB'``), or binary for sizes that
    are powers of two (``fmt_bytes(64 * 2**20, binary=True) == '64 MiB'``)."""
    if binary:
        for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
            if abs(n) >= scale:
                return f"{n / scale:g} {unit}"
        return f"{int(n)} B"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float, per_s: bool = True) -> str:
    """FLOP or FLOP/s with a unit, e.g. ``fmt_flops(2.5e12) == '2.50 TFLOP/s'``."""
    suffix = "FLOP/s" if per_s else "FLOP"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}{suffix}"
    return f"{n:.0f} {suffix}"
