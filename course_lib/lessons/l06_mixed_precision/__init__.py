"""Lesson 06, mixed precision: formats, loss scaling, master weights (notebooks/06_mixed_precision.ipynb)."""
