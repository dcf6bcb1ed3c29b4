"""Copied answers (issue 48; `course_lib.grading.similarity`, docs/GRADING.md "Copied answers").

A class of lesson 02 is built from the student copy with answers put in its stub cells (nothing runs: similarity
reads text only):
- ``paster`` pastes the course's ring all-reduce (`course_lib.parallel.collectives.ring_all_reduce`) verbatim;
- ``disguiser`` pastes it with two statements swapped, every local name changed, comments and spaces added;
- ``second`` answers every exercise independently (tests/fixtures/grading/similarity/l02_second.py), and is
  compared, beside the course's code and the official solution, with solutions/independent/l02.py (the other
  independent answer: both written by helpers who read neither the solution nor the course's implementation);
- ``borrower`` copies ``second``'s 02-grad-accum with two statements swapped and names changed.
The three copies are flagged against their source; the honest answer reaches no flag against the course's solution or
code, and no more does lesson 09's. The CLI (``--jobs``, shards and ``merge``) is
tested in tests/test_grading_scale.py.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import io
import json
import tokenize
from pathlib import Path

import pytest

from course_lib.grading import authoring, build, grade, similarity
from course_lib.notebook import source

ROOT = Path(__file__).resolve().parents[1]
SECOND = ROOT / "tests" / "fixtures" / "grading" / "similarity"
RING = "course_lib.parallel.collectives.ring_all_reduce"


def rename_locals(src: str) -> str:
    """``src`` with every name it binds (but imports, builtins, ``self`` and top-level definitions, which the tests
    call) renamed, every comment replaced, a space put after each comma and a blank line after each line."""
    tree = ast.parse(src)
    keep = set(dir(builtins)) | {"self", "cls"}
    keep |= {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    keep |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    new = {b: f"my_{i}" for i, b in enumerate(sorted(bound - keep))}
    tokens = list(tokenize.generate_tokens(io.StringIO(src).readline))
    lines = src.split("\n")
    edits, depth = [], 0                                  # (row, col, end col, text), applied right to left
    for i, t in enumerate(tokens):
        depth += t.string in "([{" if t.type == tokenize.OP else 0
        depth -= t.string in ")]}" if t.type == tokenize.OP else 0
        prev = tokens[i - 1].string if i else ""
        keyword_arg = depth > 0 and i + 1 < len(tokens) and tokens[i + 1].string == "=" and prev in ",("
        if t.type == tokenize.NAME and t.string in new and prev != "." and not keyword_arg:
            edits.append((t.start[0], t.start[1], t.end[1], new[t.string]))
        elif t.type == tokenize.COMMENT:
            edits.append((t.start[0], t.start[1], t.end[1], "# a note of my own"))
        elif t.type == tokenize.OP and t.string == "," and t.end[1] < len(lines[t.start[0] - 1]):
            edits.append((t.start[0], t.start[1], t.end[1], ", "))
    for row, col, end, text in sorted(edits, reverse=True):
        lines[row - 1] = lines[row - 1][:col] + text + lines[row - 1][end:]
    renamed = "\n\n".join(lines)
    compile(renamed, "renamed", "exec")
    return renamed


class Lesson:
    def __init__(self, number: str):
        self.solutions = grade.Solutions(ROOT / "solutions")
        self.stem = next(s for s in self.solutions.notebooks if s.startswith(number))
        self.official = self.solutions.notebooks[self.stem]
        self.student = build.make_exercise(self.official, self.stem)
        self.owner = {i: ex for ex, cells in build._exercise_cells(self.student).items() for i in cells}

    def submission(self, answers: dict[str, str]):
        """The student copy with each exercise's stub cells replaced by ``answers[exercise]`` (its first stub cell
        takes the answer, the others are emptied)."""
        nb = copy.deepcopy(self.student)
        done = set()
        for i, cell in enumerate(nb["cells"]):
            ex = self.owner.get(i)
            if ex in answers and "raise NotImplementedError(" in source(cell):
                cell["source"] = "" if ex in done else answers[ex]
                done.add(ex)
        return nb

    def result(self, student: str, answers: dict[str, str]) -> dict:
        assembled = grade.assemble(self.submission(answers), self.official)
        return {"student": student, "submission": f"{student}.ipynb", "status": "graded", "lesson": self.stem,
                "answers": similarity.learner_code(assembled, self.official, self.stem)}


@pytest.fixture(scope="module")
def lesson02():
    return Lesson("02")


def ring_cell(lesson: Lesson) -> str:
    """The student copy's ring cell with the course's ring all-reduce pasted over the learner's function."""
    from course_lib.parallel import collectives

    stub = next(source(c) for i, c in enumerate(lesson.student["cells"])
                if lesson.owner.get(i) == "02-ring-all-reduce" and "raise NotImplementedError(" in source(c))
    head = stub[: stub.index("def ring_all_reduce")]
    return head + inspect.getsource(collectives.ring_all_reduce).replace("@reference_for(\"02-ring-all-reduce\")\n", "")


