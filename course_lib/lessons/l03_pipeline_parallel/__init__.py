"""Lesson 03, model and pipeline parallelism: GPipe, 1F1B, the bubble (notebooks/03_pipeline_parallel.ipynb)."""
