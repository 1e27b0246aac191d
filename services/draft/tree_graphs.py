"""The tree build on the propose graphs' output, under CUDA graphs, brought to the host in one copy.

Why: on the GPU a propose is one graph replay, but the tree build after it was a few eager
launches (the vocabulary top-k, the tree kernel) and four device-to-host copies, each a sync. On
an H200 with the demo drafter (``bench/draft_probe.py --graphs``, ``bench/results/draft-probe-graphs.json``)
that took 0.20-0.22 ms at batch 1, against 0.11-0.12 ms replayed with the trees packed into one
int64 block that the graph copies into pinned memory; propose plus trees on the host went from
0.51-0.59 ms to 0.40-0.50. In the service at C=1 the step's tree time went from 0.51-0.63 ms to
0.31-0.37.

A graph is captured per (batch bucket, budget), reading the leading rows of the propose graphs'
output buffer, whose address never changes, at its full depth. Rows past the batch hold the
padding rows' logits that the propose graph wrote for its own bucket (the same buckets); their
trees are built and dropped. A shallower tree (a request near its context limit) is built eagerly,
so those few steps do not each capture a graph. ``capture=False`` runs the same packed build
eagerly (the CPU path and tests).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.cuda_graphs import capture
from services.draft.propose_graphs import batch_buckets
from services.draft.tree import TreeBatch, build_trees_from_logits

__all__ = ["HostTrees", "TreeGraphs", "pack_trees", "unpack_trees"]

# sizes [R], then tokens / parents / depths [R, budget + 1], all int64 on the host
HostTrees = tuple[Tensor, Tensor, Tensor, Tensor]


def pack_trees(batch: TreeBatch) -> Tensor:
    """``[R, 1 + 3 (budget + 1)]`` int64: each tree's size, tokens, parents and depths in one row,
    so one copy brings a step's trees to the host."""
    return torch.cat([batch.sizes[:, None], batch.tokens, batch.parents, batch.depths], dim=1).to(torch.int64)


def unpack_trees(packed: Tensor, rows: int) -> HostTrees:
    """The first ``rows`` trees of ``pack_trees``' block, as copies (the block is reused)."""
    n = (packed.shape[1] - 1) // 3
    p = packed[:rows].clone()
    return p[:, 0], p[:, 1:1 + n], p[:, 1 + n:1 + 2 * n], p[:, 1 + 2 * n:]


@dataclass
class _TreeGraph:
    roots_host: Tensor  # [batch] int64, pinned on CUDA
    roots: Tensor  # [batch] int64 on the buffer's device
    out_host: Tensor  # [batch, 1 + 3 (budget + 1)] int64, pinned on CUDA: the graph copies the trees here
    graph: torch.cuda.CUDAGraph | None = None


class TreeGraphs:
    """``build_trees_from_logits`` over the leading rows of ``logits`` (``[rows, D, V]``, the propose
    graphs' output buffer), one replay and one copy a call, at the propose graphs' batch buckets."""

    def __init__(self, logits: Tensor, capture: bool = True) -> None:
        self.buffer = logits
        self.batch_buckets = batch_buckets(logits.shape[0])
        self.capture = capture
        self._graphs: dict[tuple[int, int], _TreeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, g in self._graphs.items() if g.graph is not None)

    def holds(self, logits: Tensor, depth: int) -> bool:
        """Whether ``logits`` is the buffer's leading rows (what a replayed propose returns), a
        bucket holds them and ``depth`` is the buffer's: else the caller builds eagerly."""
        buf = self.buffer
        return (logits.data_ptr() == buf.data_ptr() and logits.stride() == buf.stride()
                and logits.shape[1:] == buf.shape[1:] and depth == buf.shape[1]
                and self._bucket(logits.shape[0]) is not None)

    def build(self, logits: Tensor, budget: int, depth: int, roots: Tensor) -> HostTrees | None:
        """The trees of ``build_trees_from_logits(logits[:, :depth], budget, roots)`` on the host, or None
        where ``holds`` says no. ``roots``: [R] int64 on the host."""
        if not self.holds(logits, depth):
            return None
        rows = logits.shape[0]
        batch = self._bucket(rows)
        g = self._graph(batch, budget)
        g.roots_host.zero_()  # every call ends synchronised, so the pinned twins are free to rewrite
        g.roots_host[:rows] = roots
        g.roots.copy_(g.roots_host, non_blocking=True)
        if not self.capture:
            self._run(g, batch, budget)
            return unpack_trees(g.out_host, rows)
        if g.graph is None:
            self._capture(g, batch, budget)
        g.graph.replay()
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the copy into out_host has landed
        return unpack_trees(g.out_host, rows)

    def warm_up(self, budgets: Sequence[int]) -> int:
        """Captures every batch bucket at these budgets now, not during a user's step; returns the count."""
        for budget in budgets:
            for batch in self.batch_buckets:
                g = self._graph(batch, budget)
                if self.capture and g.graph is None:
                    self._capture(g, batch, budget)
        return len(self.captured)

    def _bucket(self, rows: int) -> int | None:
        """The smallest batch bucket holding ``rows`` trees, or None."""
        b = bisect.bisect_left(self.batch_buckets, rows)
        return self.batch_buckets[b] if b < len(self.batch_buckets) else None

    def _graph(self, batch: int, budget: int) -> _TreeGraph:
        key = (batch, budget)
        if key not in self._graphs:
            pin = self.capture
            roots_host = torch.zeros(batch, dtype=torch.int64, pin_memory=pin)
            self._graphs[key] = _TreeGraph(
                roots_host=roots_host, roots=roots_host.to(self.buffer.device, copy=True),
                out_host=torch.zeros(batch, 1 + 3 * (budget + 1), dtype=torch.int64, pin_memory=pin))
        return self._graphs[key]

    def _capture(self, g: _TreeGraph, batch: int, budget: int) -> None:
        g.graph, _ = capture(lambda: self._run(g, batch, budget), self.buffer.device, self._pool)

    def _run(self, g: _TreeGraph, batch: int, budget: int) -> None:
        """The build from the static inputs, ending in the copy to pinned memory: no host sync."""
        trees = build_trees_from_logits(self.buffer[:batch], budget, g.roots)
        g.out_host.copy_(pack_trees(trees), non_blocking=self.capture)
