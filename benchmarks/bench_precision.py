"""fp32 vs bf16 vs fp16 (autocast) training-step time of the course's GPT, and a matmul, on this machine (lesson 06).

    .venv/bin/python benchmarks/bench_precision.py                 # the 'tiny' preset
    .venv/bin/python benchmarks/bench_precision.py --preset small --rounds 5

Prints, per precision, the median step time (forward + backward + AdamW), the speed ratio fp32 time / time, the
activation bytes saved for backward and the matmul rate, with the hardware. No target: on a CPU without bf16
matrix instructions (AMX / AVX512-BF16) low precision is slower (ratio < 1); on GPU tensor cores it is faster.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from course_lib.config import get_preset
from course_lib.data import random_batches
from course_lib.measure.hardware import hardware_label
from course_lib.lessons.l06_mixed_precision.experiments import speed_and_memory
from course_lib.measure.units import fmt_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per precision and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all precisions (median of the rounds)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (a shared machine: 1 contends least)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = get_preset(args.preset)
    (x, y), = random_batches(cfg, args.batch, 1)
    runs = [speed_and_memory(cfg, x, y, repeats=args.repeats) for _ in range(args.rounds)]   # a noisy machine
    rows = runs[0]                                                                            # slows all alike
    for i, r in enumerate(rows):
        r["step_s"] = statistics.median(run[i]["step_s"] for run in runs)
        r["matmul_tflops"] = statistics.median(run[i]["matmul_tflops"] for run in runs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{args.preset} GPT ({cfg.num_params():,} parameters), batch {args.batch} x {cfg.seq_len} tokens, autocast")
    for r in rows:
        ratio = rows[0]["step_s"] / r["step_s"]
        print(f"  {r['precision']:5s} step {r['step_s'] * 1e3:8.1f} ms  fp32/this {ratio:5.2f}x  "
              f"activations {fmt_bytes(r['activation_bytes']):>10s}  matmul n={r['matmul_n']} "
              f"{r['matmul_tflops']:.3f} TFLOP/s")
    print(f"measured fp32/bf16 step-time ratio: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x   "
          f"[{hardware_label(device=device)}]")


if __name__ == "__main__":
    main()
