"""`course_lib.reference`: the course's answers are marked, and while graded they are refused to a learner's code.

In this process, code compiled under a file name that is not installed code plays the learner's cell; this file
plays the official test cell (`Guard.test_files`). tests/test_grading.py grades a cheating copy of every lesson.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading

import pytest

from course_lib import reference
from course_lib.grading import grade, kernel_guard
from course_lib import notebook as nbio
from course_lib.grading import authoring
from course_lib.runtime.launch import DistributedRunError, run
from course_lib.parallel import collectives, ddp, pipeline_schedules
from course_lib.theory import planner

HERE = __file__
LEARNER = "/tmp/ipykernel_0/1234.py"                 # where a kernel compiles a learner's cell


def learner(code: str, **names) -> dict:
    """Run ``code`` as a learner's cell would: compiled under a cell's file name, in a namespace of its own."""
    ns = {"__name__": "__main__", **names}
    exec(compile(code, LEARNER, "exec"), ns)
    return ns


def in_thread(fn):
    """``fn()`` on a thread of its own, whose call stack holds only installed code and this file: under
    pytest-xdist the main thread's outer frames are execnet's exec'd code, which the guard would count as the
    learner's (in a kernel or a rank they are all installed code)."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture
def guard():
    """The guard of a test cell of 00-partial-sum and 02-ring-all-reduce, this file being the test cell."""
    g = reference.Guard(frozenset({"00-partial-sum", "02-ring-all-reduce"}), frozenset({HERE}))
    before = reference.activate(g)
    yield g
    reference.activate(before)


def test_a_marked_function_is_the_function_outside_grading():
    assert reference.current() is None
    assert collectives.chunk_sizes(10, 3) == [4, 3, 3]
    assert collectives.chunk_sizes.__name__ == "chunk_sizes" and "ring chunks" in collectives.chunk_sizes.__doc__
    assert list(inspect.signature(collectives.chunk_sizes).parameters) == ["numel", "n"]
    source = inspect.getsource(collectives.chunk_sizes)        # IPython's ?? shows the course's code, marked
    assert source.startswith('@reference_for("00-partial-sum")\ndef chunk_sizes(') and "return" in source
    assert not hasattr(collectives.chunk_sizes, "__wrapped__")       # no back door to an unmarked copy
    assert getattr(collectives.chunk_sizes, reference.MARK) == {"00-partial-sum"}
    with pytest.raises(ValueError, match="'NN-name' ids"):
        reference.reference_for("stage memory")


def test_the_tests_own_call_works_and_a_learners_call_is_refused(guard):
    assert in_thread(lambda: collectives.chunk_sizes(10, 3)) == [4, 3, 3]   # the test computing its expectation
    ns = learner("def partial_sum(n, rank, w):\n    return chunk_sizes(n, w)[rank]\n",
                 chunk_sizes=collectives.chunk_sizes)
    with pytest.raises(reference.ReferenceCalled) as err:
        in_thread(lambda: ns["partial_sum"](10, 0, 3))
    assert str(err.value) == ("00-partial-sum calls course_lib.parallel.collectives.chunk_sizes, "
                              "the course's answer: write your own")
    assert guard.seen == [("00-partial-sum", "course_lib.parallel.collectives.chunk_sizes")]
    # course code called by the learner's code that calls the reference is caught too: the learner's frame is
    # further out on the stack (a wrapper of a wrapper, a method of a course class)
    ns = learner("def f():\n    return list(map(lambda n: chunk_sizes(n, 2), [4]))\n", chunk_sizes=collectives.chunk_sizes)
    with pytest.raises(reference.ReferenceCalled):
        in_thread(ns["f"])


def test_other_exercises_references_are_allowed(guard):
    ns = learner("def f():\n    return one_f_one_b_order(2, 2, 0)\n",
                 one_f_one_b_order=pipeline_schedules.one_f_one_b_order)          # 03's answer, not guarded now
    assert ns["f"]() == pipeline_schedules.one_f_one_b_order(2, 2, 0)


def test_a_learners_cell_ahead_of_the_tests_is_recorded_not_raised():
    g = reference.Guard(frozenset({"00-partial-sum"}), refuse=False)
    before = reference.activate(g)
    try:
        ns = learner("TABLE = {n: chunk_sizes(n, 3) for n in range(5)}\n", chunk_sizes=collectives.chunk_sizes)
    finally:
        reference.activate(before)
    assert ns["TABLE"][4] == [2, 1, 1]
    assert g.seen == [("00-partial-sum", "course_lib.parallel.collectives.chunk_sizes")]


