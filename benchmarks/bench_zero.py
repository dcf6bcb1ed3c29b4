"""Own ZeRO-3 vs PyTorch FSDP2 step time, and the whole lesson-05 comparison table (issue 9).

    .venv/bin/python benchmarks/bench_zero.py                  # 2 ranks, gloo on CPU / NCCL on GPUs
    .venv/bin/python benchmarks/bench_zero.py --nprocs 4 --table

Own ZeRO-3 and FSDP2 train the same GPT on the same data in the same processes, in alternating rounds, so a
noisy shared machine slows both alike. Target: FSDP2 step time / own ZeRO-3 step time >= 0.8 (own at least
0.8x as fast). Prints the ratio of medians and the hardware; --table adds every variant (own ZeRO-1/2/3,
DeepSpeed 0-3 and offload, FSDP2, DDP): memory per rank measured vs formula, step time, loss vs DDP.
"""

from __future__ import annotations

import argparse
import statistics

from course_lib.config import ModelConfig
from course_lib.runtime import run

TARGET = 0.8


def _bench(cfg: ModelConfig, global_batch: int, steps: int, rounds: int) -> dict:
    from course_lib import dist as cdist
    from course_lib.data import random_batches
    from course_lib.measure.hardware import hardware_label
    from course_lib.lessons.variants import train_variant

    batches = random_batches(cfg, global_batch, steps)
    times = {"zero3": [], "fsdp2": []}
    for i in range(rounds):
        for variant in (("zero3", "fsdp2") if i % 2 == 0 else ("fsdp2", "zero3")):
            times[variant].append(train_variant(cfg, batches, variant, full_params=False)["step_s"])
    return {"times": times, "hardware": hardware_label(cdist.backend(), cdist.device())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="steps per round (median of all but the first)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--table", action="store_true", help="also print the full comparison table")
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=256, seq_len=64, n_layer=args.layers, n_head=4, d_model=args.d_model,
                      name="bench-zero")
    res = run(_bench, args.nprocs, args=(cfg, args.batch, args.steps, args.rounds), timeout_s=600, stream=False)
    t = res.value["times"]
    own, fsdp = statistics.median(t["zero3"]), statistics.median(t["fsdp2"])
    print(f"{res.value['hardware']} ({res.backend}, {args.nprocs} ranks), {cfg.num_params():,} parameters")
    print(f"own ZeRO-3 step {own * 1e3:.1f} ms, FSDP2 step {fsdp * 1e3:.1f} ms (medians of {args.rounds} rounds)")
    ratio = fsdp / own
    print(f"own ZeRO-3 speed relative to FSDP2: {ratio:.2f}x (target >= {TARGET}): "
          f"{'met' if ratio >= TARGET else 'NOT met'}")
    if args.table:
        from course_lib.lessons.l05_zero_fsdp_deepspeed.experiments import compare
        from course_lib.lessons.l05_zero_fsdp_deepspeed.report import format_table
        rows, hw = compare(cfg, args.nprocs, steps=6, global_batch=args.batch)
        print(format_table(rows, hw))


if __name__ == "__main__":
    main()
