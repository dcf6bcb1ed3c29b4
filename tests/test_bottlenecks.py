"""Lesson 01 machinery: benchmarks (through launch.run on gloo), profiler breakdown, plots, widget."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from course_lib.measure import hardware
from course_lib.measure import speed  # noqa: E402
from course_lib.lessons.l01_bottlenecks import experiments as bottleneck_lab  # noqa: E402
from course_lib.lessons.l01_bottlenecks import report as bottleneck_report  # noqa: E402
from course_lib.theory import comm, flops, memory  # noqa: E402


def test_breakdown_of_synthetic_events_adds_up():
    events = [("aten::mm", 0.0, 4.0), ("aten::add", 3.0, 5.0),        # compute 0..5
              ("gloo:all_reduce", 4.0, 7.0), ("c10d::allreduce_", 6.5, 8.0),  # comm 4..8
              ("aten::mul", 9.0, 9.5), ("aten::outside", 11.0, 12.0)]
    bd = bottleneck_lab.breakdown(events, (0.0, 10.0))
    assert bd["compute"] == pytest.approx(5.5) and bd["communication"] == pytest.approx(4.0)
    assert bd["overlap"] == pytest.approx(1.0)
    assert bd["compute_only"] + bd["comm_only"] + bd["overlap"] + bd["idle"] == pytest.approx(10.0)
    assert bd["idle"] == pytest.approx(1.5)
    assert bottleneck_lab.is_comm_event("nccl:all_reduce") and bottleneck_lab.is_comm_event("gloo:all_gather")
    assert not bottleneck_lab.is_comm_event("aten::addmm")


def test_collective_sizes():
    sizes = bottleneck_lab.collective_sizes()
    assert sizes[0] == 1024 and sizes[-1] == 64 * 1024 ** 2 and len(sizes) == 9


def test_collective_benchmark_bus_bandwidth_exact():
    rows = bottleneck_lab.collective_benchmark(world_sizes=(2,), sizes=[1024, 1024 ** 2], timeout_s=180)
    assert {r["op"] for r in rows} == set(comm.OPS) and len(rows) == 8
    for r in rows:
        assert r["world_size"] == 2 and r["time_s"] > 0 and r["backend"] == "gloo"
        assert "gloo" in r["hardware"]
        assert r["algbw"] == r["bytes"] / r["time_s"]
        if r["op"] == "all_reduce":   # nccl-tests: busbw = algbw x 2(n-1)/n, exactly
            assert r["busbw"] == r["bytes"] / r["time_s"] * (2 * (2 - 1) / 2)
    fits = bottleneck_lab.fit_collectives(rows)
    assert set(fits) == {(op, 2) for op in comm.OPS}


def test_profile_ddp_step_breakdown():
    out = bottleneck_lab.profile_ddp_step(nprocs=2, preset="tiny", batch_size=4, steps=2, timeout_s=180)
    assert out["backend"] == "gloo" and len(out["steps"]) == 2
    bd = out["median"]
    assert bd["compute"] > 0 and bd["communication"] > 0   # DDP all-reduced the gradients
    parts = bd["compute_only"] + bd["comm_only"] + bd["overlap"] + bd["idle"]
    assert parts == pytest.approx(bd["total"], rel=1e-9)
    assert bd["idle"] >= -1e-9


def test_single_device_benchmarks_small():
    mm = bottleneck_lab.matmul_sweep(sizes=[32, 64], repeats=1)
    assert [r["n"] for r in mm] == [32, 64] and all(r["flop_s"] > 0 for r in mm)
    cp = bottleneck_lab.copy_bandwidth(sizes_bytes=[1 << 20], repeats=1)
    assert cp[0]["bytes_moved"] == 2 << 20 and cp[0]["bw"] > 0
    pts = bottleneck_lab.roofline_points(repeats=1)
    kinds = {p["kind"] for p in pts}
    assert kinds == {"matmul", "elementwise", "layernorm", "attention"}
    for p in pts:
        assert p["intensity"] == p["flops"] / p["bytes"]
    fig = bottleneck_report.roofline_figure(pts, 1e11, 1e10, hardware.hardware_label())
    assert fig.axes


def test_plots_build():
    label = hardware.hardware_label("gloo")
    rows = [dict(op=op, world_size=ws, bytes=b, time_s=1e-5 + b / 1e9, busbw=b / (1e-5 + b / 1e9))
            for op in comm.OPS for ws in (2, 4) for b in (1024, 1 << 20, 1 << 26)]
    assert bottleneck_report.collectives_figure(rows, bottleneck_lab.fit_collectives(rows), label).axes
    assert bottleneck_report.matmul_figure([dict(n=64, flop_s=1e9), dict(n=128, flop_s=2e9)], 3e9, label).axes
    assert bottleneck_report.memory_figure({"predicted": dict(params=1, grads=1), "measured": dict(params=1, grads=1)},
                             label).axes
    bd = bottleneck_lab.breakdown([("aten::mm", 0, 1), ("gloo:all_reduce", 0.5, 2)], (0, 3))
    assert bottleneck_report.step_breakdown_figure(bd, label).axes


def test_widget_estimate_uses_the_formulas():
    est = bottleneck_report.bottleneck_estimate("gpt2-124m", "H100", "4 nodes x 8 GPUs, InfiniBand 400 Gb/s per GPU",
                                      micro_batch=8, mfu=0.5)
    from course_lib.config import get_preset
    cfg = get_preset("gpt2-124m")
    P = cfg.num_params()
    assert est["time_s"]["compute"] == pytest.approx(
        flops.flops_per_token(cfg) * 8 * cfg.seq_len / (989.4e12 * 0.5))
    assert est["time_s"]["communication"] == pytest.approx(
        comm.collective_time("all_reduce", 2 * P, 32, 20e-6, 50e9))
    assert est["memory_bytes"]["params"] + est["memory_bytes"]["grads"] + est["memory_bytes"]["master"] \
        + est["memory_bytes"]["optimizer"] == 16 * P
    assert est["memory_bytes"]["activations"] == memory.activation_bytes(cfg, 8, dtype=torch.bfloat16)["total"]
    assert est["fits"] and "compute" in est["bound"] or "communication" in est["bound"]
    big = bottleneck_report.bottleneck_estimate("gpt3-175b", "A100", "1 GPU")
    assert not big["fits"] and big["bound"].startswith("memory")
    assert bottleneck_report.bottleneck_widget() is not None


def test_training_step_helpers_match_the_formulas():
    from course_lib.config import get_preset
    cfg = get_preset("tiny")
    mem = bottleneck_lab.training_memory(cfg, 2, "cpu")
    pred = memory.training_memory_bytes(cfg, "adam", torch.float32, step_counters=memory.num_param_tensors(cfg))
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (pred["params"], pred["grads"], pred["optimizer"])
    assert mem["activations"] == pytest.approx(memory.activation_bytes(cfg, 2)["total"], rel=0.10)
    assert mem["rss"] > 0 and mem["hardware"].startswith("CPU")
    step = bottleneck_lab.train_step_mfu(cfg, 2, "cpu", warmup=1, repeats=2)
    assert step["step_flops"] == flops.flops_per_token(cfg) * 2 * cfg.seq_len
    assert step["mfu"] == pytest.approx(step["step_flops"] / step["seconds"] / step["peak"])
    assert step["mfu"] > 0   # no bound on the value: timings on a shared machine are noisy


def test_counted_flops_splits_matmuls_and_attention():
    from course_lib.config import get_preset
    from course_lib.model import build_model
    cfg = get_preset("tiny")
    c = bottleneck_lab.counted_flops(cfg)
    assert c["total"] == flops.flops_per_token(cfg)                          # 786,432, exact
    assert c["attention"] == flops.attention_flops_per_token(cfg)           # 12 * 2 * 64 * 64 = 98,304
    assert c["matmul"] == 6 * flops.matmul_params(cfg)
    model, idx = build_model(cfg), torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    stock = speed.count_flops(lambda: model.loss(idx, idx).backward(), model_flops=False) / idx.numel()
    assert stock == c["matmul"]               # the stock counter has no formula for the CPU attention kernel


def test_flop_counter_counts_causal_attention_as_the_full_matrix():
    att = bottleneck_lab.causal_attention_flops(batch=1, heads=2, seq_len=32, head_dim=8)
    full = 3 * 2 * 2 * 1 * 2 * 32 ** 2 * 8                                    # 3 x (QK^T + PV) = 98,304
    assert att["formula_full"] == full and att["formula_causal"] == full / 2
    assert att["math_full"] == att["math_causal"] == full                    # computed in full, then masked
    assert att["kernel_full"] == att["kernel_causal"] == full    # torch: "NB: ... not accounting for causal"


def test_flops_conventions_table():
    rows = bottleneck_report.flops_conventions_rows(["tiny", "llama3-405b"], counted={"tiny": 786_432.0})
    assert rows[0]["course (6N + 12LTd)"] == rows[0]["FlopCounterMode"] == 786_432
    assert rows[1]["FlopCounterMode"] != rows[1]["FlopCounterMode"]          # NaN: not measured
    text = bottleneck_report.flops_conventions_table(rows)
    assert "torchtitan before #3225" in text and "tiny (MFLOP)" in text and "llama3-405b (GFLOP)" in text
    assert "  0.79 ( +0.0%)" in text and "-0.0%" not in text


def test_palm_table_22_counts_every_parameter():
    """Lesson 01 section 1.5: PaLM's N is every parameter. Its table 22 (as transcribed) gives 3.28 TFLOP per token for
    the 540B model (540.35B parameters, L 118, H 48, Q 256, T 2048): 6N + 12LHQT with N every parameter rounds to
    it; without the 256K x 18,432 input table (tied to the head) it would be 3.25."""
    attention = 12 * 118 * 48 * 256 * 2048
    assert round((6 * 540.35e9 + attention) / 1e12, 2) == 3.28
    assert round((6 * (540.35e9 - 256_000 * 18_432) + attention) / 1e12, 2) == 3.25


def test_quiz_mfu_of_another_convention():
    """Lesson 01's graded quiz q5: a run reported at 30 % MFU with the causal half over the sparse peak (2 x dense)
    is 0.30 x 2 x full / causal by the course's convention; the wrong readings (only the peak, only the causal
    half) land outside the check's 1 % band."""
    from course_lib.config import get_preset
    llama = get_preset("llama3-405b")
    full, causal = flops.flops_per_token(llama), flops.flops_per_token(llama, causal=True)
    right = 30 * 2 * full / causal
    assert right == pytest.approx(62.41, abs=0.01)
    for wrong in (30 * 2, 30 * full / causal, 30 * 2 * causal / full):
        assert abs(wrong / right - 1) > 0.03
