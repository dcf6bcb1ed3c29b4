"""lessons.display's readings: held back until a prediction is written (a learner's first run, the browser test), run
without one under COURSE_READINGS=1 (the test command sets it, so nbval runs every reading), and `shown` formats a
prediction that may still be None."""

from __future__ import annotations

import pytest

from course_lib.lessons.display import READINGS_VAR, after_prediction, shown


def test_a_reading_waits_for_its_prediction_unless_readings_are_asked_for(monkeypatch, capsys):
    ran = []
    monkeypatch.delenv(READINGS_VAR, raising=False)
    assert after_prediction(None, lambda: ran.append(1)) is False
    assert after_prediction({"a": 1, "b": None}, lambda: ran.append(2)) is False
    assert ran == [] and "write your prediction" in capsys.readouterr().out
    assert after_prediction({"a": 1, "b": 2}, lambda: ran.append(3)) is True and ran == [3]
    monkeypatch.setenv(READINGS_VAR, "1")
    assert after_prediction(None, lambda: ran.append(4)) is True and ran == [3, 4]
    out = capsys.readouterr().out
    assert "shown without a prediction" in out and "write your prediction" not in out


def test_shown_formats_a_prediction_or_says_there_is_none():
    assert shown(None, ".3f") == "-" and shown(None, "+.2%", of=lambda p: 2 / p - 1) == "-"
    assert shown(0.25, ".3f") == "0.250" and shown(4, "+.0%", of=lambda p: 5 / p - 1) == "+25%"
    assert shown(1e6, of=lambda p: f"{p / 1e6:g} MB") == "1 MB"
    with pytest.raises(ValueError):
        shown("x", ".3f")


def test_the_browser_tests_lab_runs_lessons_as_a_learner_does():
    """The browser test's JupyterLab leaves COURSE_READINGS out of its kernels' environment (the name it strips is
    display's)."""
    import inspect

    from course_lib.instructor import browser

    assert f'"{READINGS_VAR}"' in inspect.getsource(browser.Lab.start)
