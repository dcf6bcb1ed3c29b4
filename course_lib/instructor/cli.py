"""The ``course`` command: doctor | gpu-check | lab | run | build | grade | lab-report | book.

    course doctor          check this machine: versions, devices, backends, a real 2-rank job
    course gpu-check       the instructor's self-test of a (GPU) node: a table of checks, non-zero exit on a failure
    course lab             open JupyterLab on the course index [--ip IP] [--port N] [--gpus 2,3] [--no-browser]
    course run 02          execute lesson 02 headless (progress bar), keep the executed copy
    course build [--check] write exercises/ from solutions/
    course grade PATH...   grade submissions (see docs/GRADING.md)
    course lab-report      run the self-test and every lesson here, write one HTML report (reports/lab/)
    course book            the course as a static website with the outputs of a real run (runs/book/site/)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.instructor.catalog import lessons
from course_lib.instructor.lab_settings import lab_flags, write_lab_settings

ROOT = Path(__file__).resolve().parents[2]           # the repository (this is course_lib/instructor/)


# ------------------------------------------------------------------------------------------ doctor

def _doctor_job():
    """The 2-rank job `course doctor` runs: an all_reduce whose answer is known."""
    import torch
    import torch.distributed as dist

    from course_lib import dist as cdist

    t = torch.tensor([float(dist.get_rank() + 1)], device=cdist.device())
    dist.all_reduce(t)
    return {"sum": t.item(), "device": cdist.device_name(), "backend": dist.get_backend()}


def doctor(nprocs: int = 2, timeout_s: float = 120) -> int:
    """Print what this machine has and run a real distributed job; return 0 when all is well."""
    problems: list[str] = []

    def line(name: str, value: str) -> None:
        print(f"  {name:<22} {value}")

    print("course doctor")
    line("python", f"{platform.python_version()} ({sys.executable})")
    if sys.version_info < (3, 10):
        problems.append("Python >= 3.10 is needed: install a newer Python and run `make lab` again")
    versions = {}
    for mod in ("torch", "deepspeed", "transformers", "jupyterlab", "ipywidgets", "nbval", "matplotlib",
                "cloudpickle", "psutil"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:  # noqa: BLE001 - PackageNotFoundError and friends
            versions[mod] = None
            problems.append(f"package {mod} is missing: run `make lab` (or `pip install -e .`) in the repo")
        line(mod, versions[mod] or "MISSING")
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("\nFAILED: torch cannot be imported; run `make lab` to create the environment")
        return 1
    from course_lib.runtime.procs import usable_cores

    line("cpu cores (usable)", str(usable_cores()))
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    line("cuda", f"{torch.version.cuda} with {len(gpus)} GPU(s): {', '.join(gpus)}" if cuda else
         "not available (CPU only: lessons run on gloo)")
    line("gloo / nccl", f"{dist.is_gloo_available()} / {dist.is_nccl_available()}")
    line("backend of a run", f"NCCL (a GPU per rank) for up to {len(gpus)} ranks, gloo on the CPU beyond" if gpus else
         "gloo on the CPU (no GPU)")
    if not dist.is_gloo_available():
        problems.append("torch was built without gloo: install the official torch wheel from PyPI")
    from course_lib.grading.sandbox import doctor_line

    _, sandbox = doctor_line()            # only `course grade` needs it: not a problem for a learner
    line("grading sandbox", sandbox.removeprefix("grading sandbox: "))
    n = min(nprocs, len(gpus)) if cuda and len(gpus) >= 2 else nprocs
    print(f"\n  running a {n}-rank job with torchrun ...", flush=True)
    from course_lib.runtime.launch import DistributedRunError, LaunchError, run

    try:
        res = run(_doctor_job, n, timeout_s=timeout_s, stream=False, fresh=True)   # a real start-up
    except (DistributedRunError, LaunchError) as exc:
        print(f"\nFAILED: the {n}-rank job did not work:\n{exc}")
        print("Fix: check that localhost networking works (the ranks meet on 127.0.0.1), and see the logs above.")
        return 1
    expected = n * (n + 1) / 2
    ok = all(abs(r["sum"] - expected) < 1e-6 for r in res.returns)
    line("job", f"{res.summary()}")
    line("where the time went", ", ".join(f"{k} {v:.2f} s" for k, v in res.breakdown().items()))
    if not ok:
        problems.append(f"all_reduce gave {[r['sum'] for r in res.returns]}, expected {expected}")
    if problems:
        print("\nPROBLEMS:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nOK: this machine can run the course.")
    return 0


# --------------------------------------------------------------------------------------------- lab

INDEX = "notebooks/index.ipynb"
# JupyterLab's URL of the index, given as `LabApp.default_url`: Jupyter's printed URLs and its browser-open file go
# there. (`ServerApp.default_url` does not work under `jupyter lab`: the extension sets it from its own.)
INDEX_URL = "/lab/tree/" + INDEX
DEFAULT_PORT = 8888


class LabError(ValueError):
    """Bad input to `course lab`: one line naming what, the flag and the fix; nothing has started."""


def _bind_address(ip: str) -> str:
    """The address Jupyter will listen on for ``--ip`` (its default, localhost, is the loopback)."""
    return {"": "0.0.0.0", "*": "0.0.0.0", "localhost": "127.0.0.1"}.get(ip, ip)  # noqa: S104 - what --ip says


def port_problem(ip: str, port: int) -> str | None:
    """Why Jupyter could not listen on ``ip:port`` now ('in use', 'not an address of this machine'), or None."""
    import errno
    import socket

    address = _bind_address(ip)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as Jupyter (tornado) binds
        try:
            s.bind((address, port))
        except socket.gaierror:
            return "unknown address"
        except OSError as exc:
            return {errno.EADDRINUSE: "in use", errno.EADDRNOTAVAIL: "not an address of this machine",
                    errno.EACCES: "not allowed for this user (ports below 1024 need root)"}.get(exc.errno, str(exc))
    return None


def _first_free_port(ip: str, start: int = DEFAULT_PORT, tries: int = 100) -> int:
    return next((p for p in range(start, start + tries) if port_problem(ip, p) is None), 0)


def browser_available() -> bool:
    """Whether Jupyter can open a browser here: Python finds one, and this is not an SSH session without a display
    (where only a text browser would be found, and JupyterLab needs JavaScript)."""
    import webbrowser

    remote = bool(os.environ.get("SSH_CONNECTION") or os.environ.get("SSH_CLIENT"))
    if remote and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return False
    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


@dataclass
class LabPlan:
    """What `course lab` starts, decided (and checked) before anything starts."""

    cmd: list[str]
    env: dict[str, str]                    # the server's environment: its kernels, and their ranks, inherit it
    ip: str
    port: int
    gpus: list[int] | None = None
    open_browser: bool = True
    notes: list[str] = field(default_factory=list)   # printed before the server starts

    def tunnel(self, port: int | None = None) -> str:
        """The SSH command that brings this server (on ``port``, default the planned one) to a laptop's
        ``localhost:PORT``: ``ssh -L 8891:localhost:8891 alice@gpu-node``."""
        import getpass
        import socket

        port = port or self.port
        loopback_or_all = ("127.0.0.1", "0.0.0.0", "::1", "::")  # noqa: S104
        target = "localhost" if _bind_address(self.ip) in loopback_or_all else self.ip
        return f"ssh -L {port}:{target}:{port} {getpass.getuser()}@{socket.gethostname()}"


def plan_lab(ip: str = "localhost", port: int | None = None, gpus: str | None = None, no_browser: bool = False,
             extra: list[str] = (), environ: dict[str, str] | None = None) -> LabPlan:
    """Check `course lab`'s flags and decide the server's command and environment; `LabError` on bad input."""
    from course_lib.runtime import gpus as gpu_select

    env = dict(os.environ if environ is None else environ)
    if port is not None:
        if not 1 <= port <= 65535:
            raise LabError(f"--port {port}: a TCP port is a number from 1 to 65535 (e.g. --port 8891)")
        problem = port_problem(ip, port)
        if problem == "in use":
            free = _first_free_port(ip, port + 1)
            raise LabError(f"--port {port} on {_bind_address(ip)}: in use (another server, maybe another "
                           f"learner's): choose another" + (f", e.g. --port {free}" if free else ""))
        if problem and problem.startswith("not allowed"):
            raise LabError(f"--port {port}: {problem}: choose one above 1023, e.g. --port 8891")
        if problem:
            raise LabError(f"--ip {ip}: cannot listen on {_bind_address(ip)} ({problem}): give an address of "
                           f"this machine, e.g. --ip 127.0.0.1")
    else:
        port = _first_free_port(ip)
        if port == 0:
            problem = port_problem(ip, DEFAULT_PORT)
            raise LabError(f"--ip {ip}: cannot listen on {_bind_address(ip)} ({problem}): give an address of "
                           f"this machine, e.g. --ip 127.0.0.1, or a free --port")
    ids = None
    notes = []
    if gpus is not None:
        try:
            ids = gpu_select.parse_gpus(gpus, gpu_select.machine_gpus())
        except gpu_select.GpuSelectionError as exc:
            raise LabError(str(exc)) from None
        env.update(gpu_select.visible_devices_env(ids, env))
        notes.append(gpu_select.describe(ids, env))
    open_browser = not no_browser and "--no-browser" not in extra and browser_available()
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}", f"--LabApp.default_url={INDEX_URL}",
           f"--ServerApp.ip={ip}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0", *lab_flags(),
           *([] if open_browser else ["--no-browser"]), *extra]
    return LabPlan(cmd=cmd, env=env, ip=ip, port=port, gpus=ids, open_browser=open_browser, notes=notes)


def index_url(server: dict) -> str:
    """The course index's URL on a running server (an entry of `jupyter_server.serverapp.list_running_servers`)."""
    from urllib.parse import urlencode

    query = "?" + urlencode({"token": server["token"]}) if server.get("token") else ""
    return server["url"].rstrip("/") + INDEX_URL + query


