"""How a lesson shows things: the course's own code (`show`, `source_lines`), a reading held back until the learner has
predicted it (`after_prediction`), and the colours and log-scale ticks every figure shares (lessons 01-09)."""

from __future__ import annotations

import inspect
import os
import textwrap

__all__ = ["COLORS", "source_lines", "after_prediction", "shown", "show", "plain_log_ticks", "READINGS_VAR"]

# One colour per part of memory and of a step's time, in every lesson's figures.
COLORS = dict(params="#4C72B0", grads="#DD8452", optimizer="#55A868", master="#8172B3", activations="#C44E52",
              compute="#4C72B0", communication="#DD8452", overlap="#8172B3", idle="#BBBBBB")


def source_lines(obj, start: str | None = None, end: str | None = None, docstring: bool = False) -> str:
    """The source of a function, method or class, dedented: from the first line that contains ``start`` to the
    first later line that contains ``end`` (both included; None: the whole definition), with the docstring left
    out unless ``docstring``. Raises ValueError naming the marker that is not in the source."""
    src = textwrap.dedent(inspect.getsource(obj))
    if not docstring:
        doc = inspect.getdoc(obj)
        body = _docstring_span(src) if doc else None
        if body:
            src = src[:body[0]] + src[body[1]:]
    lines = src.splitlines()
    first = 0 if start is None else next((i for i, ln in enumerate(lines) if start in ln), None)
    if first is None:
        raise ValueError(f"{start!r} is not in the source of {getattr(obj, '__qualname__', obj)}")
    last = len(lines) - 1 if end is None else next((i for i in range(first, len(lines)) if end in lines[i]), None)
    if last is None:
        raise ValueError(f"{end!r} is not in the source of {getattr(obj, '__qualname__', obj)} after {start!r}")
    return textwrap.dedent("\n".join(lines[first:last + 1]))


def _docstring_span(src: str) -> tuple[int, int] | None:
    """Character span of the first definition's docstring line(s) in ``src`` (with their newline), or None."""
    import ast

    tree = ast.parse(src)
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
        return None
    first = node.body[0]
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return None
    offsets = [0]
    for line in src.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    return offsets[first.lineno - 1], offsets[first.end_lineno]


READINGS_VAR = "COURSE_READINGS"      # "1": show every reading without a prediction (the test command sets it)


def after_prediction(prediction, compare) -> bool:
    """Run ``compare()`` (the lines that read a measurement against the learner's prediction) only once there is a
    prediction: every lesson's predictions start as None, and until one is written the cell says so instead of
    giving the reading away. A dict of predictions counts as written when none of its values is None.

    With ``COURSE_READINGS=1`` in the environment (the test command sets it for nbval, so that every reading runs in
    a test; the browser test's JupyterLab runs without it, as a learner does) the reading runs without a prediction,
    under a line that says so; a reading must then work with its prediction None."""
    values = prediction.values() if isinstance(prediction, dict) else [prediction]
    if any(v is None for v in values):
        if os.environ.get(READINGS_VAR) != "1":
            print("-> write your prediction in the cell above (it is still None), then run this cell again: the "
                  "comparison with the measurement appears then")
            return False
        print(f"({READINGS_VAR}=1: the reading is shown without a prediction)")
    compare()
    return True


def shown(prediction, spec: str = "", of=None) -> str:
    """A learner's prediction in a reading: ``format(prediction, spec)``, or of ``of(prediction)`` (a ratio or a
    relative error computed from it), and "-" while it is None (readings also run without a prediction, under
    ``COURSE_READINGS=1``)."""
    if prediction is None:
        return "-"
    return format(of(prediction) if of is not None else prediction, spec)


def show(obj, start: str | None = None, end: str | None = None, docstring: bool = False):
    """Show the course's own code in a lesson, highlighted: ``show(ZeroOptimizer._make_grad_hook)``, or the lines
    of ``obj`` from ``start`` to ``end`` (see :func:`source_lines`). The title line names the file and the line, so
    the learner can open the whole of it. Returns an ``IPython.display.Code`` (plain text outside a notebook)."""
    from IPython.display import Code

    plain = inspect.unwrap(obj)                 # a decorated function (@torch.no_grad()): the function itself
    path = inspect.getsourcefile(plain) or "?"
    line = inspect.getsourcelines(plain)[1]
    where = path[path.rfind("course_lib"):] if "course_lib" in path else path
    title = f"# {where}, line {line}: {getattr(obj, '__qualname__', obj)}"
    return Code(title + "\n" + source_lines(obj, start, end, docstring), language="python")


def plain_log_ticks(ax, which: str = "xy") -> None:
    """Log-scale tick labels as plain numbers (1, 2, 5, 10, 20, ...) instead of matplotlib's mathtext $10^{x}$: a
    figure redrawn by an ipywidget in JupyterLab has failed to parse its own mathtext tick labels (pyparsing's
    ``ParseException: exception raised in parse action``; lessons 08 and 09, in the browser test)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axis in [a for name, a in (("x", ax.xaxis), ("y", ax.yaxis)) if name in which]:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
