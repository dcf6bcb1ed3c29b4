"""Lesson 12, one device at full speed: the ladder of single-device optimisations of a training step (issue 45).

    ladder.py   the rungs (fp32 eager ... CUDA graphs, fp8) measured side by side, with transformers' GPT-2
    steps.py    one training step built from switches (precision, padding, attention, optimizer, compile)
    profile.py  where a step's time goes (torch.profiler: matmul / attention / elementwise / optimizer / other)
    report.py   the ladder as a table and its one-line summary
    fp8.py      the FP8 experiments (scale granularity, loss curves, GEMM speed; technique: `parallel.float8`)
    checks.py   what the graded exercises of lesson 12 call
"""
