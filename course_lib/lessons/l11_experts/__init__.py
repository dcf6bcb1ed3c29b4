"""Lesson 11: mixture of experts and expert parallelism (notebooks/11_mixture_of_experts.ipynb)."""
