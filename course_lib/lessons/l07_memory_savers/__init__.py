"""Lesson 07, memory savers: checkpointing, accumulation, offload, attention (notebooks/07_memory_savers.ipynb)."""