def _wait_for_server(proc, timeout_s: float = 180) -> dict | None:
    """The running-server record (url, port, token) of Jupyter ``proc`` once it serves, None if it ended first."""
    import time

    from jupyter_server.serverapp import list_running_servers

    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        found = [s for s in list_running_servers() if s.get("pid") == proc.pid]
        if found:
            return found[0]
        time.sleep(0.25)
    return None


def lab(ip: str = "localhost", port: int | None = None, gpus: str | None = None, no_browser: bool = False,
        extra: list[str] = ()) -> int:
    """``course lab``: JupyterLab on the course index, until Ctrl-C (or SIGTERM, passed on to the server).

    Prints the index's URL once the server answers and, where no browser is found, the SSH tunnel that reaches it
    from a laptop. Returns the server's exit status; 2 for bad input, before anything starts."""
    import signal
    import subprocess

    from course_lib.instructor.browser import sigterm_when_parent_dies

    try:
        plan = plan_lab(ip, port, gpus, no_browser, extra)
    except LabError as exc:
        print(f"course lab: {exc}", file=sys.stderr)
        return 2
    write_lab_settings()
    for note in plan.notes:
        print(f"course lab: {note}", flush=True)
    print("starting:", " ".join(plan.cmd), flush=True)
    server = subprocess.Popen(plan.cmd, cwd=ROOT, env=plan.env,  # same process group: Ctrl-C reaches Jupyter
                              preexec_fn=sigterm_when_parent_dies())  # noqa: PLW1509 - it only makes a system call

    def pass_on(signum, _frame):
        server.send_signal(signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Jupyter gets the terminal's Ctrl-C itself and asks to confirm
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, pass_on)
    info = _wait_for_server(server)
    if info is not None:
        url = index_url(info)
        print(f"\ncourse lab: the course index (Ctrl-C stops the server):\n    {url}", flush=True)
        if not plan.open_browser:
            from urllib.parse import urlparse

            laptop = urlparse(url)._replace(netloc=f"localhost:{info['port']}").geturl()
            there = "the URL above there" if laptop == url else f"there\n    {laptop}"
            print(f"no browser here: from your laptop, run\n    {plan.tunnel(info['port'])}\nthen open {there}\n",
                  flush=True)
    status = server.wait()
    return 128 - status if status < 0 else status


