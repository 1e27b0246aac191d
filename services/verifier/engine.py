"""The verifier's step: prefill prompts, verify a batch of trees, accept, commit.

This is the heart of a decode step and reads top to bottom: `prefill` and `verify` build a
`ForwardBatch`, run the target once, pick posterior tokens, walk each tree, and commit only the
accepted path's latent KV into the request's pages. No gRPC here; `server.py` wraps it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kernels.skinny_gemm import MAX_ROWS
from kernels.tree_mla import (
    TreeAttentionDeviceMetadata, TreeAttentionMetadata, served_dv_splits, warm_up_attention, warm_up_merges,
)
from services.common.devices import current
from services.common.grpc_server import ServiceError
from services.common.settings import MAX_BUDGET
from services.draft.tree import ancestor_mask
from services.verifier.acceptance import accept
from services.verifier.graphs import VerifyGraphs
from services.verifier.kv_cache import OutOfPages, PagedKVCache
from services.verifier.model import ForwardBatch, TargetModel
from services.verifier.sampling import Sampling, draw_seed, draw_tokens, token_keys

__all__ = ["VerifierEngine", "PrefillInput", "ItemOutcome", "StepOutcome", "tree_shape_error", "WARMUP_BATCHES"]

WARMUP_BATCHES = (1, 8, 64)   # the warm-up's step batches; its MoE step sweep covers steps up to the largest


@dataclass
class PrefillInput:
    request_id: str
    token_ids: list[int]
    sampling: Sampling
    reserve_tokens: int
    owner: str = ""
    more: bool = False  # more of the prompt follows in a later step: commit this piece, sample nothing
    offset: int = 0     # where the piece starts in the prompt; > 0: a request still being prefilled


@dataclass
class ItemOutcome:
    """What one request got from a prefill or verify: tokens out, and how many entered the cache."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    committed: int = 0
    error: ServiceError | None = None


@dataclass
class StepOutcome:
    items: list[ItemOutcome]
    features: torch.Tensor  # [sum(committed), F] features of committed tokens, in item order


@dataclass
class _Request:
    request_id: str
    owner: str
    sampling: Sampling
    seed: int | None         # keys its draws (sampled requests; `token_keys`)
    length: int = 0          # tokens whose KV is in the cache
    pending: int = -1        # the last sampled token: the next tree's root
    prefilling: bool = False  # its prompt is still arriving in pieces (no token sampled yet)


