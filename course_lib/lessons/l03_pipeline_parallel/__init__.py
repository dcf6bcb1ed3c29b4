"""Lesson 03, model and pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and zero bubble, the bubble
(notebooks/03_pipeline_parallel.ipynb)."""
