"""course.py, the set-up script (README's two commands): which tests `python3 course.py test ...` hands to pytest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def course(monkeypatch):
    spec = importlib.util.spec_from_file_location("course_script", ROOT / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    module.calls = calls
    return module


def _pytest_args(course, extra, fast=False):
    course.run_tests(list(extra), browser="", fast=fast)
    cmd = course.calls[-1]
    return cmd[cmd.index("pytest") + 1:]


@pytest.mark.parametrize("fast", [False, True])
def test_a_named_file_or_node_runs_alone(course, fast):
    args = _pytest_args(course, ["tests/test_launch.py::test_run_returns", "-x"], fast)
    assert "tests" not in args and "notebooks" not in args, args     # not the whole suite beside the named test
    assert "tests/test_launch.py::test_run_returns" in args and "-x" in args
    assert ("not slow" in args) == fast


@pytest.mark.parametrize("fast, paths", [(False, ["tests", "notebooks"]), (True, ["tests"])])
def test_without_a_named_test_everything_runs(course, fast, paths):
    args = _pytest_args(course, ["-k", "launch", "-n", "1"], fast)
    assert [a for a in args if a in ("tests", "notebooks")] == paths, args


def test_options_and_their_values_are_not_taken_for_tests(course):
    assert not course.names_a_test("-x") and not course.names_a_test("not slow")
    assert course.names_a_test("tests") and course.names_a_test("tests/test_cli.py::test_x")
    assert not course.names_a_test("tests/no_such_file.py")
