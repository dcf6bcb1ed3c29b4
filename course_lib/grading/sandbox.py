"""The grading sandbox (issue 16): each submission runs in bubblewrap, under a memory and a process cap.

`course grade` starts a submission's runner (and so its kernel, torchrun and every rank) as
``bwrap ... python -m course_lib.grading.runner PLAN``. Inside, the submission sees:

- read-only: the system (/usr, /etc, /sys, the /bin and /lib links), Python's prefixes (the venv and the
  Python it was made from) and the course_lib package folder. Nothing else of the instructor's checkout
  (solutions/, notebooks/, exercises/, .git), no $HOME, no other submission;
- writable: its own temp folder (the cwd) and a private /tmp (HOME is /tmp/home);
- its own /proc (pid namespace), a minimal /dev, no network but its own loopback (torchrun and gloo use it;
  the grader's loopback is another one), no capabilities, a new session; everything dies with the grader;
- a few environment variables (PATH, locale, ``COURSE_*``, thread counts): the grader's tokens stay out.

Caps, for all of a submission's processes together: ``memory_mb`` of RAM + swap, ``max_procs``
processes + threads and ``cpus`` cores of CPU time (a quota: a fork bomb's hundreds of busy processes share
them, and the grader and the machine keep the rest of their share), through a new cgroup (v2 where
delegated, v1 where writable, a ``systemd-run`` scope on a systemd machine). Without one, rlimits cap each
process's data memory, and the process count for a non-root user only (Linux does not count root's
processes), and nothing caps the CPU. The runner reads the cgroup's event counters around every cell
(`limit_events`), so that a grade says ``memory limit (4096 MB) reached``, not ``kernel died``.
"""

from __future__ import annotations

import functools
import glob
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import course_lib

