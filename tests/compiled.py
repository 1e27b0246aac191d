"""Builds for a GPU target from the CPU test run: a child process, since conftest sets
``TRITON_INTERPRET`` for this one and Triton reads it once (the interpreter neither compiles nor
runs Gluon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH_FLAG = "--batch"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_compiled(argv: list[str], timeout: float = 600) -> dict:
    """``python *argv`` from the repo root without ``TRITON_INTERPRET``; its last stdout line as JSON.
    A failed child fails the calling test with its output."""
    proc = subprocess.run([sys.executable, *argv], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_compiled_batch(script: str, arg_lists: Sequence[Sequence[str]], children: int = 2,
                       timeout: float = 600) -> dict[tuple[str, ...], dict]:
    """Several builds of ``script`` (whose ``__main__`` calls ``build_main``), shared out over up to
    ``children`` child processes run side by side (CI has two cores): each child pays Python's,
    torch's and Triton's start-up once for its share. Returns each argument list's result; a build
    that raised gives ``{"error": traceback}`` (``build_result`` fails the test that asked for it)."""
    arg_lists = [list(a) for a in dict.fromkeys(tuple(a) for a in arg_lists)]
    shares = [arg_lists[k::children] for k in range(min(children, len(arg_lists)))]
    procs = [subprocess.Popen([sys.executable, script, BATCH_FLAG, json.dumps(share)], env=_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for share in shares]
    out: dict[tuple[str, ...], dict] = {}
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        assert proc.returncode == 0, f"build child failed:\n{stdout[-2000:]}\n{stderr[-4000:]}"
        for line in stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[tuple(row["args"])] = row
    return out


def build_result(results: dict[tuple[str, ...], dict], args: Sequence[str]) -> dict:
    """One build's result from ``run_compiled_batch``; a build that raised fails the caller with its traceback."""
    row = results[tuple(args)]
    assert "error" not in row, f"build failed:\n{row['error'][-4000:]}"
    return row["result"]


def build_main(build: Callable[[list[str]], dict]) -> None:
    """A build script's ``__main__``: ``--batch JSON`` runs each argument list of the JSON list and
    prints one line per build (its result, or the traceback it raised); otherwise one build from
    ``sys.argv[1:]``, printed as the last line (``run_compiled``)."""
    if sys.argv[1:2] == [BATCH_FLAG]:
        for args in json.loads(sys.argv[2]):
            try:
                row = dict(args=args, result=build(args))
            except Exception:  # noqa: BLE001 - reported to the test of this build
                row = dict(args=args, error=traceback.format_exc())
            print(json.dumps(row), flush=True)
    else:
        print(json.dumps(build(sys.argv[1:])))

