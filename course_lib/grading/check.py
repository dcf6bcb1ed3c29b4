"""Checks used by the test cells of graded exercises (docs/GRADING.md).

    from course_lib.grading.check import check_close, check_equal, check_true, check_shape
    check_close("sum over 2 ranks", actual, expected, rtol=1e-6, hint="combine the partial sums")

A failing check raises `CheckFailed` (an ``AssertionError``) with a one-line message::

    check 'sum over 2 ranks' failed: expected 5050, got 2525. Hint: combine the partial sums

The message shows the expected value of *that* check only (never the reference code). Quiz answers use
``check_answer(name, actual, digest)``: the cell holds a salted hash of the answer, not the answer, so the
learner's copy does not spell it; the message says "wrong value" and the hint, nothing more. The digest is
``answer_digest(name, expected)`` (``python -m course_lib.grading.check digest NAME VALUE [RTOL]``).
This module imports nothing heavy (torch is only touched when a value is a tensor).
"""

from __future__ import annotations

import hashlib
import math
import sys
from typing import Any

MAX_SHOWN = 120  # characters of a value shown in a message


class CheckFailed(AssertionError):
    """A check in a test cell failed. ``str(exc)`` is one line: check, expected vs actual, hint."""

    def __init__(self, name: str, detail: str, hint: str = ""):
        self.check_name, self.detail, self.hint = name, detail, hint
        msg = f"check {name!r} failed: {detail}"
        if hint:
            msg += f". Hint: {hint}"
        super().__init__(_one_line(msg, 600))


def _one_line(text: str, limit: int = MAX_SHOWN) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    return _one_line(repr(_plain(value)))


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _plain(x: Any) -> Any:
    """Tensors and numpy arrays -> Python numbers / nested lists (for comparison and messages)."""
    if _is_tensor(x):
        x = x.detach().cpu()
        return x.item() if x.dim() == 0 else x.tolist()
    if type(x).__module__ == "numpy":
        return x.item() if getattr(x, "ndim", 1) == 0 else x.tolist()
    if isinstance(x, tuple):
        return [_plain(v) for v in x]
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def _fail(name: str, expected: Any, actual: Any, hint: str, reveal: bool, extra: str = "") -> None:
    if reveal:
        detail = f"expected {_show(expected)}, got {_show(actual)}{extra}"
    else:
        detail = "wrong value"
    raise CheckFailed(name, detail, hint)


def _flatten(x: Any) -> list:
    if isinstance(x, list):
        out = []
        for v in x:
            out.extend(_flatten(v))
        return out
    return [x]


def _shape_of(x: Any) -> tuple | None:
    if hasattr(x, "shape"):
        return tuple(int(d) for d in x.shape)
    if isinstance(x, (list, tuple)):
        if not x:
            return (0,)
        inner = {_shape_of(v) for v in x}
        if len(inner) != 1:
            return None  # ragged
        sub = inner.pop()
        return (len(x),) + (sub or ())
    return ()


def check_close(name: str, actual: Any, expected: Any, *, rtol: float = 1e-6, atol: float = 1e-8,
                hint: str = "", reveal: bool = True) -> None:
    """``actual`` equals ``expected`` within ``|a - e| <= atol + rtol * |e|`` elementwise.

    Numbers, lists, tuples, numpy arrays and torch tensors are accepted; shapes must match.
    """
    a, e = _plain(actual), _plain(expected)
    if _shape_of(a) != _shape_of(e):
        if reveal:
            raise CheckFailed(name, f"expected shape {_shape_of(e)}, got shape {_shape_of(a)}", hint)
        _fail(name, e, a, hint, reveal)
    worst, worst_i = 0.0, None
    for i, (x, y) in enumerate(zip(_flatten(a), _flatten(e))):
        try:
            x, y = float(x), float(y)
        except (TypeError, ValueError):
            _fail(name, e, a, hint, reveal, extra=" (not a number)")
        if math.isnan(x) != math.isnan(y) or (not math.isnan(x) and not _close(x, y, rtol, atol)):
            err = abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf
            if worst_i is None or err > worst:
                worst, worst_i = err, i
    if worst_i is not None:
        where = "" if _shape_of(e) == () else f" (largest difference {worst:.3g} at flat index {worst_i})"
        _fail(name, e, a, hint, reveal, extra=f"{where}, rtol={rtol:g}")


