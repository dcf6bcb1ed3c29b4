"""Closed-form formulas that the lessons put next to measurements (lesson 01 onwards).

- :mod:`course_lib.theory.flops`: FLOPs per token of a GPT (6N + attention), training FLOPs, MFU inputs.
- :mod:`course_lib.theory.memory`: bytes of parameters, gradients, optimizer state and activations.
- :mod:`course_lib.theory.comm`: nccl-tests bus bandwidth, the alpha-beta (latency + size/bandwidth)
  model of a collective and its least-squares fit.

Every formula is checked against a measurement in tests/test_theory.py and tests/test_bottlenecks.py.
"""

from course_lib.theory import comm, flops, memory

__all__ = ["comm", "flops", "memory"]
