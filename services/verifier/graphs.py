"""The verify forward under CUDA graphs: one capture per (batch bucket, tree-size bucket).

Why: a verify step launches a few dozen kernels per layer (61 layers on K2). Launched eagerly at
5-12 µs each that is several milliseconds, more than the step's HBM floor at small batch; replayed
from a graph each costs under a microsecond. The seeds' stack crashed under graphs at budgets
above 8; here every budget 1..128 has a bucket.

Padding keeps real rows exact: a tree is padded to its bucket's node count with nodes that see the
prefix and themselves only, and the batch with empty requests (no prefix, padding nodes only). No
real node sees a padding node, so a real node's output does not depend on them. Positions and
ancestor bits are computed inside the graph from the padded tokens / parents / depths / prefix
lengths, so a step is a few small copies into the static inputs, one replay, and a gather of the
real rows. Captures share one memory pool: replays never overlap, and a graph's outputs are
gathered before the next replay.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.tree_mla import TreeAttentionDeviceMetadata, pack_ancestor_bits
from services.common.logging import get_logger
from services.draft.tree import ancestor_mask
from services.verifier.kv_cache import PagedKVCache
from services.verifier.model import ForwardBatch, ForwardOutput, TargetModel

__all__ = ["BATCH_BUCKETS", "NODE_BUCKETS", "VerifyGraphs"]

# Tree sizes are budget + 1 (the root); budgets 0 (autoregressive), 1, 2, 4, 8, 12, 16, 24, 32,
# 48, 64, 96 and 128 fit their bucket exactly, others pad to the next one.
NODE_BUCKETS: tuple[int, ...] = (1, 2, 3, 5, 9, 13, 17, 25, 33, 49, 65, 97, 129)
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

log = get_logger("verifier")


@dataclass
class _Bucket:
    """Static inputs and outputs of one captured shape."""

    batch: int
    nodes: int
    tokens: Tensor  # [B, T] int64
    parents: Tensor  # [B, T] int64, -1 for roots and padding
    depths: Tensor  # [B, T] int64
    prefix_lens: Tensor  # [B] int32
    page_table: Tensor  # [B, max_pages] int32
    query_starts: Tensor  # [B + 1] int32, constant r * T
    output: ForwardOutput | None = None
    graph: torch.cuda.CUDAGraph | None = None


class VerifyGraphs:
    """Runs the target over padded tree batches: replayed from CUDA graphs, or eagerly.

    ``capture=False`` runs the same padded forward without graphs: the CPU tests check the
    padding with it, and the GPU check compares it with the replay.
    """

    def __init__(
        self,
        model: TargetModel,
        cache: PagedKVCache,
        max_context: int,
        feature_layers: Sequence[int] = (),
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        node_buckets: Sequence[int] = NODE_BUCKETS,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.max_pages = -(-max_context // cache.page_size)
        self.feature_layers = tuple(feature_layers)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.node_buckets = tuple(sorted(node_buckets))
        self.capture = capture
        self.device = model.embed_weight.device
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    def bucket_for(self, batch: int, max_nodes: int) -> tuple[int, int] | None:
        """Smallest (batch, nodes) bucket holding the step, or None (the caller runs eagerly)."""
        b = bisect.bisect_left(self.batch_buckets, batch)
        t = bisect.bisect_left(self.node_buckets, max_nodes)
        if b == len(self.batch_buckets) or t == len(self.node_buckets):
            return None
        return self.batch_buckets[b], self.node_buckets[t]

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, b in self._buckets.items() if b.graph is not None)

    # ---- one step ------------------------------------------------------------------------------
    def run(self, tokens: Tensor, parents: Tensor, depths: Tensor, sizes: Sequence[int],
            prefix_lens: Sequence[int], page_ids: Sequence[Sequence[int]]) -> ForwardOutput:
        """The forward for flat trees (request r owns the next ``sizes[r]`` entries, root first).

        Returns the real rows only, in the flat order given. Raises ValueError when no bucket
        holds the step (``bucket_for`` says so beforehand).
        """
        key = self.bucket_for(len(sizes), max(sizes))
        if key is None:
            raise ValueError(f"no graph bucket holds {len(sizes)} trees of up to {max(sizes)} nodes")
        b = self._bucket(*key)
        rows = self._load(b, tokens, parents, depths, sizes, prefix_lens, page_ids)
        if self.capture:
            if b.graph is None:
                self._capture(b)
            b.graph.replay()
            out = b.output
        else:
            out = self._forward(b)
        assert out is not None
        return ForwardOutput(logits=out.logits[rows], features=out.features[rows], new_kv=out.new_kv[:, rows])

    def _load(self, b: _Bucket, tokens: Tensor, parents: Tensor, depths: Tensor, sizes: Sequence[int],
              prefix_lens: Sequence[int], page_ids: Sequence[Sequence[int]]) -> Tensor:
        """Scatter the real trees into the padded static inputs; returns their rows [N] (device)."""
        dev, T = self.device, b.nodes
        rows = torch.cat([torch.arange(s) + r * T for r, s in enumerate(sizes)]).to(dev)   # [N]
        b.tokens.view(-1).fill_(0).index_copy_(0, rows, tokens.to(dev))
        b.parents.view(-1).fill_(-1).index_copy_(0, rows, parents.to(dev))
        b.depths.view(-1).fill_(0).index_copy_(0, rows, depths.to(dev))
        lens = torch.zeros(b.batch, dtype=torch.int32)
        lens[:len(prefix_lens)] = torch.tensor(list(prefix_lens), dtype=torch.int32)
        b.prefix_lens.copy_(lens)
        used = max(1, max(len(p) for p in page_ids))
        table = torch.zeros(b.batch, used, dtype=torch.int32)   # only a request's first pages are read
        for r, pages in enumerate(page_ids):
            table[r, :len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
        b.page_table[:, :used].copy_(table)
        return rows

    # ---- the padded forward --------------------------------------------------------------------
    def _bucket(self, batch: int, nodes: int) -> _Bucket:
        key = (batch, nodes)
        if key not in self._buckets:
            dev = self.device

            def ints(*shape: int, fill: int = 0, dtype: torch.dtype = torch.int64) -> Tensor:
                return torch.full(shape, fill, dtype=dtype, device=dev)

            self._buckets[key] = _Bucket(
                batch, nodes, tokens=ints(batch, nodes), parents=ints(batch, nodes, fill=-1),
                depths=ints(batch, nodes), prefix_lens=ints(batch, dtype=torch.int32),
                page_table=ints(batch, self.max_pages, dtype=torch.int32),
                query_starts=(torch.arange(batch + 1, dtype=torch.int32) * nodes).to(dev))
        return self._buckets[key]

    def _forward(self, b: _Bucket) -> ForwardOutput:
        """Everything from the static inputs: no host sync, so it can be captured."""
        words = max(1, -(-b.nodes // 32))
        bits = pack_ancestor_bits(ancestor_mask(b.parents), words)   # [B, T, words]
        positions = b.prefix_lens.to(torch.int64)[:, None] + b.depths   # [B, T]
        meta = TreeAttentionDeviceMetadata(
            query_starts=b.query_starts, prefix_lens=b.prefix_lens, page_table=b.page_table,
            ancestor_bits=bits.view(b.batch * b.nodes, words), max_nodes=b.nodes)
        batch = ForwardBatch(input_ids=b.tokens.view(-1), positions=positions.view(-1), attn=meta)
        return self.model(batch, self.cache, feature_layers=self.feature_layers)

    def _capture(self, b: _Bucket) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks), then capture."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            b.output = self._forward(b)
        b.graph = graph
        log.info("graph_captured", batch=b.batch, nodes=b.nodes, seconds=round(time.perf_counter() - t0, 2))
