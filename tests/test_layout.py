"""The layout of course_lib (docs/CONVENTIONS.md, "Where code lives"): a folder per concern, layers that import only
downward, no circle, no module over 500 lines.

Read from the source with `ast`, nothing imported. Every import counts, wherever it stands: at module level, inside a
function, under ``if TYPE_CHECKING`` (a function-level import is a dependency all the same, only a later one).
``from a.b import c`` is an import of module ``a.b.c`` when that module exists, else of ``a.b``.

Layers, from the bottom (`LAYERS`; `MAY_IMPORT` says which layers each one may import):
  core        course_lib's root: config, model, data, dist, one_process, reference, notebook, glossary
  runtime     runtime/: starting ranks (launch, pool, procs, gpus, NCCL's rules, the programs torchrun starts)
  measure     measure/: time, FLOP/s, bytes, collectives, hardware facts, units, recorded comparisons
  theory      theory/: closed-form formulas and the planner
  techniques  parallel/: one technique per file, applied to a plain model
  training    training/: the training script and its parts
  grading     grading/: course build and course grade
  lessons     lessons/: one folder per lesson, and the modules directly in lessons/ that several lessons share
  instructor  instructor/: the `course` command and the instructor's tools, beside the lessons, never importing them
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
    "core": ["config", "data", "dist", "glossary", "model", "notebook", "one_process", "reference"],
    "runtime": ["runtime."],
    "measure": ["measure."],
    "theory": ["theory."],
    "techniques": ["parallel."],
    "training": ["training."],
    "grading": ["grading."],
    "lessons": ["lessons."],
    "instructor": ["instructor."],
}
BELOW_THE_TOP = {"core", "runtime", "measure", "theory", "techniques", "training", "grading"}
MAY_IMPORT = {
    "core": {"core"},
    "runtime": {"core", "runtime"},
    "measure": {"core", "runtime", "measure"},
    "theory": {"core", "measure", "theory"},
    "techniques": {"core", "measure", "theory", "techniques"},
    "training": {"core", "runtime", "measure", "theory", "techniques", "training"},
    "grading": {"core", "runtime", "grading"},
    "lessons": BELOW_THE_TOP | {"lessons"},
    "instructor": BELOW_THE_TOP | {"instructor"},
}
MAX_ROOT_MODULES = 8               # the core; everything else has a folder
MAX_LINES = 500                    # split by concept, not by size


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


def oversized(files: dict[str, str], limit: int = MAX_LINES) -> list[str]:
    """``path (N lines)`` of each file over ``limit`` lines ({relative path: text})."""
    return [f"{path} ({n} lines)" for path, text in sorted(files.items())
            if (n := len(text.splitlines())) > limit]


def root_modules(pkg: Path = PKG) -> list[str]:
    """The modules directly in ``pkg`` (not its __init__)."""
    return sorted(p.stem for p in pkg.glob("*.py") if p.name != "__init__.py")


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


def test_the_root_holds_the_core_only():
    """course_lib/ lists the core and its folders; a new module goes into the folder of its concern."""
    modules = root_modules()
    assert set(modules) == set(LAYERS["core"]) and len(modules) <= MAX_ROOT_MODULES, \
        f"course_lib/ holds {modules}: the root is the core {sorted(LAYERS['core'])}; put a new module in its folder"


def test_every_folder_says_what_it_holds_and_may_import():
    """Each folder's __init__.py has a docstring naming what lives there and what it may import."""
    for layer, members in LAYERS.items():
        for folder in (m[:-1] for m in members if m.endswith(".")):
            doc = ast.get_docstring(ast.parse((PKG / folder / "__init__.py").read_text())) or ""
            assert len(doc.splitlines()) >= 3 and re.search(r"may import", doc, re.I), \
                f"course_lib/{folder}/__init__.py: a docstring saying what lives there and what it may import"


def test_no_module_over_500_lines():
    files = {str(p.relative_to(ROOT)): p.read_text() for folder in ("course_lib", "tests", "tools", "benchmarks")
             for p in (ROOT / folder).rglob("*.py")}
    files["course.py"] = (ROOT / "course.py").read_text()
    assert len(files) > 150
    bad = oversized(files)
    assert not bad, f"modules over {MAX_LINES} lines (split each by concept, not by size): {bad}"


