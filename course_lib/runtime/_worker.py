"""The program torchrun starts in every rank for `course_lib.runtime.launch.run`.

    python -m torch.distributed.run ... -m course_lib.runtime._worker RUN_DIR

It sends its output to RUN_DIR/rank{R}.log, sets the thread count, initialises the default process group,
runs the pickled function and writes RUN_DIR/result{R}.pkl (or error{R}.json with its own traceback).
Files are written atomically (temp file + rename), so a result that exists is complete.
Kept free of heavy imports before the log is set up, so start-up time can be measured.
"""

import os
import sys
import time

T_START = time.time()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when torchrun dies, so no worker outlives its launcher."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def redirect_output(log_path: str) -> None:
    """Point file descriptors 1 and 2 at the rank's log (C-level output included), line-buffered."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def report_failure(run_dir: str, rank: int, exc: BaseException) -> None:
    """Print the traceback into the rank's log and write RUN_DIR/error{rank}.json for the launcher."""
    import json
    import traceback

    tb = traceback.format_exc()
    sys.stderr.write(tb)
    sys.stderr.flush()
    err = {"rank": rank, "type": type(exc).__name__, "message": str(exc)[:2000],
           "traceback": tb[-20000:], "time": time.time()}
    write_atomic(os.path.join(run_dir, f"error{rank}.json"), json.dumps(err).encode())


def init_process_group(backend: str, timeout_s: float) -> None:
    """The default process group of a rank (gloo, or NCCL with the GPU set to LOCAL_RANK), every rank connected."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    # Every rank waits until the whole group is connected: under load, gloo's connectFullMesh can return on
    # a fast rank before a slow one has accepted the connection, and a fast rank that ran a function
    # without collectives and exited would then fail the slow one ("Connection closed by peer").
    wait_for_every_rank(backend)


def wait_for_every_rank(backend: str) -> None:
    """A barrier on the default group (on this rank's GPU under NCCL)."""
    import torch.distributed as dist

    if backend == "nccl":
        dist.barrier(device_ids=[int(os.environ["LOCAL_RANK"])])
    else:
        dist.barrier()


def run_job(run_dir: str, rank: int, timings: dict) -> None:
    """Run RUN_DIR/payload.pkl on this rank and write RUN_DIR/result{rank}.pkl (tensors moved to the CPU).
    Raises what the function raised; the caller reports it."""
    import cloudpickle
    import torch

    from course_lib import reference

    with open(os.path.join(run_dir, "payload.pkl"), "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    posts = None
    before = reference.enter_job(run_dir)                # while graded: the course's answers refused to the learner's
    try:
        if os.environ.get("COURSE_NCCL_RULES") == "1":  # the test command: check NCCL's rules on gloo
            from course_lib.runtime import nccl_rules

            with nccl_rules.enforced((args, kwargs)) as state:
                value = fn(*args, **kwargs)
            posts = state.groups                         # replayed by the launcher once every rank is done
        else:
            value = fn(*args, **kwargs)
    finally:
        reference.activate(before)
    timings["work_done"] = time.time()

    from course_lib import dist as cdist

    value = torch.utils._pytree.tree_map(
        lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)
    record = {"value": value, "timings": timings, "device": cdist.device_name(),
              "threads": torch.get_num_threads(), "p2p": posts}
    write_atomic(os.path.join(run_dir, f"result{rank}.pkl"), cloudpickle.dumps(record))
    sys.stdout.flush()


def main() -> int:
    die_with_parent()
    os.environ["COURSE_IN_RANK"] = "1"  # a run started inside a rank starts its own processes (no pool)
    run_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
    timings = {"process_start": T_START}

    import json

    try:
        import cloudpickle  # noqa: F401 - counted in the import time
        import torch
        import torch.distributed as dist

        timings["imports_done"] = time.time()
        settings = json.loads(open(os.path.join(run_dir, "settings.json")).read())
        torch.set_num_threads(settings["threads_per_rank"])
        init_process_group(settings["backend"], settings["pg_timeout_s"])
        timings["rendezvous_done"] = time.time()
        run_job(run_dir, rank, timings)
        # No rank leaves before every rank is done: a rank that exits while a slower one is still connecting to it
        # in a group the function creates (gloo's connectFullMesh) fails that one ("Connection closed by peer").
        wait_for_every_rank(settings["backend"])
        try:
            dist.destroy_process_group()
        except Exception:  # a peer that already left must not turn a success into a failure
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is on disk: skip the interpreter's slow teardown of torch
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, KeyboardInterrupt included
        report_failure(run_dir, rank, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
