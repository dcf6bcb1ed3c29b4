"""Measuring: what a run took, in time, FLOP/s, bytes and messages, and on which hardware (lesson 01 onwards).

    speed.py               timers (median after warm-up; CUDA-synchronised), FLOPs counted, peak FLOP/s, MFU
    memory_stats.py        bytes counted from tensors: model state, saved activations, live tensors, RSS
    collective_counter.py  the collectives a rank calls, with their payload bytes, per phase
    hardware.py            datasheet rows of the GPUs the course meets, this CPU's features, the hardware label
    units.py               numbers with their units (GB, GiB, TFLOP/s)
    comparisons.py         ``compare(...)``: a measurement beside its formula or library twin, recorded for the
                           lab report

Formulas are `course_lib.theory`'s; this folder measures what they predict.
May import: the core, `course_lib.runtime` (process and NCCL-rule helpers) and itself (tests/test_layout.py).
"""
