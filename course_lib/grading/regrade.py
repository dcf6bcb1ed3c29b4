"""``course grade --exercise ID``: grade one exercise of a submission (a regrade request), not all of it.

The rule (docs/GRADING.md, "Regrades"), on the notebook `grade.assemble` made (official tests put back):

1. kept as they are: the official test cells of each chosen exercise, and the learner's code cells of that
   exercise, i.e. those after the previous exercise's test cells (as `grade.score` assigns a cell to the exercise
   whose tests come next);
2. every earlier learner code cell is kept when a kept cell after it may need it: it defines, imports, assigns or
   mutates (``x.attr = ...``, ``x[k] = ...``, ``x.method(...)``) a name that a kept cell after it mentions
   (transitively); or it cannot be read as Python (a cell magic), or it uses ``import *``, ``exec``, ``eval``,
   ``globals()`` (its names cannot be known): kept, to be safe;
3. dropped: the other exercises' test cells (test cells define nothing later cells need, docs/GRADING.md,
   "Authoring"), every cell after the last chosen test cell, Markdown, and the earlier code nothing kept mentions
   (a slow experiment, another exercise's answer).

So the chosen exercise runs with every definition it can reach, and its score equals the full grade's
(tests/test_grading_scale.py checks it on a submission whose answer calls a helper defined in another
exercise's cell, next to a slow cell the regrade skips).
"""

from __future__ import annotations

import ast
import copy
import re

from course_lib import notebook as nbio
from course_lib.grading import authoring

WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OPAQUE_CALLS = {"exec", "eval", "globals", "locals", "vars", "__import__"}


class SelectionError(ValueError):
    """An exercise asked for is not in the lesson."""


def _root(node: ast.AST) -> str | None:
    """``a`` for ``a``, ``a.b.c``, ``a[0].b``, ``a.b(...)``: the name whose object an expression reaches."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def names(src: str) -> tuple[set[str], set[str]] | None:
    """(names the cell may define or change, names it mentions) of one code cell; None when what it defines cannot
    be known (not Python, ``import *``, ``exec`` and friends)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return None
    defined, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                defined.add(node.id)
            elif node.id in OPAQUE_CALLS:
                return None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                defined.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            defined.update(node.names)
    for node in tree.body:  # mutations at the top level change the object a name holds
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else \
            [node.value] if isinstance(node, ast.Expr) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, (ast.Attribute, ast.Subscript, ast.Call)) and (name := _root(part)):
                    defined.add(name)
    return defined, used


def select(assembled, exercises: list[str]) -> dict:
    """The cells of ``assembled`` that grading ``exercises`` runs (see the module docstring), in their order.

    Raises `SelectionError` naming the lesson's exercises when one of ``exercises`` has no test cell.
    """
    cells = assembled["cells"]
    info = [authoring.test_info(c) for c in cells]
    present = list(dict.fromkeys(i["exercise"] for i in info if i))
    unknown = [e for e in exercises if e not in present]
    if unknown:
        raise SelectionError(f"no exercise {', '.join(map(repr, unknown))} in this lesson: its exercises are "
                             f"{', '.join(present)}")
    keep: set[int] = set()
    last = -1
    previous_test = -1                          # the last test cell of another exercise before this one
    for i, meta in enumerate(info):
        if meta is None:
            continue
        if meta["exercise"] in exercises:
            keep.add(i)
            keep.update(j for j in range(previous_test + 1, i) if info[j] is None and cells[j]["cell_type"] == "code")
            last = i
        previous_test = i
    needed: set[str] = set()
    for i in range(last, -1, -1):               # backwards: what the kept cells after i mention
        cell = cells[i]
        if cell.get("cell_type") != "code" or (info[i] and i not in keep):
            continue
        src = nbio.source(cell)
        found = names(src)
        if i not in keep and found is not None and not (found[0] & needed):
            continue
        keep.add(i)
        # a cell whose names cannot be read (a magic): every word in it may be a name it uses
        needed |= found[1] if found is not None else set(WORD.findall(src))
    out = copy.deepcopy(assembled)
    out["cells"] = [copy.deepcopy(cells[i]) for i in sorted(keep)]
    return out
