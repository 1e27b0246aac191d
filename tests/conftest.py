"""Make the repo root (``services``, ``kernels``, ``bench``) and ``protos`` (``ddtree.v1``) importable,
and run Triton kernels in its interpreter where there is no GPU.

TRITON_INTERPRET must be set before triton's first import anywhere in the process, so it is set
here, before any test module is collected.
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = Path(__file__).resolve().parent.parent
for p in (_ROOT, _ROOT / "protos"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from ci_skips import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa: E402,F401
