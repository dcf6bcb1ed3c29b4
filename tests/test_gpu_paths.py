"""The GPU branches of the course, run on a CPU with ``torch.cuda`` mocked (availability, device count, names).

No GPU is needed: what is checked is the decision each branch takes (which backend, which device, which datasheet row,
which sizes, which label), not CUDA itself. NCCL's own rules (devices, message order, synchronize) are checked on every
real run of the test command by `course_lib.runtime.nccl_rules` (tests/test_nccl_rules.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from course_lib import dist as cdist
from course_lib.instructor import gpu_check
from course_lib.measure import hardware, speed
from course_lib.runtime.launch import LaunchError, resolve_backend
from course_lib.lessons import sizes
from course_lib.parallel import deepspeed_config


@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(names): this process sees CUDA with these devices (nothing can run on them)."""
    def install(names: list[str]):
        def device_name(d=None):
            return names[0 if d is None else d if isinstance(d, int) else torch.device(d).index or 0]

        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(names))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
        monkeypatch.setattr(cdist, "_ANNOUNCED", set())
    return install


def test_backend_policy_without_gpus(fake_gpus, capsys):
    fake_gpus([])
    assert [cdist.pick_backend(n) for n in (1, 2, 4)] == ["gloo"] * 3
    assert resolve_backend("auto", 2) == "gloo" and capsys.readouterr().out == ""   # nothing to announce
    with pytest.raises(LaunchError, match="needs CUDA GPUs"):
        resolve_backend("nccl", 1)


def test_backend_policy_with_enough_gpus(fake_gpus, capsys):
    fake_gpus(["NVIDIA H100 80GB HBM3"] * 4)
    assert [cdist.pick_backend(n) for n in (1, 2, 4)] == ["nccl"] * 3
    assert resolve_backend("auto", 4) == "nccl" and resolve_backend("nccl", 4) == "nccl"
    assert sizes.on_gpus(4) and sizes.by_device(cpu="cpu size", gpu="gpu size", nprocs=4) == "gpu size"
    assert capsys.readouterr().out == ""


def test_backend_policy_falls_back_and_says_so_once(fake_gpus, capsys):
    fake_gpus(["NVIDIA L4"] * 2)
    assert cdist.pick_backend(2) == "nccl"
    assert cdist.pick_backend(4) == "gloo"                       # 4 ranks, 2 GPUs: CPU ranks, not an error
    assert "4 ranks need 4 GPUs" in capsys.readouterr().out
    assert resolve_backend("auto", 4) == "gloo" and capsys.readouterr().out == ""   # said once per process
    with pytest.raises(LaunchError, match="4 GPUs .* this machine has 2"):
        resolve_backend("nccl", 4)                                   # explicitly asked for: a clear error
    assert sizes.by_device(cpu="cpu size", gpu="gpu size", nprocs=4) == "cpu size"
    assert sizes.by_device(cpu="cpu size", gpu="gpu size", nprocs=2) == "gpu size"


def test_hardware_label_names_where_ranks_computed(fake_gpus):
    fake_gpus(["NVIDIA H100 80GB HBM3"] * 2)
    assert hardware.hardware_label("gloo").startswith("CPU: ")          # gloo ranks compute on the CPU
    assert hardware.hardware_label("nccl").startswith("NVIDIA H100 80GB HBM3") and "NCCL" in hardware.hardware_label()


def test_device_of_a_rank(fake_gpus, monkeypatch):
    fake_gpus(["NVIDIA A100-SXM4-80GB"] * 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cdist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "nccl")
    assert cdist.device() == torch.device("cuda", 1)                   # one GPU per rank: LOCAL_RANK's
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    assert cdist.device() == torch.device("cpu")                       # gloo on a GPU machine: the CPU


def test_deepspeed_fp16_follows_the_device(fake_gpus, monkeypatch):
    fake_gpus(["NVIDIA H100 80GB HBM3"])
    assert deepspeed_config.deepspeed_config(2, 4, precision="fp16")["fp16"]["enabled"]
    fake_gpus([])
    monkeypatch.setattr(deepspeed_config, "cpu_features", lambda: dict(isa="AVX2", bf16=False, fp16=False, amx=[]))
    with pytest.raises(ValueError, match="fp16 is refused"):
        deepspeed_config.deepspeed_config(2, 4, precision="fp16")
    monkeypatch.setattr(deepspeed_config, "cpu_features",
                        lambda: dict(isa="AVX512", bf16=True, fp16=True, amx=["amx_fp16"]))
    assert deepspeed_config.deepspeed_config(2, 4, precision="fp16")["fp16"]["enabled"]