# The largest peak of a solution graded in the sandbox (benchmarks/bench_grading.py --peaks, 2-core AMD EPYC):
# lesson 02, four gloo ranks, 1874 MB and 60 processes + threads. The defaults leave twice that and more; not
# much more processes: at 1024 a fork bomb kept ~800 busy processes alive and a 2-core machine crawled for
# minutes (benchmarks/bench_class.py). The CPU quota defaults to all cores (None): the submission's processes
# then compete as one group, and a grade takes as long as the notebook does outside the sandbox.
DEFAULT_MEMORY_MB = 4096
DEFAULT_MAX_PROCS = 256
INSTALL = "apt-get install bubblewrap"
PACKAGE = Path(course_lib.__file__).resolve().parent
HOME = "/tmp/home"
SYSTEM = ("/usr", "/etc", "/sys", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The environment a sandboxed run keeps (systemd-run --user needs the last two; /run is not in the sandbox).
ENV_NAMES = {"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONHASHSEED", "PYTHONPATH", "MPLBACKEND",
             "PYDEVD_DISABLE_FILE_VALIDATION", "JUPYTER_PLATFORM_DIRS", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS"}
ENV_PREFIXES = ("COURSE_", "LC_", "OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_", "TORCH_")
# Where a cgroup counts the times it hit a cap: (cap, hierarchy, file, key), v2 then v1. Processes first: a fork
# bomb fills the memory too, and is named for what it is.
EVENTS = (("processes", "v2", "pids.events", "max"), ("processes", "pids", "pids.events", "max"),
          ("memory", "v2", "memory.events", "oom_kill"), ("memory", "memory", "memory.oom_control", "oom_kill"))


class SandboxError(RuntimeError):
    """The sandbox cannot be set up as asked."""


@dataclass(frozen=True)
class Limits:
    """Caps for one submission, all its processes together: RAM + swap, processes + threads, and CPU time in
    cores (None: all of this machine's)."""

    memory_mb: int = DEFAULT_MEMORY_MB
    max_procs: int = DEFAULT_MAX_PROCS
    cpus: float | None = None

    def __post_init__(self):
        if self.memory_mb < 64:
            raise SandboxError(f"memory_mb={self.memory_mb} is too small for a Jupyter kernel: give at least 64")
        if self.max_procs < 16:
            raise SandboxError(f"max_procs={self.max_procs} is too small for a kernel and its threads: give at "
                               f"least 16")
        cores = os.cpu_count() or 1
        if self.cpus is not None and not 0.1 <= self.cpus <= cores:
            raise SandboxError(f"cpus={self.cpus} is not between 0.1 and this machine's {cores} cores: give a "
                               f"share of them (e.g. --cpus {max(1, cores - 1)}), or leave it out for all")

    @property
    def cores(self) -> float:
        """The CPU quota in cores."""
        return float(self.cpus if self.cpus is not None else os.cpu_count() or 1)

    def as_dict(self) -> dict:
        return {"memory_mb": self.memory_mb, "max_procs": self.max_procs, "cpus": self.cpus}

    @classmethod
    def from_dict(cls, caps: dict) -> "Limits":
        """The limits in a runner plan's ``caps`` (which also holds ``via``)."""
        return cls(caps["memory_mb"], caps["max_procs"], caps.get("cpus"))


# ---------------------------------------------------------------------------------- availability

def bwrap_path() -> str | None:
    """bubblewrap's binary: ``$COURSE_BWRAP`` when set (empty: behave as if not installed), else PATH's ``bwrap``."""
    if "COURSE_BWRAP" in os.environ:
        return os.environ["COURSE_BWRAP"] or None
    return shutil.which("bwrap")


@functools.cache
def _probe(bwrap: str) -> str:
    """'' when ``bwrap`` creates its namespaces here, else why not."""
    cmd = [bwrap, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-pid", "--unshare-net",
           "--die-with-parent", "--cap-drop", "ALL", "true"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} does not run: {exc}"
    if proc.returncode != 0:
        said = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return f"{bwrap} cannot create namespaces here ({said}): unprivileged user namespaces may be disabled"
    return ""


def unavailable() -> str | None:
    """Why submissions cannot be sandboxed on this machine, or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux, this is {sys.platform}"
    bwrap = bwrap_path()
    if bwrap is None:
        return f"bubblewrap is not installed ({INSTALL})"
    return _probe(bwrap) or None


def doctor_line() -> tuple[bool, str]:
    """For `course doctor`: (ok, one line) on whether `course grade` can sandbox submissions here."""
    why = unavailable()
    if why:
        return False, (f"grading sandbox: unavailable, {why}; `course grade` would run submissions "
                       f"unprotected (they could read solutions/)")
    limits = Limits()
    return True, f"grading sandbox: bubblewrap, {describe(limits, caps_via())}"


# ---------------------------------------------------------------------------------------- cgroups

def cgroup_dirs() -> dict[str, Path]:
    """This process's cgroup folders: ``v2`` (the unified hierarchy), ``memory``, ``pids``, ``cpu`` and ``cpuacct``
    (v1) where mounted (``cpu`` and ``cpuacct`` may be one folder)."""
    where = {}  # hierarchy -> path of this process in it
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["v2"]:
            where[name] = path
    dirs = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        root, point = fields[3], fields[4]
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        names = ["v2"] if fstype == "cgroup2" else [o for o in ("memory", "pids", "cpu", "cpuacct") if o in options] \
            if fstype == "cgroup" else []
        for name in names:
            path = where.get(name)
            if path is not None and (path + "/").startswith(root.rstrip("/") + "/"):
                dirs[name] = Path(point, path[len(root):].lstrip("/"))
    return dirs


def systemd_run_prefix(limits: Limits, unit: str = "") -> list[str]:
    user = ["--user"] if os.getuid() else []
    name = [f"--unit={unit}"] if unit else []
    return ["systemd-run", *user, *name, "--scope", "--quiet", "--collect", "-p", f"MemoryMax={limits.memory_mb}M",
            "-p", "MemorySwapMax=0", "-p", f"TasksMax={limits.max_procs}", "-p",
            f"CPUQuota={round(limits.cores * 100)}%", "--"]


@functools.cache
def _systemd_caps() -> bool:
    """Whether a ``systemd-run`` scope here gets a memory cap (systemd delegates the memory controller)."""
    if not shutil.which("systemd-run") or not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return False
    probe = Limits(memory_mb=123, max_procs=45)
    show = 'cat "/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup)/memory.max"'
    try:
        out = subprocess.run([*systemd_run_prefix(probe), "sh", "-c", show], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == str(123 << 20)


def _writable(folder: Path | None) -> bool:
    return folder is not None and folder.is_dir() and os.access(folder, os.W_OK)


def caps_via() -> str:
    """How the caps are enforced here: ``cgroup v2``, ``cgroup v1``, ``systemd-run`` or ``rlimit``.

    cgroup v2 only where this process's cgroup is delegated with both controllers enabled for its children.
    """
    dirs = cgroup_dirs()
    v2 = dirs.get("v2")
    if _writable(v2) and {"memory", "pids"} <= set((v2 / "cgroup.subtree_control").read_text().split()):
        return "cgroup v2"
    if _writable(dirs.get("memory")) and _writable(dirs.get("pids")):
        return "cgroup v1"
    return "systemd-run" if _systemd_caps() else "rlimit"


def cpu_capped(via: str) -> bool:
    """Whether a cgroup made ``via`` this way caps the CPU (its controller may not be delegated)."""
    dirs = cgroup_dirs()
    if via == "cgroup v2":
        return "cpu" in (dirs["v2"] / "cgroup.subtree_control").read_text().split()
    if via == "cgroup v1":
        return _writable(dirs.get("cpu"))
    return via == "systemd-run"


def describe(limits: Limits, via: str) -> str:
    """One line for the results: what protects the grading machine."""
    procs = f"{limits.max_procs} processes" if via != "rlimit" or os.getuid() else "no process cap (root)"
    memory = f"{limits.memory_mb} MB" + (" per process" if via == "rlimit" else "")
    cpu = f"{limits.cores:g} CPUs" if cpu_capped(via) else "CPU not capped"
    return f"memory {memory}, {procs}, {cpu} ({via})"


def cgroup_settings(limits: Limits, via: str) -> dict[str, int | str]:
    """The files a new cgroup (``cgroup v2`` or ``cgroup v1``) gets written, and their values. A file that the
    cgroup lacks (memsw without swap accounting, cpu.* without the cpu controller) is skipped."""
    period = 100_000  # µs
    quota = round(limits.cores * period)
    if via == "cgroup v2":
        return {"memory.max": limits.memory_mb << 20, "memory.swap.max": 0, "pids.max": limits.max_procs,
                "cpu.max": f"{quota} {period}"}
    return {"memory.limit_in_bytes": limits.memory_mb << 20, "memory.memsw.limit_in_bytes": limits.memory_mb << 20,
            "pids.max": limits.max_procs, "cpu.cfs_period_us": period, "cpu.cfs_quota_us": quota}


class Cgroup:
    """A new cgroup with the caps for one submission; `enter` is the command prefix that runs a command in it."""

    def __init__(self, name: str, limits: Limits, via: str):
        self.via, self.folders, self.enter = via, [], []
        if via == "systemd-run":
            self.enter = systemd_run_prefix(limits, unit=name)
            return
        dirs, settings = cgroup_dirs(), cgroup_settings(limits, via)
        if via == "cgroup v2":
            self.folders = [dirs["v2"] / name]
        else:
            self.folders = [dirs["memory"] / name, dirs["pids"] / name]
            if cpu_capped(via):
                self.folders.append(dirs["cpu"] / name)
            if _writable(dirs.get("cpuacct")) and dirs["cpuacct"] / name not in self.folders:
                self.folders.append(dirs["cpuacct"] / name)      # counts the CPU time (`cpu_seconds`)
        for folder in self.folders:
            folder.mkdir()
        for key, value in settings.items():
            for folder in self.folders:
                if (folder / key).exists():
                    (folder / key).write_text(str(value))
        # The shell joins the cgroup, then becomes the command: everything it starts is counted.
        join = " && ".join(f"echo $$ > {shlex.quote(str(f / 'cgroup.procs'))}" for f in self.folders)
        self.enter = ["/bin/sh", "-c", join + ' && exec "$@"', "sh"]

    def cpu_seconds(self) -> float | None:
        """CPU time its processes used so far (s): ``cpu.stat`` ``usage_usec`` (v2) or ``cpuacct.usage`` (v1); None
        where nothing counts it (``systemd-run``, no cpuacct controller)."""
        for folder in self.folders:
            try:
                if (folder / "cpuacct.usage").exists():
                    return int((folder / "cpuacct.usage").read_text()) / 1e9
                if self.via == "cgroup v2" and (folder / "cpu.stat").exists():
                    for line in (folder / "cpu.stat").read_text().splitlines():
                        if line.startswith("usage_usec "):
                            return int(line.split()[1]) / 1e6
            except (OSError, ValueError):
                return None
        return None

    def close(self) -> None:
        """Remove the cgroup (killing whatever is still in it)."""
        # Up to 30 s: after a fork bomb on a loaded machine, hundreds of killed processes can take seconds to go.
        deadline = time.monotonic() + 30
        for folder in self.folders:
            pause = 0.05
            while True:
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # busy: processes left, or the last ones not reaped yet
                    if time.monotonic() > deadline:
                        break
                    try:
                        pids = (folder / "cgroup.procs").read_text().split()
                    except OSError:
                        pids = []
                    for pid in pids:
                        try:
                            os.kill(int(pid), 9)
                        except (ProcessLookupError, ValueError):
                            pass
                    time.sleep(pause)
                    pause = min(pause * 2, 0.5)


# ------------------------------------------------------------------------------------ runner side

def limit_events() -> dict[str, int]:
    """How often this process's cgroup hit a cap so far: ``{"processes": refused forks, "memory": OOM kills}``."""
    dirs, counts = cgroup_dirs(), {}
    for cap, hierarchy, name, key in EVENTS:
        path = dirs[hierarchy] / name if hierarchy in dirs else None
        if cap in counts or path is None or not path.exists():
            continue
        for line in path.read_text().splitlines():
            word, _, value = line.partition(" ")
            if word == key:
                counts[cap] = int(value)
    return counts


def memory_peak_mb() -> float | None:
    """Peak memory of this process's cgroup (MB): ``memory.peak`` (v2) or ``memory.max_usage_in_bytes`` (v1)."""
    dirs = cgroup_dirs()
    for folder, name in ((dirs.get("v2"), "memory.peak"), (dirs.get("memory"), "memory.max_usage_in_bytes")):
        if folder is not None and (folder / name).exists():
            return round(int((folder / name).read_text()) / 2**20, 1)
    return None


def apply_rlimits(limits: Limits) -> None:
    """Where no cgroup caps the submission: cap this process's data memory (its children inherit the cap), and
    the process count for a non-root user (Linux does not count root's processes). Not RLIMIT_AS: torch
    reserves far more address space than it uses."""
    resource.setrlimit(resource.RLIMIT_DATA, (limits.memory_mb << 20,) * 2)
    if os.getuid():
        import psutil

        mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + limits.max_procs,) * 2)


