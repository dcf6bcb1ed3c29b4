"""The layout of course_lib (docs/CONVENTIONS.md, "Where code lives"): layers that import only downward, no circle.

Read from the source with `ast`, nothing imported. Every import counts, wherever it stands: at module level, inside a
function, under ``if TYPE_CHECKING`` (a function-level import is a dependency all the same, only a later one).
``from a.b import c`` is an import of module ``a.b.c`` when that module exists, else of ``a.b``.

Layers, from the bottom (`LAYERS`; `MAY_IMPORT` says which layers each one may import):
  base        configs, model, data, ranks, launching, hardware facts, measurements, formulas (theory/)
  techniques  parallel/: one technique per file, applied to a plain model
  training    the training script (train.py, train_config.py)
  grading     grading/ and the glossary `course build` writes
  lessons     lessons/: one folder per lesson, and the modules directly in lessons/ that several lessons share
  tools       the instructor's tools (gpu_check, lab_report, browser): beside the lessons, never importing them
  cli         the `course` command, on top
A lesson's folder imports no other lesson's folder; notebooks and solutions import modules under words.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "course_lib"

# layer: its modules (names under course_lib; "x." takes package x and everything in it)
LAYERS = {
    "base": ["_pool_worker", "_script", "_worker", "alerts", "catalog", "collective_counter", "comparisons", "config",
             "data", "dist", "gpus", "hardware", "lab_settings", "launch", "measure", "memory_stats", "model",
             "monitor", "nccl_rules", "one_process", "pool", "procs", "reference", "spikes", "theory.", "token_loss",
             "units"],
    "techniques": ["parallel."],
    "training": ["recovery", "train", "train_config", "watchdog"],
    "grading": ["grading.", "glossary"],
    "lessons": ["lessons."],
    "tools": ["gpu_check", "lab_report", "browser"],
    "cli": ["cli"],
}
MAY_IMPORT = {
    "base": {"base"},
    "techniques": {"base", "techniques"},
    "training": {"base", "techniques", "training"},
    "grading": {"base", "grading"},
    "lessons": {"base", "techniques", "training", "grading", "lessons"},
    "tools": {"base", "techniques", "training", "grading", "tools"},
    "cli": {"base", "techniques", "training", "grading", "tools", "cli"},
}


def _module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """{module: the course_lib modules it imports}, from every import statement of every file (see the docstring)."""
    files = {_module_name(p, pkg): p for p in pkg.rglob("*.py")}

    def known(name: str) -> str:                       # the longest prefix that is a module of the package
        while name not in files and "." in name:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(known(a.name) for a in node.names if a.name.split(".")[0] == pkg.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                            # relative: from its own package upward
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] == pkg.name:
                    out.update(known(f"{base}.{a.name}") for a in node.names)
        graph[module] = out - {module, pkg.name}
    return graph


def layer_of(module: str) -> str | None:
    name = module.partition(".")[2]
    for layer, members in LAYERS.items():
        for m in members:
            if name == m or (m.endswith(".") and (name == m[:-1] or name.startswith(m))):
                return layer
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that reaches a layer its module may not import (upward, or sideways between lessons and tools)."""
    bad = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            if layer_of(other) not in MAY_IMPORT.get(layer_of(module), ()):
                bad.append(f"{module} ({layer_of(module)}) imports {other} ({layer_of(other)})")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph: each strongly connected set of modules with more than one member (Tarjan), or a
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while not members or members[-1] != v:
                members.append(stack.pop())
            if len(members) > 1 or v in graph.get(v, ()):
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "course_lib.measure.speed" in graph and "course_lib.lessons.l02_data_parallel.experiments" in graph
    missing = sorted(m for m in graph if m != "course_lib" and layer_of(m) is None)
    assert not missing, f"{missing}: put each new module in a layer of LAYERS (tests/test_layout.py)"


def test_modules_import_only_downward():
    bad = upward_imports(import_graph())
    assert not bad, "imports that reach up (move what they need below both):\n" + "\n".join(bad)


