"""Foundation targets (issue 3), measured and printed; not a test.

- a cold 2-rank job from a notebook-style call to its result (target: at most 6 s on the 2-core machine),
  with where the time goes (launcher + process start, imports, rendezvous, work, shutdown);
- one training step of the `tiny` preset on this machine (target: at most 0.3 s).

    .venv/bin/python benchmarks/bench_foundation.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _job():
    import torch.distributed as dist

    from course_lib import dist as cdist

    t = torch.ones(1, device=cdist.device())              # on the rank's GPU under NCCL
    dist.all_reduce(t)
    return t.item()


def cold_start(repeats: int) -> None:
    from course_lib.runtime import run

    walls, breakdowns = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = run(_job, 2, stream=False, fresh=True)    # a cold start: new processes, not the warm pool
        walls.append(time.perf_counter() - t0)
        breakdowns.append(res.breakdown())
    print(f"cold 2-rank job, call to result: median {statistics.median(walls):.2f} s "
          f"(runs: {', '.join(f'{w:.2f}' for w in walls)}; target <= 6 s)")
    for key in breakdowns[0]:
        print(f"  {key:<28} {statistics.median(b[key] for b in breakdowns):.2f} s")


def tiny_step(steps: int = 20) -> None:
    from course_lib.config import TrainConfig, get_preset
    from course_lib.data import get_batch, synthetic_corpus
    from course_lib.measure.speed import time_fn
    from course_lib.model import build_model

    cfg = get_preset("tiny")
    train = TrainConfig()
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr)
    tokens = synthetic_corpus(100_000, cfg.vocab_size, seed=0).tokens
    x, y = get_batch(tokens, train.batch_size, cfg.seq_len, step=0)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        opt.step()

    seconds = time_fn(step, warmup=3, repeats=steps)
    print(f"tiny preset training step (batch {train.batch_size} x {cfg.seq_len} tokens, AdamW, "
          f"{torch.get_num_threads()} threads): median {seconds * 1e3:.1f} ms (target <= 300 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from course_lib.measure.hardware import hardware_label

    print(f"hardware: {hardware_label()}")
    cold_start(args.repeats)
    tiny_step()


if __name__ == "__main__":
    main()
