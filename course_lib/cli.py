"""The ``course`` command: doctor | gpu-check | lab | run | build | grade | lab-report.

    course doctor          check this machine: versions, devices, backends, a real 2-rank job
    course gpu-check       the instructor's self-test of a (GPU) node: a table of checks, non-zero exit on a failure
    course lab             open JupyterLab on the course index
    course run 02          execute lesson 02 headless (progress bar), keep the executed copy
    course build [--check] write exercises/ from solutions/
    course grade PATH...   grade submissions (see docs/GRADING.md)
    course lab-report      run the self-test and every lesson here, write one HTML report (reports/lab/)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lessons(folder: str = "notebooks") -> dict[str, Path]:
    """{'00': Path('notebooks/00_getting_started.ipynb'), ...}"""
    return {p.name[:2]: p for p in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb"))}


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
    from course_lib.procs import usable_cores

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
    from course_lib.launch import DistributedRunError, LaunchError, run

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

LAB_SETTINGS = {
    # No "Jupyter news" prompt and no update checks for learners (no internet needed).
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    # Open every notebook on the course kernel without asking which kernel to use.
    # Render every cell (no lazy "windowing"): lessons are short, and outputs stay in place when scrolling.
    "@jupyterlab/notebook-extension:tracker": {"autoStartDefaultKernel": True, "windowingMode": "none"},
}


def write_lab_settings(prefix: str | Path = sys.prefix) -> Path:
    """Write JupyterLab's overrides.json into this environment (idempotent)."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(LAB_SETTINGS)
    path.write_text(json.dumps(current, indent=2))
    return path


def lab_flags() -> list[str]:
    """Jupyter flags the course needs: containers often run as root, which Jupyter refuses by default."""
    return ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []


def lab(extra: list[str]) -> int:
    write_lab_settings()
    index = "notebooks/index.ipynb"
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={ROOT}", *lab_flags(), index, *extra]
    print("starting:", " ".join(cmd), flush=True)
    os.chdir(ROOT)
    os.execv(sys.executable, cmd)  # replace this process: Ctrl-C stops JupyterLab as usual


# --------------------------------------------------------------------------------------------- run

def run_notebook(path: Path, out_dir: Path, cell_timeout: float = 600) -> int:
    """Execute a notebook cell by cell in a fresh kernel with a progress bar; keep the executed copy and, beside
    it, the comparisons the lesson recorded (``NN_name.comparisons.jsonl``, `course_lib.comparisons`).

    Returns 0 when every cell ran, 1 when one failed (the run stops there, like JupyterLab's "run all").
    Whatever the notebook started (torchrun jobs included) is killed at the end.
    """
    from tqdm.auto import tqdm

    from course_lib import comparisons
    from course_lib.lab_report import count_code_cells, execute_notebook

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
    p.set_defaults(func=lambda a: __import__("course_lib.gpu_check", fromlist=["main"]).main(a.timeout))

    p = sub.add_parser("lab", help="open JupyterLab on the course index (extra args go to jupyter lab)")
    p.set_defaults(func=lambda a: lab(a.extra))

    p = sub.add_parser("run", help="execute lesson NN headless, keep the executed copy")
    p.add_argument("lesson", help="lesson number, e.g. 02, or 'all'")
    p.add_argument("--folder", default="notebooks", help="notebooks (lessons) or solutions")
    p.add_argument("--out", default=str(ROOT / "runs"), help="where executed copies go (default: runs/)")
    p.add_argument("--cell-timeout", type=float, default=600)
    p.set_defaults(func=cmd_run)

    from course_lib.grading.commands import add_parsers
    from course_lib.lab_report import add_parser as add_lab_report

    add_parsers(sub)
    add_lab_report(sub)
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
