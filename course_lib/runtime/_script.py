"""The program torchrun starts in every rank for `course_lib.runtime.launch.run_script`.

    python -m torch.distributed.run ... -m course_lib.runtime._script RUN_DIR SCRIPT [ARGS...]

Same log, thread and error handling as `course_lib.runtime._worker`, but it runs a script as ``__main__``;
the script initialises its own process group.
"""

import os
import runpy
import sys
import time

from course_lib.runtime._worker import T_START, die_with_parent, redirect_output, report_failure, write_atomic


def main() -> int:
    die_with_parent()
    run_dir, script, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
    import pickle

    timings = {"process_start": T_START}
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        import torch

        torch.set_num_threads(threads)
        timings["imports_done"] = timings["rendezvous_done"] = time.time()
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        timings["work_done"] = time.time()
        record = {"value": None, "timings": timings, "device": None, "threads": threads}
        write_atomic(os.path.join(run_dir, f"result{rank}.pkl"), pickle.dumps(record))
        return 0
    except BaseException as exc:  # noqa: BLE001
        report_failure(run_dir, rank, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
