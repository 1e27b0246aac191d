"""Capturing a forward as a CUDA graph: the one recipe the verifier and the draft share.

Warm up on a side stream first: the first run compiles Triton kernels, picks cuBLAS and attention
algorithms and allocates workspaces, none of which may happen inside a capture. Capture in
``thread_local`` mode: the services capture in worker threads (the draft also on its event loop)
while other threads keep working (a handshake mapping a new peer's ring allocates and opens IPC
handles), and neither may break the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["capture"]


def capture(fn: Callable[[], object], device: torch.device, pool: tuple | None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Runs ``fn`` once eagerly on a side stream, then captures it; returns the graph and what
    the captured call returned (its tensors are the graph's outputs, rewritten by each replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
