"""Lesson 10, long sequences: context parallelism (notebooks/10_context_parallel.ipynb)."""
