"""Which GPU a service runs on, made the process's current CUDA device at start-up.

Why pin it: everything that defaults to "the current device" (Triton kernel launches, bare "cuda"
allocations such as a shared ring, `torch.cuda.current_stream()`, CUDA graph capture) must land on
the GPU the service was given. Left at the default (cuda:0), a draft configured for cuda:1 would
launch its Triton tree builder on cuda:0 with pointers into cuda:1.
"""

from __future__ import annotations

import contextlib
import os

import torch

from services.common.settings import SettingsError

__all__ = ["pin_device", "current", "device_name", "seen_gpus", "visible_gpus"]


def pin_device(device: str | torch.device, setting: str = "device") -> torch.device:
    """Makes `device` current when it is a GPU; returns it with its index filled in ("cuda" -> "cuda:N").
    `setting` names where the device came from, for the error when there is no such GPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    count = visible_gpus(d, setting)
    if d.index is None and count:
        d = torch.device("cuda", torch.cuda.current_device())
    if (d.index or 0) >= count:
        raise SettingsError(f"{setting}: device {d} does not exist: {seen_gpus(count)}")
    torch.cuda.set_device(d)
    return d


def visible_gpus(device: str | torch.device, setting: str) -> int:
    """The GPUs this process sees, for a GPU ``device`` that ``setting`` asked for; a CPU build of
    torch is refused naming it."""
    if torch.version.cuda is None:
        raise SettingsError(f"{setting}: {device} asked for, but this torch build has no CUDA support "
                            f"(torch {torch.__version__}; a CPU build runs with device = \"cpu\")")
    return torch.cuda.device_count()


def seen_gpus(count: int) -> str:
    """How many GPUs this process sees, and why, for a message naming a GPU past them."""
    return f"this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"


def current(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` made current for a block (a no-op off the GPU). Worker threads start on GPU 0,
    whatever the service pinned: engine calls made in them wrap their work in this."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def device_name(device: torch.device) -> str:
    """What a service computes on, for the people reading its results: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
