"""Hostile submissions against the grading sandbox (issue 16; docs/GRADING.md, "Sandbox").

A two-exercise lesson is written at test time into a temporary solutions folder. Each hostile submission
attacks in its answer cell for ``sb-answer`` (the answer is defined only after the attack, so an attack the
sandbox stops costs exactly that exercise) and answers ``sb-double`` correctly. The class is graded once (module
fixture) with small caps; the tests then read the results: every attack scores zero for ``sb-answer`` only,
nothing is left behind, and the submission graded last is not slower than the one graded first.
Skipped, with the reason, where bubblewrap or its namespaces are not available; the tests without bubblewrap
(at the end) always run, with the sandbox made unavailable through ``COURSE_BWRAP``.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

import course_lib
from course_lib.runtime import procs
from course_lib.grading import commands, grade, sandbox
from course_lib import notebook as nbio
from course_lib.grading import authoring

LESSON = "sb_lesson"
LIMITS = sandbox.Limits(memory_mb=768, max_procs=48)
MARKER = "sandbox-test-left-behind"  # in the command line of the process a submission leaves running
CHECKOUT_SOLUTION = Path(course_lib.__file__).resolve().parents[1] / "solutions" / "00_getting_started.ipynb"
PATCHED = Path(course_lib.__file__).resolve().parent / "runtime" / "procs.py"
SITE_PACKAGES = Path(psutil.__file__).resolve().parents[1]
PLANTED = SITE_PACKAGES / "zz_sandbox_test_planted.pth"
DOUBLE_TEST = ('import builtins\nfrom course_lib.runtime import procs\nfrom course_lib.grading.check import check_equal, '
               'check_true\ncheck_equal("double(21)", double(21), 42)\n'
               'check_true("the course\'s harness is untouched", procs.new_tag("x").startswith("x-") '
               'and not hasattr(builtins, "planted"))')
TAG_PREFIX = f"grade-{os.getpid()}-"  # procs.new_tag("grade") in this process
# A record saying every cell passed, written where the runner's record could be (its temp folder, any file the
# runner has open), then the runner is killed so that it cannot overwrite it.
FORGE = """import glob, json, os, signal
fake = json.dumps({"cells": [{"index": i, "test": True, "status": "ok", "ename": "", "evalue": ""} for i in range(9)],
                   "done": True})
open("record.json", "w").write(fake)
for fd in glob.glob(f"/proc/{os.getppid()}/fd/*"):
    try:
        with open(fd, "w") as f:
            f.write(fake)
    except OSError:
        pass
