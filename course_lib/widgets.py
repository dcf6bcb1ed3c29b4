"""ipywidgets front-ends of the lessons.

Lesson 01: :func:`bottleneck_widget`: pick a model preset, a GPU and a cluster; see where the time
and the memory of one data-parallel training step go, by formula (:func:`bottleneck_estimate`, which
uses only `course_lib.theory` and the datasheet table `course_lib.measure.GPU_SPECS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib.config import PRESETS, get_preset
from course_lib.measure import GPU_SPECS
from course_lib.theory import comm, flops, memory


@dataclass(frozen=True)
class Cluster:
    """Data-parallel cluster: ``nodes x gpus_per_node`` GPUs; inter-node bandwidth per GPU (GB/s, one way).

    ``alpha_us``: latency of one message (an assumption of the order of magnitude: ~10 us in a node,
    ~20 us across InfiniBand/Ethernet).
    """

    name: str
    nodes: int
    gpus_per_node: int
    inter_gbs_per_gpu: float | None = None
    alpha_us: float = 10.0

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


CLUSTERS = {c.name: c for c in [
    Cluster("1 GPU", 1, 1),
    Cluster("1 node x 8 GPUs (NVLink / PCIe of the GPU)", 1, 8),
    Cluster("4 nodes x 8 GPUs, InfiniBand 400 Gb/s per GPU", 4, 8, 50.0, 20.0),
    Cluster("32 nodes x 8 GPUs, InfiniBand 400 Gb/s per GPU", 32, 8, 50.0, 20.0),
    Cluster("4 nodes x 8 GPUs, Ethernet 100 Gb/s per node", 4, 8, 12.5 / 8, 30.0),
]}


def bottleneck_estimate(preset: str, gpu: str, cluster: str, micro_batch: int = 8, mfu: float = 0.4) -> dict:
    """Time and memory of one plain data-parallel step (bf16 mixed precision, Adam), by formula.

    - compute: ``flops_per_token x tokens per GPU / (peak x mfu)`` (lesson 01's 6N + attention);
    - communication: a ring all-reduce of the bf16 gradients, ``2(n-1) alpha + 2(n-1)/n x 2P / bandwidth``,
      the bandwidth being the GPU's link in one node, else the slower inter-node link per GPU;
    - memory per GPU: 16 bytes per parameter (mixed-precision Adam, ``theory.memory.mixed_precision_bytes``)
      plus activations of ``micro_batch`` sequences in bf16 (``theory.memory.activation_bytes``, derived for
      the course GPT; approximate for llama-style presets), no sharding, no checkpointing.
    """
    cfg = get_preset(preset)
    spec = GPU_SPECS[gpu]
    cl = CLUSTERS[cluster]
    n = cl.n_gpus
    P = cfg.num_params()
    tokens = micro_batch * cfg.seq_len
    compute = flops.flops_per_token(cfg) * tokens / (spec.bf16_tflops * 1e12 * mfu)
    bw = spec.link_gbs if cl.nodes == 1 else min(spec.link_gbs, cl.inter_gbs_per_gpu)
    communication = comm.collective_time("all_reduce", 2 * P, n, cl.alpha_us * 1e-6, bw * 1e9)
    mem = memory.mixed_precision_bytes(P)
    mem.pop("total")
    mem["activations"] = memory.activation_bytes(cfg, micro_batch, dtype=torch.bfloat16)["total"]
    mem["total"] = sum(mem.values())
    gpu_mem = spec.mem_gb * 1e9
    fits = mem["total"] <= gpu_mem
    step = compute + communication
    if not fits:
        bound = "memory: the replica does not fit (shard it: ZeRO/FSDP lesson 05, TP/PP lessons 03-04)"
    elif communication > compute:
        bound = "communication (bigger batch per GPU, overlap, faster links, gradient compression)"
    else:
        bound = "compute (raise MFU: bigger matmuls, bf16, fused kernels)"
    return dict(time_s=dict(compute=compute, communication=communication, total=step),
                memory_bytes=mem, gpu_mem_bytes=gpu_mem, fits=fits, bound=bound, n_gpus=n, params=P,
                tokens_per_s=n * tokens / step, link_gbs=bw)


def describe(est: dict, preset: str, gpu: str, cluster: str) -> str:
    """A few lines of text for one estimate."""
    t, m = est["time_s"], est["memory_bytes"]
    return (f"{preset} ({est['params'] / 1e9:.3g} B params) on {est['n_gpus']} x {GPU_SPECS[gpu].name}, {cluster}\n"
            f"  step: compute {t['compute'] * 1e3:.1f} ms + all-reduce {t['communication'] * 1e3:.1f} ms "
            f"({est['link_gbs']:.3g} GB/s per GPU) = {t['total'] * 1e3:.1f} ms, "
            f"{est['tokens_per_s']:.3g} tokens/s for the cluster\n"
            f"  memory per GPU: {m['total'] / 1e9:.1f} GB of {est['gpu_mem_bytes'] / 1e9:.0f} GB "
            f"(model state {(m['total'] - m['activations']) / 1e9:.1f} GB, activations {m['activations'] / 1e9:.1f} GB)\n"
            f"  bound: {est['bound']}  [formula, not a measurement]")


def bottleneck_widget():
    """Dropdowns for preset, GPU, cluster; sliders for micro-batch and MFU; text and bars update live."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from course_lib import plots

    preset = w.Dropdown(options=list(PRESETS), value="gpt2-124m", description="model")
    gpu = w.Dropdown(options=list(GPU_SPECS), value="H100", description="GPU")
    cluster = w.Dropdown(options=list(CLUSTERS), value=list(CLUSTERS)[1], description="cluster",
                         layout=w.Layout(width="480px"))
    mb = w.IntSlider(value=8, min=1, max=64, description="micro-batch")
    mfu_s = w.FloatSlider(value=0.4, min=0.05, max=0.8, step=0.05, description="MFU")
    out = w.Output()

    def update(*_):
        est = bottleneck_estimate(preset.value, gpu.value, cluster.value, mb.value, mfu_s.value)
        with out:
            out.clear_output(wait=True)
            print(describe(est, preset.value, gpu.value, cluster.value))
            fig = plots.estimate_bars(est, f"{preset.value} on {gpu.value}, {cluster.value} (formula)")
            display(fig)
            plt.close(fig)

    for c in (preset, gpu, cluster, mb, mfu_s):
        c.observe(update, names="value")
    update()
    return w.VBox([w.HBox([preset, gpu]), cluster, w.HBox([mb, mfu_s]), out])