def swap_two_statements(code: str) -> str:
    """``code`` (an answer cell) with the first two neighbouring simple statements of a function body swapped that
    neither reads what the other writes."""
    tree = ast.parse(code)
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for a, b in zip(fn.body, fn.body[1:]):
            if not all(isinstance(s, (ast.Assign, ast.AugAssign, ast.Expr)) for s in (a, b)):
                continue
            names = [{n.id for n in ast.walk(s) if isinstance(n, ast.Name)} for s in (a, b)]
            if isinstance(a, ast.Expr) and isinstance(a.value, ast.Constant):
                continue                                               # a docstring
            if names[0] & names[1]:
                continue
            lines = code.split("\n")
            first = lines[a.lineno - 1: a.end_lineno]
            second = lines[b.lineno - 1: b.end_lineno]
            lines[a.lineno - 1: b.end_lineno] = second + first
            return "\n".join(lines)
    raise AssertionError("no two independent neighbouring statements to swap")


@pytest.fixture(scope="module")
def class02(lesson02):
    second = similarity.read_answers(SECOND / "l02_second.py")
    ring = ring_cell(lesson02)
    borrowed = rename_locals(swap_two_statements(second["02-grad-accum"]))
    assert borrowed != second["02-grad-accum"]
    results = [lesson02.result("paster", {"02-ring-all-reduce": ring}),
               lesson02.result("disguiser", {"02-ring-all-reduce": rename_locals(swap_two_statements(ring))}),
               lesson02.result("second", second),
               lesson02.result("borrower", {"02-grad-accum": borrowed})]
    report = similarity.class_report(results, lesson02.solutions)
    return {r["student"]: r["similarity"] for r in results}, report


def test_a_pasted_course_implementation_is_flagged_plain_or_disguised(class02):
    sim, _ = class02
    for who in ("paster", "disguiser"):
        got = sim[who]["02-ring-all-reduce"]
        assert got["flagged"] and got["score"] >= 0.9, (who, got)
        assert RING in dict(got["matches"]) and dict(got["matches"])[RING] >= 0.9, (who, got)


def test_a_classmates_answer_reordered_and_renamed_is_flagged_both_ways(class02):
    sim, _ = class02
    for who, other in (("borrower", "second"), ("second", "borrower")):     # who copied is for you to judge
        got = sim[who]["02-grad-accum"]
        assert got["flagged"] and got["source"] == f"classmate {other}" and got["score"] >= 0.9, (who, got)


def course_matches(row: dict) -> list:
    """The sources at or above the exercise's flag that are the course's: its solution or its code."""
    return [m for m in row["matches"] if m[0] == similarity.SOLUTION or m[0].startswith("course_lib.")]


def test_two_honest_independent_answers_are_not_flagged(class02):
    """``second`` (a helper's answer) against the official solution (the course author's) and the course's code: no
    exercise reaches its flag. (The noise floor is another helper's answer against the solution, so this pair is
    not the one the flag is set from.) Against that other helper's answer it is flagged on two exercises: two
    answers written by the same language model from the same text are as alike as copies (docs/GRADING.md)."""
    sim, report = class02
    assert not any(course_matches(v) for v in sim["second"].values()), similarity.table(report)
    assert all(report["exercises"][ex]["noise_floor"] is not None for ex in sim["second"])


def test_nothing_written_is_nothing_compared(lesson02):
    res = lesson02.result("blank", {})
    assert set(res["answers"]) == {"02-average-gradients", "02-ring-all-reduce", "02-bucketed-ddp", "02-grad-accum"}
    assert all(code == "" for code in res["answers"].values())          # the given code and the stubs are not hers
    similarity.class_report([res], lesson02.solutions)
    assert not any(v["scored"] or v["flagged"] for v in res["similarity"].values())


def test_the_official_solution_handed_in_is_flagged_against_itself(lesson02):
    res = {**lesson02.result("x", {}), "answers": similarity.learner_code(lesson02.official, lesson02.official,
                                                                          lesson02.stem)}
    similarity.class_report([res], lesson02.solutions)
    assert all(v["source"] == similarity.SOLUTION and v["score"] == 1.0 and v["flagged"]
               for v in res["similarity"].values()), res["similarity"]


def test_lesson_09s_independent_answers_are_not_flagged_against_the_course():
    lesson = Lesson("09")
    results = [lesson.result("second", similarity.read_answers(SECOND / "l09_second.py"))]
    report = similarity.class_report(results, lesson.solutions)
    assert not any(course_matches(v) for v in results[0]["similarity"].values()), similarity.table(report)


