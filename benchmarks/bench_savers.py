"""Activation checkpointing: memory saved vs recomputation paid, on this machine (lesson 07).

    .venv/bin/python benchmarks/bench_savers.py                 # the lesson's 8-block GPT, batch 4
    .venv/bin/python benchmarks/bench_savers.py --d-model 256 --batch 8 --repeats 9

Prints, per variant (no checkpointing, every k blocks, selective), the activation bytes held after the forward and
at the backward's peak (measured and formula), the matmul FLOPs counted (recomputation included) and the median
step time relative to no checkpointing, with the hardware. Expect FLOPs <= 4/3 (one extra forward); the time ratio
approaches the FLOPs ratio on a GPU with a large model, and is dominated by per-operator overhead on a small CPU one.
No target is asserted: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse

import torch

from course_lib.config import ModelConfig
from course_lib.measure.hardware import hardware_label
from course_lib.lessons.l07_memory_savers.experiments import checkpoint_sweep
from course_lib.lessons.l07_memory_savers.report import checkpoint_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="alternating timing rounds (median; first discarded)")
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=4, d_model=args.d_model,
                      name="bench-savers")
    rows = checkpoint_sweep(cfg, args.batch, everys=(None, 1, 2, 4, args.n_layer), repeats=args.repeats)
    print(checkpoint_table(rows, hardware_label(device="cpu")))
    print(f"(torch threads: {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
