"""The committed stubs must be exactly what protos/generate.sh writes from the .proto files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "protos" / "generate.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "PYTHON": sys.executable})
    committed = sorted((ROOT / "protos" / "ddtree" / "v1").glob("*_pb2*.py*"))
    fresh = sorted((tmp_path / "ddtree" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in committed] == [p.name for p in fresh]
    stale = [p.name for p, q in zip(committed, fresh) if p.read_bytes() != q.read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run `make protos` and commit the result"
