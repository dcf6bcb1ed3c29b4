"""Every coding exercise rejects the honest mistakes recorded for it (tests/fixtures/grading/mistakes/lNN.py).

Each mistake replaces the learner's answer in the solution notebook's namespace and runs the exercise's official
test cells: it must raise `CheckFailed` (the one-line message a learner reads) matching the mistake's `match`, while
the solution passes the same cells first. A class per lesson, so pytest-xdist's ``--dist loadscope`` spreads the
lessons over its workers; one solution namespace per lesson (its setup and answer cells run once).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

from course_lib.grading import authoring, build, similarity
from course_lib.grading.check import CheckFailed
from course_lib.notebook import source

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "grading" / "mistakes"
INDEPENDENT = ROOT / "solutions" / "independent"
MIN_PER_EXERCISE = 4
pytestmark = pytest.mark.slow


def _fixture(lesson: str):
    spec = importlib.util.spec_from_file_location(f"mistakes_l{lesson}", FIXTURES / f"l{lesson}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_mistakes(lesson: str) -> list[tuple[str, str, str, str]]:
    """``MISTAKES`` of tests/fixtures/grading/mistakes/l{lesson}.py: (exercise, what, code, match)."""
    return _fixture(lesson).MISTAKES


def load_accepted(lesson: str) -> list[tuple[str, str, str]]:
    """``ACCEPTED`` of the same file, where it has one: (exercise, what, code), right answers that differ from the
    solution in a choice the exercise's rules leave free; each must pass."""
    return getattr(_fixture(lesson), "ACCEPTED", [])


def load_independent(lesson: str) -> dict[str, str]:
    """``ANSWERS`` of solutions/independent/l{lesson}.py, where it exists: {exercise: answer cell}, right answers
    written without reading the solution (the noise floor of `course_lib.grading.similarity`); each must pass."""
    path = INDEPENDENT / f"l{lesson}.py"
    return similarity.read_answers(path) if path.exists() else {}


