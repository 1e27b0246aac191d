"""`make up` / `make test` on a machine whose Python is too old: a clear message before any install."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD_PYTHON = '#!/bin/sh\nif [ "$1" = "-V" ]; then echo "Python 3.10.12"; exit 0; fi\nexit 1\n'   # fails the version check

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def make_install(tmp_path: Path, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"PYTHON={python}", f"VENV={tmp_path / 'venv'}"],
                          capture_output=True, text=True, timeout=60)


def test_an_old_python_is_named_before_anything_is_installed(tmp_path):
    old = tmp_path / "python3"
    old.write_text(OLD_PYTHON)
    old.chmod(0o755)
    result = make_install(tmp_path, str(old))
    assert result.returncode != 0
    assert "needs Python >= 3.11" in result.stderr and "Python 3.10.12" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_a_venv_left_by_an_older_python_is_not_reused(tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    stale = tmp_path / "venv" / "bin" / "python"
    stale.write_text(OLD_PYTHON)
    stale.chmod(0o755)
    result = make_install(tmp_path, sys.executable)
    assert result.returncode != 0 and "holds Python 3.10.12; remove it (make clean)" in result.stderr
    assert sorted(p.name for p in (tmp_path / "venv").iterdir()) == ["bin"]