def test_every_marked_implementation_is_a_source_read_without_importing():
    found = similarity.marked_sources()
    assert RING in found["02-ring-all-reduce"]
    assert found["02-ring-all-reduce"][RING].startswith("def ring_all_reduce(")       # the decorator is not code
    assert "course_lib.theory.planner.stage_memory.stage_params" in found["08-stage-memory"]


def test_the_report_shows_the_pair_side_by_side_offline_and_the_csv_cells(class02, tmp_path):
    sim, report = class02
    html_path, json_path = similarity.write(report, tmp_path)
    page = html_path.read_text()
    assert "paster vs " + RING in page and "<mark class='a'>" in page and "<mark class='b'>" in page
    assert "http" not in page                                             # nothing fetched: it renders offline
    data = json.loads(json_path.read_text())
    assert data["exercises"]["02-ring-all-reduce"]["rows"][0]["student"] == "paster"
    score, flags = similarity.csv_cells({"similarity": sim["paster"]})
    assert float(score) >= 0.9 and flags.startswith("02-ring-all-reduce: ") and RING in flags
    assert similarity.csv_cells({"similarity": {"x": {**sim["paster"]["02-ring-all-reduce"], "flagged": False}}})[1] == ""


def test_every_lesson_has_its_noise_floors_and_docs_grading_prints_them():
    """Each coding exercise has an independent answer, hence a floor; docs/GRADING.md's table holds these floors."""
    solutions = grade.Solutions(ROOT / "solutions")
    table = {}
    for line in (ROOT / "docs" / "GRADING.md").read_text().splitlines():
        if line.startswith("| ") and line[2:4].isdigit() and "floors" not in line:
            table[line[2:4]] = line.split("|")[2].strip()
    for stem, official in solutions.notebooks.items():
        sources, floors = similarity._sources(solutions, stem)
        assert set(floors) == set(sources), f"{stem}: exercises without an independent answer: " \
                                            f"{sorted(set(sources) - set(floors))}"
        short = {ex for ex, code in similarity.solution_answers(official).items()
                 if similarity._Print(code).size < similarity.MIN_CHARS}
        printed = ", ".join(f"{ex[3:]} {'short' if ex in short and floors[ex] == 0 else f'{floors[ex]:.2f}'}"
                            for ex in sources)
        assert table.get(stem[:2]) == printed, f"docs/GRADING.md's floors of lesson {stem[:2]}: {printed}"


def test_a_paste_in_another_cell_after_a_stray_quote_or_with_its_tests_deleted_is_found(lesson02):
    """Code belongs to the exercise whose tests follow it; the course's answers to every exercise are compared."""
    ring = ring_cell(lesson02)
    elsewhere = lesson02.result("a", {"02-average-gradients": ring, "02-ring-all-reduce": "pass"})
    nb = lesson02.submission({"02-ring-all-reduce": ring})
    at = next(i for i, c in enumerate(lesson02.student["cells"]) if "raise NotImplementedError" in source(c)
              and lesson02.owner.get(i) == "02-ring-all-reduce")
    nb["cells"].insert(at, {**copy.deepcopy(nb["cells"][at]), "source": '"""'})        # a cell that does not parse
    quoted = {"student": "b", "submission": "b", "status": "graded", "lesson": lesson02.stem,
              "answers": similarity.learner_code(grade.assemble(nb, lesson02.official), lesson02.official,
                                                 lesson02.stem)}
    nb = lesson02.submission({"02-ring-all-reduce": ring})
    nb["cells"] = [c for c in nb["cells"] if (authoring.test_info(c) or {}).get("exercise") != "02-ring-all-reduce"]
    deleted = {**quoted, "student": "c", "answers": similarity.learner_code(grade.assemble(nb, lesson02.official),
                                                                            lesson02.official, lesson02.stem)}
    for res in (elsewhere, quoted, deleted):
        similarity.class_report([res], lesson02.solutions)
        hits = [name for v in res["similarity"].values() for name, _ in v["matches"]]
        assert any(name.startswith(RING) for name in hits), (res["student"], res["similarity"])


def test_the_report_escapes_what_a_submission_writes(lesson02, tmp_path):
    evil = "<script>alert(1)</script>"
    res = lesson02.result(evil, {"02-ring-all-reduce": ring_cell(lesson02) + f"\nx = '</pre>{evil}'\n"})
    report = similarity.class_report([res], lesson02.solutions)
    page = similarity.write(report, tmp_path)[0].read_text()
    assert evil not in page and "&lt;script&gt;" in page
