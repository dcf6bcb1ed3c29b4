"""Execute one assembled submission, cell by cell, in a fresh kernel; survive the kernel's death.

Run by `course_lib.grading.grade` in its own subprocess (``python -m course_lib.grading.runner PLAN``)
whose environment carries a unique ``COURSE_PROC_TAG``, so that the grader can kill everything the
submission started afterwards. This module only executes and records; scoring is in ``grade.py``.
The record goes to a file descriptor the grader passes (``record_fd``), which the kernel can neither inherit
nor reach through /proc: the submission can kill the runner, not forge its record.

Per code cell it records ``status``: ``ok`` | ``error`` (with ``ename``/``evalue``) | ``timeout`` |
``died`` | ``not-run`` (the total time limit was reached) | ``skipped`` (a test cell of an exercise that an earlier
test cell failed, or whose answer called the course's: it scores zero whatever follows), and ``limit`` (``memory`` | ``processes``) when
the sandbox's cgroup hit that cap during the cell (`course_lib.grading.sandbox`), and ``refused``: the calls of the
learner's code to the course's own answers that the kernel's guard refused or recorded in the cell
(`course_lib.grading.kernel_guard`, from the plan's ``guard``). When a cell times out, kills
the kernel or hits a cap, the kernel and all its descendants are killed, a new kernel is started, the earlier
non-test cells that ran fine are replayed (test cells are not), and execution goes on after the failed cell.
Captured output is capped per cell (``output_limit`` bytes), so a 50 MB print cannot fill the memory.
"""

from __future__ import annotations

import ast
import json
import os
import resource
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from course_lib.runtime import procs
from course_lib.grading import sandbox

TRUNCATED = "\n[output truncated by the grader]\n"


class CappedClient(NotebookClient):
    """nbclient that keeps at most ``output_limit`` bytes of stream/display output per cell.

    Error outputs are always kept (their traceback shortened): the grader needs ename/evalue.
    """

    output_limit = 1_000_000
    guard_plan: dict | None = None      # `kernel_guard.install`'s plan (from the grader), or None: no guard

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._bytes: dict[int, int] = {}

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        if msg["msg_type"] == "error":
            content["traceback"] = [line[:2000] for line in content.get("traceback", [])[-20:]]
            content["evalue"] = str(content.get("evalue", ""))[:20_000]
            return super().output(outs, msg, display_id, cell_index)
        size = len(json.dumps(content.get("data", content.get("text", "")), default=str))
        used = self._bytes.get(cell_index, 0)
        self._bytes[cell_index] = used + size
        if used + size <= self.output_limit:
            return super().output(outs, msg, display_id, cell_index)
        if used <= self.output_limit:  # first overflow: say so once, in place of the rest
            outs.append(nbformat.v4.new_output("stream", name="stderr", text=TRUNCATED))
        return None


def _kernel_pid(client: NotebookClient) -> int | None:
    km = getattr(client, "km", None)
    prov = getattr(km, "provisioner", None)
    proc = getattr(prov, "process", None)
    return getattr(proc, "pid", None)


# Run in the kernel before the submission: caps what one cell can print, inside the kernel, so that a 50 MB
# print never crosses ZeroMQ into the grader (the CappedClient cap alone still receives every message).
# The cap is (re)installed at the start of every cell: IPython >= 9 wraps each stream's `write` for the
# duration of a cell (`InteractiveShell._tee`) and restores the original afterwards, which silently drops
# a wrapper installed once.
_KERNEL_OUTPUT_CAP = """
def _course_cap_output(limit):
    import sys
    state = {"n": 0, "said": False}

    def capped(original):
        def write(text, *args, **kwargs):
            state["n"] += len(text)
            if state["n"] <= limit:
                return original(text, *args, **kwargs)
            if not state["said"]:
                state["said"] = True
                original("\\n[output truncated by the grader]\\n")
            return len(text)
        write._course_capped = True
        return write

    def install(*args, **kwargs):
        state["n"], state["said"] = 0, False
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not getattr(stream.write, "_course_capped", False):
                stream.write = capped(stream.write)

    get_ipython().events.register("pre_run_cell", install)
    install()

_course_cap_output(%d)
del _course_cap_output
"""


