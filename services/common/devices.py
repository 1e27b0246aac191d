"""Which GPU a service runs on, made the process's current CUDA device at start-up.

Why pin it: everything that defaults to "the current device" (Triton kernel launches, bare "cuda"
allocations such as a shared ring, `torch.cuda.current_stream()`, CUDA graph capture) must land on
the GPU the service was given. Left at the default (cuda:0), a draft configured for cuda:1 would
launch its Triton tree builder on cuda:0 with pointers into cuda:1.
"""

from __future__ import annotations

import contextlib

import torch

from services.common.settings import SettingsError

__all__ = ["pin_device", "current"]


def pin_device(device: str | torch.device) -> torch.device:
    """Makes `device` current when it is a GPU; returns it with its index filled in ("cuda" -> "cuda:N")."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    if d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if d.index >= count:
        raise SettingsError(f"device {d} does not exist: this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(d)
    return d


def current(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made current for a block (a no-op off the GPU). Worker threads start on GPU 0,
    whatever the service pinned: engine calls made in them wrap their work in this."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