def test_the_rules_reject_each_violation():
    """Each rule fails where it must: synthetic graphs and files, not the course's."""
    back_stair = {"course_lib.model": {"course_lib.parallel.ddp"}, "course_lib.parallel.ddp": set()}
    assert upward_imports(back_stair) == ["course_lib.model (core) imports course_lib.parallel.ddp (techniques)"]
    for module, other in [("course_lib.instructor.gpu_check", "course_lib.lessons.l03_pipeline_parallel.experiments"),
                          ("course_lib.lessons.variants", "course_lib.instructor.cli"),
                          ("course_lib.training.train", "course_lib.lessons.l09_training.checks"),
                          ("course_lib.parallel.ddp", "course_lib.runtime.launch"),
                          ("course_lib.parallel.ddp", "course_lib.training.token_loss"),
                          ("course_lib.measure.speed", "course_lib.theory.flops"),
                          ("course_lib.runtime.launch", "course_lib.measure.hardware"),
                          ("course_lib.grading.grade", "course_lib.measure.comparisons"),
                          ("course_lib.theory.flops", "course_lib.parallel.ddp"),
                          ("course_lib.glossary", "course_lib.grading.authoring"),
                          ("course_lib.measure.speed", "course_lib.new_folder.thing")]:
        assert len(upward_imports({module: {other}})) == 1, f"{module} -> {other} was let through"
    downward = {"course_lib.instructor.cli": {"course_lib.instructor.lab_report", "course_lib.grading.commands"},
                "course_lib.lessons.variants": {"course_lib.parallel.zero", "course_lib.training.train"},
                "course_lib.training.train": {"course_lib.parallel.ddp", "course_lib.runtime.launch"},
                "course_lib.measure.hardware": {"course_lib.runtime.procs"},
                "course_lib.glossary": {"course_lib.notebook"}}
    assert upward_imports(downward) == []
    circle = {"course_lib.instructor.cli": {"course_lib.instructor.lab_report"},
              "course_lib.instructor.lab_report": {"course_lib.instructor.catalog", "course_lib.instructor.cli"},
              "course_lib.instructor.catalog": set()}
    assert import_cycles(circle) == [["course_lib.instructor.cli", "course_lib.instructor.lab_report"]]
    long_circle = {"course_lib.a": {"course_lib.b"}, "course_lib.b": {"course_lib.c"}, "course_lib.c": {"course_lib.a"}}
    assert import_cycles(long_circle) == [["course_lib.a", "course_lib.b", "course_lib.c"]]
    assert import_cycles({"course_lib.a": {"course_lib.a"}}) == [["course_lib.a"]]
    assert import_cycles({"course_lib.a": {"course_lib.b"}, "course_lib.b": set()}) == []
    assert layer_of("course_lib.launch") is None and layer_of("course_lib.measure") == "measure"  # a stray root module
    big, small = "x = 1\n" * (MAX_LINES + 1), "x = 1\n" * MAX_LINES
    assert oversized({"course_lib/big.py": big, "course_lib/ok.py": small}) == ["course_lib/big.py (501 lines)"]


def test_a_stray_root_module_is_refused(tmp_path):
    pkg = tmp_path / "course_lib"
    pkg.mkdir()
    for name in ["__init__", *LAYERS["core"], "launch"]:
        (pkg / f"{name}.py").write_text("")
    modules = root_modules(pkg)
    assert "launch" in modules and "__init__" not in modules and len(modules) == MAX_ROOT_MODULES + 1
    assert layer_of("course_lib.launch") is None


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


def test_modules_one_folder_down_still_find_the_repository_and_the_package():
    """Paths a moved module derives from its own file: the repository (the lab's notebooks, course.py), the package
    the ranks import and pickle by reference, the code NCCL's rules judge as the course's own."""
    from course_lib.instructor import catalog, cli, lab_report
    from course_lib.runtime import nccl_rules, payload, torchrun

    for module in (catalog, cli, lab_report):
        assert (module.ROOT / "course.py").is_file() and (module.ROOT / "notebooks").is_dir(), module.__name__
    assert nccl_rules._COURSE == str(PKG.resolve()) + "/"
    import course_lib.lessons.l02_data_parallel.experiments as lesson
    assert payload._importable_by_workers(lesson) and payload._importable_by_workers(nccl_rules)
    env = torchrun.child_env(None, 1, "t")
    assert str(ROOT.resolve()) in env["PYTHONPATH"].split(":") and str(PKG.resolve()) not in env["PYTHONPATH"]
