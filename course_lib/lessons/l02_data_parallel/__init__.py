"""Lesson 02, data parallelism: naive, ring all-reduce, bucketed DDP (notebooks/02_data_parallel.ipynb)."""