def test_installed_code_and_generated_code_count_as_the_courses():
    frame = in_thread(inspect.currentframe)
    assert reference.called_by_learner(frame)                        # this file is not installed code
    assert not reference.called_by_learner(frame, frozenset({HERE}))
    ns = in_thread(lambda: learner("import sys\nframe = sys._getframe()\n"))
    assert reference.called_by_learner(ns["frame"], frozenset({HERE}))
    # code generated by an installed module (a dataclass's __init__, file '<string>') is that module's
    code = compile("import sys\ndef f():\n    return sys._getframe()\n", "<string>", "exec")
    course, cell = {"__name__": "course_lib.theory.planner"}, {"__name__": "__main__"}
    exec(code, course)
    exec(code, cell)
    assert not reference._learner_frame(course["f"](), frozenset())
    assert reference._learner_frame(cell["f"](), frozenset())          # exec in a learner's cell


@pytest.mark.parametrize("make", [
    lambda: collectives.ring_all_reduce,                                   # an alias
    lambda: functools.partial(collectives.ring_all_reduce, group=None),    # a partial
    lambda: functools.lru_cache(collectives.ring_all_reduce),              # a wrapper with __wrapped__
    lambda: collectives.ring_all_reduce.__call__,                          # the function's method-wrapper
    lambda: type("Ring", (), {"__call__": staticmethod(collectives.ring_all_reduce)})(),  # an object calling it
    lambda: type("DDP", (ddp.BucketedDDP,), {}),                            # a subclass
    lambda: type("DDP", (), {"finish_gradient_synchronization": ddp.BucketedDDP.finish_gradient_synchronization}),
], ids=["alias", "partial", "lru_cache", "method-wrapper", "callable-object", "subclass", "copied-method"])
def test_is_reference_sees_through_aliases(make):
    obj = make()
    found = reference.is_reference(obj, {"02-ring-all-reduce", "02-bucketed-ddp"})
    assert found in {"course_lib.parallel.collectives.ring_all_reduce", "course_lib.parallel.ddp.BucketedDDP"}
    assert reference.is_reference(obj, {"03-bubble"}) is None


def test_own_answers_are_not_references():
    def ring_all_reduce(tensor, group=None):
        return tensor
    assert reference.is_reference(ring_all_reduce, {"02-ring-all-reduce"}) is None
    assert reference.is_reference(type("Mine", (), {}), {"02-bucketed-ddp"}) is None
    assert reference.is_reference(planner, {"08-stage-memory"}) is None          # a module is not an answer
    assert reference.is_reference(42, {"00-quiz"}) is None


def _rank_test_calls_reference():
    """The official test's own function in a rank: its expectation from the reference."""
    import torch

    from course_lib import dist as cdist

    t = torch.arange(4.0, device=cdist.device())
    collectives.ring_all_reduce(t)
    return t.tolist()


def test_the_guard_goes_to_the_ranks(guard, tmp_path):
    assert run(_rank_test_calls_reference, nprocs=2, stream=False).returns == [[0.0, 2.0, 4.0, 6.0]] * 2
    ns = learner("def ring(t, group=None):\n"
                 "    from course_lib.parallel import collectives\n"
                 "    try:\n"
                 "        collectives.ring_all_reduce(t, group)\n"
                 "    except Exception:\n"
                 "        pass\n"          # caught inside the rank: the call is still recorded for the grader
                 "    return t\n"
                 "def rank_fn():\n"
                 "    import torch\n"
                 "    from course_lib import dist as cdist\n"
                 "    return ring(torch.ones(2, device=cdist.device())).tolist()\n")
    assert run(ns["rank_fn"], nprocs=2, stream=False).returns == [[1.0, 1.0]] * 2
    assert guard.seen == [("02-ring-all-reduce", "course_lib.parallel.collectives.ring_all_reduce")]
    guard.seen.clear()
    ns = learner("def rank_fn():\n"
                 "    import torch\n"
                 "    from course_lib import dist as cdist\n"
                 "    from course_lib.parallel import collectives\n"
                 "    return collectives.ring_all_reduce(torch.ones(2, device=cdist.device()))\n")
    with pytest.raises(DistributedRunError, match="02-ring-all-reduce calls course_lib.parallel.collectives."
                                                  "ring_all_reduce, the course's answer: write your own"):
        run(ns["rank_fn"], nprocs=2, stream=False)


