"""Lesson 08: 3D parallelism and choosing a strategy."""