def test_no_import_circle():
    cycles = import_cycles(import_graph())
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_rules_reject_a_back_stair_and_a_circle():
    """Each rule fails where it must: synthetic graphs, not the course's."""
    back_stair = {"course_lib.model": {"course_lib.parallel.ddp"}, "course_lib.parallel.ddp": set()}
    assert upward_imports(back_stair) == ["course_lib.model (base) imports course_lib.parallel.ddp (techniques)"]
    tool_into_lesson = {"course_lib.instructor.gpu_check": {"course_lib.lessons.l03_pipeline_parallel.experiments"}}
    assert len(upward_imports(tool_into_lesson)) == 1
    lesson_into_tool = {"course_lib.lessons.variants": {"course_lib.instructor.cli"}}
    assert len(upward_imports(lesson_into_tool)) == 1
    downward = {"course_lib.instructor.cli": {"course_lib.instructor.lab_report", "course_lib.grading.commands"},
                "course_lib.lessons.variants": {"course_lib.parallel.zero", "course_lib.training.train"}}
    assert upward_imports(downward) == []
    circle = {"course_lib.instructor.cli": {"course_lib.instructor.lab_report"}, "course_lib.instructor.lab_report": {"course_lib.instructor.catalog",
              "course_lib.instructor.cli"}, "course_lib.instructor.catalog": set()}
    assert import_cycles(circle) == [["course_lib.instructor.cli", "course_lib.instructor.lab_report"]]
    long_circle = {"course_lib.a": {"course_lib.b"}, "course_lib.b": {"course_lib.c"}, "course_lib.c": {"course_lib.a"}}
    assert import_cycles(long_circle) == [["course_lib.a", "course_lib.b", "course_lib.c"]]
    assert import_cycles({"course_lib.a": {"course_lib.a"}}) == [["course_lib.a"]]
    assert import_cycles({"course_lib.a": {"course_lib.b"}, "course_lib.b": set()}) == []


def test_the_graph_counts_function_level_and_from_imports(tmp_path):
    pkg = tmp_path / "course_lib"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "model.py", "sub/__init__.py", "sub/deep.py"):
        (pkg / name).write_text("")
    (pkg / "model.py").write_text("def f():\n    from course_lib.sub import deep\n    from . import sub\n")
    (pkg / "sub" / "deep.py").write_text("import course_lib.model\nfrom ..model import f\n")
    graph = import_graph(pkg)
    assert graph["course_lib.model"] == {"course_lib.sub.deep", "course_lib.sub"}
    assert graph["course_lib.sub.deep"] == {"course_lib.model"}
    assert import_cycles(graph) == [["course_lib.model", "course_lib.sub.deep"]]


def test_lessons_share_code_only_through_shared_modules():
    """A lesson's folder imports no other lesson's folder: what two lessons share lives in a module directly in
    course_lib/lessons/ (display, sizes, errors, variants, quizzes), or below, and those import no lesson's folder."""
    graph = import_graph()
    lessons = sorted(p for p in (PKG / "lessons").iterdir() if p.is_dir() and re.fullmatch(r"l\d\d_\w+", p.name))
    assert [p.name[:3] for p in lessons] == sorted(p.name[:3] for p in lessons) and len(lessons) >= 7
    for module, imported in graph.items():
        own = re.match(r"course_lib\.lessons\.(l\d\d_\w+)", module)
        for other in imported:
            theirs = re.match(r"course_lib\.lessons\.(l\d\d_\w+)", other)
            assert theirs is None or (own is not None and own.group(1) == theirs.group(1)), \
                f"{module} imports {other}: share it through a module directly in course_lib/lessons/"


def test_notebooks_import_modules_under_words():
    alias = re.compile(r"^\s*(?:from\s+course_lib\S*\s+import|import\s+course_lib\S*).*\bas\s+([A-Za-z_]\w*)", re.M)
    for path in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("solutions/*.ipynb")]):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for name in alias.findall("".join(cell["source"])):
                assert len(name) > 3, f"{path.relative_to(ROOT)}: `as {name}`: name a course module with a word"


def test_show_prints_the_course_code_a_lesson_names():
    """`lessons.display.show`: the lines between two markers of a (decorated) function, its file and line named."""
    from course_lib.lessons.display import show, source_lines
    from course_lib.parallel.zero import ZeroOptimizer

    code = show(ZeroOptimizer._reduce_scatter_unit, "send = ", "out.div_(N)")     # under @torch.no_grad()
    first, *body = code.data.splitlines()
    assert first.startswith("# course_lib/parallel/zero.py, line ") and "_reduce_scatter_unit" in first
    assert body[0].startswith("send = ") and body[-1] == "out.div_(N)"
    assert source_lines(ZeroOptimizer._make_grad_hook).startswith("def _make_grad_hook(")
    assert '"""' not in source_lines(ZeroOptimizer._reduce_scatter_unit)                 # docstring left out
    assert '"""' in source_lines(ZeroOptimizer._reduce_scatter_unit, docstring=True)
    with pytest.raises(ValueError, match="not in the source"):
        source_lines(ZeroOptimizer._make_grad_hook, "no such line")