# --------------------------------------------------------------------------------------------- run

def run_notebook(path: Path, out_dir: Path, cell_timeout: float = 600) -> int:
    """Execute a notebook cell by cell in a fresh kernel with a progress bar; keep the executed copy and, beside
    it, the comparisons the lesson recorded (``NN_name.comparisons.jsonl``, `course_lib.measure.comparisons`).

    Returns 0 when every cell ran, 1 when one failed (the run stops there, like JupyterLab's "run all").
    Whatever the notebook started (torchrun jobs included) is killed at the end.
    """
    from tqdm.auto import tqdm

    from course_lib.measure import comparisons
    from course_lib.instructor.lab_report import count_code_cells, execute_notebook

    out_path = out_dir / path.name.replace(".ipynb", ".executed.ipynb")
    records = out_dir / path.name.replace(".ipynb", ".comparisons.jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    records.unlink(missing_ok=True)
    env = {comparisons.ENV: str(records), "COURSE_LESSON": path.name[:2]}
    with tqdm(total=count_code_cells(path), desc=path.stem, unit="cell") as bar:
        failed, _, wall = execute_notebook(path, out_path, cell_timeout, env, on_cell=lambda i: bar.update(1))
    if failed:
        print(f"FAILED: {path.name} {failed}\nexecuted copy: {out_path}")
        return 1
    recorded = comparisons.load(records)
    bad = [c.name for c in recorded if c.ok is False]
    print(f"OK: {path.name} ran in {wall:.1f} s; {len(recorded) - len(bad)}/{len(recorded)} comparisons within "
          f"tolerance{' (out: ' + '; '.join(bad) + ')' if bad else ''}; executed copy: {out_path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    found = lessons(args.folder)
    keys = sorted(found) if args.lesson == "all" else [args.lesson.zfill(2)]
    missing = [k for k in keys if k not in found]
    if missing:
        print(f"no lesson {missing[0]} in {args.folder}/: choose one of {', '.join(sorted(found))} or 'all'",
              file=sys.stderr)
        return 2
    status = 0
    for k in keys:
        status |= run_notebook(found[k], Path(args.out), cell_timeout=args.cell_timeout)
    return status


# -------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="check versions, devices, backends and run a real 2-rank job")
    p.add_argument("--nprocs", type=int, default=2)
    p.set_defaults(func=lambda a: doctor(a.nprocs))

    p = sub.add_parser("gpu-check", help="self-test of this node: launcher, collectives, hang canaries, peak, memory")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds per distributed check (default 90)")
    p.set_defaults(func=lambda a: __import__("course_lib.instructor.gpu_check", fromlist=["main"]).main(a.timeout))

    p = sub.add_parser("lab", allow_abbrev=False, help="open JupyterLab on the course index (extra args go to "
                       "jupyter lab)")
    p.add_argument("--ip", default="localhost", help="address to listen on (default localhost; reach a remote "
                   "node through the SSH tunnel it prints)")
    p.add_argument("--port", type=int, default=None, help="port (default: the first free from 8888); refused if in "
                   "use, never silently changed")
    p.add_argument("--gpus", default=None, help="the GPUs its kernels and their ranks see, e.g. 2,3 or 0-3 "
                   "(CUDA_VISIBLE_DEVICES): one slice of a shared node per learner")
    p.add_argument("--no-browser", action="store_true", help="open no browser; print the URL and the SSH tunnel")
    p.set_defaults(func=lambda a: lab(a.ip, a.port, a.gpus, a.no_browser, a.extra))

    p = sub.add_parser("run", help="execute lesson NN headless, keep the executed copy")
    p.add_argument("lesson", help="lesson number, e.g. 02, or 'all'")
    p.add_argument("--folder", default="notebooks", help="notebooks (lessons) or solutions")
    p.add_argument("--out", default=str(ROOT / "runs"), help="where executed copies go (default: runs/)")
    p.add_argument("--cell-timeout", type=float, default=600)
    p.set_defaults(func=cmd_run)

    from course_lib.grading.commands import add_parsers
    from course_lib.instructor.book import add_parser as add_book
    from course_lib.instructor.lab_report import add_parser as add_lab_report

    add_parsers(sub)
    add_lab_report(sub)
    add_book(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
