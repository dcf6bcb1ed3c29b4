"""One folder per lesson: the code behind each notebook, apart from the techniques it teaches.

    lessons/display.py         what several lessons share: showing the course's code, predictions, colours
    lessons/sizes.py           experiment sizes per device (`by_device`, `sizes_label`)
    lessons/errors.py          errors between two runs (`relative_error`, ...)
    lessons/variants.py        the training loop over the sharded variants of lessons 05-07
    lessons/quizzes.py         quizzes checked by code
    lessons/lNN_<topic>/       experiments.py  functions the lesson runs (``rank_*`` run on every rank)
                               checks.py       what the graded exercises' test cells call
                               report.py       tables, figures and widgets

A technique itself (DDP, a pipeline schedule, tensor parallelism, ZeRO, ...) lives in `course_lib.parallel`, one
file each; formulas live in `course_lib.theory`. A new lesson adds one folder here, named after its notebook.
May import: everything below it (the core, runtime, measure, theory, parallel, training, grading) and itself, never
`course_lib.instructor`; a lesson's folder imports no other lesson's folder (tests/test_layout.py).
"""
