"""Lesson 01, bottleneck analysis: compute, memory, network (notebooks/01_bottlenecks.ipynb)."""
