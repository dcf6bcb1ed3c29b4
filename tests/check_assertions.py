"""What the tests of the lessons' graded checks assert about a check that fails (imported by test files; pytest puts
tests/ on the path)."""

import pytest

from course_lib.grading.check import CheckFailed


def fails_check(match: str, fn, *args):
    """``fn(*args)`` raises CheckFailed whose one-line message matches ``match`` and carries a hint; returns it."""
    with pytest.raises(CheckFailed, match=match) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg and "Hint:" in msg, msg
    return msg
