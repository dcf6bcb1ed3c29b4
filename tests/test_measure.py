"""course_lib.measure.speed: timers, FLOP counting, exact memory accounting (lesson 01)."""

import pytest
import torch
import torch.nn as nn

from course_lib.measure import hardware, memory_stats, speed, units


def test_time_fn_median_and_timer():
    calls = []
    t = speed.time_fn(lambda: calls.append(1), warmup=2, repeats=3)
    assert len(calls) == 5 and t >= 0
    all_t = speed.time_fn(lambda: None, warmup=0, repeats=4, return_all=True)
    assert len(all_t) == 4
    with speed.Timer() as timer:
        sum(range(100))
    assert timer.seconds > 0
    with pytest.raises(ValueError):
        speed.time_fn(lambda: None, repeats=0)


def test_throughput_and_mfu():
    assert speed.tokens_per_s(1000, 0.5) == 2000
    assert speed.mfu(50e12, 100e12) == pytest.approx(0.5)


# What torch.cuda.get_device_name returns on each device, and the row (and dense bf16 peak) it must get. A name
# matched by substring would give an L40S the L4's row (3x too high an MFU) and an H100 PCIe the SXM's.
DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": ("A100 SXM4 40GB", 312.0), "NVIDIA A100-SXM4-80GB": ("A100 SXM4 80GB", 312.0),
    "NVIDIA A100-PCIE-40GB": ("A100 PCIe 40GB", 312.0), "NVIDIA A100 80GB PCIe": ("A100 PCIe 80GB", 312.0),
    "NVIDIA H100 80GB HBM3": ("H100 SXM5 80GB", 989.4), "NVIDIA H100 PCIe": ("H100 PCIe 80GB", 756.0),
    "NVIDIA H100 NVL": ("H100 NVL 94GB", 835.5), "NVIDIA H200": ("H200 SXM 141GB", 989.4),
    "NVIDIA H200 NVL": ("H200 NVL 141GB", 835.5), "NVIDIA GH200 480GB": ("GH200 96GB HBM3 (Hopper GPU)", 989.4),
    "NVIDIA L4": ("L4 24GB", 121.0), "NVIDIA L40": ("L40 48GB", 181.05), "NVIDIA L40S": ("L40S 48GB", 362.05),
    "NVIDIA GeForce RTX 3090": ("GeForce RTX 3090 24GB", 71.0),
    "NVIDIA GeForce RTX 4090": ("GeForce RTX 4090 24GB", 165.2),
    "NVIDIA GeForce RTX 5090": ("GeForce RTX 5090 32GB", 209.5),
    "Tesla V100-SXM2-32GB": ("V100 SXM2 (16 or 32GB)", 125.0),
    "Tesla V100-PCIE-16GB": ("V100 PCIe (16 or 32GB)", 112.0), "Tesla T4": ("T4 16GB", 65.0),
}


@pytest.mark.parametrize("device_name", list(DEVICE_NAMES))
def test_gpu_spec_matches_model_and_form_factor(device_name):
    row, tflops = DEVICE_NAMES[device_name]
    spec = hardware.gpu_spec(device_name)
    assert spec is not None and (spec.name, spec.bf16_tflops) == (row, tflops), f"{device_name} -> {spec}"


def test_gpu_table_and_unknown_devices():
    for name in ("AMD Instinct MI300X", "NVIDIA GeForce RTX 4090 Laptop GPU", "Some Other Accelerator", "cpu"):
        assert hardware.gpu_spec(name) is None, name        # measured, never guessed
    assert hardware.gpu_spec("NVIDIA H200").mem_gb == 141
    for key, spec in hardware.GPU_SPECS.items():
        assert spec.bf16_tflops > 0 and spec.mem_bw_gbs > 0 and spec.link_gbs > 0, key
        assert "datasheet" in spec.source or "whitepaper" in spec.source, key
        assert hardware.gpu_spec(f"NVIDIA {key}") is spec, key             # every row can be reached


def test_hardware_label_names_backend():
    label = hardware.hardware_label("gloo", device="cpu")
    assert label.startswith("CPU: ") and "cores" in label and "torch" in label and label.endswith("gloo")


def test_measured_peak_is_positive():
    peak = speed.measure_peak_matmul_flops("cpu", n=256)
    assert peak > 1e8  # any CPU does > 0.1 GFLOP/s on a 256^3 matmul