class _Shell:
    """The part of IPython's shell that `kernel_guard.install` uses."""

    def __init__(self):
        self.user_ns, self.execution_count, self.hooks = {}, 1, {}
        self.events = self
        self.compile = self

    def register(self, event, fn):
        self.hooks[event] = fn

    def get_code_name(self, raw, transformed, number):
        return f"/tmp/ipykernel_0/{kernel_guard.cell_key(raw)[:8]}.py"

    def transform_cell(self, raw):
        return raw

    def run(self, source: str):
        self.hooks["pre_run_cell"](type("Info", (), {"raw_cell": source})())
        try:
            exec(compile(source, self.get_code_name(source, source, 0), "exec"), self.user_ns)
        finally:
            self.hooks["post_run_cell"](None)


def test_kernel_guard_refuses_an_alias_for_its_test_cell_only():
    solution = {"cells": [
        {"cell_type": "code", "source": "def chunk(n, w):\n    ### BEGIN SOLUTION\n    return []\n    ### END SOLUTION",
         "metadata": {}},
        {"cell_type": "code", "source": "# Test ex 00-partial-sum\nresult = chunk(10, 3)",
         "metadata": {"course": {"exercise": "00-partial-sum", "points": 1}}},
        {"cell_type": "code", "source": "# Test ex 00-quiz\nassert chunk is not None",
         "metadata": {"course": {"exercise": "00-quiz", "points": 1}}},
    ]}
    submission = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                             "source": "from course_lib.parallel.collectives import chunk_sizes as chunk"},
                            *solution["cells"][1:]]}
    assembled = grade.assemble(submission, solution)
    plan = json.loads(json.dumps(grade.guard_plan(assembled, solution)))       # as the runner sends it
    assert plan["answers"] == ["chunk"] and plan["lesson"] == ["00-partial-sum", "00-quiz"]
    shell = _Shell()
    kernel_guard.install(plan, shell)
    sources = [nbio.source(c) for c in assembled["cells"]]
    shell.run(sources[0])
    assert json.loads(kernel_guard.report()) == []                    # importing is not calling
    with pytest.raises(reference.ReferenceCalled, match="00-partial-sum calls course_lib.parallel.collectives"):
        shell.run(sources[1])
    assert json.loads(kernel_guard.report()) == [["00-partial-sum", "course_lib.parallel.collectives.chunk_sizes"]]
    assert shell.user_ns["chunk"] is collectives.chunk_sizes          # given back after the cell
    shell.run(sources[2])                                             # another exercise's test: nothing refused
    assert json.loads(kernel_guard.report()) == [] and reference.current() is None


def test_the_grader_reports_the_refused_exercise_only():
    official = {"cells": [
        {"cell_type": "code", "source": "x = 1", "metadata": {"course": {"exercise": "00-partial-sum", "points": 2}}},
        {"cell_type": "code", "source": "y = 1", "metadata": {"course": {"exercise": "00-quiz", "points": 1}}},
    ]}
    record = {"done": True, "cells": [
        {"index": 0, "status": "error", "ename": "DistributedRunError", "refused": [],
         "evalue": "rank 1 of 2 failed with ReferenceCalled: " + reference.message("00-partial-sum", "a.b")},
        {"index": 1, "status": "ok", "ename": "", "evalue": "", "refused": []},
    ]}
    rows = {r["exercise"]: r for r in grade.score(official, record)}
    assert rows["00-partial-sum"]["status"] == "refused: " + reference.message("00-partial-sum", "a.b")
    assert rows["00-partial-sum"]["points"] == 0 and rows["00-quiz"]["points"] == 1


def test_every_graded_exercise_with_a_course_answer_is_marked():
    """The exercises whose answer course_lib computes (tests/fixtures/grading/cheats.py lists a way to call each)
    are all marked; the ones with none are named here, so that a new exercise is a decision, not an omission."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(HERE).parent / "fixtures" / "grading"))
    from cheats import CHEATS

    exercises = set()
    for path in sorted(Path(HERE).parents[1].glob("solutions/*.ipynb")):
        exercises |= {i["exercise"] for i in map(authoring.test_info, nbio.read(path).cells) if i}
    no_course_answer = ({"00-distributed-sum", "01-classify-bound", "12-profile-ceiling"}
                        | {e for e in exercises if e.endswith("-quiz")})
    cheated = {e for lesson in CHEATS.values() for e in lesson}
    assert exercises - no_course_answer - cheated == set(), "exercises with a course answer but no cheat to try"
