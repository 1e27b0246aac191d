"""The drafter's propose and context commit under CUDA graphs, over a pool of contexts.

Why: a propose is some 80 small launches on the demo drafter (norms, projections, rope,
attention, MLP per layer). Launched eagerly they took 5-9 ms of host time a step on an H200, and
the attention call alone over 1 ms a layer, against well under a millisecond of GPU work: more
than the verify step at C=1, which made DDTree lose to plain decoding there. Replayed, a propose
is one launch. The commit of each step's accepted tokens (feature projection, per-layer keys
and values, a scatter into the pool) is captured likewise, per bucket of committed tokens.

Contexts live in a pool, ``[layers, rows, context, kv_heads, head_dim]`` keys and values on the
GPU, one row per request while its context fits, so a graph reads any request's context through
a row index instead of per-request copies. A request whose context outgrows its row moves to its
own storage and proposes eagerly; so does a batch larger than the pool.

Padding keeps real rows exact: the batch pads with row 0 at length 0 (every context key masked;
its output is discarded), and contexts pad to the bucket with masked keys, as the eager propose
pads to the longest. A commit pads with tokens written to a scratch row no request owns. Captures share one memory pool and write into one output buffer, so the
memory does not grow with the number of buckets; a returned view is valid until the next propose.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.cuda_graphs import capture
from services.common.logging import get_logger

__all__ = ["BATCH_BUCKETS", "COMMIT_BUCKETS", "batch_buckets", "context_buckets", "ProposeGraphs"]

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
COMMIT_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)   # tokens committed in a step
_CONTEXT_STEP = 64

log = get_logger("draft")

# forward(bonus [R], lengths [R], context_kv(layer) -> (k, v) [R, L, kvh, hd], L) -> [R, B-1, V]
BlockForward = Callable[[Tensor, Tensor, Callable[[int], tuple[Tensor, Tensor]], int], Tensor]
# context_kv(features [N, F], positions [N]) -> keys, values [layers, N, kvh, hd]
ContextKV = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def batch_buckets(rows: int) -> tuple[int, ...]:
    """The batch sizes captured for a pool of ``rows`` contexts: ``BATCH_BUCKETS`` below it, then ``rows``."""
    return tuple(b for b in BATCH_BUCKETS if b < rows) + (rows,)


def context_buckets(limit: int) -> tuple[int, ...]:
    """Multiples of 64, each at most 1.5x the one before, up to ``limit``: padded keys cost at most
    half the attention of a step, and a run meets a new shape every ~50% of context growth. A limit
    below one step is the one bucket (a 64-key bucket over a shorter pool row failed its forward)."""
    out = [min(_CONTEXT_STEP, limit)]
    while out[-1] < limit:
        nxt = max(out[-1] + _CONTEXT_STEP, (out[-1] * 3 // 2) // _CONTEXT_STEP * _CONTEXT_STEP)
        out.append(min(nxt, limit))
    return tuple(out)


@dataclass
class _Graph:
    """Static inputs of one captured shape.

    Propose (``context`` > 0): ``inputs`` = [rows | lengths | bonus], int64 [3, batch].
    Commit (``context`` == 0): ``inputs`` = [rows | positions], int64 [2, batch] with ``batch``
    the token bucket, and ``features`` [batch, F] the committed tokens' target features.
    """

    batch: int
    context: int
    inputs: Tensor  # int64 (device)
    host: Tensor  # same, pinned host memory on CUDA
    features: Tensor | None = None
    copied: torch.cuda.Event | None = None   # the last host -> device copy; the host twin is reused after it
    graph: torch.cuda.CUDAGraph | None = None


class ProposeGraphs:
    """A context pool plus the captured block forwards that read it.

    ``capture=False`` runs the same pooled, padded forward eagerly: the CPU tests check the pool
    and the padding with it, and the GPU check compares it with the replay.
    """

    def __init__(self, forward: BlockForward, context_kv: ContextKV, num_features: int, num_layers: int,
                 kv_heads: int, head_dim: int, rows: int, context: int, out_shape: tuple[int, int],
                 dtype: torch.dtype, device: torch.device, capture: bool = True) -> None:
        if rows < 1 or context < 1:
            raise ValueError(f"a context pool needs rows >= 1 and context >= 1, got {rows} and {context}")
        self.forward = forward
        self.context_kv = context_kv
        self.num_features = num_features
        self.dtype = dtype
        self.rows = rows
        self.context = context
        self.device = device
        self.capture = capture
        shape = (num_layers, rows + 1, context, kv_heads, head_dim)   # row `rows`: the commits' scratch
        self.keys = torch.zeros(shape, dtype=dtype, device=device)    # [layers, rows + 1, context, kvh, hd]
        self.values = torch.zeros_like(self.keys)                       # [layers, rows + 1, context, kvh, hd]
        self.batch_buckets = batch_buckets(rows)
        self.context_buckets = context_buckets(context)
        self.out = torch.empty(rows, *out_shape, dtype=dtype, device=device)  # [rows, B-1, V] logits
        self._free = list(range(rows - 1, -1, -1))   # a stack: row 0 is handed out first
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def pool_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, g in self._graphs.items() if g.graph is not None)

    # ---- rows ----------------------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A free pool row, zeroed, or None when every row is taken (the context then keeps its own
        storage). Zeroed because masked keys still enter the attention as 0 x value: a NaN that an
        earlier request left in the row would reach the next one."""
        if not self._free:
            return None
        row = self._free.pop()
        self.keys[:, row].zero_()
        self.values[:, row].zero_()
        return row

    def release(self, row: int) -> None:
        assert 0 <= row < self.rows and row not in self._free, f"row {row} released twice or out of range"
        self._free.append(row)

    @property
    def free_rows(self) -> int:
        return len(self._free)

    # ---- one propose ---------------------------------------------------------------------------
    def bucket_for(self, batch: int, longest: int) -> tuple[int, int] | None:
        """Smallest (batch, context) bucket holding the call, or None (the caller runs eagerly)."""
        b = bisect.bisect_left(self.batch_buckets, batch)
        c = bisect.bisect_left(self.context_buckets, max(longest, 1))
        if b == len(self.batch_buckets) or c == len(self.context_buckets):
            return None
        return self.batch_buckets[b], self.context_buckets[c]

    def run(self, rows: Sequence[int], lengths: Sequence[int], bonus: Sequence[int]) -> Tensor:
        """Logits [R, B-1, V] (a view of the shared output: valid until the next call).

        Raises ValueError when no bucket holds the call (``bucket_for`` says so beforehand).
        """
        key = self.bucket_for(len(rows), max(lengths))
        if key is None:
            raise ValueError(f"no propose bucket holds {len(rows)} contexts of up to {max(lengths)} tokens")
        self._launch(self._graph(*key), (rows, lengths, bonus), pad=(0, 0, 0))
        return self.out[:len(rows)]

    def extend_bucket(self, tokens: int) -> int | None:
        """Token bucket of a commit of ``tokens`` tokens, or None (the caller commits eagerly)."""
        b = bisect.bisect_left(COMMIT_BUCKETS, tokens)
        return COMMIT_BUCKETS[b] if b < len(COMMIT_BUCKETS) else None

    def extend(self, features: Sequence[Tensor], rows: Sequence[int], positions: Sequence[int]) -> None:
        """Writes the context keys and values of committed tokens into their pool rows.

        features: per request [n_r, F] target features (any float dtype, on this GPU or the host), in the
        order of ``rows`` / ``positions`` (one entry per token). Raises ValueError when no bucket
        holds the commit (``extend_bucket`` says so beforehand).
        """
        n = len(rows)
        size = self.extend_bucket(n)
        if size is None:
            raise ValueError(f"no commit bucket holds {n} tokens")
        g = self._graph(size, 0)
        self._launch(g, (rows, positions), pad=(self.rows, 0),   # padding tokens land in the scratch row
                     features=torch.cat(list(features)) if len(features) > 1 else features[0])

    def warm_up(self, batches: Sequence[int], contexts: Sequence[int]) -> int:
        """Captures the buckets of these batch sizes x context lengths now (each compiles and
        captures once, some tens of milliseconds), not during a user's step. Returns the count."""
        keys = {self.bucket_for(b, c) for b in batches for c in contexts} | {(t, 0) for t in COMMIT_BUCKETS}
        for key in sorted(k for k in keys if k is not None):
            g = self._graph(*key)
            if self.capture and g.graph is None:
                self._capture(g)
        return len(self.captured)

    # ---- the padded forward --------------------------------------------------------------------
    def _launch(self, g: _Graph, columns: Sequence[Sequence[int]], pad: Sequence[int],
                features: Tensor | None = None) -> None:
        """One call: each input row of the pinned host twin is ``columns[i]`` then ``pad[i]``, one
        copy to the device (and the features into theirs), then the replay (captured first if
        this bucket has none yet) or, without capture, the same forward eagerly."""
        if g.copied is not None:
            g.copied.synchronize()   # the previous call's copy has left the host twin
        host = g.host.numpy()   # numpy on the pinned twin: a tensor op a column costs more on the host
        for i, (col, fill) in enumerate(zip(columns, pad)):
            n = len(col)
            host[i, :n] = col.tolist() if isinstance(col, Tensor) else col
            host[i, n:] = fill
        g.inputs.copy_(g.host, non_blocking=True)
        if features is not None:
            g.features[:features.shape[0]].copy_(features)
        if not self.capture:
            self._forward(g)
            return
        g.copied = torch.cuda.Event()
        g.copied.record()
        if g.graph is None:
            self._capture(g)
        g.graph.replay()

    def _graph(self, batch: int, context: int) -> _Graph:
        """Propose buckets have ``context`` > 0; commit buckets ``context`` == 0."""
        key = (batch, context)
        if key not in self._graphs:
            width = 3 if context else 2
            host = torch.zeros(width, batch, dtype=torch.int64, pin_memory=self.capture)
            if not context:
                host[0].fill_(self.rows)   # a valid all-scratch commit until the first load
            g = _Graph(batch, context, inputs=host.to(self.device, copy=True), host=host)
            if not context:
                g.features = torch.zeros(batch, self.num_features, dtype=self.dtype, device=self.device)
            self._graphs[key] = g
        return self._graphs[key]

    def _forward(self, g: _Graph) -> None:
        """Everything from the static inputs: no host sync, so it can be captured."""
        if not g.context:   # a commit
            rows, positions = g.inputs[0], g.inputs[1]
            keys, values = self.context_kv(g.features, positions)   # [layers, batch, kvh, hd] each
            self.keys[:, rows, positions] = keys
            self.values[:, rows, positions] = values
            return
        rows, lengths, bonus = g.inputs[0], g.inputs[1], g.inputs[2]

        def context_kv(layer: int) -> tuple[Tensor, Tensor]:
            return (self.keys[layer, :, :g.context].index_select(0, rows),     # [batch, context, kvh, hd]
                    self.values[layer, :, :g.context].index_select(0, rows))   # [batch, context, kvh, hd]

        self.out[:g.batch].copy_(self.forward(bonus, lengths, context_kv, g.context))

    def _capture(self, g: _Graph) -> None:
        t0 = time.perf_counter()
        g.graph, _ = capture(lambda: self._forward(g), self.device, self._pool)
        log.debug("draft_graph_captured", batch=g.batch, context=g.context,
                  seconds=round(time.perf_counter() - t0, 3))