# ------------------------------------------------------------------------------------- the command

def readable() -> list[Path]:
    """What a submission may read besides the system: Python's prefixes, the site-packages folders on sys.path
    (a venv can reach another's through a .pth file) and the course_lib package folder."""
    paths = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    paths |= {Path(p).resolve() for p in sys.path if Path(p).name in ("site-packages", "dist-packages")
              and Path(p).is_dir()}
    paths.add(PACKAGE)
    system = [Path(p).resolve() for p in SYSTEM if os.path.isdir(p)]
    return sorted(p for p in paths if not any(p.is_relative_to(s) for s in system))


def command(argv: list[str], workdir: Path, hidden: list[Path]) -> list[str]:
    """``argv`` run under bubblewrap in ``workdir`` (see the module docstring for what it sees).

    Raises `SandboxError` when a folder that must stay hidden (``hidden``: the official notebooks, the
    submissions, $HOME) lies inside one the sandbox shows.
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxError(f"bubblewrap is not installed ({INSTALL})")
    shown = readable() + [Path(p).resolve() for p in SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    for secret in (Path(h).resolve() for h in hidden):
        for folder in shown:
            if secret.is_relative_to(folder):
                raise SandboxError(f"{secret} would be visible in the sandbox (it is inside {folder}, which "
                                   f"submissions must read): move it elsewhere, or grade with --no-sandbox")
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL"]
    for p in SYSTEM:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    # The private /tmp first, then what may be read on top of it: a venv or a checkout under /tmp stays visible.
    # A folder under /tmp that holds one (CI's fresh clone, /tmp/ci/.venv) gets a tmpfs of its own, made read-only
    # below like the root: the folders bwrap creates in it for the mounts must not take a write either.
    tmp_roots = sorted({Path("/tmp", p.relative_to("/tmp").parts[0]) for p in readable()
                        if p.is_relative_to("/tmp") and p != Path("/tmp")})
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", HOME]
    for root in tmp_roots:
        args += ["--tmpfs", str(root)]
    for p in readable():
        args += ["--ro-bind", str(p), str(p)]
    for dev in sorted(glob.glob("/dev/nvidia*")):  # GPUs, where there are
        args += ["--dev-bind", dev, dev]
    workdir = str(Path(workdir).resolve())
    # The sandbox's own root (a tmpfs holding the folders its mount points need, e.g. the checkout's above
    # course_lib) read-only too: a write outside the temp folder fails instead of landing there unseen.
    read_only = [x for root in ["/", *map(str, tmp_roots)] for x in ("--remount-ro", root)]
    return args + ["--bind", workdir, workdir, *read_only, "--chdir", workdir, "--", *argv]


def environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` a sandboxed run keeps, with HOME and TMPDIR inside the sandbox."""
    kept = {k: v for k, v in env.items() if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    return {**kept, "HOME": HOME, "TMPDIR": "/tmp"}
