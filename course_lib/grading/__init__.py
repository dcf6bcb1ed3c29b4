"""Graded exercises: author once in ``solutions/``, generate ``exercises/``, grade submissions.

- `course_lib.grading.check`: the checks test cells call (``check_close``, ``check_equal``, ...).
- `course_lib.grading.authoring`: the authoring format: answer regions, test cells (notebook I/O: `course_lib.notebook`).
- `course_lib.grading.build`: ``course build`` (solutions -> exercises).
- `course_lib.grading.grade`: ``course grade`` (run a submission with the official tests restored).
- `course_lib.grading.sandbox`: where ``course grade`` runs each submission (bubblewrap, memory and process caps).
- `course_lib.grading.jobs`: a class: checked before anything runs, graded ``--jobs N`` at a time, Ctrl-C.
- `course_lib.grading.shards`: ``--shard K/N`` and ``course grade merge``; `course_lib.grading.regrade`: ``--exercise``;
  `course_lib.grading.feedback`: ``--feedback``; `course_lib.grading.lms`: ``--lms-csv``.

See docs/GRADING.md for the authoring format and the instructor guide.
May import: the core (notebook I/O, the marks of `course_lib.reference`), `course_lib.runtime` (process hygiene) and
itself; grading knows no technique and no lesson (tests/test_layout.py).
"""