def _close(x: float, y: float, rtol: float, atol: float) -> bool:
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= atol + rtol * abs(y)


def check_equal(name: str, actual: Any, expected: Any, *, hint: str = "", reveal: bool = True) -> None:
    """``actual == expected`` exactly (tensors and arrays compared as nested lists)."""
    a, e = _plain(actual), _plain(expected)
    if not (type(a) is type(e) or _both_numbers(a, e)) or a != e:
        _fail(name, e, a, hint, reveal)


def _both_numbers(a: Any, b: Any) -> bool:
    num = (int, float)
    return isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool)


def check_true(name: str, condition: Any, *, hint: str = "") -> None:
    """``condition`` is true. The message says only that the property does not hold, and the hint."""
    if not condition:
        raise CheckFailed(name, "the condition does not hold", hint)


def check_shape(name: str, actual: Any, expected_shape: tuple, *, hint: str = "") -> None:
    """``actual`` (tensor, array or nested list) has shape ``expected_shape``."""
    shape = _shape_of(actual)
    if shape != tuple(expected_shape):
        raise CheckFailed(name, f"expected shape {tuple(expected_shape)}, got shape {shape}", hint)


# ------------------------------------------------------------------------------ answers checked by hash

SALT = "llm-scale-course/quiz/v1"


def _digest(name: str, canonical: str) -> str:
    return hashlib.sha256(f"{SALT}|{name}|{canonical}".encode()).hexdigest()[:24]


def _canonical(value: Any, rtol: float | None, spread: int = 0) -> list[str]:
    """The strings ``value`` hashes to: exact (``rtol`` None: an integral number, a bool or a word), or its
    relative bucket of width ``rtol`` (and ``spread`` buckets either side, for the answer being checked)."""
    value = _plain(value)
    if isinstance(value, bool):
        return [f"bool:{value}"]
    if isinstance(value, str):
        return [f"str:{value.strip().lower()}"]
    try:
        x = float(value)
    except (TypeError, ValueError):
        return []
    if math.isnan(x) or math.isinf(x):
        return []
    if rtol is None:
        return [f"int:{int(x)}" if x.is_integer() else f"float:{x!r}"]
    if x == 0:
        return ["zero"]
    b = math.floor(math.log(abs(x)) / math.log1p(rtol))
    sign = "-" if x < 0 else "+"
    return [f"{sign}{k}" for k in range(b - spread, b + spread + 1)]


def answer_digest(name: str, expected: Any, rtol: float | None = None) -> str:
    """The digest ``check_answer(name, ..., digest, rtol=rtol)`` accepts for ``expected`` (salted with the
    check's name, so equal answers of two questions hash differently)."""
    canon = _canonical(expected, rtol)
    if not canon:
        raise ValueError(f"{expected!r}: an answer is a number, a bool or a word")
    return _digest(name, canon[0])


def check_answer(name: str, actual: Any, digest: str, *, rtol: float | None = None, hint: str = "") -> None:
    """``actual`` is the answer whose ``answer_digest`` is ``digest``: exactly (``rtol`` None) or within about
    ``rtol`` to ``2 rtol`` relative (the answer's bucket and its neighbours). Never shows the answer."""
    if actual is None:
        raise CheckFailed(name, "not answered yet (the answer is None)", hint)
    if not any(_digest(name, c) == digest for c in _canonical(actual, rtol, spread=1)):
        raise CheckFailed(name, "wrong value", hint)


def _main(argv: list[str]) -> int:
    """``python -m course_lib.grading.check digest NAME VALUE [RTOL]``: print the digest of an answer."""
    if len(argv) not in (3, 4) or argv[0] != "digest":
        print(_main.__doc__, file=sys.stderr)
        return 2
    import ast
    value = ast.literal_eval(argv[2]) if argv[2] not in ("True", "False") else argv[2] == "True"
    print(answer_digest(argv[1], value, float(argv[3]) if len(argv) == 4 else None))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
