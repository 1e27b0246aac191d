"""Make the repo root (``services``, ``kernels``, ``bench``) and ``protos`` (``ddtree.v1``) importable."""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for p in (_ROOT, _ROOT / "protos"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
