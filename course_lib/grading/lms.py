"""``course grade --lms-csv OUT``: a gradebook a learning-management system imports.

One row per student: ``student``, one column per exercise (its points), ``total``. The student is the
identifier `grade.student_name` takes from the submission's place (docs/GRADING.md, "Who is the student"): the
first folder under the class folder given (``class/s1234567/lesson.ipynb`` -> ``s1234567``), else the file name
without ``.ipynb`` (``class/s1234567.ipynb`` -> ``s1234567``), so name the folders or files by the LMS's student
id. A submission that could not be graded gets 0 everywhere (its reason is in ``--csv``/``--json``). The columns
are the exercises in the lesson's order; the maximum of each is in ``--csv``/``--json``. ``--csv`` keeps its
columns (student, submission, lesson, points, max, status, exercises, sandbox) for existing consumers.
"""

from __future__ import annotations

import csv
from pathlib import Path

from course_lib.grading.grade import exercise_columns


def write(results: list[dict], path: str | Path) -> None:
    exercises = exercise_columns(results)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", *exercises, "total"])
        for res in results:
            pts = {r["exercise"]: r["points"] for r in res["exercises"]}
            w.writerow([res.get("student", Path(res["submission"]).stem), *(f"{pts.get(e, 0):g}" for e in exercises),
                        f"{res['points']:g}"])
