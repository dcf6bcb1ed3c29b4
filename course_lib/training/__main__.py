"""``python -m course_lib.training`` (or ``torchrun ... -m course_lib.training``): the training script's command
line (`course_lib.training.command`)."""

import sys

from course_lib.training.command import main

sys.exit(main())
