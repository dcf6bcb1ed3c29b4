"""`course lab` lands on the course index, on a laptop and on a remote node, and gives each learner of a shared GPU
node a slice of its GPUs; `course lab-report --gpus` checks such a slice (issue 36).

No GPU is needed: CUDA is mocked (as in tests/test_gpu_paths.py) and what is checked is the server's command and the
environment its kernels, and the ranks they start, inherit. One test starts the real `course lab` on a free port,
reads the URL it prints, opens it (in headless Chromium where /usr/bin/chromium is installed: the page shows the
index) and stops it with SIGTERM, leaving no process behind.
"""

from __future__ import annotations

import getpass
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from course_lib.instructor import cli
from course_lib.runtime import gpus
from course_lib.instructor import lab_report
from course_lib.runtime import procs
from course_lib import dist as cdist
from course_lib.runtime.launch import run

INDEX_PATH = "/lab/tree/notebooks/index.ipynb"


@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(n): a machine with n GPUs whose CUDA honours CUDA_VISIBLE_DEVICES, as the driver does (nothing can
    run on them). The GPU variables of this process are restored after the test."""
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(var, "")          # recorded: monkeypatch puts back what was there (or nothing)
        monkeypatch.delenv(var)

    def install(n: int):
        def count():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return n if visible is None else len([e for e in visible.split(",") if e.strip()])

        monkeypatch.setattr(torch.cuda, "is_available", lambda: count() > 0)
        monkeypatch.setattr(torch.cuda, "device_count", count)
        monkeypatch.setattr(cdist, "_ANNOUNCED", set())
    return install


@pytest.fixture
def nothing_starts(monkeypatch):
    """`course lab` must refuse before it starts anything: starting a process fails the test."""
    def refuse(*a, **k):
        raise AssertionError(f"a process was started: {a[0] if a else k}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------------------ the index, the URL

def test_the_server_lands_on_the_index_on_the_port_asked(monkeypatch):
    monkeypatch.setattr(cli, "browser_available", lambda: True)
    port = procs.free_port()
    plan = cli.plan_lab(port=port)
    assert (cli.ROOT / cli.INDEX).is_file() and cli.INDEX_URL == INDEX_PATH
    assert f"--LabApp.default_url={INDEX_PATH}" in plan.cmd                 # printed URLs and the browser go there
    assert f"--ServerApp.port={port}" in plan.cmd and "--ServerApp.port_retries=0" in plan.cmd  # never another port
    assert "--no-browser" not in plan.cmd and plan.open_browser
    assert cli.plan_lab(port=port, no_browser=True).cmd.count("--no-browser") == 1
    monkeypatch.setattr(cli, "browser_available", lambda: False)             # none found: Jupyter tries none
    assert "--no-browser" in cli.plan_lab(port=port).cmd
    server = {"url": "http://localhost:8891/", "token": "abc", "port": 8891}
    assert cli.index_url(server) == f"http://localhost:8891{INDEX_PATH}?token=abc"


def test_the_tunnel_line_names_the_port_this_user_and_this_machine(monkeypatch):
    monkeypatch.setattr(cli, "browser_available", lambda: False)
    port = procs.free_port()
    me = f"{getpass.getuser()}@{socket.gethostname()}"
    assert cli.plan_lab(port=port).tunnel() == f"ssh -L {port}:localhost:{port} {me}"
    assert cli.plan_lab(ip="0.0.0.0", port=port).tunnel() == f"ssh -L {port}:localhost:{port} {me}"
    assert "--ServerApp.ip=0.0.0.0" in cli.plan_lab(ip="0.0.0.0", port=port).cmd


def test_an_ssh_session_without_a_display_has_no_browser(monkeypatch):
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.2 50000 10.0.0.9 22")
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert cli.browser_available() is False


# ------------------------------------------------------------------------------------------ a slice of the GPUs

def test_gpus_slice_is_what_kernels_and_backend_policy_see(fake_gpus, monkeypatch, capsys):
    fake_gpus(8)
    monkeypatch.setattr(cli, "browser_available", lambda: False)
    plan = cli.plan_lab(port=procs.free_port(), gpus="2,3")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3" and plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert plan.gpus == [2, 3] and "runs of up to 2 ranks use NCCL" in plan.notes[0]
    assert plan.env["PATH"] == os.environ["PATH"]                           # the rest of the environment kept

    # The server is started with that environment (its kernels inherit it): Popen is caught, nothing runs.
    started = {}

    class FakeServer:
        pid, returncode = 0, 0

        def __init__(self, cmd, **kw):
            started.update(kw, cmd=cmd)

        def poll(self):
            return 0

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeServer)
    monkeypatch.setattr(cli, "write_lab_settings", lambda: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)          # leave pytest's own handlers alone
    assert cli.main(["lab", "--gpus", "2,3", "--port", str(procs.free_port()), "--no-browser"]) == 0
    assert started["env"]["CUDA_VISIBLE_DEVICES"] == "2,3" and f"--LabApp.default_url={INDEX_PATH}" in started["cmd"]
    assert "CUDA_VISIBLE_DEVICES=2,3" in capsys.readouterr().out

    # In a kernel of that server, CUDA sees 2 GPUs: NCCL for up to 2 ranks, gloo for 4, said once.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", plan.env["CUDA_VISIBLE_DEVICES"])
    assert torch.cuda.device_count() == 2
    assert [cdist.pick_backend(n) for n in (1, 2)] == ["nccl", "nccl"] and capsys.readouterr().out == ""
    assert cdist.pick_backend(4) == "gloo"
    assert "4 ranks need 4 GPUs (one per rank) and this machine has 2" in capsys.readouterr().out


def test_every_rank_a_kernel_starts_inherits_the_slice(monkeypatch):
    """The ranks `launch.run` starts from a kernel whose environment holds the slice see the same slice (gloo here:
    there is no real GPU)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    res = run(_visible_devices, 2, backend="gloo", stream=False, fresh=True, timeout_s=120)
    assert res.returns == ["2,3", "2,3"]