def top_level_names(code: str) -> set[str]:
    """The functions and classes a cell defines at its top level."""
    return {node.name for node in ast.parse(code).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def answer_cell_names(lesson: str, exercise: str) -> set[str]:
    """The functions and classes that the solution's answer cells of ``exercise`` define (those cells come after
    the previous exercise's test cells and before this one's)."""
    nb = json.loads(solution_of(lesson).read_text())
    return {name for i, ex in build.answer_exercises(nb).items() if ex == exercise
            for name in top_level_names(source(nb["cells"][i]))}


def solution_of(lesson: str) -> Path:
    (path,) = ROOT.glob(f"solutions/{lesson}_*.ipynb")
    return path


def coding_exercises(lesson: str) -> list[str]:
    cells = json.loads(solution_of(lesson).read_text())["cells"]
    found = [info["exercise"] for c in cells if (info := authoring.test_info(c))]
    return [e for e in dict.fromkeys(found) if not e.endswith("-quiz")]


class Lesson:
    """A solution notebook run as the grader's kernel runs it: every code cell but the tests, in order."""

    def __init__(self, lesson: str):
        self.cells = [c for c in json.loads(solution_of(lesson).read_text())["cells"] if c["cell_type"] == "code"]
        self.namespace = {"__name__": "__main__"}
        self.solution_passed: set[str] = set()          # exercises whose official cells the solution has passed
        with contextlib.redirect_stdout(io.StringIO()):
            for cell in self.cells:
                if authoring.test_info(cell) is None:
                    exec(compile(source(cell), f"<{lesson} solution>", "exec"), self.namespace)

    def run_tests(self, exercise: str, code: str | None = None) -> None:
        """The official test cells of ``exercise`` in a copy of the namespace, with ``code`` run first."""
        namespace = dict(self.namespace)
        tests = [source(c) for c in self.cells if (info := authoring.test_info(c)) and info["exercise"] == exercise]
        assert tests, f"no test cell for {exercise}"
        with contextlib.redirect_stdout(io.StringIO()):
            if code is not None:
                exec(compile(code, f"<mistake for {exercise}>", "exec"), namespace)
            for cell in tests:
                exec(compile(cell, f"<test of {exercise}>", "exec"), namespace)


def _lessons_with_fixtures() -> list[str]:
    return sorted(p.stem[1:] for p in FIXTURES.glob("l[0-9][0-9].py"))


def _cases(lesson: str) -> list:
    return [pytest.param(exercise, what, code, match, id=f"{exercise}: {what}")
            for exercise, what, code, match in load_mistakes(lesson)]


@pytest.fixture(scope="class")
def lesson(request) -> Lesson:
    return Lesson(request.cls.LESSON)


def _check_mistake(lesson: Lesson, exercise: str, what: str, code: str, match: str) -> None:
    if exercise not in lesson.solution_passed:                       # the solution passes the same cells (once)
        lesson.run_tests(exercise)
        lesson.solution_passed.add(exercise)
    with pytest.raises(CheckFailed) as caught:
        lesson.run_tests(exercise, code)
    message = str(caught.value)
    assert "\n" not in message and len(message) <= 600, f"{exercise} ({what}): not one line: {message!r}"
    assert re.search(match, message), f"{exercise} ({what}) failed, but not on the check expected: {message}"


def lesson_class(number: str):
    """A test class for lesson ``number``: every recorded mistake fails its exercise; every recorded other right
    answer passes it."""
    @pytest.mark.parametrize("exercise, what, code, match", _cases(number))
    def test_mistake_fails_its_exercise(self, lesson, exercise, what, code, match):
        _check_mistake(lesson, exercise, what, code, match)

    members = {"LESSON": number, "test_mistake_fails_its_exercise": test_mistake_fails_its_exercise}
    accepted = [pytest.param(e, w, c, id=f"{e}: {w}") for e, w, c in load_accepted(number)]
    if accepted:
        @pytest.mark.parametrize("exercise, what, code", accepted)
        def test_other_right_answer_passes(self, lesson, exercise, what, code):
            lesson.run_tests(exercise, code)

        members["test_other_right_answer_passes"] = test_other_right_answer_passes
    independent = [pytest.param(e, c, id=f"{e}: independent") for e, c in load_independent(number).items()]
    if independent:
        @pytest.mark.parametrize("exercise, code", independent)
        def test_independent_answer_passes(self, lesson, exercise, code):
            missing = answer_cell_names(number, exercise) - top_level_names(code)
            assert not missing, f"{exercise}: the independent answer does not define {sorted(missing)}"
            lesson.run_tests(exercise, code)

        members["test_independent_answer_passes"] = test_independent_answer_passes
    return type(f"TestLesson{number}", (), members)


for _number in _lessons_with_fixtures():
    globals()[f"TestLesson{_number}"] = lesson_class(_number)


def test_every_coding_exercise_has_four_recorded_mistakes():
    """Lessons 00-11: each coding exercise of each solution notebook has at least four mistakes on record."""
    short = {}
    for path in sorted(ROOT.glob("solutions/[0-9][0-9]_*.ipynb")):
        number = path.name[:2]
        have = [m[0] for m in load_mistakes(number)] if (FIXTURES / f"l{number}.py").exists() else []
        for exercise in coding_exercises(number):
            if have.count(exercise) < MIN_PER_EXERCISE:
                short[exercise] = have.count(exercise)
    assert not short, f"exercises with fewer than {MIN_PER_EXERCISE} recorded mistakes: {short}"


def test_the_runner_catches_a_mistake_that_passes_and_one_that_fails_elsewhere():
    """The runner itself: a 'mistake' that is the solution fails the test; so does one caught by another check."""
    lesson = Lesson("00")
    solution = source(next(c for c in lesson.cells if "def partial_sum" in source(c)))
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        _check_mistake(lesson, "00-partial-sum", "the solution itself", solution, ".")
    off_by_one = "def partial_sum(n, rank, world_size):\n    return 0\n"
    with pytest.raises(AssertionError, match="not on the check expected"):
        _check_mistake(lesson, "00-partial-sum", "returns 0", off_by_one, "no check is named like this")