def _start(client: NotebookClient) -> None:
    """A new kernel, tagged so that `_stop` also finds what it double-forks; the first the OOM killer takes."""
    client.km = client.create_kernel_manager()
    client.kernel_tag = procs.new_tag("kernel")
    client.start_new_kernel(env={**os.environ, procs.TAG_VAR: procs.nested_tag(client.kernel_tag)})
    client.start_new_kernel_client()
    try:
        Path(f"/proc/{_kernel_pid(client)}/oom_score_adj").write_text("1000")
    except OSError:  # not Linux
        pass
    from jupyter_core.utils import run_sync

    run_sync(client.kc.execute_interactive)(_KERNEL_OUTPUT_CAP % client.output_limit, silent=True,
                                            store_history=False, timeout=60)
    if client.guard_plan is not None:   # the course's answers refused to the learner's code (kernel_guard)
        run_sync(client.kc.execute_interactive)(_GUARD_INSTALL % json.dumps(json.dumps(client.guard_plan)),
                                                silent=True, store_history=False, timeout=60)


_GUARD_INSTALL = "__import__('course_lib.grading.kernel_guard', fromlist=['install']).install(__import__('json').loads(%s))"
_GUARD_REPORT = "__import__('course_lib.grading.kernel_guard', fromlist=['report']).report()"


def _refused(client: NotebookClient) -> list:
    """The calls to the course's answers that the kernel's guard refused or recorded during the last cell."""
    from jupyter_core.utils import run_sync

    try:
        reply = run_sync(client.kc.execute_interactive)("", silent=True, store_history=False, timeout=30,
                                                        user_expressions={"refused": _GUARD_REPORT})
        out = reply["content"]["user_expressions"]["refused"]
        return json.loads(ast.literal_eval(out["data"]["text/plain"])) if out.get("status") == "ok" else []
    except Exception:  # noqa: BLE001 - a dead or busy kernel: nothing recorded for this cell
        return []


def _stop(client: NotebookClient, sandboxed: bool = False) -> None:
    """Kill the kernel and all it started. In the sandbox, also every other process of the sandbox's pid namespace
    but this runner and its init, until none is left: a fork bomb's children can outrun a few sweeps, and the
    survivors would hold the process cap so that the next kernel cannot start (bench_class found it)."""
    procs.kill_tree(_kernel_pid(client), tag=getattr(client, "kernel_tag", None), grace_s=0.0, sweeps=20)
    if sandboxed:
        _kill_namespace()
    try:
        client._cleanup_kernel()
    except Exception:  # noqa: BLE001 - the kernel is gone either way
        client.km, client.kc = None, None


def _kill_namespace(limit_s: float = 30.0) -> None:
    """SIGKILL every process this runner sees except itself and its ancestors (in the sandbox: its pid namespace,
    whose init is pid 1), again and again until none is left or ``limit_s`` has passed."""
    import psutil

    if psutil.Process(1).name() != "bwrap":      # not bubblewrap's pid namespace: never kill the machine's processes
        return
    keep = {os.getpid(), 1, *(p.pid for p in psutil.Process().parents())}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        others = [p for p in psutil.process_iter() if p.pid not in keep]
        if not others:
            return
        for p in others:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(others, timeout=0.2)


def peak_rss_mb() -> float:
    """This process's own peak resident memory (MB).

    ``/proc/self/status`` VmHWM where Linux has it: ``ru_maxrss`` is not this process's own peak there,
    because Linux carries the parent's high-water mark over fork and exec (a runner started from a
    pytest process that holds torch would report that process's 800 MB).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _keep_to_itself() -> None:
    """Make this process non-dumpable, so that the kernel (the same user) can neither open its
    ``/proc/<pid>/fd`` (the record) nor ptrace it. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def _error_of(cell) -> tuple[str, str] | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return str(out.get("ename", "Error")), str(out.get("evalue", ""))
    return None


