"""Measuring what a training step costs: time, throughput, FLOPs, MFU and memory (lesson 01).

Everything a lesson prints as "measured" comes from here, always together with
:func:`hardware_label`, so that every number names the machine and backend it came from.

- Time: :class:`Timer` and :func:`time_fn` (warm-up, then the median of several repeats; on GPU
  ``torch.cuda.synchronize`` before reading the clock, because kernels run asynchronously); :class:`Stopwatch`
  (CUDA events, never a synchronize) for work between point-to-point messages.
- Compute: :func:`count_flops` (``torch.utils.flop_counter.FlopCounterMode`` with the CPU attention
  kernel registered), :func:`mfu`, the datasheet table :data:`GPU_SPECS` and
  :func:`measure_peak_matmul_flops` for a CPU (which has no datasheet number that matters);
  :func:`cpu_features` (native bf16 / fp16 kernels, AMX) for what low precision costs on this CPU.
- Memory: :func:`model_state_bytes` (parameters, gradients, optimizer state counted from the tensors
  themselves, exact), :class:`SavedActivations` (bytes that autograd keeps for the backward pass,
  counted with saved-tensor hooks), :func:`live_tensor_bytes` (every tensor alive), :func:`rss_bytes` and
  :func:`cuda_memory_stats`.
- Communication: :class:`CollectiveCounter` (every collective call with its payload bytes, per phase), and
  :func:`interval_union` / :func:`intervals_length` for the busy time of a profiled timeline.

MFU (model FLOPs utilisation) follows PaLM (Chowdhery et al. 2022, appendix B): achieved *model*
FLOP/s (6N + attention per token, no recomputation) divided by the device's peak dense FLOP/s.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import platform
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from course_lib import nccl_rules

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


# Vendor datasheets and whitepapers (dense numbers; NVIDIA lists "with sparsity" figures, which are 2x these).
_NVLINK3, _NVLINK4 = "NVLink 3 (600 GB/s bidirectional)", "NVLink 4 (900 GB/s bidirectional)"
_PCIE3, _PCIE4, _PCIE5 = ("PCIe Gen3 x16 (32 GB/s bidirectional)", "PCIe Gen4 x16 (64 GB/s bidirectional)",
                          "PCIe Gen5 x16 (128 GB/s bidirectional)")
GPU_SPECS: dict[str, GPUSpec] = {
    "V100": GPUSpec("V100 SXM2 (16 or 32GB)", 125.0, 32, 900, 150, "NVLink 2 (300 GB/s bidirectional)",
                    "NVIDIA Tesla V100 datasheet (2020): 125 TFLOPS tensor (fp16); no bf16 support"),
    "V100 PCIe": GPUSpec("V100 PCIe (16 or 32GB)", 112.0, 32, 900, 16, _PCIE3,
                         "NVIDIA Tesla V100 datasheet (2020): PCIe 112 TFLOPS tensor (fp16); no bf16 support"),
    "V100S": GPUSpec("V100S PCIe 32GB", 130.0, 32, 1134, 16, _PCIE3,
                     "NVIDIA Tesla V100S datasheet (2019): 130 TFLOPS tensor (fp16); no bf16 support"),
    "T4": GPUSpec("T4 16GB", 65.0, 16, 320, 16, _PCIE3,
                  "NVIDIA T4 datasheet (2019): mixed-precision (fp16/fp32) tensor 65 TFLOPS; no bf16 support"),
    "A100": GPUSpec("A100 SXM4 80GB", 312.0, 80, 2039, 300, _NVLINK3,
                    "NVIDIA A100 datasheet (2021): BF16 tensor core 312 TFLOPS (624 with sparsity)"),
    "A100 40GB": GPUSpec("A100 SXM4 40GB", 312.0, 40, 1555, 300, _NVLINK3,
                         "NVIDIA A100 datasheet (2021): BF16 tensor core 312 TFLOPS; 40GB HBM2 1,555 GB/s"),
    "A100 PCIe": GPUSpec("A100 PCIe 80GB", 312.0, 80, 1935, 32, _PCIE4,
                         "NVIDIA A100 datasheet (2021): BF16 tensor core 312 TFLOPS; 80GB PCIe 1,935 GB/s"),
    "A100 PCIe 40GB": GPUSpec("A100 PCIe 40GB", 312.0, 40, 1555, 32, _PCIE4,
                              "NVIDIA A100 datasheet (2021): BF16 tensor core 312 TFLOPS; 40GB PCIe 1,555 GB/s"),
    "H100": GPUSpec("H100 SXM5 80GB", 989.4, 80, 3350, 450, _NVLINK4,
                    "NVIDIA H100 datasheet (2023): BF16 tensor core 1,979 TFLOPS with sparsity = 989 dense"),
    "H100 PCIe": GPUSpec("H100 PCIe 80GB", 756.0, 80, 2000, 64, _PCIE5,
                         "NVIDIA H100 datasheet (2023): PCIe BF16 tensor core 1,513 TFLOPS with sparsity = 756 dense"),
    "H100 NVL": GPUSpec("H100 NVL 94GB", 835.5, 94, 3900, 300, "NVLink bridge (600 GB/s bidirectional)",
                        "NVIDIA H100 datasheet (2023): H100 NVL BF16 tensor core 1,671 TFLOPS with sparsity = "
                        "835.5 dense"),
    "H200": GPUSpec("H200 SXM 141GB", 989.4, 141, 4800, 450, _NVLINK4,
                    "NVIDIA H200 datasheet (2024): BF16 tensor core 1,979 TFLOPS with sparsity = 989 dense"),
    "H200 NVL": GPUSpec("H200 NVL 141GB", 835.5, 141, 4800, 450, "NVLink bridge (900 GB/s bidirectional)",
                        "NVIDIA H200 datasheet (2024): H200 NVL BF16 tensor core 1,671 TFLOPS with sparsity = "
                        "835.5 dense"),
    "GH200": GPUSpec("GH200 96GB HBM3 (Hopper GPU)", 989.4, 96, 4000, 450, _NVLINK4,
                     "NVIDIA GH200 Grace Hopper Superchip datasheet (2023): BF16 tensor core 1,979 TFLOPS with "
                     "sparsity = 989 dense; 96GB HBM3, 4 TB/s"),
    "L4": GPUSpec("L4 24GB", 121.0, 24, 300, 32, _PCIE4,
                  "NVIDIA L4 datasheet (2023): BF16 tensor core 242 TFLOPS with sparsity = 121 dense"),
    "L40": GPUSpec("L40 48GB", 181.05, 48, 864, 32, _PCIE4,
                   "NVIDIA L40 datasheet (2022): BF16 tensor core 362.1 TFLOPS with sparsity = 181.05 dense"),
    "L40S": GPUSpec("L40S 48GB", 362.05, 48, 864, 32, _PCIE4,
                    "NVIDIA L40S datasheet (2023): BF16 tensor core 733 TFLOPS with sparsity = 362.05 dense"),
    "RTX 3090": GPUSpec("GeForce RTX 3090 24GB", 71.0, 24, 936, 32, _PCIE4,
                        "NVIDIA Ampere GA102 GPU architecture whitepaper v2 (2021): RTX 3090 peak BF16 tensor TFLOPS "
                        "with FP32 accumulate 71 (142 with sparsity)"),
    "RTX 4090": GPUSpec("GeForce RTX 4090 24GB", 165.2, 24, 1008, 32, _PCIE4,
                        "NVIDIA Ada Lovelace architecture whitepaper v1.0 (2022), table 2: "
                        "peak BF16 tensor TFLOPS with FP32 accumulate 165.2 (330.4 with sparsity)"),
    "RTX 5090": GPUSpec("GeForce RTX 5090 32GB", 209.5, 32, 1792, 64, _PCIE5,
                        "NVIDIA RTX Blackwell GPU architecture whitepaper (2025): RTX 5090 peak FP16/BF16 tensor "
                        "TFLOPS with FP32 accumulate 209.5 (419 with sparsity)"),
}

# How CUDA names these devices (torch.cuda.get_device_name), most specific first: the form factor decides the peak
# (an H100 PCIe is not an H100 SXM), so a name matches a row only by its whole model number and form factor.
_GPU_NAMES = [(re.compile(p, re.I), key) for p, key in (
    (r"\bV100S\b", "V100S"), (r"\bV100\b.*\bPCIE\b", "V100 PCIe"), (r"\bV100\b", "V100"), (r"\bT4\b", "T4"),
    (r"\bA100\b(?=.*\bPCIE\b)(?=.*\b40GB\b)", "A100 PCIe 40GB"), (r"\bA100\b.*\bPCIE\b", "A100 PCIe"),
    (r"\bA100\b.*\b40GB\b", "A100 40GB"), (r"\bA100\b", "A100"),
    (r"\bGH200\b", "GH200"), (r"\bH100\b.*\bPCIE\b", "H100 PCIe"), (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b", "H100"), (r"\bH200\b.*\bNVL\b", "H200 NVL"), (r"\bH200\b", "H200"),
    (r"\bL40S\b", "L40S"), (r"\bL40\b", "L40"), (r"\bL4\b", "L4"),
    (r"\bRTX 3090\b", "RTX 3090"), (r"\bRTX 4090\b", "RTX 4090"), (r"\bRTX 5090\b", "RTX 5090"))]


def gpu_spec(device_name: str) -> GPUSpec | None:
    """The :data:`GPU_SPECS` row of a CUDA device name ("NVIDIA H100 80GB HBM3" -> H100 SXM5, "NVIDIA H100 PCIe" ->
    H100 PCIe, "NVIDIA L40S" -> L40S, "NVIDIA GH200 480GB" -> GH200), or None for a device the table does not know
    (an AMD MI300X, a laptop GPU): then the course measures the peak instead of guessing a row."""
    if re.search(r"\b(Laptop|Mobile|Max-Q)\b", device_name, re.I):    # same model number, a fraction of the power
        return None
    for pattern, key in _GPU_NAMES:
        if pattern.search(device_name):
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


@functools.lru_cache(maxsize=None)
def cpu_features() -> dict:
    """What this CPU offers for 16-bit arithmetic (lesson 06).

    ``isa``: the vector instruction set PyTorch's CPU kernels dispatch to ('AVX2', 'AVX512', ...);
    ``bf16``: bf16 dot-product instructions (x86: AVX512-BF16 or AMX-BF16; elsewhere oneDNN's own answer);
    ``fp16``: fp16 arithmetic for oneDNN (x86: AVX512-FP16 or AMX-FP16), the question DeepSpeed's CPU accelerator asks
    (`torch.ops.mkldnn._is_mkldnn_fp16_supported`) before it accepts ``"fp16"``;
    ``amx``: the AMX extensions present. Without native 16-bit instructions a CPU converts each 16-bit operand to
    fp32 and back, so low precision is slower, not faster.
    """
    def ask(name: str) -> bool:
        try:
            return bool(getattr(torch.ops.mkldnn, name)())
        except Exception:  # noqa: BLE001 - an old torch or a build without oneDNN: no native kernels
            return False

    caps = getattr(torch.cpu, "get_capabilities", dict)()          # torch's cpuinfo (x86); {} on older torch
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    has = lambda name: bool(caps.get(name)) or name in flags  # noqa: E731
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    bf16 = has("avx512_bf16") or has("amx_bf16") if x86 else ask("_is_mkldnn_bf16_supported")
    amx = sorted(n for n in ("amx_tile", "amx_bf16", "amx_fp16", "amx_int8") if has(n))
    return dict(isa=torch.backends.cpu.get_cpu_capability(), bf16=bf16, fp16=ask("_is_mkldnn_fp16_supported"),
                amx=amx)


def describe_cpu_precision() -> str:
    """One line for a lesson: this CPU's native 16-bit support (`cpu_features`), and what follows from it."""
    f = cpu_features()
    names = [n for n, ok in (("bf16", f["bf16"]), ("fp16", f["fp16"])) if ok]
    amx = f", {', '.join(f['amx'])}" if f["amx"] else ""
    fp16 = "DeepSpeed accepts fp16 here" if f["fp16"] else "DeepSpeed refuses fp16 here"
    if not names:
        return (f"{cpu_model_name()} ({f['isa']}): no native bf16 or fp16 instructions, so 16-bit operands are "
                f"converted to fp32 and back (expect low precision to be slower than fp32); {fp16}")
    return f"{cpu_model_name()} ({f['isa']}{amx}): native {' and '.join(names)} instructions; {fp16}"


def hardware_label(backend: str | None = None, device: torch.device | str | None = None) -> str:
    """A one-line description of where a number was measured.

    >>> hardware_label("gloo")   # doctest: +SKIP
    'CPU: AMD EPYC, 2 cores, 2 threads, torch 2.14.1, gloo'
    >>> hardware_label()         # on a GPU node  # doctest: +SKIP
    'NVIDIA H100 80GB HBM3, torch 2.14.1, CUDA 13.0, NCCL'

    Without a device: the CPU for a gloo run (its ranks compute on the CPU even on a GPU machine), else the GPU
    when there is one.
    """
    if device is None:
        device = torch.device("cpu") if (backend or "").lower() == "gloo" else default_device()
    device = torch.device(device)
    tv = torch.__version__.split("+")[0]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        be = backend or "NCCL"
        return f"{name}, torch {tv}, CUDA {torch.version.cuda}, {be.upper() if be.lower() == 'nccl' else be}"
    from course_lib.procs import usable_cores

    label = f"CPU: {cpu_model_name()}, {usable_cores()} cores, {torch.get_num_threads()} threads, torch {tv}"
    return f"{label}, {backend}" if backend else label


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (no-op on CPU). Never while a receive is pending: on a GPU this waits for NCCL's
    streams too (`course_lib.nccl_rules`, rule 3, checks it on CPU runs)."""
    nccl_rules.note_synchronize()
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


class Stopwatch:
    """Timestamps of device work that never block the host while it runs: CUDA events on a GPU, read once the work
    is done; ``time.perf_counter`` on a CPU. Every process of a machine shares perf_counter's clock, so the ranks'
    timelines line up; on a GPU each rank's events are placed on that clock by one reference point, taken when the
    stopwatch is made (make it when nothing is pending, e.g. right after a barrier).

        clock = Stopwatch(device)
        t0 = clock.stamp(); work(); t1 = clock.stamp()
        clock.seconds(t1) - clock.seconds(t0)    # on a GPU: waits for the events, so call it after the work

    Unlike `Timer`, it never calls ``torch.cuda.synchronize()``, which would wait for NCCL's pending receives too
    (`course_lib.nccl_rules`, rule 3): the way to time work between point-to-point messages (lesson 03).
    """

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else default_device()
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            self.reference.synchronize()
        self.t_reference = time.perf_counter()

    def stamp(self):
        """Now, on the device's timeline: a float (CPU) or a recorded CUDA event (GPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamp) -> float:
        """A stamp as ``time.perf_counter`` seconds (on a GPU, once its event has happened)."""
        if not self.cuda:
            return stamp
        stamp.synchronize()
        return self.t_reference + self.reference.elapsed_time(stamp) / 1e3


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
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (a fraction, 0..1); from a throughput,
    ``mfu(tokens_per_s_per_gpu * flops_per_token, peak)``.

    ``peak_flops_per_s`` must be the *dense* peak of the dtype the matmuls run in (H100 SXM bf16: 989.4e12,
    ``GPU_SPECS["H100"]``), not the datasheet's headline 1,979e12, which assumes 2:4 structured sparsity (NVIDIA's
    H100 table marks it "* Shown with sparsity. Specifications 1/2 lower without sparsity"). torchtitan divides by
    the same number (``torchtitan/tools/utils.py``, ``get_peak_flops``: "# NOTE: Specifications are one-half lower
    without sparsity." ... ``return 989e12`` for H100 SXM)."""
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


def count_flops(fn: Callable[[], object], model_flops: bool = True, by_op: bool = False) -> int | dict[str, int]:
    """FLOPs executed by ``fn()`` as counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Counts matmuls (mm, addmm, bmm, attention) only: 2 FLOPs per multiply-add. Elementwise ops,
    softmax, layer norm, the loss and the optimizer step are not counted (they are a small
    fraction of a transformer's FLOPs, and are memory-bound anyway).
    With ``model_flops=True`` attention uses :func:`flop_counter_mapping` (CPU kernel counted,
    no recompute); with ``False`` the stock counter is used unchanged. ``by_op=True`` returns the count per op
    (``{"aten.mm": ..., ...}``, summing to the total) instead of the total.
    """
    from torch.utils.flop_counter import FlopCounterMode
    mapping = flop_counter_mapping() if model_flops else None
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    if by_op:
        return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    return int(counter.get_total_flops())


_BEST_MATMUL: dict[tuple[str, str], float] = {}  # best matmul FLOP/s seen in this process, per (device, dtype)


def record_matmul_flops(device, dtype: torch.dtype, flop_s: float) -> None:
    """Remember an achieved matmul FLOP/s (lesson 01's ``matmul_sweep`` calls this): on a CPU the peak
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


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages behind ``tensors`` that are not in ``seen`` yet (``seen`` is updated): a storage
    shared by several tensors (tied weights, views) counts once; a DTensor counts its local shard. None and
    non-tensors are skipped."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):                 # a DTensor (FSDP2, DTensor TP): this rank's shard
            t = t.to_local()
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
    p_bytes = unique_bytes(params, seen)
    g_bytes = unique_bytes([p.grad for p in params], seen)
    o_bytes = o_scalars = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    b = unique_bytes([v], seen)
                    o_bytes += b
                    if v.dim() == 0:
                        o_scalars += b
    return dict(params=p_bytes, grads=g_bytes, optimizer=o_bytes, optimizer_scalars=o_scalars,
                total=p_bytes + g_bytes + o_bytes)


def live_tensor_bytes(device: torch.device | str | None = None) -> int:
    """Bytes of every tensor alive in this process on `device` (storages deduplicated; DTensors counted by their local
    shard; ``device`` defaults to this rank's, `dist.device()`). The one measurement that treats every library alike,
    on a CPU and on a GPU: whatever it keeps (buckets, flat buffers, optimizer state), it keeps in tensors. Not the
    CUDA allocator's count, which adds its rounding and caches and so differs from the formulas by more than the
    model state of a small model. A walk over every Python object: about 0.3 s on a CPU (lesson 05)."""
    import gc

    from course_lib import dist

    device = torch.device(device) if device is not None else dist.device()   # this rank's device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gc.collect()
    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                local = obj.to_local() if hasattr(obj, "to_local") else obj
                if local.device == device:
                    tensors.append(obj)
        except Exception:  # noqa: BLE001 - objects half torn down by gc
            continue
    return unique_bytes(tensors, set())


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


# ---------------------------------------------------------------------------------------------
# Communication: collectives counted per call (lesson 04), intervals of a profiled timeline (lessons 01, 02)
# ---------------------------------------------------------------------------------------------

# (the *_single forms are torch 2.14's names for the flat-tensor collectives; older releases lack them)
COUNTED_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                       "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all_single")
# one name per algorithm
COLLECTIVE_NAMES = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}


def _payload(op: str, args: tuple, kwargs: dict) -> torch.Tensor | list:
    first = args[0] if args else kwargs.get("tensor", kwargs.get("output", kwargs.get("output_tensor")))
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):   # (output, input): the input is the full tensor
        return args[1] if len(args) > 1 else kwargs["input"]
    if op == "reduce_scatter":                         # (output, input_list)
        return args[1] if len(args) > 1 else kwargs["input_list"]
    return first                                       # all_reduce tensor; all_gather(_into_tensor) output


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return tensor_bytes(x)


class CollectiveCounter:
    """Count the collectives a rank calls, with their payload bytes, forward and backward apart (lesson 04).
    Records every call as (phase, op, payload bytes, group size).

        counter = CollectiveCounter()
        with counter:                                   # patches torch.distributed's collectives
            with counter.phase("forward"):
                loss = tp_model.loss(x, y)
            with counter.phase("backward"):
                loss.backward()
        counter.table()    # {(phase, op): {"calls": n, "bytes": b}}

    The payload of a call is the size of the whole tensor being reduced or gathered: the tensor of an
    all-reduce, the *output* of an all-gather, the *input* of a reduce-scatter. What one rank actually sends
    over a ring is a fraction of it: 2(t-1)/t for an all-reduce, (t-1)/t for the other two
    (`course_lib.theory.comm.bus_factor`). Code that calls ``dist.all_reduce(...)`` at call time (every layer
    in this course, and a learner's) is counted; DTensor's functional collectives are not.
    """

    def __init__(self):
        self.records: list[tuple[str, str, int, int]] = []
        self.groups: list[tuple[int, ...]] = []        # the global ranks of each record's group (lesson 08)
        self.current = "other"
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveCounter":
        for op in COUNTED_COLLECTIVES:
            real = getattr(dist, op, None)
            if real is None:
                continue
            self._saved[op] = real
            setattr(dist, op, self._wrap(op, real))
        return self

    def __exit__(self, *exc) -> None:
        for op, real in self._saved.items():
            setattr(dist, op, real)
        self._saved = {}

    def _wrap(self, op: str, real):
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            self.records.append((self.current, COLLECTIVE_NAMES.get(op, op), _nbytes(_payload(op, args, kwargs)),
                                 dist.get_world_size(group)))
            self.groups.append(tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
            return real(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def phase(self, name: str):
        """Label the calls made inside the block ("forward", "backward", ...)."""
        old, self.current = self.current, name
        try:
            yield
        finally:
            self.current = old

    def reset(self) -> None:
        self.records.clear()
        self.groups.clear()

    def bytes_by_group(self) -> dict[tuple[int, ...], int]:
        """{global ranks of a group: payload bytes of the collectives called on it} (a 3D grid's dimensions)."""
        out: dict[tuple[int, ...], int] = collections.defaultdict(int)
        for (_, _, nbytes, _), ranks in zip(self.records, self.groups):
            out[ranks] += nbytes
        return dict(out)

    def table(self) -> dict:
        """{(phase, op): {"calls": n, "bytes": payload bytes}} (plain types: it travels back from ranks)."""
        out = collections.defaultdict(lambda: {"calls": 0, "bytes": 0})
        for phase, op, nbytes, _ in self.records:
            out[(phase, op)]["calls"] += 1
            out[(phase, op)]["bytes"] += nbytes
        return {k: dict(v) for k, v in out.items()}

    def calls(self, phase: str | None = None, op: str | None = None) -> int:
        return sum(1 for p, o, _, _ in self.records if phase in (None, p) and op in (None, o))

    def bytes(self, phase: str | None = None, op: str | None = None) -> int:
        return sum(b for p, o, b, _ in self.records if phase in (None, p) and op in (None, o))


def interval_union(intervals) -> list[list[float]]:
    """Merge (start, end) intervals into disjoint, sorted ones: the time during which at least one was open."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def intervals_length(intervals) -> float:
    """Total length of disjoint intervals (e.g. `interval_union`'s)."""
    return sum(e - s for s, e in intervals)
