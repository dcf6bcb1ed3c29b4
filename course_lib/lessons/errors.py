"""How far one run is from another (a parallel run from the one-process reference, `course_lib.one_process`):
relative and absolute errors of tensors and of {name: tensor} dicts, one number a message can show (lessons 02-09)."""

from __future__ import annotations

import torch

__all__ = ["relative_error", "max_relative_error", "max_abs_error"]


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for _, v in sorted(d.items())])


def relative_error(actual, expected) -> float:
    """||a - e|| / ||e|| of two tensors, or over all tensors of two {name: tensor} dicts together (one number a
    message can show). inf when `actual` is None or the shapes / names differ."""
    if isinstance(expected, dict):
        if actual is None or set(actual) != set(expected):
            return float("inf")
        actual, expected = _flat(actual), _flat(expected)
    if actual is None or tuple(actual.shape) != tuple(expected.shape):
        return float("inf")
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def max_relative_error(actual: dict, expected: dict) -> float:
    """The largest `relative_error` of one tensor over two {name: tensor} dicts (inf when the names differ)."""
    if set(actual) != set(expected):
        return float("inf")
    return max(relative_error(actual[k], expected[k]) for k in expected)


def max_abs_error(actual, expected) -> float:
    """Largest |a - e| over two lists (or dicts) of tensors; inf if a shape differs or anything is inf/nan."""
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            return float("inf")
        actual, expected = [actual[k] for k in expected], list(expected.values())
    errs = [(a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
            for a, b in zip(actual, expected)]
    return max((e if e == e else float("inf") for e in errs), default=0.0)
