"""Lesson 04, tensor and sequence parallelism (notebooks/04_tensor_parallel.ipynb)."""
