"""Launch Triton kernels on their inputs' GPU, whatever the calling thread's current device is;
and which GPUs take the Hopper (Gluon) kernels.

Why: Triton launches on the *current* CUDA device and stream, and the current device is
per-thread. The services run engine calls in worker threads (``asyncio.to_thread``), which start
on GPU 0: a draft on ``cuda:1`` launched its tree kernel on GPU 0 with GPU 1 pointers and got
garbage trees. Torch's own ops follow their tensors; these host wrappers now do too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["on_input_device", "is_hopper", "capability_major", "interpreted", "fix_interpreter_scalars",
           "tile_counters", "TILE_COUNTERS"]

F = TypeVar("F", bound=Callable)
TILE_COUNTERS = 1 << 14  # output tiles one launch may split over K (a counter each)
_COUNTER_BUFFERS: dict[tuple[int, int], torch.Tensor] = {}


def on_input_device(fn: F) -> F:
    """Runs ``fn(x, ...)`` with ``x.device`` current when ``x`` is a CUDA tensor on another GPU."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if isinstance(x, torch.Tensor) and x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def is_hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.x (cached per device): where the Gluon kernels run."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return capability_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


@functools.cache
def capability_major(index: int) -> int:
    """The compute capability's major number of CUDA device ``index`` (cached: launches ask it)."""
    return torch.cuda.get_device_capability(index)[0]


def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter here (``TRITON_INTERPRET=1``), where libdevice calls
    such as IEEE ``exp`` or ``mul.rn`` do not exist; its numpy arithmetic needs none of them."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fix_interpreter_scalars() -> None:
    """Makes Triton's interpreter turn a scalar argument into an index as later tritons do.

    Triton 3.6 (torch 2.11's pin) holds a scalar argument as a one-element array and indexes with
    ``int(array)``, which numpy 2.4 and later refuse for arrays of one dimension: under the interpreter
    every loop to a run-time bound (``tl.range(0, K, ...)``) failed on such a host. Later tritons
    squeeze the array first; this wraps the interpreter's tensor patch to do the same, once.
    Its patches are undone last in, first out, so the tensor class gets its own attribute back.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "scalars_fixed", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.scalars_fixed = True
    interpreter._patch_lang_tensor = patched


def tile_counters(device: torch.device) -> torch.Tensor:
    """``TILE_COUNTERS`` zeroed int32 counters for split-K kernels whose last slice to finish a tile
    adds the partials (``kernels.skinny_gemm``, the INT4 MoE's gate/up), and for the MoE
    alignment's expert counts (its last entries). One buffer a (device,
    stream), shared by every such kernel: launches on one stream never overlap, and each leaves the
    counters it used at zero, so the next launch (or graph replay) finds them zeroed."""
    if device.type != "cuda":  # the interpreter runs programs one after another
        key = (-1, 0)
    else:
        key = (device.index if device.index is not None else torch.cuda.current_device(),
               torch.cuda.current_stream(device).cuda_stream)
    if key not in _COUNTER_BUFFERS:
        _COUNTER_BUFFERS[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTER_BUFFERS[key]
