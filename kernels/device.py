"""Launch Triton kernels on their inputs' GPU, whatever the calling thread's current device is.

Why: Triton launches on the *current* CUDA device and stream, and the current device is
per-thread. The services run engine calls in worker threads (``asyncio.to_thread``), which start
on GPU 0: a draft on ``cuda:1`` launched its tree kernel on GPU 0 with GPU 1 pointers and got
garbage trees. Torch's own ops follow their tensors; these host wrappers now do too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["on_input_device"]

F = TypeVar("F", bound=Callable)


def on_input_device(fn: F) -> F:
    """Runs ``fn(x, ...)`` with ``x.device`` current when ``x`` is a CUDA tensor on another GPU."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if isinstance(x, torch.Tensor) and x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
