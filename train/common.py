"""Small pieces the demo training scripts share: data, schedule, logging, device choice."""

from __future__ import annotations

import csv
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

__all__ = ["pick_device", "seed_everything", "load_tokens", "Schedule", "CsvLog", "progress_bar", "device_name",
           "write_json"]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """A uint16 ``.npy`` token stream as int64 on ``device`` ([n])."""
    return torch.from_numpy(np.load(path).astype(np.int64)).to(device)


class Schedule:
    """Linear warm-up then cosine decay to ``min_ratio``, driven by progress in [0, 1].

    Progress is ``max(step / steps, elapsed / budget_s)``: the run ends after ``steps`` steps or
    ``budget_s`` seconds, whichever comes first, and the learning rate still anneals fully, so a
    slower machine gives a shorter but complete run (the log records the steps actually done).
    """

    def __init__(self, lr: float, steps: int, budget_s: float | None, warmup: int, min_ratio: float = 0.1) -> None:
        self.lr, self.steps, self.budget_s, self.warmup, self.min_ratio = lr, steps, budget_s, warmup, min_ratio
        self.t0 = time.time()

    def progress(self, step: int) -> float:
        p = step / self.steps
        if self.budget_s:
            p = max(p, (time.time() - self.t0) / self.budget_s)
        return min(p, 1.0)

    def lr_at(self, step: int) -> float:
        p = self.progress(step)
        warm = min(1.0, (step + 1) / max(1, self.warmup))
        cos = self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
        return self.lr * warm * cos

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0

    def elapsed(self) -> float:
        return time.time() - self.t0


class CsvLog:
    """Append-only CSV of training rows (flushed on every write so a killed run keeps its log)."""

    def __init__(self, path: Path, fields: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w", newline="")
        self._w = csv.DictWriter(self._f, fieldnames=fields)
        self._w.writeheader()

    def write(self, **row) -> None:
        self._w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def progress_bar(total: int, desc: str):
    """tqdm when installed (it is a project dependency), else a no-op stand-in."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; the fallback keeps bare images working
        class _Bar:
            def update(self, n: int = 1) -> None: ...
            def set_postfix(self, **kw) -> None: ...
            def close(self) -> None: ...
        return _Bar()
    return tqdm(total=total, desc=desc, mininterval=2.0 if sys.stderr.isatty() else 15.0, dynamic_ncols=True)


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
