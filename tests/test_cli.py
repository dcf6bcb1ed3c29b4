"""The `course` command: doctor runs a real job; run executes a notebook and reports a failing cell."""

from __future__ import annotations

import subprocess
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from course_lib.instructor import cli
from course_lib.measure import comparisons
from course_lib.runtime import procs


def test_doctor_passes_and_names_where_time_went(capsys):
    assert cli.doctor() == 0
    out = capsys.readouterr().out
    assert "OK: this machine can run the course." in out
    assert "2 ranks, backend gloo" in out or "backend nccl" in out
    assert "imports (torch)" in out
    assert "grading sandbox" in out and ("bubblewrap" in out)       # available, or how to install it


def _notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_run_keeps_executed_copy_and_fails_on_error(tmp_path, capsys, monkeypatch):
    good = _notebook(tmp_path / "01_good.ipynb", "x = 6 * 7", "print('answer', x)",
                     "from course_lib.measure.comparisons import compare\ncompare('x', x, 42, rtol=0, hardware='test')")
    assert cli.run_notebook(good, tmp_path / "out") == 0
    executed = nbformat.read(tmp_path / "out" / "01_good.executed.ipynb", as_version=4)
    assert executed.cells[1].outputs[0]["text"] == "answer 42\n"
    assert "1/1 comparisons within tolerance" in capsys.readouterr().out
    [recorded] = comparisons.load(tmp_path / "out" / "01_good.comparisons.jsonl")  # beside the executed copy
    assert (recorded.name, recorded.status, recorded.lesson) == ("x", "pass", "01")

    # A notebook that starts a torchrun job and then fails: exit 1, the failing cell named, nothing left behind.
    bad = _notebook(tmp_path / "02_bad.ipynb",
                    "from course_lib.runtime.launch import run\n"
                    "def f():\n    import time; time.sleep(600)\n"
                    "import threading\n"
                    "threading.Thread(target=lambda: run(f, 2, stream=False), daemon=True).start()\n"
                    "import time; time.sleep(8)",
                    "raise ValueError('cell two is broken')",
                    "print('never')")
    outer = procs.new_tag("testcli")
    monkeypatch.setenv(procs.TAG_VAR, outer)  # every process of the run inherits it (tags nest)
    assert cli.run_notebook(bad, tmp_path / "out") == 1
    assert "cell 1: ValueError: cell two is broken" in capsys.readouterr().out
    assert procs.tagged_processes(outer) == []


def test_cli_entry_points():
    out = subprocess.run([sys.executable, "-m", "course_lib.instructor.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("doctor", "lab", "run", "build", "grade", "lab-report"):
        assert command in out.stdout
    bad = subprocess.run([sys.executable, "-m", "course_lib.instructor.cli", "run", "77"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no lesson 77" in bad.stderr
