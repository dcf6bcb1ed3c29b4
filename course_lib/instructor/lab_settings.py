"""JupyterLab as the course runs it, for `course lab` and the browser test (`course_lib.instructor.browser`): the settings every
learner gets (no news prompt, the course kernel without asking, every cell rendered) and the flags it needs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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
