"""Run a lesson in a real JupyterLab, in headless Chromium, the way a learner would (Run > Run All Cells).

Not part of the test suite (it needs Debian's `chromium` and the `browser` extra: `pip install -e .[browser]`);
run it before a release and look at the screenshot:

    .venv/bin/python tools/lab_smoke.py notebooks/00_getting_started.ipynb --out runs/lab_smoke.png

It starts `course lab` settings (no news prompt), opens the notebook, runs all cells, waits until every code cell
has an execution count and the kernel is idle, fails if any cell shows an error, and saves a screenshot.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebook")
    parser.add_argument("--out", default=str(ROOT / "runs" / "lab_smoke.png"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    from course_lib import procs
    from course_lib.cli import lab_flags, write_lab_settings

    write_lab_settings()
    port, token = free_port(), "smoke"
    tag = procs.new_tag("labsmoke")
    env = dict(os.environ, **{procs.TAG_VAR: tag})
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={ROOT}", "--ServerApp.ip=127.0.0.1", *lab_flags()],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ok = False
    try:
        deadline = time.time() + 90
        while time.time() < deadline:  # wait for the server to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        # Work on a copy next to the original (JupyterLab saves outputs into the file it runs).
        source = Path(args.notebook).resolve()
        copy = source.with_name(f"_smoke_{source.name}")
        copy.write_bytes(source.read_bytes())
        # A fresh workspace (?reset): no tabs restored from an earlier session.
        url = (f"http://127.0.0.1:{port}/lab/workspaces/smoke-{os.getpid()}/tree/{copy.relative_to(ROOT)}"
               f"?reset&token={token}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            t0 = time.time()
            page.goto(url, timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_timeout(3000)  # a kernel dialog, if any, shows up now
            dialogs = page.locator(".jp-Dialog").count()
            print(f"notebook open after {time.time() - t0:.1f} s; dialogs shown: {dialogs}")
            page.click("text=Run", timeout=10_000)
            page.click("text=Run All Cells", timeout=10_000)
            panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
            n_code = panel.locator(".jp-CodeCell").count()
            deadline = time.time() + args.timeout
            while time.time() < deadline:
                counts = panel.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
                done = sum(1 for c in counts if c.strip() not in ("[ ]:", "[*]:", ""))
                errors = panel.locator("[data-mime-type='application/vnd.jupyter.error']").count()
                if errors or done == n_code:
                    break
                time.sleep(2)
            print("prompts:", " ".join(c.strip() for c in counts))
            print(f"{done}/{n_code} code cells ran in {time.time() - t0:.1f} s; cells with errors: {errors}")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=False)
            print("screenshot:", args.out)
            ok = done == n_code and errors == 0 and dialogs == 0
            browser.close()
    finally:
        procs.kill_tree(server.pid, tag=tag, grace_s=2)
        if "copy" in locals():
            copy.unlink(missing_ok=True)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