def test_count_flops_of_linear_and_cpu_attention():
    lin = nn.Linear(32, 16, bias=True)
    x = torch.randn(8, 32, requires_grad=True)
    assert speed.count_flops(lambda: lin(x)) == 2 * 8 * 32 * 16
    assert speed.count_flops(lambda: lin(x).sum().backward()) == 3 * 2 * 8 * 32 * 16
    # The stock counter has no formula for the CPU attention kernel; ours counts QK^T and PV.
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    fwd = 2 * (2 * 2 * 4 * 16 * 16 * 8)
    f = torch.nn.functional.scaled_dot_product_attention
    assert speed.count_flops(lambda: f(q, q, q, is_causal=True)) == fwd
    assert speed.count_flops(lambda: f(q, q, q, is_causal=True).sum().backward()) == 3 * fwd


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


def test_model_state_bytes_adam_exact():
    model = _mlp()
    P = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    opt = torch.optim.Adam(model.parameters())
    before = memory_stats.model_state_bytes(model, opt)
    assert before == dict(params=4 * P, grads=0, optimizer=0, optimizer_scalars=0, total=4 * P)
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    s = memory_stats.model_state_bytes(model, opt)
    assert s["params"] == 4 * P and s["grads"] == 4 * P
    assert s["optimizer"] == 8 * P + 4 * n_tensors      # exp_avg, exp_avg_sq, step (fp32 scalar)
    assert s["optimizer_scalars"] == 4 * n_tensors
    assert s["total"] == 16 * P + 4 * n_tensors


def test_model_state_bytes_counts_tied_weights_once():
    emb = nn.Embedding(7, 3)
    head = nn.Linear(3, 7, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict(dict(emb=emb, head=head))
    assert memory_stats.model_state_bytes(model)["params"] == 7 * 3 * 4


def test_live_bytes_since_a_snapshot_ignore_tensors_freed_after_it():
    old = torch.ones(4096)                          # alive at the snapshot, freed before the count
    kept = torch.ones(100)                          # alive at both: not counted
    snap = memory_stats.LiveTensors("cpu")
    new = torch.ones(1000)
    view = new[:10]                                 # a view of a new storage counts once
    del old
    assert memory_stats.live_tensor_bytes("cpu", since=snap) == 1000 * 4
    assert memory_stats.live_tensor_bytes("cpu") >= (1000 + 100) * 4
    del kept, view, new


def test_saved_activations_mlp_hand_computed():
    model = _mlp()
    B = 6
    x = torch.randn(B, 10)  # a data batch: does not require grad
    with memory_stats.SavedActivations(model) as acts:
        y = model(x)
    # Linear1 saves x (weight grad needs it): B*10; ReLU saves its output: B*20, which is also
    # Linear2's input (one storage); Linear2 saves its weight for the input gradient (a parameter).
    assert acts.bytes == 4 * (B * 10 + B * 20)
    assert acts.params_saved_bytes == 4 * 5 * 20
    y.sum().backward()  # the saved tensors are really used


def test_saved_activations_without_model_still_skips_parameters():
    lin = nn.Linear(4, 3)
    with memory_stats.SavedActivations() as acts:
        torch.relu(lin(torch.randn(2, 4, requires_grad=True)))
    assert acts.bytes == 4 * (2 * 4 + 2 * 3)
    assert acts.params_saved_bytes == 4 * 3 * 4


def test_rss_and_formatting():
    assert memory_stats.rss_bytes() > 10_000_000
    assert units.fmt_bytes(3.2e9) == "3.20 GB"
    assert units.fmt_bytes(64 * 2 ** 20, binary=True) == "64 MiB"
    assert units.fmt_flops(2.5e12) == "2.50 TFLOP/s"
    assert units.fmt_flops(3.14e23, per_s=False) == "314000000.00 PFLOP"


def test_cpu_features_predict_what_deepspeed_accepts():
    """The lessons branch on `cpu_features`: its fp16 answer must be DeepSpeed's own (AMD EPYC: no; Intel Xeon with
    AVX512-FP16 / AMX-FP16: yes), whatever machine runs the tests."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    f = hardware.cpu_features()
    assert set(f) == {"isa", "bf16", "fp16", "amx"} and isinstance(f["isa"], str)
    assert bool(CPU_Accelerator().is_fp16_supported()) == f["fp16"]


def test_cpu_precision_sentence_follows_the_features(monkeypatch):
    plain = dict(isa="AVX2", bf16=False, fp16=False, amx=[])
    xeon = dict(isa="AVX512", bf16=True, fp16=True, amx=["amx_bf16", "amx_fp16", "amx_tile"])
    monkeypatch.setattr(hardware, "cpu_features", lambda: plain)
    text = hardware.describe_cpu_precision()
    assert "no native bf16 or fp16" in text and "slower" in text and "refuses fp16" in text
    monkeypatch.setattr(hardware, "cpu_features", lambda: xeon)
    text = hardware.describe_cpu_precision()
    assert "native bf16 and fp16" in text and "amx_bf16" in text and "accepts fp16" in text and "slower" not in text