os.kill(os.getppid(), signal.SIGKILL)"""


def lesson_notebook(answer: str = "def answer():\n    return 42", double: str = "def double(x):\n    return 2 * x"):
    cells = [new_code_cell("from course_lib.grading.check import check_equal"),
             new_markdown_cell("## Exercise sb-answer"), new_code_cell(answer),
             new_code_cell('from course_lib.grading.check import check_equal\ncheck_equal("answer()", answer(), 42)'),
             new_markdown_cell("## Exercise sb-double"), new_code_cell(double), new_code_cell(DOUBLE_TEST)]
    cells[3].metadata["course"] = {"exercise": "sb-answer", "points": 1}
    cells[6].metadata["course"] = {"exercise": "sb-double", "points": 1}
    for i, c in enumerate(cells):
        c.id = authoring.cell_id(LESSON, i)
    return new_notebook(cells=cells, metadata={"course": {"lesson": LESSON}, "kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})


def attacks(paths: dict[str, str], port: int, host_ip: str) -> dict[str, str]:
    """name -> code run before ``def answer(): return 42`` (its exception, if any, is the exercise's status)."""
    read = "from pathlib import Path\nPath({!r}).read_text()"
    connect = "import socket\nassert socket.create_connection(({!r}, {}), timeout=5).recv(2) == b'42'"
    return {
        "read_checkout": ("import course_lib\nfrom pathlib import Path\n"
                          "(Path(course_lib.__file__).resolve().parents[1] / 'solutions' / "
                          f"{CHECKOUT_SOLUTION.name!r}).read_text()"),
        "read_solutions": read.format(paths["solution"]),
        "read_classmate": read.format(paths["classmate"]),
        "read_home": read.format(paths["home"]),
        "write_outside": f"from pathlib import Path\nPath({paths['outside']!r}).write_text('escaped')",
        # The checkout's folder exists in the sandbox (course_lib is mounted below it), on the sandbox's own root:
        # a write there would change nothing outside, but must fail all the same (found by bench_class).
        "write_checkout": ("import course_lib\nfrom pathlib import Path\n"
                           "(Path(course_lib.__file__).resolve().parents[1] / 'sandbox-escaped.txt').write_text('x')"),
        "write_solutions": f"from pathlib import Path\nPath({paths['solution']!r}).write_text('{{}}')",
        "net_loopback": connect.format("127.0.0.1", port),
        "net_external": connect.format(host_ip, port),
        "memory": "blocks = [bytearray(64 << 20) for _ in range(10_000)]",
        "fork_bomb": "import os\nwhile True:\n    os.fork()",
        "patch_course_lib": ("import course_lib.runtime.launch\ncourse_lib.runtime.launch.run = None  # in memory: this kernel only\n"
                             f"with open({str(PATCHED)!r}, 'a') as f:\n"
                             "    f.write('\\nnew_tag = lambda prefix=\"run\": \"patched\"\\n')"),
        "plant_pth": (f"from pathlib import Path\n"
                      f"Path({str(PLANTED)!r}).write_text('import builtins; builtins.planted = 1')"),
        "leave_process": ("import subprocess, sys\n"  # no COURSE_PROC_TAG: only the pid namespace catches it
                          f"subprocess.Popen([sys.executable, '-c', 'while True: pass', {MARKER!r}], env={{}}, "
                          "start_new_session=True)\nraise RuntimeError('left a process running')"),
        "forge_record": FORGE,
    }


def marked_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if MARKER in (p.info["cmdline"] or []):
            found.append(p)
    return found


def tagged_leftovers() -> list[psutil.Process]:
    """Processes started by a grading in this test process that are still alive."""
    return procs.tagged_processes(TAG_PREFIX, prefix=True)


def host_address() -> str:
    """A non-loopback IPv4 address of this machine (reachable from the host itself), else a public one."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return "1.1.1.1"


class Server:
    """A TCP server on every address of the host that answers b'42' and counts its connections."""

    def __init__(self):
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.sock.settimeout(0.2)
        self.port, self.connections, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.sendall(b"42")

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


def cgroups_left() -> set[str]:
    """This process's gradings' cgroups (another test process may be grading at the same time)."""
    mine = f"course-grade-{os.getpid()}-*"
    return {p.name for d in sandbox.cgroup_dirs().values() if d.is_dir() for p in d.glob(mine)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    why = sandbox.unavailable()
    if why:
        pytest.skip(f"no grading sandbox here: {why}")
    tmp = tmp_path_factory.mktemp("sandbox")
    solutions, klass = tmp / "solutions", tmp / "class"
    solutions.mkdir()
    klass.mkdir()
    nbio.write(lesson_notebook(), solutions / f"{LESSON}.ipynb")
    home_probe = Path.home() / f".course-sandbox-probe-{os.getpid()}"
    home_probe.write_text("a file in the grader's home")
    (tmp / "outside").mkdir()
    paths = {"solution": str(solutions / f"{LESSON}.ipynb"), "classmate": str(klass / "00_good.ipynb"),
             "home": str(home_probe), "outside": str(tmp / "outside" / "escaped.txt")}
    server = Server()
    host_ip = host_address()
    hostile = attacks(paths, server.port, host_ip)
    if sandbox.caps_via() == "rlimit" and os.getuid() == 0:
        del hostile["fork_bomb"]  # no process cap for root without a cgroup: it would take the machine down
    for name, code in hostile.items():
        nbio.write(lesson_notebook(answer=f"{code}\ndef answer():\n    return 42"), klass / f"{name}.ipynb")
    nbio.write(lesson_notebook(), klass / "00_good.ipynb")
    nbio.write(lesson_notebook(), klass / "zz_good.ipynb")
    patched_before, cgroups_before = PATCHED.read_bytes(), cgroups_left()
    snapshot = grade.Solutions(solutions)
    kw = dict(cell_timeout=30, total_timeout=120, limits=LIMITS, sandboxed=True)
    try:
        results = {"00_good": grade.grade_submission(klass / "00_good.ipynb", snapshot, **kw)}
        with ThreadPoolExecutor(2) as pool:
            futures = {n: pool.submit(grade.grade_submission, klass / f"{n}.ipynb", snapshot, **kw) for n in hostile}
            results.update({n: f.result() for n, f in futures.items()})
        results["zz_good"] = grade.grade_submission(klass / "zz_good.ipynb", snapshot, **kw)
    finally:
        server.close()
        home_probe.unlink()
        patched_now = PATCHED.read_bytes()
        PATCHED.write_bytes(patched_before)  # only if the sandbox failed
        planted = PLANTED.exists()
        PLANTED.unlink(missing_ok=True)
    for name, r in results.items():
        print(f"{name:18s} {r['points']:g}/{r['max']:g}  {r['seconds']:5.1f} s  {statuses(r)['sb-answer']}")
    return {"results": results, "server": server, "host_ip": host_ip, "paths": paths, "solutions": solutions,
            "patched": patched_now != patched_before, "planted": planted, "marked": marked_processes(),
            "leftovers": tagged_leftovers(), "cgroups": cgroups_left() - cgroups_before}


def statuses(res: dict) -> dict[str, str]:
    return {r["exercise"]: r["status"] for r in res["exercises"]}


def points(res: dict) -> dict[str, float]:
    return {r["exercise"]: r["points"] for r in res["exercises"]}


@pytest.mark.slow    # grades submissions in the sandbox: the `graded` fixture takes a minute or more
def test_a_correct_submission_scores_full_marks_in_the_sandbox(graded):
    for name in ("00_good", "zz_good"):
        res = graded["results"][name]
        assert res["points"] == res["max"] == 2, statuses(res)
        assert res["sandbox"].startswith("bubblewrap, memory 768 MB"), res["sandbox"]


@pytest.mark.parametrize("name", ["read_checkout", "read_solutions", "read_classmate", "read_home",
                                  "write_outside", "write_checkout", "write_solutions", "net_loopback", "net_external",
                                  "memory", "fork_bomb", "patch_course_lib", "plant_pth", "leave_process"])
@pytest.mark.slow
def test_an_attack_costs_its_exercise_only(graded, name):
    if name not in graded["results"]:
        pytest.skip("not run: no process cap here (rlimits only, as root)")
    res = graded["results"][name]
    assert points(res) == {"sb-answer": 0, "sb-double": 1}, statuses(res)
    assert not res["warnings"], res["warnings"]


@pytest.mark.slow
def test_a_forged_record_is_not_read(graded):
    res = graded["results"]["forge_record"]
    assert res["points"] == 0, statuses(res)
    stopped = "error: the grading runner was stopped before this test ran (killed by the submission?)"
    assert set(statuses(res).values()) == {stopped}


@pytest.mark.slow
def test_reads_outside_the_temp_folder_find_nothing(graded):
    assert CHECKOUT_SOLUTION.is_file()  # it is there, outside the sandbox
    for name in ("read_checkout", "read_solutions", "read_classmate", "read_home"):
        assert "FileNotFoundError" in statuses(graded["results"][name])["sb-answer"], name


@pytest.mark.slow
def test_writes_outside_the_temp_folder_change_nothing(graded):
    assert not Path(graded["paths"]["outside"]).exists()
    assert grade.Solutions(graded["solutions"]).notebooks[LESSON].cells  # still the official notebook
    assert not graded["patched"] and not graded["planted"]
    assert "Read-only file system" in statuses(graded["results"]["patch_course_lib"])["sb-answer"]
    assert "Read-only file system" in statuses(graded["results"]["plant_pth"])["sb-answer"]
    assert "Read-only file system" in statuses(graded["results"]["write_checkout"])["sb-answer"]
    assert not (PATCHED.parents[1] / "sandbox-escaped.txt").exists()


@pytest.mark.slow
def test_the_network_is_only_the_sandboxs_own_loopback(graded):
    assert graded["server"].connections == 0
    st = statuses(graded["results"]["net_loopback"])["sb-answer"]
    assert "ConnectionRefusedError" in st, st  # the sandbox's loopback: nobody listens there
    st = statuses(graded["results"]["net_external"])["sb-answer"]
    assert "Network is unreachable" in st, (graded["host_ip"], st)


@pytest.mark.slow
def test_memory_and_process_caps_name_the_limit(graded):
    if sandbox.caps_via() == "rlimit":
        pytest.skip("no writable cgroup here: the caps are rlimits (per process; no process cap for root)")
    assert statuses(graded["results"]["memory"])["sb-answer"] == "memory limit (768 MB) reached"
    st = statuses(graded["results"]["fork_bomb"])["sb-answer"]
    assert st == "process limit (48 processes and threads) reached", st


@pytest.mark.slow
def test_nothing_is_left_behind_and_the_next_submission_is_not_slower(graded):
    assert graded["marked"] == [] and graded["leftovers"] == [] and tagged_leftovers() == []
    assert graded["cgroups"] == set()
    first, last = graded["results"]["00_good"], graded["results"]["zz_good"]
    assert last["seconds"] < first["seconds"] + 10, (first["seconds"], last["seconds"])


# ----------------------------------------------------------------- without bubblewrap (always run)

def test_without_bubblewrap_grading_goes_on_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COURSE_BWRAP", "")  # as if bubblewrap were not installed
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    nbio.write(lesson_notebook(), solutions / f"{LESSON}.ipynb")
    nbio.write(lesson_notebook(), tmp_path / "good.ipynb")
    with pytest.raises(grade.GraderError, match="bubblewrap is not installed"):
        grade.grade_submission(tmp_path / "good.ipynb", solutions, sandboxed=True)
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    args = ["grade", str(tmp_path / "good.ipynb"), "--solutions", str(solutions), "--json", str(out_json),
            "--csv", str(out_csv)]
    assert commands.main(args) == 0
    err = capsys.readouterr().err
    assert "WARNING: no sandbox (bubblewrap is not installed (apt-get install bubblewrap))" in err
    assert "--no-sandbox" in err and len(err.strip().splitlines()) == 1
    [res] = json.loads(out_json.read_text())
    assert res["points"] == 2 and res["sandbox"].startswith("off: bubblewrap is not installed")
    [row] = list(csv.DictReader(out_csv.open()))
    assert row["sandbox"] == res["sandbox"]
    ok, line = sandbox.doctor_line()
    assert not ok and "apt-get install bubblewrap" in line


def test_limits_are_validated():
    with pytest.raises(sandbox.SandboxError, match="memory_mb=10"):
        sandbox.Limits(memory_mb=10)
    assert commands.main(["grade", "x.ipynb", "--max-procs", "3"]) == 2
    with pytest.raises(sandbox.SandboxError, match=r"cpus=0.01 is not between 0.1 and this machine's \d+ cores"):
        sandbox.Limits(cpus=0.01)
    assert commands.main(["grade", "x.ipynb", "--cpus", str((os.cpu_count() or 1) + 1)]) == 2


def test_the_cpu_quota_holds_a_busy_process_to_its_share():
    """A submission's processes together get ``cpus`` cores of CPU time: a fork bomb's hundreds of busy processes
    share them and leave the grader and the machine the rest (bench_class found a 2-core machine crawling without).
    Two processes spin for 2 s in a cgroup capped at 0.5 cores: together they get at most ~1 s of CPU, where
    without the cap they would get up to 4 s."""
    via = sandbox.caps_via() if sys.platform.startswith("linux") else "rlimit"
    if not sandbox.cpu_capped(via):
        pytest.skip(f"no CPU controller to delegate here ({via})")
    assert "0.5 CPUs" in sandbox.describe(sandbox.Limits(cpus=0.5), via)
    cgroup = sandbox.Cgroup(f"course-grade-cpu-test-{os.getpid()}", sandbox.Limits(cpus=0.5), via)
    spin = ("import os, time\nos.fork()\nstart, cpu = time.time(), time.process_time()\n"
            "while time.time() - start < 2: pass\nos.write(1, f'{time.process_time() - cpu}\\n'.encode())")
    try:
        out = subprocess.run([*cgroup.enter, sys.executable, "-c", spin], capture_output=True, text=True, timeout=60)
    finally:
        cgroup.close()
    used = sum(float(x) for x in out.stdout.split())
    assert len(out.stdout.split()) == 2, out.stderr
    assert used < 1.3, f"two busy processes used {used:.2f} s of CPU in 2 s under a 0.5-core quota"


def test_a_venv_and_course_lib_under_tmp_stay_visible(monkeypatch, tmp_path):
    """The private /tmp is mounted first and what may be read on top of it: CI's fresh clone (and its .venv) can
    live under /tmp, and a sandbox that hid it could not start Python at all."""
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/usr/bin/bwrap")
    monkeypatch.setattr(sandbox, "readable", lambda: [Path("/tmp/clone/.venv"), Path("/tmp/clone/course_lib")])
    args = sandbox.command(["python", "-V"], tmp_path, hidden=[Path("/tmp/clone/solutions")])
    tmpfs = args.index("--tmpfs")
    for folder in ("/tmp/clone/.venv", "/tmp/clone/course_lib", str(tmp_path.resolve())):
        assert args.index(folder) > tmpfs, f"{folder} is mounted before the private /tmp, which hides it"
    # /tmp/clone itself is a tmpfs of its own, read-only once the mounts in it are made (a write there must fail)
    assert args[args.index("/tmp/clone") - 1] == "--tmpfs" and args.index("/tmp/clone") < args.index("/tmp/clone/.venv")
    ro = [args[i + 1] for i, a in enumerate(args) if a == "--remount-ro"]
    assert ro == ["/", "/tmp/clone"] and args.index("--remount-ro") > args.index(str(tmp_path.resolve()))



def test_cap_settings_of_cgroup_v2_v1_and_systemd():
    """What each mechanism is told (this machine has one of them; the others are checked by what they would
    write): memory, processes and the CPU quota, in each mechanism's own units."""
    limits = sandbox.Limits(memory_mb=100, max_procs=40, cpus=0.5)
    assert sandbox.cgroup_settings(limits, "cgroup v2") == {
        "memory.max": 100 << 20, "memory.swap.max": 0, "pids.max": 40, "cpu.max": "50000 100000"}
    assert sandbox.cgroup_settings(limits, "cgroup v1") == {
        "memory.limit_in_bytes": 100 << 20, "memory.memsw.limit_in_bytes": 100 << 20, "pids.max": 40,
        "cpu.cfs_period_us": 100000, "cpu.cfs_quota_us": 50000}
    prefix = sandbox.systemd_run_prefix(limits, unit="u")
    assert {"MemoryMax=100M", "MemorySwapMax=0", "TasksMax=40", "CPUQuota=50%", "--unit=u"} <= set(prefix)
    everything = sandbox.Limits(memory_mb=100, max_procs=40)
    cores = os.cpu_count() or 1
    assert sandbox.cgroup_settings(everything, "cgroup v2")["cpu.max"] == f"{cores * 100000} 100000"
    assert "CPU not capped" in sandbox.describe(limits, "rlimit")
