"""The verify forward under CUDA graphs: one capture per (batch bucket, tree-size bucket).

Why: a verify step launches a few dozen kernels per layer (61 layers on K2). Launched eagerly at
5-12 µs each that is several milliseconds, more than the step's HBM floor at small batch; replayed
from a graph each costs under a microsecond. The seeds' stack crashed under graphs at budgets
above 8; here every budget 1..128 has a bucket.

Padding keeps real rows exact: a tree is padded to its bucket's node count with nodes that see the
prefix and themselves only, and the batch with empty requests (no prefix, padding nodes only). No
real node sees a padding node, so a real node's output does not depend on them. Positions and
ancestor bits are computed inside the graph from the padded tokens / parents / depths / prefix
lengths, so a step is two host-to-device copies into the static inputs (padded on the host) and one
replay; the step then reads what it needs of the real rows (their argmax, the sampled requests'
logits, the accepted nodes' KV and features) through their index, ``ForwardOutput.rows``.

Replays never overlap, and a step reads its rows before the next replay, so the graphs
share their memory: the captures one pool for what they make and drop, and every bucket one set
of output buffers, sized once for the largest bucket (``outputs_bytes``). Outputs allocated by
each capture stayed allocated with it: with all 104 buckets captured, a 3-layer Kimi-K2 TP8 slice
held 20.2 GB where it now holds 6.6 (bench/results/verify_first_use-k2-*). The start-up's warm-up
captures every bucket (``capture_buckets``), so what the graphs hold is known before the first
request (without a warm-up, ``verifier.warmup_budgets`` empty, requests capture them).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kernels.tree_mla import TreeAttentionDeviceMetadata, pack_ancestor_bits
from services.common.cuda_graphs import capture
from services.common.devices import current
from services.common.logging import get_logger
from services.draft.tree import ancestor_mask
from services.verifier.kv_cache import PagedKVCache
from services.verifier.model import ForwardBatch, ForwardOutput, TargetModel

__all__ = ["BATCH_BUCKETS", "EAGER_ROWS", "NODE_BUCKETS", "REPLAY_ROWS", "VerifyGraphs"]

# Tree sizes are budget + 1 (the root); budgets 0 (autoregressive), 1, 2, 4, 8, 12, 16, 24, 32,
# 48, 64, 96 and 128 fit their bucket exactly, others pad to the next one.
NODE_BUCKETS: tuple[int, ...] = (1, 2, 3, 5, 9, 13, 17, 25, 33, 49, 65, 97, 129)
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
# A replay's cost beside its rows, in rows: on one H200 a replay of 1 x 1 took 7.9 ms and each row
# about 0.035 ms more on the 61-layer K2 slice (1.2 ms, ~0.002-0.004 ms on 3 layers), so ~230-560
# rows (bench/results/verify_first_use-k2-61-subset-2b8a0c0.json, -k2-2b8a0c0.json).
REPLAY_ROWS = 256
# An eager forward's, in the same rows: launch-bound, one prompt of 2-512 tokens took 109-245 ms
# on the 61-layer slice (~3100 rows), ~6 ms on 3 layers (~2000: bench/results/verify_first_use-k2-*-2b8a0c0.json).
EAGER_ROWS = 3072

log = get_logger("verifier")


@dataclass
class _Bucket:
    """Static inputs and outputs of one captured shape.

    The int64 inputs live in one device buffer ``inputs`` = [tokens | parents | depths | rows |
    prefix_lens], filled from a pinned host twin with one copy per step.
    """

    batch: int
    nodes: int
    inputs: Tensor  # [4 * B * T + B] int64 (device)
    host: Tensor  # same, pinned host memory on CUDA
    page_table: Tensor  # [B, max_pages] int32
    query_starts: Tensor  # [B + 1] int32, constant r * T
    output: ForwardOutput | None = None
    graph: torch.cuda.CUDAGraph | None = None

    def views(self, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """tokens [B, T], parents [B, T] (-1: root or padding), depths [B, T], rows [B * T]
        (flat padded row of each real node, first N used), prefix_lens [B]."""
        B, T = self.batch, self.nodes
        n = B * T
        return (t[:n].view(B, T), t[n:2 * n].view(B, T), t[2 * n:3 * n].view(B, T), t[3 * n:4 * n],
                t[4 * n:4 * n + B])


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
        self.batch_buckets = tuple(sorted(set(batch_buckets)))
        self.node_buckets = tuple(sorted(set(node_buckets)))
        self.capture = capture
        self.device = model.embed_weight.device
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._logits: Tensor | None = None     # the shared output buffers, flat (``_outputs``)
        self._features: Tensor | None = None
        self._new_kv: Tensor | None = None
        self._pages_host = torch.zeros(0, dtype=torch.int32)   # pinned staging of the page table (``_load``)
        self._copied: torch.cuda.Event | None = None   # the last step's copies; the pinned buffers are reused after it

    def set_feature_layers(self, layers: Sequence[int]) -> None:
        """The drafter named its feature layers (at its handshake, after the start-up warm-up): a
        graph returns the layers it was captured with, so recapture every captured bucket now,
        from its current inputs (always a valid batch), rather than during a later step."""
        layers = tuple(layers)
        if layers == self.feature_layers:
            return
        self.feature_layers = layers
        recapture = [b for b in self._buckets.values() if b.graph is not None]
        for b in self._buckets.values():
            b.output, b.graph = None, None
        self._features = None   # the old width's buffer is dropped before the new one is made
        if self.capture:   # the old graphs' pool went with the last of them: it cannot take captures
            self._pool = torch.cuda.graph_pool_handle()
            torch.cuda.empty_cache()   # and its blocks stay reserved until given back
        if recapture:
            self._capture_each(recapture)
        self.log_outputs_bound()

    def bucket_for(self, batch: int, max_nodes: int) -> tuple[int, int] | None:
        """Smallest (batch, nodes) bucket holding the step, or None (the caller runs eagerly)."""
        b = bisect.bisect_left(self.batch_buckets, batch)
        t = bisect.bisect_left(self.node_buckets, max_nodes)
        if b == len(self.batch_buckets) or t == len(self.node_buckets):
            return None
        return self.batch_buckets[b], self.node_buckets[t]

    @property
    def holds_chains(self) -> bool:
        """Whether prefill chunks can replay these graphs (some bucket exists)."""
        return bool(self.batch_buckets and self.node_buckets)

    def replays_pay(self, length: int, most: int) -> bool:
        """Whether a prompt of ``length`` tokens costs less replayed, as chains of up to the largest
        node bucket's tokens (and ``most``), than in eager forwards of up to ``most`` tokens (one
        replay ``REPLAY_ROWS`` plus its rows, one forward ``EAGER_ROWS`` plus its). With the
        default buckets every prompt replays (129-token chains against 512-token forwards); with
        a largest node bucket of 9, prompts past ~100 tokens run eagerly, where 1000 tokens took
        115 ms in 9-token replays on the 3-layer slice and 12.5 ms eagerly
        (bench/results/verify_first_use-k2-subset-d90f0c1.json, -k2-subset-2d9361a.json)."""
        chunk = min(most, self.node_buckets[-1])
        return -(-length // chunk) * (REPLAY_ROWS + chunk) <= -(-length // most) * EAGER_ROWS + length

    def plan_chains(self, lengths: Sequence[int]) -> list[list[int]]:
        """Groups chains of these lengths (prefill chunks of one request each, none longer than
        the largest node bucket) into replays, as indices into ``lengths``: the fewest padded rows,
        counting ``REPLAY_ROWS`` for each replay. One 129-token prompt among 127 one-token ones
        pads to 128 x 129 rows in one replay, to 129 + 128 in two.

        Groups are runs of the chains sorted longest first (a group pads to its first), each
        filling its batch bucket: a shorter chain added to a group costs nothing it pads to."""
        order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
        n = len(order)
        cost = [0] + [-1] * n    # cost[j]: the cheapest plan of the first j chains (-1: none yet)
        cut = [0] * (n + 1)      # where its last group starts
        for i in range(n):
            if cost[i] < 0:
                continue   # no plan ends here (no batch bucket of 1)
            for most in self.batch_buckets:
                j = min(n, i + most)
                key = self.bucket_for(j - i, lengths[order[i]])
                if key is None:
                    raise ValueError(f"no graph bucket holds a chain of {lengths[order[i]]} tokens")
                c = cost[i] + REPLAY_ROWS + key[0] * key[1]
                if cost[j] < 0 or c < cost[j]:
                    cost[j], cut[j] = c, i
                if j == n:
                    break
        groups: list[list[int]] = []
        while n:
            groups.append(order[cut[n]:n])
            n = cut[n]
        return groups[::-1]

    @property
    def _most_rows(self) -> int:
        """Rows of the largest bucket (0 without buckets: every step runs eagerly)."""
        return self.batch_buckets[-1] * self.node_buckets[-1] if self.batch_buckets and self.node_buckets else 0

    def _per_row(self) -> tuple[int, int, int]:
        """Elements a row takes in each output: logits of this rank's vocabulary, features, new KV."""
        m, c = self.model, self.model.config
        return m.lm_head_weight.shape[0], len(self.feature_layers) * c.hidden_size, c.num_hidden_layers * c.kv_dim

    def outputs_bytes(self) -> int:
        """Bytes of the output buffers every bucket shares: float32 logits, the feature layers and
        every layer's new KV, a row each node of the largest bucket. Made at the first capture (the
        start-up's warm-up), so a GPU without room for them fails the start, not a request; the
        features' again when the drafter's handshake changes the feature layers."""
        logits, features, kv = self._per_row()
        return self._most_rows * (logits * 4 + (features + kv) * self.model.dtype.itemsize)

    def log_outputs_bound(self) -> None:
        """Says what the shared outputs take beside what the GPU has free, at start-up and when
        the feature layers change their width."""
        free = torch.cuda.mem_get_info(self.device)[0] if self.capture else None
        log.info("graph_outputs", gb=round(self.outputs_bytes() / 2**30, 2), rows=self._most_rows,
                 free_gb=round(free / 2**30, 2) if free is not None else None,
                 feature_layers=len(self.feature_layers))

    def _outputs(self, rows: int) -> ForwardOutput:
        """A bucket's outputs: views of the first ``rows`` rows of the shared buffers, each
        contiguous (the buffers are flat), as a forward would make them."""
        m = self.model
        logits, features, kv = self._per_row()
        most, dev = self._most_rows, self.device
        if self._logits is None:
            self._logits = torch.empty(most * logits, dtype=torch.float32, device=dev)
            self._new_kv = torch.empty(most * kv, dtype=m.dtype, device=dev)
        if self._features is None:
            self._features = torch.empty(most * features, dtype=m.dtype, device=dev)
        assert self._new_kv is not None
        return ForwardOutput(logits=self._logits[:rows * logits].view(rows, logits),
                             features=self._features[:rows * features].view(rows, features),
                             new_kv=self._new_kv[:rows * kv].view(m.config.num_hidden_layers, rows, m.config.kv_dim))

    def capture_buckets(self) -> int:
        """Captures every bucket not yet captured, largest first; returns how many. Without
        capture (the CPU) runs each one's padded forward once instead, on its all-padding inputs.

        Why at start-up: a bucket's first step would otherwise compile its kernels (fused-MoE
        configs by token count, tile sizes by rows: seconds each) and capture its graph (tens of
        milliseconds), while that request and every other of the replica wait. The capture's
        warm-up run compiles what the graph launches: launches depend on the bucket's shapes
        only, never on the inputs' values (a capture could not hold them otherwise). Largest
        first: a GPU without room for the largest step fails the start at once."""
        todo = [b for b in (self._bucket(n, t) for n in self.batch_buckets for t in self.node_buckets) if b.graph is None]
        self._capture_each(todo)
        self.log_outputs_bound()
        return len(todo)

    def _capture_each(self, buckets: Sequence[_Bucket]) -> None:
        """Captures these buckets (without capture, runs each padded forward), largest first, then
        gives back the capture warm-ups' eager blocks; the graphs keep their pool."""
        t0 = time.perf_counter()
        with current(self.device):
            for b in sorted(buckets, key=lambda b: (-b.batch * b.nodes, b.batch)):
                if self.capture:
                    self._capture(b, quiet=True)
                else:
                    self._forward(b)
            if self.capture:
                torch.cuda.empty_cache()
        log.info("graph_buckets_captured" if self.capture else "graph_buckets_run", buckets=len(buckets),
                 seconds=round(time.perf_counter() - t0, 2))

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(k for k, b in self._buckets.items() if b.graph is not None)

    # ---- one step ------------------------------------------------------------------------------
    def run(self, tokens: Tensor | np.ndarray, parents: Tensor | np.ndarray, depths: Tensor | np.ndarray,
            sizes: Sequence[int], prefix_lens: Sequence[int], page_ids: Sequence[Sequence[int]]) -> ForwardOutput:
        """The forward for flat trees (request r owns the next ``sizes[r]`` entries, root first).

        Returns the bucket's padded outputs, valid until the next run, with ``rows`` the real
        rows in the flat order given (``.real()`` copies them out). Raises ValueError when no
        bucket holds the step (``bucket_for`` says so beforehand).
        """
        key = self.bucket_for(len(sizes), max(sizes))
        if key is None:
            raise ValueError(f"no graph bucket holds {len(sizes)} trees of up to {max(sizes)} nodes")
        # Engine calls run in worker threads, whose current device is GPU 0: capture, replay and
        # the pinned copies must happen on the model's GPU.
        with current(self.device):
            return self._run(self._bucket(*key), _host(tokens), _host(parents), _host(depths), sizes,
                             prefix_lens, page_ids)

    def _run(self, b: _Bucket, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, sizes: Sequence[int],
             prefix_lens: Sequence[int], page_ids: Sequence[Sequence[int]]) -> ForwardOutput:
        rows_host = self._load(b, tokens, parents, depths, sizes, prefix_lens, page_ids)
        if self.capture:
            if b.graph is None:
                self._capture(b)
            b.graph.replay()
            out = b.output
        else:
            out = self._forward(b)
        assert out is not None
        rows = b.views(b.inputs)[3][:sum(sizes)]   # [N] device
        return ForwardOutput(logits=out.logits, features=out.features, new_kv=out.new_kv, rows=rows, rows_host=rows_host)

    def _load(self, b: _Bucket, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray, sizes: Sequence[int],
              prefix_lens: Sequence[int], page_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Pad the trees on the host (numpy on pinned memory: a step's few hundred ints cost less
        there than a dozen tensor ops), then two asynchronous copies: the int64 inputs, and the
        used page-table columns through a pinned staging buffer (a pageable copy would wait for
        the stream). Returns the trees' padded rows [N], a copy on the host."""
        if self._copied is not None:
            self._copied.synchronize()   # the previous step's copies have left the pinned buffers
        tok, par, dep, rows, lens = (v.numpy() for v in b.views(b.host))
        sizes_a = np.asarray(sizes, dtype=np.int64)
        R, N = len(sizes), int(sizes_a.sum())
        starts = np.cumsum(sizes_a) - sizes_a                                                  # [R]
        rows[:N] = np.repeat(np.arange(R) * b.nodes - starts, sizes_a) + np.arange(N)          # [N] padded row
        tok.fill(0)
        par.fill(-1)
        dep.fill(0)
        tok.reshape(-1)[rows[:N]] = tokens
        par.reshape(-1)[rows[:N]] = parents
        dep.reshape(-1)[rows[:N]] = depths
        lens.fill(0)
        lens[:R] = prefix_lens
        b.inputs.copy_(b.host, non_blocking=True)
        used = max(1, max(len(p) for p in page_ids))   # only a request's first pages are read
        staged = self._page_staging(b.batch * used).view(b.batch, used)
        pages = staged.numpy()
        pages.fill(0)
        for r, p in enumerate(page_ids):
            pages[r, :len(p)] = p
        b.page_table[:, :used].copy_(staged, non_blocking=True)
        if self.capture:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()
        return rows[:N].copy()

    def _page_staging(self, n: int) -> Tensor:
        """The first `n` int32 of a pinned buffer that grows as needed (steps never overlap)."""
        if self._pages_host.numel() < n:
            self._pages_host = torch.zeros(max(n, 2 * self._pages_host.numel()), dtype=torch.int32,
                                           pin_memory=self.capture)
        return self._pages_host[:n]

    # ---- the padded forward --------------------------------------------------------------------
    def _bucket(self, batch: int, nodes: int) -> _Bucket:
        key = (batch, nodes)
        if key not in self._buckets:
            size = 4 * batch * nodes + batch
            host = torch.zeros(size, dtype=torch.int64, pin_memory=self.capture)
            b = _Bucket(
                batch, nodes, inputs=torch.zeros(size, dtype=torch.int64, device=self.device), host=host,
                page_table=torch.zeros(batch, self.max_pages, dtype=torch.int32, device=self.device),
                query_starts=(torch.arange(batch + 1, dtype=torch.int32) * nodes).to(self.device))
            b.views(b.host)[1].fill_(-1)
            b.inputs.copy_(b.host)   # a valid all-padding batch until the first load
            self._buckets[key] = b
        return self._buckets[key]

    def _forward(self, b: _Bucket) -> ForwardOutput:
        """Everything from the static inputs: no host sync, so it can be captured."""
        tokens, parents, depths, _, prefix_lens = b.views(b.inputs)
        words = max(1, -(-b.nodes // 32))
        bits = pack_ancestor_bits(ancestor_mask(parents), words)   # [B, T, words]
        positions = prefix_lens[:, None] + depths   # [B, T]
        meta = TreeAttentionDeviceMetadata(
            query_starts=b.query_starts, prefix_lens=prefix_lens.to(torch.int32), page_table=b.page_table,
            ancestor_bits=bits.view(b.batch * b.nodes, words), max_nodes=b.nodes)
        batch = ForwardBatch(input_ids=tokens.reshape(-1), positions=positions.reshape(-1), attn=meta)
        return self.model(batch, self.cache, feature_layers=self.feature_layers,
                          out=self._outputs(b.batch * b.nodes))

    def _capture(self, b: _Bucket, quiet: bool = False) -> None:
        t0 = time.perf_counter()
        self._outputs(0)   # made here, on this stream, outside the capture and its side-stream warm-up
        b.graph, b.output = capture(lambda: self._forward(b), self.device, self._pool)
        if not quiet:   # a capture on a request's step, where the start-up did not capture them all
            log.info("graph_captured", batch=b.batch, nodes=b.nodes, seconds=round(time.perf_counter() - t0, 2))


def _host(t: Tensor | np.ndarray) -> np.ndarray:
    return t.cpu().numpy() if isinstance(t, Tensor) else t
