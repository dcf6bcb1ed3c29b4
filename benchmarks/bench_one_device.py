"""The ladder of lesson 12 on this machine: one training step of the course's GPT made faster one change at a time,
every rung measured in the same run, with Hugging Face's GPT-2 beside it.

    .venv/bin/python benchmarks/bench_one_device.py                      # this machine's sizes (lessons.sizes)
    .venv/bin/python benchmarks/bench_one_device.py --rounds 5 --compile-baseline
    python benchmarks/bench_one_device.py --preset gpt2-1.5b --layers 4 --batch 4   # a GPU: wide enough for FP8

Sizes: GPT-2 124M at batch 8 x 1024 on a GPU; on a CPU `ladder.CPU_CONFIG` (2 layers, d_model 128, vocabulary 6,143:
one short of a multiple of 128) at batch 8 x 128. On a CPU the two torch.compile rungs spend most of the wall time
compiling C++ (tens of seconds each the first time; inductor's cache on disk makes later runs faster); compile time is
reported apart and never counted in a step. Prints the ladder (tokens/s, step time, MFU, peak memory, first-step loss,
compile time, kernels per step), where each rung's time goes, and ends with the one-line summary.
"""

from __future__ import annotations

import argparse
import time

from course_lib.config import get_preset
from course_lib.lessons.l12_one_device.ladder import default_sizes, ladder
from course_lib.lessons.l12_one_device.report import breakdown_table, ladder_table, summary_line
from course_lib.lessons.sizes import sizes_label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: this machine's size)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all rungs (the median of every timed step)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per rung and round")
    ap.add_argument("--max-micro-batch", type=int, default=None, help="largest micro-batch the ladder tries")
    ap.add_argument("--preset", default=None, help="a model preset instead of this machine's size, e.g. gpt2-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="keep the preset's width, change its number of layers")
    ap.add_argument("--compile-baseline", action="store_true", help="also transformers + torch.compile on a CPU")
    args = ap.parse_args()
    cfg, batch = default_sizes()
    if args.preset:
        cfg = get_preset(args.preset)
    if args.layers:
        cfg = cfg.replace(n_layer=args.layers, name=f"{cfg.name}, {args.layers} layers")
    batch = args.batch or batch
    t0 = time.perf_counter()
    rows = ladder(cfg, batch, rounds=args.rounds, steps=args.steps, max_micro_batch=args.max_micro_batch,
                  compile_baseline=args.compile_baseline or None)
    wall = time.perf_counter() - t0
    print(f"{cfg.name} GPT ({cfg.num_params():,} parameters, vocabulary {cfg.vocab_size:,}), batch {batch} x "
          f"{cfg.seq_len} tokens, {sizes_label()}; {rows[0]['hardware']}")
    print(ladder_table(rows))
    print()
    print(breakdown_table(rows))
    print(f"wall time {wall:.0f} s, compilation included")
    print(summary_line(rows, cfg.name))


if __name__ == "__main__":
    main()
