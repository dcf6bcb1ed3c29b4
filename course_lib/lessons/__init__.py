"""One folder per lesson: the code behind each notebook, apart from the techniques it teaches.

    lessons/common.py          what several lessons share: small configs, a rank's rows of a batch, one-process
                               references, snapshots, errors, the training loop over sharded variants (05-07)
    lessons/lNN_<topic>/       experiments.py  functions the lesson runs (``rank_*`` run on every rank)
                               checks.py       what the graded exercises' test cells call
                               report.py       tables, figures and widgets

A technique itself (DDP, a pipeline schedule, tensor parallelism, ZeRO, ...) lives in `course_lib.parallel`, one
file each; formulas live in `course_lib.theory`. A new lesson adds one folder here, named after its notebook.
"""
