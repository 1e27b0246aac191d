"""Proposers: what the draft service asks for per-position logits, keyed by request id.

`DFlashProposer` wraps the real drafter and its per-request context caches. `OracleProposer` is a
test drafter: it knows the target's greedy continuation of some prompts and hides it among noise at
a random rank per depth (sometimes not at all), so the lossless tests see multi-token accepted paths
and rejections at every depth without needing a trained drafter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from services.common.checkpoint import CheckpointError, require_checkpoint
from services.draft.dflash import DFlashDrafter, DraftContext

__all__ = ["Proposer", "DFlashProposer", "OracleProposer", "load_proposer"]


class Proposer(Protocol):
    device: torch.device
    block_size: int
    target_layer_ids: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype   # what propose returns

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def commit(self, request_id: str, token_ids: Sequence[int], features: torch.Tensor) -> None:
        """Tokens entered the target's cache; `features` [len(token_ids), F] are their target features."""

    def commit_many(self, commits: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> None:
        """`commit` for every (request_id, token_ids, features) of a step, batched where it can be."""

    def propose(self, request_ids: Sequence[str], bonus_tokens: torch.Tensor) -> torch.Tensor:
        """Logits [R, block_size - 1, V] (any float dtype; log-probs are logits too) for the
        positions after each request's pending token: the tree builder normalises them."""

    def drop(self, request_id: str) -> None: ...

    def enable_graphs(self, rows: int, context: int) -> int:
        """Propose from CUDA graphs over a pool of ``rows`` contexts; returns the pool's bytes."""

    @property
    def propose_output(self) -> torch.Tensor | None:
        """The graphs' output buffer ``[rows, block_size - 1, V]`` whose leading rows a replayed
        propose returns (the tree build then replays too: ``tree_graphs``), or None without graphs."""

    def warm_up(self, batch_sizes: Sequence[int], context_lengths: Sequence[int]) -> None:
        """Run propose over these shapes once, before the first request (GPU: see DFlashProposer)."""


class DFlashProposer:
    """The DFlash drafter with one context cache per request."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.device = torch.device(drafter.device)
        self.block_size = drafter.block_size
        self.target_layer_ids = tuple(drafter.target_layer_ids)
        self.hidden_size = drafter.config.hidden_size
        self.vocab_size = drafter.config.vocab_size
        self.dtype = drafter.dtype
        self._ctx: dict[str, DraftContext] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._ctx[request_id] = self.drafter.new_context()

    def commit(self, request_id: str, token_ids: Sequence[int], features: torch.Tensor) -> None:
        self.drafter.extend_context(self._ctx[request_id], features)

    def commit_many(self, commits: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> None:
        """One drafter projection for the whole step (a few dozen launches, not that many per request)."""
        self.drafter.extend_contexts([self._ctx[rid] for rid, _, _ in commits], [f for _, _, f in commits])

    def propose(self, request_ids: Sequence[str], bonus_tokens: torch.Tensor) -> torch.Tensor:
        return self.drafter.propose([self._ctx[r] for r in request_ids], bonus_tokens)

    def drop(self, request_id: str) -> None:
        ctx = self._ctx.pop(request_id, None)
        if ctx is not None:
            self.drafter.release_context(ctx)

    def enable_graphs(self, rows: int, context: int) -> int:
        """Context pool + propose graphs (see DFlashDrafter.enable_graphs); returns the pool's bytes."""
        return self.drafter.enable_graphs(rows, context).pool_bytes

    @property
    def propose_output(self) -> torch.Tensor | None:
        graphs = self.drafter.graphs
        return None if graphs is None else graphs.out

    def warm_up(self, batch_sizes: Sequence[int], context_lengths: Sequence[int]) -> None:
        """Proposes over throw-away contexts of each (batch, length), and with graphs on captures
        every (batch, context) bucket. Why: on the GPU, the first steps of a fresh draft service
        took 30-80 ms of host time in propose against 4-5 ms for the same call in a warm process
        (bench/results/draft-probe.json), falling as a run met more shapes; loading each kernel the
        first time a shape needs it is the cost, paid here at start-up instead of during the first
        requests."""
        width = self.drafter.config.num_features
        for n in context_lengths:
            ctx = self.drafter.new_context()
            self.drafter.extend_context(ctx, torch.randn(n, width, device=self.drafter.device,
                                                         dtype=self.drafter.dtype))
            for r in batch_sizes:
                self.drafter.propose([ctx] * r, torch.zeros(r, dtype=torch.int64))
            self.drafter.release_context(ctx)
        graphs = self.drafter.graphs
        if graphs is not None:
            graphs.warm_up(graphs.batch_buckets, graphs.context_buckets)


class OracleProposer:
    """A test drafter that plants the target's known greedy continuation among noise.

    The file is JSON: {"vocab_size", "hidden_size", "block_size", "target_layer_ids", "seed",
    "continuations": [{"prompt": [...], "continuation": [...]}]}. Per depth the true token is put at
    rank 0 (70%), 1 (15%), 2 (7.5%) or left out (7.5%), chosen by a generator seeded from the
    history, so a run is reproducible and different budgets see different accepted depths.
    """

    def __init__(self, spec: dict) -> None:
        self.device = torch.device("cpu")
        self.block_size = int(spec["block_size"])
        self.target_layer_ids = tuple(spec["target_layer_ids"])
        self.hidden_size = int(spec["hidden_size"])
        self.vocab_size = int(spec["vocab_size"])
        self.dtype = torch.float32
        self.seed = int(spec.get("seed", 0))
        self._known = [(list(c["prompt"]), list(c["continuation"])) for c in spec["continuations"]]
        self._history: dict[str, list[int]] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._history[request_id] = []   # the prompt arrives through commit(), like every token

    def commit(self, request_id: str, token_ids: Sequence[int], features: torch.Tensor) -> None:
        if features.shape[0] != len(token_ids):
            raise ValueError(f"features have {features.shape[0]} rows for {len(token_ids)} committed tokens")
        self._history[request_id].extend(int(t) for t in token_ids)

    def commit_many(self, commits: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> None:
        for rid, token_ids, features in commits:
            self.commit(rid, token_ids, features)

    def propose(self, request_ids: Sequence[str], bonus_tokens: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(request_ids), self.block_size - 1, self.vocab_size)   # [R, D, V]
        for i, rid in enumerate(request_ids):
            hist = self._history[rid] + [int(bonus_tokens[i])]
            truth = self._continuation_after(hist)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + len(hist) * 7919 + sum(hist) % 65521)
            for d in range(self.block_size - 1):
                # A peaked proposal like a trained drafter's: three candidates well above the noise
                # (p ~ 0.85 / 0.07 / 0.03), the truth among them at a drawn rank or left out.
                logits = torch.randn(self.vocab_size, generator=gen) * 0.5             # [V]
                cand = torch.randperm(self.vocab_size, generator=gen)[:3]
                u = float(torch.rand((), generator=gen))
                if d < len(truth):
                    rank = 0 if u < 0.7 else 1 if u < 0.85 else 2 if u < 0.925 else None
                    cand = cand[cand != truth[d]][:2]
                    if rank is not None:
                        cand = torch.cat([cand[:rank], torch.tensor([truth[d]]), cand[rank:]])[:3]
                logits[cand] = torch.tensor([8.0, 5.5, 4.5])[:cand.numel()]
                out[i, d] = torch.log_softmax(logits, dim=-1)
        return out

    def _continuation_after(self, hist: list[int]) -> list[int]:
        """The known greedy tokens that follow `hist` (which ends with the pending token)."""
        for prompt, cont in self._known:
            n = len(prompt)
            if hist[:n] == prompt:
                done = hist[n:]
                if cont[:len(done)] == done:
                    return cont[len(done):]
        return []

    def drop(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    def enable_graphs(self, rows: int, context: int) -> int:
        return 0   # host-only test drafter: nothing to launch, so nothing to capture

    @property
    def propose_output(self) -> torch.Tensor | None:
        return None   # it proposes fresh host tensors

    def warm_up(self, batch_sizes: Sequence[int], context_lengths: Sequence[int]) -> None:
        pass   # host-only test drafter: nothing to compile or load


def load_proposer(drafter_path: str, target_path: str, dtype: torch.dtype, device: str) -> Proposer:
    """`oracle:<file.json>` selects the test drafter; anything else is a DFlash checkpoint directory."""
    if drafter_path.startswith("oracle:"):
        path = Path(drafter_path[len("oracle:"):])
        try:
            return OracleProposer(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"oracle drafter spec {path}: {exc}") from None
    require_checkpoint(drafter_path, "draft.drafter_path")
    require_checkpoint(target_path, "draft.target_path")
    return DFlashProposer(DFlashDrafter.load(Path(drafter_path), Path(target_path), dtype=dtype, device=device))
