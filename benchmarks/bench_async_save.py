"""How long a checkpoint save blocks the training loop: DCP's synchronous save vs `async_save`, measured side by
side in one run (lesson 09, section 7.5; issue 34).

    .venv/bin/python benchmarks/bench_async_save.py                 # 2 gloo ranks, the lesson's 7.2M-param GPT + AdamW
    .venv/bin/python benchmarks/bench_async_save.py --repeats 9

Each rank saves the same state `repeats` times synchronously and asynchronously, interleaved
(`lessons.l09_training.large_runs.rank_save_timing`). Blocked = from the call until it returns. Async total = until
its write is published. Target: the async save blocks the loop at most half as long as the synchronous one. Prints
the medians, their ratio and the hardware.
"""

from __future__ import annotations

import argparse

TARGET = 0.5


def main(argv: list[str] | None = None) -> int:
    from course_lib.measure.hardware import hardware_label
    from course_lib.lessons.l09_training.large_runs import async_save_timing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    t = async_save_timing(nprocs=a.nprocs, repeats=a.repeats)
    ratio = t["async_blocked_s"] / t["sync_s"]
    print(f"save of {t['params'] / 1e6:.1f}M params + AdamW, {t['state_bytes'] / 1e6:.0f} MB of state per rank, "
          f"{t['nprocs']} ranks, medians of {a.repeats} [{hardware_label('gloo')}]")
    print(f"  sync save blocks the loop      {t['sync_s'] * 1e3:8.1f} ms")
    print(f"  async save blocks the loop     {t['async_blocked_s'] * 1e3:8.1f} ms   ({ratio:.2f}x sync)")
    print(f"  async save written after       {t['async_total_s'] * 1e3:8.1f} ms")
    print(f"target: async / sync blocked <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'}")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
