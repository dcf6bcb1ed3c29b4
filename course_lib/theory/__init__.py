"""Closed-form formulas that the lessons put next to measurements (lesson 01 onwards).

- :mod:`course_lib.theory.flops`: FLOPs per token of a GPT (6N + attention), training FLOPs, MFU inputs.
- :mod:`course_lib.theory.memory`: bytes of parameters, gradients, optimizer state and activations; ZeRO's
  per-rank model state and the per-rank memory calculator (lessons 01, 05).
- :mod:`course_lib.theory.comm`: nccl-tests bus bandwidth, the alpha-beta (latency + size/bandwidth)
  model of a collective and its least-squares fit.
- :mod:`course_lib.theory.pipeline`: the pipeline bubble and the activation memory of GPipe and 1F1B (lesson 03).
- :mod:`course_lib.theory.tensor`: collectives, parameters and activations per rank under tensor and sequence
  parallelism (lesson 04).
- :mod:`course_lib.theory.context`: communication, causal work and activations per rank under context
  parallelism (lesson 10).
- :mod:`course_lib.theory.experts`: parameters, FLOPs, balancing loss and all-to-all bytes of mixtures of experts
  (lesson 11).
- :mod:`course_lib.theory.experts_tp`, :mod:`course_lib.theory.experts_fine`, :mod:`course_lib.theory.moe_imbalance`,
  :mod:`course_lib.theory.moe_routing`: expert tensor parallelism's bytes, fine-grained and shared experts' parameters,
  a skewed router's straggler and memory, node-limited routing's dispatch bytes (lesson 11).
- :mod:`course_lib.theory.savers`: activation checkpointing, accumulation and attention memory (lesson 07).
- :mod:`course_lib.theory.documents`, :mod:`course_lib.theory.context_hybrid`: packed documents' attention work per
  rank, hybrid CP's bytes and Ulysses' head caps (lesson 10).
- :mod:`course_lib.theory.practice`: GPU-hours and money of a run, the optimum checkpoint interval (lesson 09).

Every formula is checked against a measurement in the tests. ``from course_lib import theory`` gives them all:
``theory.memory.zero_model_state_bytes(...)``.
May import: the core, `course_lib.measure` (hardware facts) and itself (tests/test_layout.py): a formula needs no
technique, no launcher and no lesson.
"""

from course_lib.theory import (comm, context, context_hybrid, documents, experts, experts_fine, experts_tp, flops,
                               memory, moe_imbalance, moe_routing, pipeline, practice, savers, tensor)

__all__ = ["comm", "context", "context_hybrid", "documents", "experts", "experts_fine", "experts_tp", "flops", "memory",
           "moe_imbalance", "moe_routing", "pipeline", "practice", "savers", "tensor"]