def execute(plan: dict) -> dict:
    nb = nbformat.read(plan["notebook"], as_version=4)
    workdir = plan["workdir"]
    cell_timeout = float(plan["cell_timeout"])
    deadline = time.monotonic() + float(plan["total_timeout"])
    client = CappedClient(nb, timeout=int(cell_timeout), allow_errors=True, kernel_name="python3",
                          resources={"metadata": {"path": workdir}}, startup_timeout=120,
                          record_timing=False, interrupt_on_timeout=False, iopub_timeout=10)
    client.output_limit = int(plan["output_limit"])
    client.guard_plan = plan.get("guard")
    caps = plan.get("caps")  # {memory_mb, max_procs, cpus, via} in the sandbox, else None
    record: dict = {"cells": [], "restarts": 0, "started": time.time(), "caps": caps}
    record_fd = int(plan["record_fd"])
    os.set_inheritable(record_fd, False)  # the kernel must not get it
    _keep_to_itself()
    if caps and caps["via"] == "rlimit":
        sandbox.apply_rlimits(sandbox.Limits.from_dict(caps))
    events = sandbox.limit_events if caps and caps["via"] != "rlimit" else dict
    sandboxed = caps is not None            # inside bubblewrap's pid namespace: every other process is the kernel's

    def save() -> None:
        # Write, then cut: killed in between, the file still starts with a whole record (the grader reads
        # the first JSON value).
        data = json.dumps(record).encode()
        os.pwrite(record_fd, data, 0)
        os.ftruncate(record_fd, len(data))

    t_start = time.monotonic()
    _start(client)
    record["kernel_start_s"] = time.monotonic() - t_start
    save()  # from here on a record exists: a runner killed later is the submission's doing, not the grader's
    ran_ok: list[int] = []  # non-test cells that ran without error: replayed after a restart
    alive = True
    queue = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    retried: set[int] = set()
    lost: set[str] = set()   # exercises already at zero (all or nothing): their later test cells are skipped
    while queue:
        i = queue.pop(0)
        cell = nb.cells[i]
        is_test = "course" in cell.get("metadata", {}) and "exercise" in cell.metadata.course
        exercise = str(cell.metadata.course.exercise) if is_test else None
        entry = {"index": i, "test": is_test, "status": "not-run", "ename": "", "evalue": "", "seconds": 0.0}
        record["cells"] = [c for c in record["cells"] if c["index"] != i] + [entry]
        left = deadline - time.monotonic()
        if not alive or left <= 1:
            entry["status"] = "not-run" if alive else "died"
            continue
        if exercise in lost:
            entry["status"] = "skipped"
            continue
        client.timeout = max(1, int(min(cell_timeout, left)))
        t0 = time.monotonic()
        failure = None
        before = events()
        try:
            client.execute_cell(cell, i)
            err = _error_of(cell)
            if err:
                entry.update(status="error", ename=err[0], evalue=err[1][:2000])
            else:
                entry["status"] = "ok"
            if client.guard_plan is not None:
                entry["refused"] = _refused(client)
        except CellTimeoutError:
            failure = "timeout" if client.timeout >= cell_timeout else "not-run"
        except DeadKernelError:
            failure = "died"
        except Exception as exc:  # noqa: BLE001 - e.g. the kernel died while we were talking to it
            dead = client.kc is None or not client.km or not client.km.is_alive()
            failure = "died" if dead else "error"
            entry.update(ename=type(exc).__name__, evalue=" ".join(str(exc).split())[:500])
        entry["seconds"] = round(time.monotonic() - t0, 3)
        lost.update(str(e) for e, _ in entry.get("refused", []))
        if is_test and (failure or entry["status"]) != "ok":
            lost.add(exercise)
        after = events()
        hit = [cap for cap in after if after[cap] > before.get(cap, 0)]
        if hit:
            entry["limit"] = hit[0]
        elif entry["status"] == "ok" and not is_test:
            ran_ok.append(i)
        if failure or hit:
            entry["status"] = failure or entry["status"]
            if failure == "died" and not hit and not is_test and i not in retried:
                # A kernel can die just after the cell that killed it (ipykernel's exit() stops it once
                # the reply is sent): run a dying student cell once more before blaming it.
                retried.add(i)
                queue.insert(0, i)
            save()
            _stop(client, sandboxed)
            if deadline - time.monotonic() <= 1:
                alive = False
                continue
            record["restarts"] += 1
            try:
                _start(client)
                for j in ran_ok:  # replay the set-up; a failure here ends the run
                    left = deadline - time.monotonic()
                    if left <= 1:
                        raise CellTimeoutError("no time left to replay")
                    client.timeout = max(1, int(min(cell_timeout, left)))
                    client.execute_cell(nb.cells[j], j)
            except Exception as exc:  # noqa: BLE001
                record["replay_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                _stop(client, sandboxed)
                alive = False
        save()
    if alive:
        _stop(client, sandboxed)
    record["seconds"] = round(time.monotonic() - t_start, 3)
    record["max_rss_mb"] = peak_rss_mb()
    record["memory_peak_mb"] = sandbox.memory_peak_mb() if caps and caps["via"] != "rlimit" else None
    record["done"] = True
    save()
    return record


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    execute(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
