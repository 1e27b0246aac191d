"""CI fails on a skip it does not expect (``tests/ci_skips.py``), and only under ``DDTREE_CI``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SAMPLE = '''
import pytest

@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu_only():
    pass

@pytest.mark.skipif(True, reason="needs triton")
def test_kernel():
    pass

def test_runs():
    assert True
'''


def run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_CI"} | {"PYTHONPATH": str(TESTS)}
    if ci:
        env["DDTREE_CI"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_ci_does_not_expect_fails_the_run_and_is_named(tmp_path):
    result = run(tmp_path, ci=True)
    assert result.returncode == 1, result.stdout
    assert "skips CI does not allow" in result.stdout and "test_kernel: needs triton" in result.stdout
    assert "test_gpu_only" not in result.stdout.split("skips CI does not allow")[1]


def test_outside_ci_a_skip_is_a_skip(tmp_path):
    result = run(tmp_path, ci=False)
    assert result.returncode == 0 and "1 passed, 2 skipped" in result.stdout, result.stdout
