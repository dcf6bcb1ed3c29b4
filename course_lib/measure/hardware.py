"""Hardware facts: datasheet rows of the accelerators the course meets, this CPU's 16-bit support, and the one-line
label that names the machine and backend of every number a lesson prints (lesson 01).

- :data:`GPU_SPECS` (dense bf16 peak, memory, memory bandwidth, node-local link, with its source) and
  :func:`gpu_spec` (the row of a CUDA device name, or None for a device the table does not know);
- :func:`cpu_model_name`, :func:`cpu_features` (native bf16 / fp16 kernels, AMX) and :func:`describe_cpu_precision`
  for what low precision costs on this CPU (lesson 06);
- :func:`hardware_label` and :func:`default_device`.

Measurements live apart: time and FLOP/s in `course_lib.measure.speed`, bytes in `course_lib.measure.memory_stats`.
"""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet numbers of one accelerator (dense, i.e. without 2:4 structured sparsity).

    bf16_tflops: peak dense bf16 tensor-core TFLOP/s (V100 has no bf16: its fp16 tensor-core peak).
    mem_gb: memory (GB); mem_bw_gbs: memory bandwidth (GB/s);
    link_gbs: per-GPU, one-direction bandwidth of the node-local interconnect (GB/s), named in ``link``;
    sms: streaming multiprocessors (NVIDIA's A100 whitepaper: 108 on the A100; H100 whitepaper: 132 on the H100
    SXM5, 114 on the H100 PCIe; `_SMS`), 0 where not recorded;
    fp8_tflops: peak dense FP8 tensor-core TFLOP/s, 0 where the GPU has none or it is not recorded (`_HOPPER_FP8`).
    """

    name: str
    bf16_tflops: float
    mem_gb: float
    mem_bw_gbs: float
    link_gbs: float  # per-GPU unidirectional bandwidth of the node-local interconnect (GB/s)
    link: str
    source: str
    sms: int = 0     # streaming multiprocessors (the planner's wave quantization, `theory.planner.matmuls`); 0: unknown
    fp8_tflops: float = 0.0


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
    # H800: the H100 SXM made for export to China (2023), same compute and HBM3, NVLink cut to 400 GB/s
    # bidirectional (8 links instead of 18); DeepSeek-V3's report (arXiv 2412.19437, section 3.2.2) measures 160 GB/s
    # on NVLink and 50 GB/s on IB per GPU.
    "H800": GPUSpec("H800 SXM5 80GB", 989.4, 80, 3350, 200, "NVLink 4 (400 GB/s bidirectional)",
                    "no NVIDIA datasheet read here: the H100 SXM5 row's compute and HBM3 (the same GH100 die), "
                    "NVLink cut to 400 GB/s bidirectional, as secondary sources (H800 vs H100 comparisons, 2023-26) "
                    "and DeepSeek-V3's report describe it"),
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
# Streaming multiprocessors, for the planner's wave quantization (`theory.planner.matmuls`): NVIDIA A100 Tensor Core
# GPU Architecture whitepaper (2020): "108 SMs" on every A100; NVIDIA H100 Tensor Core GPU Architecture whitepaper
# (2022): 132 SMs on the H100 SXM5, 114 on the H100 PCIe. The H800, H200 and GH200 carry the H100 SXM5's GH100
# configuration (132; not read from an NVIDIA datasheet here). Rows not listed keep 0 (unknown).
_SMS = {"A100": 108, "A100 40GB": 108, "A100 PCIe": 108, "A100 PCIe 40GB": 108, "H100": 132, "H800": 132,
        "H100 PCIe": 114, "H200": 132, "GH200": 132}
# Hopper's dense FP8 tensor-core peak, twice its dense bf16 peak (the datasheets' figures with sparsity, halved): read
# for the H100 SXM and PCIe (NVIDIA's H100 datasheet: FP8 3,958 / 3,026 TFLOPS with sparsity beside BF16 1,979 /
# 1,513); the H200 SXM's 3,958 seen in secondary sources only; the H100 NVL, H200 NVL and GH200 rows and the H800
# (the H100 SXM5's compute, see its row) are inferred from the same ratio, not read from a datasheet here.
_HOPPER_FP8 = ("H100", "H800", "H100 PCIe", "H100 NVL", "H200", "H200 NVL", "GH200")
GPU_SPECS = {key: replace(spec, sms=_SMS.get(key, 0),
                          fp8_tflops=2 * spec.bf16_tflops if key in _HOPPER_FP8 else 0.0)
             for key, spec in GPU_SPECS.items()}

# How CUDA names these devices (torch.cuda.get_device_name), most specific first: the form factor decides the peak
# (an H100 PCIe is not an H100 SXM), so a name matches a row only by its whole model number and form factor.
_GPU_NAMES = [(re.compile(p, re.I), key) for p, key in (
    (r"\bV100S\b", "V100S"), (r"\bV100\b.*\bPCIE\b", "V100 PCIe"), (r"\bV100\b", "V100"), (r"\bT4\b", "T4"),
    (r"\bA100\b(?=.*\bPCIE\b)(?=.*\b40GB\b)", "A100 PCIe 40GB"), (r"\bA100\b.*\bPCIE\b", "A100 PCIe"),
    (r"\bA100\b.*\b40GB\b", "A100 40GB"), (r"\bA100\b", "A100"),
    (r"\bGH200\b", "GH200"), (r"\bH100\b.*\bPCIE\b", "H100 PCIe"), (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b", "H100"), (r"\bH800\b", "H800"), (r"\bH200\b.*\bNVL\b", "H200 NVL"), (r"\bH200\b", "H200"),
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
    from course_lib.runtime.procs import usable_cores

    label = f"CPU: {cpu_model_name()}, {usable_cores()} cores, {torch.get_num_threads()} threads, torch {tv}"
    return f"{label}, {backend}" if backend else label
