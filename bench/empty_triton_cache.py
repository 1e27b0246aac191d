"""An empty Triton cache for this process, for the first-use scripts (``bench.draft_first_use``,
``bench.verify_first_use``). Imported before anything imports triton, it points
``TRITON_CACHE_DIR`` at a new directory, so every kernel the process launches compiles there and
each compile shows as a new entry."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["CACHE", "kernels_in_cache"]

CACHE = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = CACHE


def kernels_in_cache() -> dict[str, str]:
    """Cache entry -> the kernel it holds (the name of its metadata file)."""
    names = {}
    for entry in Path(CACHE).iterdir():
        meta = [p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp__")]
        names[entry.name] = meta[0] if meta else "?"
    return names