class VerifierEngine:
    """Owns the target model, the paged latent cache and each request's decode state."""

    def __init__(self, model: TargetModel, cache: PagedKVCache, max_context: int, prefill_chunk: int,
                 prefill_graphs: bool = True) -> None:
        self.model = model
        self.cache = cache
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.prefill_graphs = prefill_graphs   # prompts replay the verify graphs where enabled
        self.feature_layers: tuple[int, ...] = ()
        self._requests: dict[str, _Request] = {}
        self._commit_ms: float | None = None   # the last verify's KV write, until taken (`take_commit_ms`)
        self.graphs: VerifyGraphs | None = None   # CUDA graphs for verify and prompts (``enable_graphs``)
        cfg = model.config
        self._feature_width = 0
        self._hidden = cfg.hidden_size
        self.vocab_size = cfg.vocab_size

    # ---- set-up -------------------------------------------------------------------------------
    def check_feature_layers(self, layer_ids: Sequence[int]) -> None:
        """The drafter names the target layers it reads; checked against the model's depth (on
        rank 0 before the call goes to the other ranks)."""
        n = self.model.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"feature_layer_ids {bad} outside the target's {n} layers")
        if len(set(layer_ids)) != len(layer_ids):   # each one widens every step's features and the graphs' outputs
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"feature_layer_ids {list(layer_ids)} name a layer twice")

    def set_feature_layers(self, layer_ids: Sequence[int]) -> None:
        self.check_feature_layers(layer_ids)
        self.feature_layers = tuple(int(i) for i in layer_ids)
        self._feature_width = len(self.feature_layers) * self._hidden
        if self.graphs is not None:
            self.graphs.set_feature_layers(self.feature_layers)   # captures bake them in: recaptured

    def enable_graphs(self, capture: bool = True, **buckets) -> VerifyGraphs:
        """Verify (and prompts, with ``prefill_graphs``) through padded buckets (CUDA graphs when
        ``capture``); steps no bucket holds run eagerly, those of more trees than the largest
        batch bucket in forwards of its size (``step_most_trees``)."""
        self.graphs = VerifyGraphs(self.model, self.cache, self.max_context, self.feature_layers,
                                   capture=capture, **buckets)
        return self.graphs

    def warm_up(self, budgets: Sequence[int], batches: Sequence[int] = WARMUP_BATCHES) -> None:
        """Compile and capture before the first request, not during it: prompts of every length the
        skinny GEMM serves and a few longer (its launches compile by row count, as fused-MoE configs
        do by token count), every CUDA-graph bucket (``VerifyGraphs.capture_buckets``), verify
        steps at each budget and batch (sampling, acceptance and commit), the largest bucket's step
        (``_warm_up_largest_step``) and the attention kernel in each variant and its merge at
        every launch shape (``warm_up_attention``, ``warm_up_merges``: a prefill meets shapes no
        bucket ran), and a forward for each fused-MoE config an eager prompt or verify step can
        take that none of these launched (``_warm_up_moe_prompts``, ``_warm_up_moe_steps``). Uses
        throw-away requests; leaves no state."""
        # Every row count an eager forward can have up to MAX_ROWS, not a sample: which of them
        # share a compiled kernel is Triton's integer specialisation (1, multiples of 16), and with
        # fewer graph buckets than the default none of them ran a 16-token step (a 16-token prompt
        # then compiled 8 kernels, 2.7 s, on the K2 slice: bench/results/verify_first_use-k2-3-subset-*).
        # Where prompts replay the graphs, only a verify step no bucket holds runs eagerly (a tree
        # past the largest node bucket, in forwards of up to the largest batch bucket's trees;
        # this counts from the fewer of the two, more than it needs), and a prompt cheaper
        # eagerly, in chunks longer than the largest node bucket (``replays_pay``).
        least = 1
        if self._prompts_replay:
            least = min(self.graphs.batch_buckets[-1], self.graphs.node_buckets[-1]) + 1
        lengths = sorted(n for n in {*range(1, MAX_ROWS + 1), 64, min(self.prefill_chunk, max(1, self.max_context // 4))}
                         if n >= least)
        rids = [f"__warmup_{i}__" for i in range(max(batches))]
        for n in lengths:
            if n >= self.max_context:
                continue
            prompt = [1 + (i % (self.vocab_size - 1)) for i in range(n)]
            self.prefill([PrefillInput(rids[0], prompt, Sampling(), reserve_tokens=n + 1)], eager=True)
            self.release(rids[:1])
        if self.graphs is not None and self.graphs.capture:   # the CPU compiles nothing
            self.graphs.capture_buckets()
        self.prefill([PrefillInput(r, [2, 3, 4], Sampling(), reserve_tokens=3 + 4 * (max(budgets, default=0) + 1))
                      for r in rids])
        for b in batches:
            for budget in budgets:
                live = [r for r in rids[:b] if r in self._requests]
                if any(self._requests[r].length + budget + 1 >= self.max_context for r in live):
                    continue
                self._warm_up_step(live, budget + 1)
        self.release(rids)
        self._warm_up_largest_step()
        self._warm_up_moe_prompts(least)
        self._warm_up_moe_steps(self.step_most_trees)
        c, device = self.model.config, self.model_device
        with current(device):
            warm_up_merges(c.kv_lora_rank, self.model.dtype, device,
                           dv_splits=served_dv_splits(c.kv_lora_rank, c.qk_rope_head_dim, self.model.dtype, device))
            warm_up_attention(self.cache.kv[0], heads=self.model.layers[0].attn.w_uk.shape[0], rope=c.qk_rope_head_dim,
                              backend=self.model.attention_backend)

    def _warm_up_largest_step(self) -> None:
        """One step of the largest graph bucket, half its requests sampling: a capture runs the
        forward only, and the work around the replay (the sampled requests' gathered logits,
        acceptance, the commit) also needs memory. So a GPU without room for the largest step
        fails the start, and the caching allocator holds blocks that every smaller step reuses
        (without it, each larger bucket's first step reserved new blocks: 11.5 -> 17.0 GB over
        the verify calls on the K2 slice). Skipped where the KV cache or the context cannot hold
        such a step: serving cannot meet one there either."""
        if self.graphs is None or not self.graphs.holds_chains:
            return
        batch, nodes = self.graphs.batch_buckets[-1], self.graphs.node_buckets[-1]
        # Prompts of the largest bucket's size where the cache holds them: where prompts replay,
        # theirs is then the largest prefill replay too, every row of it copied out.
        for length in (nodes, 3):
            need = -(-(length + nodes) // self.cache.page_size) * batch
            if length + nodes < self.max_context and need <= self.cache.pages_free:
                break
        else:
            return
        prompt = [2 + i % 3 for i in range(length)]
        rids = [f"__warmup_largest_{i}__" for i in range(batch)]
        self.prefill([PrefillInput(r, prompt, Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=i) if i % 2 else
                                   Sampling(), reserve_tokens=len(prompt) + nodes) for i, r in enumerate(rids)])
        try:
            self._warm_up_step(rids, nodes)
        finally:
            self.release(rids)

    def _warm_up_moe_prompts(self, least: int) -> None:
        """An eager prompt for each fused-MoE config that a prompt of ``least`` to ``prefill_chunk``
        tokens takes and no warm-up forward launched, since a config compiles its kernels on first
        use. Eager chunks come in any length there: without graphs, or where ``replays_pay`` sends
        a prompt eagerly under a small largest node bucket. The other warm-up forwards launch them
        all with the default buckets and budgets (tests/test_int4_moe_hopper.py); at the K2 TP8
        dims with ``verifier.warmup_budgets`` (0,), a 97-token prompt took a config none of them
        had, with graphs or without."""
        rid = "__warmup_moe__"
        for n in range(least, min(self.prefill_chunk, self.max_context - 1) + 1):
            config = self.model.moe_config(n, 1)
            if config is None or config in self.model.moe_configs_run:
                continue
            prompt = [1 + (i % (self.vocab_size - 1)) for i in range(n)]
            self.prefill([PrefillInput(rid, prompt, Sampling(), reserve_tokens=n + 1)], eager=True)
            self.release([rid])

    def _warm_up_moe_steps(self, most_batch: int, most_nodes: int = MAX_BUDGET + 1) -> None:
        """A verify step for each fused-MoE config that a step of up to ``most_batch`` trees of up
        to ``most_nodes`` nodes takes where no graph bucket holds it (its bucket's config ran at
        capture) and no warm-up forward launched it: chains of equal size on new 3-token requests,
        the fewest tokens first among the shapes the context holds. A step's config follows its
        tokens and whether each is its own routing group (one-node trees: the GEMV path at a few);
        on Hopper at the K2 TP8 dims, steps of 2-5 one-node trees take a config no prompt does.
        With the default buckets every such step is a replay. A step the KV cache cannot hold is
        skipped: serving cannot meet one there either."""
        shapes = sorted(((b, t) for b in range(1, most_batch + 1) for t in range(1, most_nodes + 1)
                         if 3 + t < self.max_context), key=lambda s: (s[0] * s[1], s[0]))
        steps: dict[Hashable, tuple[int, int]] = {}   # config: (trees, nodes) of its smallest step
        for b, t in shapes:
            if self.graphs is not None and self.graphs.bucket_for(b, t) is not None:
                continue
            config = self.model.moe_config(b * t, b)
            if config is not None and config not in self.model.moe_configs_run:
                steps.setdefault(config, (b, t))
        for b, t in steps.values():
            rids = [f"__warmup_moe_{i}__" for i in range(b)]
            try:
                out = self.prefill([PrefillInput(r, [2, 3, 4], Sampling(), reserve_tokens=4 + t) for r in rids])
                if all(item.error is None for item in out.items):
                    self._warm_up_step(rids, t)
            finally:
                self.release(rids)

    def _warm_up_step(self, rids: Sequence[str], nodes: int) -> None:
        """A verify step of one chain of ``nodes`` nodes a request."""
        tokens = torch.tensor([[self._requests[r].pending] + [5] * (nodes - 1) for r in rids]).view(-1)
        parents = torch.arange(-1, nodes - 1).repeat(len(rids))
        depths = torch.arange(nodes).repeat(len(rids))
        self.verify(rids, tokens, parents, depths, torch.full((len(rids),), nodes))

    def take_commit_ms(self) -> float | None:
        """The last verify's KV write time, once (None where no verify committed since): a step
        whose trees were all refused wrote nothing, and must not repeat an older figure."""
        ms, self._commit_ms = self._commit_ms, None
        return ms

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    def holds(self, request_id: str) -> bool:
        """Whether this rank's cache holds the request (a prompt of it would be ALREADY_EXISTS)."""
        return request_id in self._requests

    # ---- lifecycle ----------------------------------------------------------------------------
    def release(self, request_ids: Sequence[str], owner: str | None = None) -> None:
        """Frees these requests; with ``owner``, only those that draft replica holds. A replica
        that comes back after its requests were freed (`release_owner`) still sends the releases
        its scheduler lane kept for it, and one of those ids may by then name a request of another
        replica that a client retried under the same id."""
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is not None and (owner is None or req.owner == owner):
                del self._requests[rid]
                self.cache.free(rid)

    def release_owner(self, owner: str) -> int:
        """Frees every request of a draft replica that went away; returns how many."""
        gone = [rid for rid, r in self._requests.items() if r.owner == owner]
        self.release(gone)
        return len(gone)

    # ---- prefill ------------------------------------------------------------------------------
    def _validate_prompt(self, item: PrefillInput) -> None:
        if not item.token_ids:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        bad = [t for t in item.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(item.token_ids) >= self.max_context:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"prompt has {len(item.token_ids)} tokens; max context is {self.max_context}")
        if item.request_id in self._requests:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {item.request_id} already exists")

    def _validate_piece(self, item: PrefillInput, req: _Request | None) -> None:
        """A later piece of a prompt: it follows what the cache holds, its tokens are in the
        vocabulary, and the prompt so far fits the KV its first piece reserved (``cache.write``
        would refuse it after the forward)."""
        if req is not None and req.owner != item.owner:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request {item.request_id} is not this draft stream's")
        if req is None or not req.prefilling or req.length != item.offset:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"request {item.request_id}: a prompt piece at {item.offset} does not follow what the "
                               f"cache holds ({'nothing' if req is None else f'{req.length} tokens'})")
        bad = [t for t in item.token_ids if not 0 <= t < self.vocab_size]
        if not item.token_ids or bad:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request {item.request_id}: prompt piece is empty "
                               f"or has a token outside the vocabulary [0, {self.vocab_size})")
        # The first token's slot stays free. Whole pages may hold more than max_context: the prompt
        # may not (as one piece it is refused above; in pieces it ran past the rope table).
        room = min(self.cache.reserved_tokens(item.request_id), self.max_context) - 1
        if req.length + len(item.token_ids) > room:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request {item.request_id}: prompt of {req.length + len(item.token_ids)} tokens so far "
                               f"is over the {room} its first piece reserved within max context {self.max_context}")

    def prefill(self, items: Sequence[PrefillInput], eager: bool = False) -> StepOutcome:
        """Runs the prompts in chunks (a chain is a tree), commits them, samples each first token.
        A prompt may come in pieces over several steps (``more`` on all but the last, the first
        reserving the KV of the whole request): each piece extends the cache where the last one
        ended, and only the last samples, so running requests decode between the pieces.

        With verify graphs, the chunks replay them: a chunk is a chain tree of up to the largest
        node bucket's tokens (and ``prefill_chunk``), a step's prompts share replays
        (``VerifyGraphs.plan_chains``). An eager forward is launch-bound: one rank of the 61-layer
        K2 slice took 109-245 ms for one prompt of 2-512 tokens; replayed, 8.6-16.2 ms at 2-129
        tokens, and a call of 64 one-token prompts 15 ms (bench/results/verify_first_use-k2-61-subset-*).
        A prompt that would take more replays than its eager forwards cost (a long one under a
        small largest node bucket: ``VerifyGraphs.replays_pay``) runs eagerly. Without graphs (or
        ``prefill_graphs`` off, or ``eager``: the warm-up compiling what eager steps launch) short
        prompts share forwards of up to ``prefill_chunk`` tokens."""
        outcomes: list[ItemOutcome | None] = [None] * len(items)
        features: list[torch.Tensor] = []
        admitted: list[tuple[int, _Request]] = []   # (item index, its request), in item order
        ids: set[str] = set()   # theirs (a scan of the list was quadratic: 20k prompts held the lock 7 s)
        try:
            for i, item in enumerate(items):
                if item.request_id in ids:
                    self._run_prefills(items, admitted, outcomes, features, eager)   # its piece follows that one
                    admitted, ids = [], set()
                try:
                    req = self._admit(item)
                except ServiceError as exc:
                    outcomes[i] = ItemOutcome(item.request_id, error=exc)
                    continue
                admitted.append((i, req))
                ids.add(req.request_id)
            self._run_prefills(items, admitted, outcomes, features, eager)
        except BaseException:
            self._undo_admissions(items, admitted, outcomes)
            raise
        assert all(o is not None for o in outcomes)
        return StepOutcome(outcomes, self.cat_features(features))

    def _undo_admissions(self, items: Sequence[PrefillInput], admitted: Sequence[tuple[int, _Request]],
                         outcomes: Sequence[ItemOutcome | None]) -> None:
        """A forward failed: the admitted items it left without an outcome are as if never sent
        (a new request freed, a piece's request back where the piece found it), so a retry or a
        release finds the state the caller last saw."""
        for i, req in admitted:
            if outcomes[i] is not None:
                continue
            if items[i].offset == 0:
                self.release([req.request_id])
            else:
                req.length, req.prefilling = items[i].offset, True

    def _admit(self, item: PrefillInput) -> _Request:
        """Checks a prompt or piece and, for a new request, reserves its KV and makes its state."""
        if item.offset < 0:   # else a new prompt whose undo (offset 0 only) would not free it
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"request {item.request_id}: prompt_offset {item.offset} is negative")
        if item.offset > 0:
            req = self._requests.get(item.request_id)
            self._validate_piece(item, req)
        else:
            self._validate_prompt(item)
            seed = None   # drawn before the pages are taken: nothing may fail between those and the record
            if item.sampling.temperature > 0:
                seed = item.sampling.seed if item.sampling.seed is not None else draw_seed()
            reserve = min(max(item.reserve_tokens, len(item.token_ids) + 1), self.max_context)
            try:
                self.cache.reserve(item.request_id, reserve)
            except OutOfPages:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"KV cache full: request needs {reserve} tokens, {self.cache.pages_free} pages free "
                    f"of {self.cache.page_size} tokens") from None
            req = _Request(item.request_id, item.owner, item.sampling, seed)
            self._requests[item.request_id] = req
        req.prefilling = item.more
        return req

    def _run_prefills(self, items: Sequence[PrefillInput], admitted: Sequence[tuple[int, _Request]],
                      outcomes: list[ItemOutcome | None], features: list[torch.Tensor], eager: bool) -> None:
        """The forwards of these admitted prompts (one piece a request), a prompt's chunks in
        order (a chunk reads the KV of the one before). Writes each item's outcome and appends
        the features in item order.

        Graphs: round k replays every prompt's k-th chunk, grouped by length into buckets; a
        prompt that its eager forwards run for less (``VerifyGraphs.replays_pay``: a long one
        under a small largest node bucket) runs eagerly. Eagerly: a prompt in chunks of equal
        size up to ``prefill_chunk`` tokens (no short tail: beside replays, an eager forward stays
        longer than the row counts whose eager warm-up is skipped), consecutive chunks sharing a
        forward while they fit in ``prefill_chunk`` tokens."""
        graphs = self.graphs if self._prompts_replay and not eager else None
        replayed = {i for i, _ in admitted
                    if graphs is not None and graphs.replays_pay(len(items[i].token_ids), self.prefill_chunk)}
        parts: dict[int, list[torch.Tensor]] = {i: [] for i, _ in admitted}

        def run(group: list[tuple[int, _Request, int, int]], graphs: VerifyGraphs | None) -> None:
            rows = self._prefill_forward(items, group, outcomes, graphs)
            for (i, *_), f in zip(group, rows.split([c[3] for c in group])):
                parts[i].append(f)

        group: list[tuple[int, _Request, int, int]] = []   # (item, request, start, tokens) per chunk
        tokens = 0
        for i, req in admitted:
            if i in replayed:
                continue
            for start, n in _chunks(len(items[i].token_ids), self.prefill_chunk, even=True):
                if group and (tokens + n > self.prefill_chunk or group[-1][1] is req):
                    run(group, None)
                    group, tokens = [], 0
                group.append((i, req, start, n))
                tokens += n
        if group:
            run(group, None)
        if replayed:
            size = min(self.prefill_chunk, graphs.node_buckets[-1])
            chunks = [[(i, req, start, n) for start, n in _chunks(len(items[i].token_ids), size)]
                      for i, req in admitted if i in replayed]
            for k in range(max(map(len, chunks))):
                round_k = [prompt[k] for prompt in chunks if k < len(prompt)]
                for picks in graphs.plan_chains([c[3] for c in round_k]):
                    run([round_k[j] for j in picks], graphs)
        features.extend(f for i, _ in admitted if outcomes[i].error is None for f in parts[i])

    @property
    def _prompts_replay(self) -> bool:
        """Whether prompt chunks replay the verify graphs (``prefill_graphs`` and some bucket)."""
        return self.prefill_graphs and self.graphs is not None and self.graphs.holds_chains

    def _prefill_forward(self, items: Sequence[PrefillInput], group: Sequence[tuple[int, _Request, int, int]],
                         outcomes: list[ItemOutcome | None], graphs: VerifyGraphs | None) -> torch.Tensor:
        """One forward over these chunks (each request's chain after what its cache holds): a
        graph replay, or eager; its KV committed in one scatter; a request whose prompt ends here
        samples its first token. Returns the chunks' features, in group order."""
        dev = self.model_device
        ids = [items[i].token_ids[start:start + n] for i, _, start, n in group]
        reqs = [req for _, req, _, _ in group]
        sizes = [n for *_, n in group]
        if graphs is not None:
            out = graphs.run(np.fromiter((t for chunk in ids for t in chunk), np.int64),
                             np.concatenate([np.arange(-1, n - 1) for n in sizes]),     # chains
                             np.concatenate([np.arange(n) for n in sizes]), sizes, [r.length for r in reqs],
                             [self.cache.page_ids(r.request_id) for r in reqs])
        else:
            flat = torch.tensor([t for chunk in ids for t in chunk], dtype=torch.int64, device=dev)        # [N]
            positions = torch.cat([req.length + torch.arange(n, device=dev) for req, n in zip(reqs, sizes)])
            masks = [torch.ones(n, n, dtype=torch.bool, device=dev).tril_() for n in sizes]   # chains
            out = self._forward(flat, positions, reqs, masks, routing_groups=1)   # launches as one prompt's
        # A graph's outputs are its bucket's padded rows, reused by the next replay: the chunks'
        # rows of KV and features are copied out; of the logits only the rows that sample.
        new_kv, feats = (out.new_kv, out.features) if out.rows is None else (out.new_kv[:, out.rows], out.features[out.rows])
        self.cache.write_many([(req.request_id, req.length, n) for req, n in zip(reqs, sizes)], new_kv)
        ends = np.cumsum(sizes) - 1                                             # each chunk's last row
        done: list[int] = []                                                  # group positions that sample
        for g, ((i, req, start, n), chunk) in enumerate(zip(group, ids)):
            req.length += n
            if start + n < len(items[i].token_ids):
                continue   # more chunks of this prompt follow
            if items[i].more:
                outcomes[i] = ItemOutcome(req.request_id, [], committed=len(items[i].token_ids))
            else:
                done.append(g)
        if done:
            rows = torch.from_numpy(ends[done]).to(dev)
            rows = rows if out.rows is None else out.rows[rows]
            first = self._posterior(out.logits[rows], [reqs[g] for g in done], [1] * len(done),
                                    np.array([reqs[g].length for g in done]))   # the token after the prompt
            for g, token in zip(done, torch.cat(first).tolist()):
                i, req, _, _ = group[g]
                if token < 0:   # its last row's logits hold NaN / inf: it fails alone, freed (its features are not sent)
                    outcomes[i] = ItemOutcome(req.request_id, error=ServiceError(
                        grpc.StatusCode.INTERNAL, f"request {req.request_id}: the target's logits hold NaN or inf"))
                    self.release([req.request_id])
                    continue
                req.pending = int(token)
                outcomes[i] = ItemOutcome(req.request_id, [req.pending], committed=len(items[i].token_ids))
        return feats

    # ---- verify -------------------------------------------------------------------------------
    def verify(self, request_ids: Sequence[str], tokens: torch.Tensor, parents: torch.Tensor,
               depths: torch.Tensor, sizes: torch.Tensor, owner: str | None = None) -> StepOutcome:
        """The target over every node of every tree (one forward of up to ``step_most_trees`` trees
        at a time); accept; commit accepted paths.

        tokens/parents/depths: [N] flat, request r owning the next sizes[r] entries (root first).
        owner: the draft stream calling (None: any); a tree for another's request fails alone.
        """
        # Trees are a few hundred ints: check and walk them on the host, as numpy arrays and lists
        # (one copy each, not a device sync per check per request when they arrive on the GPU).
        shape_error = tree_shape_error(len(request_ids), tokens, parents, depths, sizes)
        if shape_error is not None:
            raise shape_error
        tok, par, dep = (_host_int64(t) for t in (tokens, parents, depths))
        sizes_l = [int(s) for s in sizes.tolist()]
        outcomes: list[ItemOutcome] = [ItemOutcome(rid) for rid in request_ids]
        errors = self._check_trees(request_ids, tok, par, dep, sizes_l, owner)
        live = [i for i, err in enumerate(errors) if err is None]
        for i, err in enumerate(errors):
            outcomes[i].error = err
        if not live:
            return StepOutcome(outcomes, self.cat_features([]))
        offsets = np.concatenate([[0], np.cumsum(sizes_l)])
        if len(live) < len(request_ids):
            sel = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in live])
            tok, par, dep = tok[sel], par[sel], dep[sel]                            # [N] live requests
        reqs = [self._requests[request_ids[i]] for i in live]
        live_sizes = [sizes_l[i] for i in live]
        bounds = np.concatenate([[0], np.cumsum(live_sizes)])
        most = self.step_most_trees
        commit_ms, parts = 0.0, []
        for a in range(0, len(live), most):
            b = min(a + most, len(live))
            nodes = slice(bounds[a], bounds[b])
            parts.append(self._verify_trees(reqs[a:b], live[a:b], tok[nodes], par[nodes], dep[nodes],
                                            live_sizes[a:b], outcomes))
            commit_ms += self._commit_ms
        self._commit_ms = commit_ms
        return StepOutcome(outcomes, self.cat_features(parts))

    @property
    def step_most_trees(self) -> int:
        """The most trees one target forward verifies; a step of more runs as several forwards
        in turn, each committed before the next (a request's trees are independent of the
        others'). The largest graph bucket's batch, whose step the warm-up ran (its memory and
        its kernels), else the warm-up's largest eager batch: a step is otherwise bounded only by
        the requests held, and 1000 held requests' trees of 129 nodes made one eager forward of
        129k rows (its logits alone 5 GB a rank at K2's vocabulary over 8 ranks)."""
        if self.graphs is not None and self.graphs.holds_chains:
            return self.graphs.batch_buckets[-1]
        return max(WARMUP_BATCHES)

    def _verify_trees(self, reqs: Sequence[_Request], live: Sequence[int], tok: np.ndarray, par: np.ndarray,
                      dep: np.ndarray, live_sizes: Sequence[int], outcomes: list[ItemOutcome]) -> torch.Tensor:
        """One forward over these checked trees (``live``: their places in the step, ``outcomes``
        written there); accepts, commits the accepted paths; their features, in request order."""
        dev = self.model_device
        if self.graphs is not None and self.graphs.bucket_for(len(live), max(live_sizes)) is not None:
            # host arrays: the graph path pads them on the host and copies once; its outputs are
            # the bucket's padded rows, the trees' among them at out.rows
            out = self.graphs.run(tok, par, dep, live_sizes, [r.length for r in reqs],
                                  [self.cache.page_ids(r.request_id) for r in reqs])
        else:
            flat_tokens, flat_depths = torch.from_numpy(tok).to(dev), torch.from_numpy(dep).to(dev)   # [N]
            starts = torch.repeat_interleave(torch.tensor([r.length for r in reqs], device=dev),
                                             torch.tensor(live_sizes, device=dev))  # [N]
            bounds = np.concatenate([[0], np.cumsum(live_sizes)])
            masks = [ancestor_mask(torch.from_numpy(par[bounds[j]:bounds[j + 1]]).to(dev)) for j in range(len(reqs))]
            out = self._forward(flat_tokens, starts + flat_depths, reqs, masks)
        drawn = np.repeat([r.length + 1 for r in reqs], live_sizes) + dep   # each node's next token's index
        posterior = torch.cat(self._posterior(out.logits, reqs, live_sizes, drawn, out.rows)).tolist()   # [N] one sync
        tok_l, par_l = tok.tolist(), par.tolist()
        keep: list[int] = []           # rows of the accepted paths, in request order
        writes: list[tuple[str, int, int]] = []
        accepted = []
        row = 0
        for req, i, n in zip(reqs, live, live_sizes):
            if min(posterior[row:row + n]) < 0:   # a sampled row of NaN / inf logits: this request fails alone
                outcomes[i].error = ServiceError(grpc.StatusCode.INTERNAL, f"request {req.request_id}: the target's "
                                                 "logits hold NaN or inf; nothing was committed")
                accepted.append(None)
                row += n
                continue
            acc = accept(tok_l[row:row + n], par_l[row:row + n], posterior[row:row + n])
            keep += [row + k for k in acc.path]
            writes.append((req.request_id, req.length, len(acc.path)))
            accepted.append(acc)
            row += n
        kept = np.asarray(keep, dtype=np.int64)                                       # [K]
        if out.rows_host is not None:
            kept = out.rows_host[kept]                                                # [K] padded rows
        t0 = time.perf_counter()
        # the rows and their cache slots in one copy to the device: each small copy costs a wait
        index = torch.from_numpy(np.concatenate([kept, self.cache.slots(writes)])).to(dev)   # [2K]
        rows, slots = index[:len(keep)], index[len(keep):]
        self.cache.write_slots(slots, out.new_kv.index_select(1, rows))               # one scatter
        self._commit_ms = (time.perf_counter() - t0) * 1e3
        features = self.cat_features([out.features.index_select(0, rows)])
        # The requests move on only once their KV is written (and their features taken): a step
        # that failed before left them past cache slots never written, read by their next step.
        for req, i, acc in zip(reqs, live, accepted):
            if acc is None:
                continue
            req.length += len(acc.path)
            req.pending = acc.tokens[-1]
            outcomes[i] = ItemOutcome(req.request_id, list(acc.tokens), committed=len(acc.path))
        return features

    def _check_trees(self, request_ids: Sequence[str], tok: np.ndarray, par: np.ndarray, dep: np.ndarray,
                     sizes: Sequence[int], owner: str | None = None) -> list[ServiceError | None]:
        """Why each tree would corrupt state, or None: unknown, repeated or another stream's request,
        wrong root, bad shape, more nodes than a budget allows, tokens or positions out of range, no
        room in the cache. The node checks run over the
        whole batch at once; a bad tree fails its own request only."""
        R = len(sizes)
        sizes_a = np.asarray(sizes, dtype=np.int64)
        starts = np.cumsum(sizes_a) - sizes_a                                     # [R]
        base = np.repeat(starts, sizes_a)                                         # [N] its tree's first node
        local = np.arange(tok.size) - base                                        # [N] node index in its tree
        child = local > 0
        bad_parent = child & ((par < 0) | (par >= local))
        bad_depth = child & (dep != dep[base + np.where(bad_parent | ~child, 0, par)] + 1)   # in range: no overflow
        bad_token = (tok < 0) | (tok >= self.vocab_size)
        # Each numpy call costs microseconds on the step's cold caches: a good batch (every step but a
        # bad draft's) pays one test, not three per-tree counts.
        bad_parent_r = bad_depth_r = bad_token_r = [False] * R
        if (bad_parent | bad_depth | bad_token).any():
            tree_of = np.repeat(np.arange(R), sizes_a)                            # [N] tree of each node

            def per_tree(bad: np.ndarray) -> list[bool]:
                return (np.bincount(tree_of[bad], minlength=R) > 0).tolist()

            bad_parent_r, bad_depth_r, bad_token_r = per_tree(bad_parent), per_tree(bad_depth), per_tree(bad_token)
        seen = Counter(request_ids)
        errors: list[ServiceError | None] = []
        for i, rid in enumerate(request_ids):
            req, n, s = self._requests.get(rid), int(sizes_a[i]), int(starts[i])
            if seen[rid] > 1:  # two trees for one request would both commit from the same state
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"request {rid} appears {seen[rid]} times in one verify call")
            elif req is None or req.prefilling:
                err = ServiceError(grpc.StatusCode.NOT_FOUND if req is None else grpc.StatusCode.FAILED_PRECONDITION,
                                   f"request {rid} is not prefilled on this verifier")
            elif owner is not None and req.owner != owner:   # a stale stream must not advance another's request
                err = ServiceError(grpc.StatusCode.NOT_FOUND, f"request {rid} is not this draft stream's")
            elif n < 1:
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: empty tree")
            elif n > MAX_BUDGET + 1:
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"request {rid}: tree of {n} nodes; at most {MAX_BUDGET + 1} (budget {MAX_BUDGET} + root)")
            elif int(tok[s]) != req.pending or int(par[s]) != -1 or int(dep[s]) != 0:
                err = ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"request {rid}: tree root must be the pending token {req.pending} at depth 0")
            elif bad_parent_r[i]:
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: parents must precede their children")
            elif bad_depth_r[i]:
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: depths must be parent depth + 1")
            elif bad_token_r[i]:
                err = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: tree token outside vocabulary")
            else:
                err = self._reserve_tree(rid, req.length + int(dep[s:s + n].max()))
            errors.append(err)
        return errors

    def _reserve_tree(self, rid: str, top: int) -> ServiceError | None:
        """Room for a tree whose deepest node sits at position `top`."""
        if top >= self.max_context:
            return ServiceError(grpc.StatusCode.OUT_OF_RANGE,
                                f"request {rid}: tree reaches position {top}, max context is {self.max_context}")
        try:
            self.cache.reserve(rid, top + 1)
        except OutOfPages:
            return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {rid}: KV cache full")
        return None

    # ---- helpers ------------------------------------------------------------------------------
    def _posterior(self, logits: torch.Tensor, reqs: Sequence[_Request], counts: Sequence[int], drawn: np.ndarray,
                   rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Posterior token at every node, per request (`counts` rows each).

        `drawn`: [rows] the index in its sequence of the token each row draws, which keys a sampled
        request's noise (`token_keys`): the same index draws the same way in a prompt's first
        token, any tree, or an autoregressive step.

        `rows`: where `logits` are a graph bucket's padded rows, the nodes' rows among them. Greedy
        takes the argmax of every padded row and keeps the nodes'; sampling reads only the sampled
        requests' rows (a copy of every row, float32 at the full vocabulary, was the step's largest
        transient: 1.35 GB at 128 trees of 129 nodes on a K2 TP8 rank).

        Under tensor parallelism `logits` [N, V/tp] is this rank's vocabulary slice: greedy needs
        only one (max, index) exchange for the whole batch; sampling gathers the sampled rows once
        and every rank draws the same tokens from the same keys.
        """
        tp = self.model.tp
        counts = list(counts)
        starts = np.concatenate([[0], np.cumsum(counts)])
        greedy = draws = None
        if any(r.sampling.temperature == 0 for r in reqs):
            greedy = tp.argmax(logits)   # [N] (padded: every row); -1 where a row is not finite
            if rows is not None:
                greedy = greedy[rows]
        sampled = [j for j, r in enumerate(reqs) if r.sampling.temperature > 0]
        if sampled:
            picks = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in sampled])
            if rows is None and len(picks) == logits.shape[0]:
                full = tp.gather_logits(logits)                                     # [N, V]
            else:
                index = torch.from_numpy(picks).to(logits.device)
                full = tp.gather_logits(logits[index if rows is None else rows[index]])   # [sampled rows, V]
            seeds = np.repeat(np.array([reqs[j].seed & 0xFFFFFFFFFFFFFFFF for j in sampled], dtype=np.uint64),
                              [counts[j] for j in sampled])   # a row's seed: Python ints once a request
            host = torch.from_numpy(token_keys(seeds, drawn[picks]))   # [sampled rows]
            # pinned, so the copy does not wait for the forward on the stream before the sampling launches
            keys = host.pin_memory().to(full.device, non_blocking=True) if full.is_cuda else host
            draws = draw_tokens(full, [reqs[j].sampling for j in sampled], [counts[j] for j in sampled], keys)
        out, at = [], 0
        for j, req in enumerate(reqs):
            if req.sampling.temperature == 0:
                out.append(greedy[starts[j]:starts[j + 1]])
            else:
                out.append(draws[at:at + counts[j]])
                at += counts[j]
        return out

    @property
    def model_device(self) -> torch.device:
        return self.model.embed_weight.device

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, reqs: Sequence[_Request],
                 masks: Sequence[torch.Tensor], routing_groups: int | None = None):
        dev = self.model_device
        counts = torch.tensor([m.shape[0] for m in masks], dtype=torch.int64)
        meta = TreeAttentionMetadata(
            query_starts=torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(dev),
            prefix_lens=torch.tensor([r.length for r in reqs], dtype=torch.int64, device=dev),
            page_tables=[self.cache.page_table(r.request_id) for r in reqs],
            tree_masks=list(masks),
        )
        if dev.type == "cuda":   # packed once here, not per layer by the kernel
            meta = TreeAttentionDeviceMetadata.from_host(meta)
        batch = ForwardBatch(input_ids=input_ids, positions=positions, attn=meta, routing_groups=routing_groups)
        return self.model(batch, self.cache, feature_layers=self.feature_layers)

    def cat_features(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """A step's features, [rows, F] in the model's dtype on the model's device ([0, F] when
        none). Not widened to float32 for the wire: the drafter casts them to its own dtype anyway,
        so a bf16 target's features sent as float32 cost twice the bytes through the ring (or the
        gRPC message, whose 1 GiB cap a long prefill step's K2-width features came within 1.5x
        of) for values a bf16 drafter rounds straight back."""
        if not parts:
            return torch.empty(0, self._feature_width, dtype=self.model.dtype, device=self.model_device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)   # on the model's device (cuda_ipc shares it there)


def tree_shape_error(num_trees: int, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                     sizes: torch.Tensor) -> ServiceError | None:
    """Why a step's tree tensors cannot be split into its trees at all, or None. Checked before
    any collective, so every tensor-parallel rank refuses a malformed bundle alike and the group
    stays in step; the step's trees fail, not the verifier."""
    flat = (tokens, parents, depths)
    if any(t.dim() != 1 for t in flat) or sizes.dim() != 1 or len({t.shape[0] for t in flat}) != 1:
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"tree tensors must be 1-D, tokens / parents / depths of one length; got shapes "
                            f"{[list(t.shape) for t in flat]} and sizes {list(sizes.shape)}")
    if any(t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool for t in (*flat, sizes)):
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"tree tensors must be integers, got {[str(t.dtype) for t in (*flat, sizes)]}")
    sizes_l = sizes.tolist()
    if len(sizes_l) != num_trees or sum(sizes_l) != tokens.shape[0] or min(sizes_l, default=1) < 0:
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"tree tensors hold {tokens.shape[0]} nodes in {len(sizes_l)} trees; "
                            f"expected {num_trees} trees summing to the node count")
    if tokens.shape[0] > num_trees * (MAX_BUDGET + 1):   # a bigger bundle is refused before its walk
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"tree tensors hold {tokens.shape[0]} nodes in {num_trees} trees; a tree has at most "
                            f"{MAX_BUDGET + 1} (budget {MAX_BUDGET} + root)")
    return None


def _host_int64(t: torch.Tensor) -> np.ndarray:
    """A tree tensor as a host int64 array: a view when it came over the wire that way (every
    step's trees do), else one copy."""
    if t.device.type == "cpu" and t.dtype == torch.int64:
        return t.numpy()
    return t.cpu().to(torch.int64).numpy()


def _chunks(length: int, most: int, even: bool = False) -> list[tuple[int, int]]:
    """(start, tokens) of a prompt's chunks of at most ``most`` tokens: all ``most`` but the last,
    or ``even``, as many and of sizes within one of each other."""
    if not even:
        return [(s, min(most, length - s)) for s in range(0, length, most)]
    count = -(-length // most)
    sizes = [length // count + (k < length % count) for k in range(count)]
    return [(sum(sizes[:k]), n) for k, n in enumerate(sizes)]
