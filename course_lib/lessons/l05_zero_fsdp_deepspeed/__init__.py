"""Lesson 05, ZeRO stages 1-3, DeepSpeed and FSDP2 side by side (notebooks/05_zero_fsdp_deepspeed.ipynb)."""
