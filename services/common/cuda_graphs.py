"""Capturing a forward as a CUDA graph: the one recipe the verifier and the draft share.

Warm up on a side stream first: the first run compiles Triton kernels, picks cuBLAS and attention
algorithms and allocates workspaces, none of which may happen inside a capture. Capture in
``thread_local`` mode: the services capture in worker threads (the draft also on its event loop)
while other threads keep working (a handshake mapping a new peer's ring allocates and opens IPC
handles), and neither may break the other. The side stream is one per device, kept: the caching
allocator reuses a freed block only on the stream that freed it, so a new stream for each capture
would keep each warm-up's blocks cached apart (1 GB more held once the verifier's 104 buckets of
a 3-layer Kimi-K2 slice were captured).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["capture"]


def capture(fn: Callable[[], object], device: torch.device, pool: tuple | None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Runs ``fn`` once eagerly on a side stream, then captures it; returns the graph and what
    the captured call returned (its tensors are the graph's outputs, rewritten by each replay)."""
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]
