"""Lesson 09: training at scale in practice: schedules, clipping, monitoring, alerts, checkpoints, faults, cost."""
