"""Builds for a GPU target from the CPU test run: a child process, since conftest sets
``TRITON_INTERPRET`` for this one and Triton reads it once (the interpreter neither compiles nor
runs Gluon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_compiled(argv: list[str], timeout: float = 600) -> dict:
    """``python *argv`` from the repo root without ``TRITON_INTERPRET``; its last stdout line as JSON.
    A failed child fails the calling test with its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