def test_peak_flops_uses_the_row_of_the_device(fake_gpus):
    fake_gpus(["NVIDIA L40S"])
    peak, source = speed.peak_flops("cuda:0")
    assert peak == pytest.approx(362.05e12) and "L40S 48GB" in source     # not the L4's row (121)


def test_gpu_check_inventory_names_the_row_of_each_gpu(fake_gpus, monkeypatch):
    names = ["NVIDIA H100 PCIe", "AMD Instinct MI300X"]
    fake_gpus(names)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2 ** 30}))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    rows = dict(gpu_check.inventory())
    assert "datasheet row 'H100 PCIe 80GB': 756 TFLOP/s" in rows["GPU 0"]
    assert "no datasheet row" in rows["GPU 1"] and rows["NCCL"] == "2.27.3"


def test_a_warm_rank_on_a_gpu_starts_each_run_with_fresh_memory_stats(fake_gpus, monkeypatch):
    """A pool's rank (course_lib.runtime._pool_worker) on a GPU: peak-memory statistics reset before every run, as a new
    process has them; after the run the GPU's work is waited for and its cached blocks returned (nothing pending:
    the run is over)."""
    import gc
    import os

    from course_lib.runtime import _pool_worker

    fake_gpus(["NVIDIA H100 80GB HBM3"] * 2)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _name=name, **k: calls.append(_name))
    monkeypatch.setattr(torch, "seed", lambda: calls.append("seed"))                 # (CUDA's generators are fake)
    monkeypatch.setattr(torch, "manual_seed", lambda s: calls.append("manual_seed"))
    monkeypatch.setattr(gc, "freeze", lambda: None)                                  # (this is pytest's process)
    base = _pool_worker.Baseline(threads=torch.get_num_threads())
    base.prepare(os.getcwd())
    assert calls[0] in ("seed", "manual_seed") and calls[1:] == ["reset_peak_memory_stats"]
    base.restore()
    assert calls[2:] == ["synchronize", "empty_cache"]


def test_two_nodes_on_one_gpu_machine_get_their_own_gpus(monkeypatch, tmp_path):
    """`run_nodes` on a machine with 8 GPUs (mocked): each of the 2 launchers of 4 ranks sees its own 4 GPUs, so that
    LOCAL_RANK 0-3 on both "nodes" do not land on the same devices; all meet at one c10d endpoint on loopback."""
    from course_lib.runtime import torchrun

    monkeypatch.setattr(torchrun, "_gpu_count", lambda: 8)
    nodes = torchrun.node_commands(["-m", "x"], 8, 2, None, {"A": "1"}, tmp_path)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in nodes] == ["0,1,2,3", "4,5,6,7"]
    endpoints = {a for cmd, _ in nodes for a in cmd if a.startswith("--rdzv-endpoint=127.0.0.1:")}
    assert len(endpoints) == 1 and all("--nnodes=2" in cmd and "--nproc-per-node=4" in cmd for cmd, _ in nodes)
    monkeypatch.setattr(torchrun, "_gpu_count", lambda: 4)      # too few GPUs: the ranks run on gloo, env untouched
    assert all("CUDA_VISIBLE_DEVICES" not in env for _, env in torchrun.node_commands(["-m", "x"], 8, 2, None, {},
                                                                                       tmp_path))


def test_training_script_keeps_the_seeds_deepspeed_config_as_written_on_a_gpu(fake_gpus, monkeypatch):
    """Lesson 09's script adapts seed 004's DeepSpeed JSON only where a CPU needs it: on a GPU its fp16 and its
    fused AdamW stay as written; on a CPU without fp16 kernels, bf16 and torch's AdamW."""
    from course_lib.training import command, engine
    from course_lib.lessons.l09_training.experiments import CONFIGS

    seed = f"{CONFIGS}/seed004_deepspeed.toml"
    fake_gpus(["NVIDIA H100 80GB HBM3"] * 2)
    cfg, layout = command.check(seed, 2)
    conf = engine.deepspeed_settings(cfg, layout)
    assert conf["fp16"] == cfg.deepspeed["fp16"] and conf["fp16"]["enabled"] and not conf.get("bf16", {}).get("enabled")
    assert conf["optimizer"] == cfg.deepspeed["optimizer"] and "torch_adam" not in conf["optimizer"].get("params", {})
    assert "zero_force_ds_cpu_optimizer" not in conf
    fake_gpus([])
    monkeypatch.setattr(deepspeed_config, "cpu_features", lambda: {"fp16": False, "bf16": True, "amx": False})
    conf = engine.deepspeed_settings(cfg, layout)
    assert conf["bf16"]["enabled"] and not conf["fp16"]["enabled"] and conf["optimizer"]["params"]["torch_adam"]


