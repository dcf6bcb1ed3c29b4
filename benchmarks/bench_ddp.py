"""Own bucketed DDP vs PyTorch DDP, measured side by side in one run (lesson 02, issue 6).

    .venv/bin/python benchmarks/bench_ddp.py                 # 2 ranks, gloo on CPU / NCCL on GPUs
    .venv/bin/python benchmarks/bench_ddp.py --nprocs 4 --bucket-mb 1

Both wrappers train identical copies of the same GPT on the same data in the same processes; their timed
steps are interleaved (order rotated every step), so a noisy shared machine slows both alike.
Target: own / torch throughput >= 0.95. Prints the ratio of median step times, the median of per-step ratios
(steps that ran back to back, robust to slow drift on a shared machine) and the hardware.
"""

from __future__ import annotations

import argparse

from course_lib.config import ModelConfig
from course_lib.runtime import run

TARGET = 0.95


def _bench(cfg: ModelConfig, batch_per_rank: int, bucket_mb: float, steps: int) -> dict:
    from course_lib import dist as cdist
    from course_lib.measure.hardware import hardware_label
    from course_lib.lessons.l02_data_parallel.experiments import rank_throughput

    stats = rank_throughput(cfg, batch_per_rank, variants=(("own", bucket_mb), ("torch", bucket_mb)),
                            steps=steps, warmup=3)
    return {"stats": stats, "hardware": hardware_label(cdist.backend(), cdist.device())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant (median reported)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap of both wrappers (MB)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=256, seq_len=64, n_layer=args.layers, n_head=4, d_model=args.d_model,
                      name="bench-ddp")
    res = run(_bench, args.nprocs, args=(cfg, args.batch, args.bucket_mb, args.steps), timeout_s=600,
              threads_per_rank=1, stream=False)                 # NCCL with a GPU per rank where there are enough
    out = res.value
    stats = out["stats"]
    own, tdp = stats[f"own@{args.bucket_mb:g}MB"], stats[f"torch@{args.bucket_mb:g}MB"]
    print(f"hardware: {out['hardware']}; {res.nprocs} ranks, 1 thread/rank")
    print(f"model: {cfg.num_params() / 1e6:.2f} M parameters ({cfg.num_params() * 4 / 2**20:.1f} MB of fp32 "
          f"gradients), {args.batch} x {cfg.seq_len} tokens per rank, bucket cap {args.bucket_mb:g} MB")
    for name, s in (("own BucketedDDP", own), ("torch DDP", tdp)):
        print(f"  {name:16s} step {s['step_s'] * 1e3:8.1f} ms   {s['tokens_per_s']:9.0f} tokens/s")
    ratio = own["tokens_per_s"] / tdp["tokens_per_s"]
    pairs = sorted(t / o for o, t in zip(own["times"], tdp["times"]))   # steps that ran back to back
    pair_ratio = pairs[len(pairs) // 2]
    verdict = "meets" if ratio >= TARGET else "MISSES"
    print(f"median of per-step ratios (torch step / own step, adjacent in time): {pair_ratio:.3f} "
          f"[{pairs[len(pairs) // 10]:.3f} .. {pairs[-1 - len(pairs) // 10]:.3f}, 10th-90th percentile]")
    print(f"throughput ratio own / torch DDP = {ratio:.3f} ({verdict} the target >= {TARGET})")


if __name__ == "__main__":
    main()