def _visible_devices():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_ids_count_among_gpus_the_shell_already_restricts():
    assert gpus.visible_devices_env([0, 1], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert gpus.visible_devices_env([1], uuids) == {"CUDA_VISIBLE_DEVICES": "GPU-bb"}
    assert gpus.visible_devices_env([3, 0], {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}) == \
        {"CUDA_VISIBLE_DEVICES": "3,0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert gpus.parse_gpus("4-6,0", 8) == [4, 5, 6, 0]


@pytest.mark.parametrize(("spec", "n", "says"), [
    ("2,8", 8, "this machine has 8 GPUs (ids 0-7), no GPU 8"),
    ("2,3", 0, "this machine has no GPU that torch can see"),
    ("2,,3", 8, "'' is not a GPU id"),
    ("3-1", 8, "goes backwards (write 1-3)"),
    ("2,2", 8, "GPU 2 is named twice"),
    ("two", 8, "'two' is not a GPU id"),
])
def test_bad_gpus_are_refused_before_anything_starts(spec, n, says, fake_gpus, nothing_starts, capsys):
    fake_gpus(n)
    assert cli.main(["lab", "--gpus", spec, "--port", str(procs.free_port())]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("course lab: --gpus") and says in err


def test_a_port_in_use_is_refused_naming_another(nothing_starts, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["lab", "--port", str(port)]) == 2
    err = _one_line_error(capsys)
    assert f"--port {port}" in err and "in use" in err and re.search(r"e\.g\. --port \d+", err)
    assert cli.main(["lab", "--port", "70000"]) == 2 and "1 to 65535" in _one_line_error(capsys)
    for flags in (["--ip", "192.0.2.1"], ["--ip", "192.0.2.1", "--port", "8891"]):   # TEST-NET: not this machine's
        assert cli.main(["lab", *flags]) == 2
        assert "--ip 192.0.2.1" in (err := _one_line_error(capsys)) and "not an address of this machine" in err


# ------------------------------------------------------------------------------------------ course lab-report --gpus

def test_lab_report_runs_on_the_slice_and_refuses_a_missing_gpu(fake_gpus, monkeypatch, tmp_path, capsys):
    fake_gpus(8)
    seen = {}

    def fake_run_report(keys, found, out, **kw):
        seen.update(keys=keys, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), count=torch.cuda.device_count())
        return {"hardware": "fake", "quick": True, "lessons": [], "wall_s": 0.0, "exit_code": 0}

    monkeypatch.setattr(lab_report, "run_report", fake_run_report)
    args = ["lab-report", "--lessons", "00", "--out", str(tmp_path), "--no-gpu-check"]
    assert cli.main([*args, "--gpus", "6,7"]) == 0
    assert seen == {"keys": ["00"], "visible": "6,7", "count": 2}    # the self-test and the kernels see 2 GPUs
    assert "GPUs 6,7 (CUDA_VISIBLE_DEVICES=6,7)" in capsys.readouterr().out
    seen.clear()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cli.main([*args, "--gpus", "9"]) == 2 and seen == {}
    err = _one_line_error(capsys)
    assert err.startswith("course lab-report: --gpus 9") and "ids 0-7" in err


# ------------------------------------------------------------------------------------------ the real server

def _read_lines(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def test_course_lab_prints_the_index_url_and_the_tunnel_and_stops_cleanly(tmp_path):
    port = procs.free_port()
    tag = procs.new_tag("testlab")
    env = dict(os.environ, CI="true", JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               **{procs.TAG_VAR: tag})
    env.pop("MPLBACKEND", None)
    with open(tmp_path / "jupyter.log", "w") as log:
        lab = subprocess.Popen([sys.executable, "-m", "course_lib.instructor.cli", "lab", "--no-browser", "--port", str(port)],
                               cwd=cli.ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=log, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(lab.stdout, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith("    ssh -L") for line in lines) and time.monotonic() < deadline:
            assert lab.poll() is None, "".join(lines)
            time.sleep(0.2)
        out = "".join(lines)
        urls = re.findall(r"^    (http://\S+)$", out, re.M)
        assert urls, out
        url = urls[0]
        assert re.fullmatch(rf"http://localhost:{port}{INDEX_PATH}\?token=\w+", url), url
        assert f"    ssh -L {port}:localhost:{port} {getpass.getuser()}@{socket.gethostname()}\n" in out
        # Jupyter's own URLs and its browser-open file go to the index too (its default URL).
        from jupyter_core.paths import jupyter_runtime_dir
        from jupyter_server.serverapp import list_running_servers

        [server] = [s for s in list_running_servers() if s["port"] == port]
        assert f"{INDEX_PATH}?token=" in (tmp_path / "jupyter.log").read_text()
        opener = os.path.join(jupyter_runtime_dir(), f"jpserver-{server['pid']}-open.html")
        with open(opener) as f:
            assert f"{INDEX_PATH}?token=" in f.read()
        with urllib.request.urlopen(url, timeout=30) as page:             # JupyterLab's page for the index
            assert page.status == 200 and "jupyter-config-data" in page.read().decode()
        chromium = os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium")
        if os.path.isfile(chromium):                                      # the page a learner sees shows the index
            dom = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'chromium'}",
                 "--virtual-time-budget=20000", "--dump-dom", url],
                capture_output=True, text=True, timeout=90, env={**env, procs.TAG_VAR: procs.nested_tag(tag)}).stdout
            assert 'lm-TabBar-tabLabel">index.ipynb<' in dom, dom[-2000:]
            assert "course index" in dom                                  # the notebook's own title, rendered
    finally:
        lab.send_signal(signal.SIGTERM)                                   # passed on: Jupyter shuts its kernels down
        try:
            status = lab.wait(timeout=60)
        finally:
            procs.kill_tree(lab.pid, tag=tag, grace_s=1)
    assert status == 0
    assert procs.tagged_processes(tag) == []