def test_a_warm_rank_whose_run_failed_exits_under_nccl_and_stays_only_under_gloo():
    """The pool worker's one decision after a failed job (course_lib/runtime/_pool_worker.py): a Python exception under gloo
    keeps the rank (it rejoins a new group); under NCCL, or on KeyboardInterrupt / SystemExit, the rank exits and the
    pool is discarded (a GPU pool is never asked to rejoin: test_pool's exception case covers the gloo side)."""
    from course_lib.runtime._pool_worker import stays_after_failure

    assert stays_after_failure(ValueError("boom"), "gloo")
    assert stays_after_failure(RuntimeError("Connection closed by peer"), "gloo")
    for exc in (ValueError("boom"), RuntimeError("NCCL error: unhandled system error"), torch.cuda.OutOfMemoryError()):
        assert not stays_after_failure(exc, "nccl"), exc
    for exc in (KeyboardInterrupt(), SystemExit(3)):
        assert not stays_after_failure(exc, "gloo") and not stays_after_failure(exc, "nccl"), exc


def test_the_global_token_count_is_all_reduced_on_the_ranks_device(monkeypatch):
    """Under NCCL a collective's tensor must live on the rank's GPU (the bug CI's NCCL-rule check caught in lesson 09:
    a CPU count built without a device). `dist.device()` stands in here as the meta device, which no CPU default
    reaches; the caller's count is left where it was."""
    from course_lib.training import token_loss

    seen = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(cdist, "device", lambda: torch.device("meta"))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, **k: seen.append((t.device, k["op"])))
    local = torch.tensor(7)
    n = token_loss.global_token_count(local)
    assert seen == [(torch.device("meta"), torch.distributed.ReduceOp.SUM)] and n.device.type == "meta"
    assert local.device.type == "cpu" and local.item() == 7
    n = token_loss.global_valid_tokens([torch.tensor([[1, -100], [2, 3]])])
    assert n.device.type == "meta" and len(seen) == 2


def test_gpu_checks_model_state_takes_cublas_workspace_before_it_reads_the_allocator(fake_gpus, monkeypatch):
    """`course gpu-check` failed on an H200 by counting cuBLAS's 65 MiB workspace as model state (docs/GPU_RUNS.md):
    the workspace must be taken before the allocator's first reading, or the 1 % tolerance fails on gpt2-124m."""
    fake_gpus(["NVIDIA H200"])
    order = []

    class Read(Exception):
        pass

    def memory_allocated(device=None):
        order.append("read allocator")
        raise Read
    monkeypatch.setattr(gpu_check, "_take_blas_workspace", lambda device: order.append("take workspace"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", memory_allocated)
    with pytest.raises(Read):
        gpu_check._memory_check(torch.device("cuda", 0))
    assert order == ["take workspace", "read allocator"]


def test_a_book_of_a_gpu_run_names_the_gpus_sizes_and_versions(fake_gpus, monkeypatch, tmp_path):
    """The browser test's lab on a GPU node writes run.json (course_lib.instructor.book.describe_run): the GPU, GPU
    sizes and the CUDA / NCCL versions, which every lesson page of `course book --from` that folder then states."""
    from course_lib.instructor import book, lab_report

    fake_gpus(["NVIDIA H200"] * 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 141 * 2 ** 30}))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    run = book.describe_run(lab_report.sizes_of(quick=True))
    assert run["hardware"].startswith("NVIDIA H200") and "NCCL" in run["hardware"]
    assert run["sizes"] == "GPU sizes where the ranks get a GPU each (2 GPUs), else CPU sizes"  # quick: CPUs only
    (tmp_path / book.RUN_INFO).write_text(json.dumps(run))
    facts = book.run_facts(tmp_path)
    assert facts["versions"]["CUDA"] == "13.0" and facts["versions"]["NCCL"] == "2.27.3"
    assert facts["default_sizes"].startswith("GPU sizes") and facts["ran"] is None
