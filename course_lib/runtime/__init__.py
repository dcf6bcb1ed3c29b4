"""Starting ranks: the one way the course starts processes (lesson 00), and what keeps them honest.

    from course_lib.runtime import run
    res = run(fn, nprocs=2, args=(...,))      # torchrun, gloo on CPU / NCCL with a GPU per rank
    res.returns                               # fn's return value on every rank

    launch.py        run, run_nodes, run_script: torchrun from a notebook cell, a structured result, one error
    torchrun.py      the torchrun command line, the ranks' environment, the run folder and its logs, how a job ended
    payload.py       a function and its arguments pickled by value for the ranks (notebook cells included)
    pool.py          warm ranks kept between runs; _pool_worker.py is what they run
    _worker.py       the program torchrun starts in every rank for `run`; _script.py the one for `run_script`
    procs.py         process-tree hygiene: nothing a run started outlives it
    gpus.py          ``--gpus 2,3``: the slice of a shared node a server or report sees
    nccl_rules.py    NCCL's rules checked on gloo (no CPU tensor in a collective, paired sends, ...)

May import: the core (``course_lib``'s root modules) and itself; nothing above (tests/test_layout.py).
"""

from course_lib.runtime.launch import (DistributedRunError, LaunchError, RunInterrupted, RunResult, RunTimeout, run,
                                       run_nodes, run_script)

__all__ = ["run", "run_nodes", "run_script", "RunResult", "DistributedRunError", "RunTimeout", "RunInterrupted",
           "LaunchError"]
