"""The draft's step: propose, build trees, verify, update contexts.

`step` reads top to bottom: sort the batch into prefills and verifies, draft a tree for each
DDTree request (one batched tree build per budget), send everything in one verify message, then
fold the answer into each request's state and answer the scheduler.

The answer goes back to the scheduler before the drafter's context commit: the commit, and the
next step's trees for every request still decoding, run while the answer travels and the
scheduler plans its next step (`run_ahead`). At C=1 that hides the draft's own work behind the
scheduler's round trip. The next step runs them first if nothing has yet, and takes a tree drafted
ahead only where the request and its budget are the ones it was drafted for; the rest it drafts
as before.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from ddtree.v1 import common_pb2, draft_pb2, verifier_pb2
from services.common.devices import current
from services.common.grpc_server import MAX_MESSAGE_BYTES, ServiceError, reply_feature_rows
from services.common.logging import get_logger
from services.common.metrics import Metrics
from services.common.settings import MAX_BUDGET
from services.draft.proposer import Proposer
from services.draft.tree import build_trees_from_logits, warm_up_tree_builds
from services.draft.tree_graphs import HostTrees, TreeGraphs, pack_trees, unpack_trees
from services.draft.verifier_client import VerifierClient

__all__ = ["DraftEngine"]

log = get_logger("draft")

MAX_LOST = 1 << 16   # lost request ids remembered (to answer UNAVAILABLE, not NOT_FOUND) until released


@dataclass
class _Request:
    request_id: str
    mode: int
    pending: int = -1   # the last token the verifier sampled: the next tree's root
    length: int = 0     # tokens in the target's cache
    prefilling: bool = False  # its prompt is still arriving in pieces
    budget: int = 0     # the tree budget of its last step (0: root only), what a tree drafted ahead uses
    owner: int = 0      # the scheduler's step stream that admitted it (``end_stream``)


@dataclass
class _Tree:
    """One request's tree on the host, int64 arrays (numpy: a step slices and joins a few hundred
    ints per tree, where each torch call costs microseconds on a C=1 step's path)."""
    tokens: np.ndarray   # [n]
    parents: np.ndarray  # [n]
    depths: np.ndarray   # [n]


# Trees drafted ahead, by request id: (the request, its length and budget then, the tree); one is
# used only by that request object at that length and budget (an id may be reused).
_Ahead = dict[str, tuple[_Request, int, int, _Tree]]


class DraftEngine:
    def __init__(self, proposer: Proposer, verifier: VerifierClient, metrics: Metrics | None = None) -> None:
        self.proposer = proposer
        self.verifier = verifier
        self.metrics = metrics or Metrics("draft")
        self._requests: dict[str, _Request] = {}
        # Read when scraped: a gauge set by steps kept the requests a stream's end or a lost
        # verifier dropped until the next step.
        self.metrics.running.set_function(lambda: len(self._requests))
        self._prompts: dict[str, list[int]] = {}   # held until the prefill's features arrive
        self._lock = asyncio.Lock()
        # The last step's commit and next trees: to run (`_job`), then their outcome (`_ahead`).
        self._job: tuple[list, list[_Request]] | None = None
        # Ids dropped with a lost stream (the verifier's, a scheduler's) or a failed context commit,
        # until released: what a later item naming one is told (not that it was never here).
        self._lost: dict[str, ServiceError] = {}
        self._reconnecting: asyncio.Future | None = None   # the probe's hand-shake (`ensure_connected`)
        self._release_owed: list[str] = []   # dropped here (a failed commit): released at the verifier next step
        self._ahead: _Ahead | _CommitFailed = {}
        self.max_context = 0
        self.tokenizer_digest = ""   # the target's tokenizer's (``model_tokenizer_digest``), told to the scheduler
        out = proposer.propose_output   # with propose graphs, the tree builds replay too
        self.tree_graphs = TreeGraphs(out, capture=out.is_cuda) if out is not None else None

    async def connect(self, wait_s: float = 0.0) -> None:
        hs = await self.verifier.connect(self.proposer.target_layer_ids, self.proposer.hidden_size,
                                         self.proposer.vocab_size, wait_s=wait_s)
        self.max_context = hs.max_context

    def warm_up(self, budgets: Sequence[int], device: str,
                batch_sizes: Sequence[int] = (1, 4, 16, 64), context_lengths: Sequence[int] = (64, 512)) -> None:
        """Compiles the GPU tree kernels (10 serve budgets 1..128, seconds each), builds trees for
        `budgets` and runs propose over a spread of batch sizes and context lengths, before the
        first request rather than while users wait."""
        if torch.device(device).type != "cuda":
            return   # nothing is compiled or loaded lazily on the CPU path
        # Budgets share tree kernels (kernels/tree_build.pads_budget): compiling them all now means
        # no budget compiles while users wait.
        warm_up_tree_builds(self.proposer.block_size - 1, self.proposer.vocab_size, self.proposer.dtype, device,
                            MAX_BUDGET, budgets, batch_sizes)
        self.proposer.warm_up(batch_sizes, context_lengths)
        if self.tree_graphs is not None:
            self.tree_graphs.warm_up(budgets)

    def model_info(self) -> common_pb2.ModelInfo:
        hs = self.verifier.handshake
        if hs is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "not connected to a verifier yet")
        return common_pb2.ModelInfo(
            model_type=hs.model_type, vocab_size=hs.vocab_size, max_context=hs.max_context,
            block_size=self.proposer.block_size, max_budget=MAX_BUDGET, eos_token_id=hs.eos_token_id,
            eos_token_ids=hs.eos_token_ids, tp_size=hs.tp_size, kv_capacity_tokens=hs.kv_capacity_tokens,
            kv_page_size=hs.kv_page_size,
            transport=hs.transport, verifier_id=hs.verifier_id, feature_bytes_per_token=hs.feature_bytes_per_token,
            device=hs.device, tokenizer_digest=self.tokenizer_digest)

    async def step(self, request: draft_pb2.StepRequest, owner: int = 0) -> draft_pb2.StepResponse:
        """One step; ``owner`` names the step stream it came on, whose requests go when it ends
        (``end_stream``). Raises ``ServiceError`` when the verifier cannot be reached: every request
        of this replica is lost then, and the scheduler must take the replica for down (answered
        request by request, it kept sending new work to a replica that failed all of it)."""
        async with self._lock:
            t0 = time.perf_counter()
            ahead = self._settle()
            waited_ms = (time.perf_counter() - t0) * 1e3
            try:
                await self._reconnect_if_lost()
                response = await self._step(request, ahead, owner)
                if response.decoded:   # only a decode step's stages are observed, on both sides
                    self.metrics.step_ms.labels("ahead_wait").observe(waited_ms)
                return response
            except ServiceError:   # from the verifier's client: its stream broke, or no handshake
                self._drop_all()
                raise

    async def ensure_connected(self) -> None:
        """Hand-shakes again where the verifier's stream was lost (the replica's probe calls this:
        a replica answers only while it reaches a verifier, and then with that verifier's id).
        One attempt at a time, shielded: a probe that gives up (its deadline is short) leaves the
        handshake running, and the next probe finds it done instead of starting over."""
        if self.verifier.connected:
            return
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._reconnect_locked())
            self._reconnecting.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved
        await asyncio.shield(self._reconnecting)

    async def _reconnect_locked(self) -> None:
        async with self._lock:
            await self._reconnect_if_lost()

    async def _reconnect_if_lost(self) -> None:
        if not self.verifier.connected:
            self._drop_all()   # a new stream means a verifier without our requests
            await self.connect()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Closes the verifier's client once the step or stream clean-up in progress is done (it
        would find the rings gone under it), or after ``timeout_s`` of waiting for it."""
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout_s)
        except asyncio.TimeoutError:
            await self.verifier.close(final=True)
            return
        try:
            await self.verifier.close(final=True)
        finally:
            self._lock.release()

    async def end_stream(self, owner: int) -> None:
        """A scheduler's step stream ended (it restarted, gave up on a step, or stopped): the
        requests it admitted here can no longer be stepped or released by it, so they go now, here
        and at the verifier (their KV pages were held until this draft or its verifier restarted)."""
        async with self._lock:
            self.run_ahead()   # another stream's commit reads features whose slot may go back below
            gone = [rid for rid, r in self._requests.items() if r.owner == owner]
            self._mark_lost(gone)
            for rid in gone:
                self._drop(rid)
            # and the releases a failed step of it still owed (a drafting failure ends the stream)
            gone, self._release_owed = gone + self._release_owed, []
            if gone and self.verifier.connected:
                try:
                    await self.verifier.step([], [], None, gone)
                except ServiceError:   # the verifier went too: its end of the stream frees them
                    pass
                log.info("stream_requests_released", requests=len(gone))

    async def _step(self, request: draft_pb2.StepRequest, ahead: dict[str, tuple[int, _Tree]],
                    owner: int = 0) -> draft_pb2.StepResponse:
        t0 = time.perf_counter()
        released = []   # another stream's request is not this one's to end (here or at the verifier)
        for rid in request.release:
            held = self._requests.get(rid)
            if held is not None and held.owner != owner:
                continue
            released.append(rid)
            self._drop(rid)
            self._lost.pop(rid, None)
        results: dict[str, draft_pb2.StepResult] = {}
        prefills: list[verifier_pb2.PrefillItem] = []
        verifying: list[_Request] = []
        budgets: list[int] = []
        repeated = {rid for rid, n in Counter(i.request_id for i in request.items).items() if n > 1}
        prompt_room = self._prompt_room(len(request.items))
        for item in request.items:
            if item.request_id in repeated:   # two items of one request would step it twice from one state
                # Refused, not dropped: a running request's KV stays held at the verifier until it
                # is released, which the scheduler does for a request that fails.
                results[item.request_id] = draft_pb2.StepResult(
                    request_id=item.request_id, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    error_message=f"request {item.request_id} appears more than once in one step")
                continue
            if prompt_room is not None and len(item.prompt_token_ids) > prompt_room:
                # The reply would pass gRPC's message cap: the verifier stream would break, and every
                # request of every stream here with it. This one is refused before it is sent.
                results[item.request_id] = draft_pb2.StepResult(
                    request_id=item.request_id, error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    error_message=f"request {item.request_id}: this step's prompt tokens would make the verifier's "
                                  f"reply larger than gRPC's {MAX_MESSAGE_BYTES >> 30} GiB message "
                                  "(scheduler.max_prefill_tokens keeps steps below it)")
                continue
            err = self._admit(item, prefills, verifying, budgets, owner)
            if err is not None:
                results[item.request_id] = draft_pb2.StepResult(request_id=item.request_id,
                                                                error_code=err.code.value[0],
                                                                error_message=err.message)
            elif prompt_room is not None:   # a refused prompt is not sent: its tokens take no room
                prompt_room -= len(item.prompt_token_ids)
        try:
            trees = await self._trees_for(verifying, budgets, ahead) if verifying else []
            packed = _pack_trees(trees) if trees else None
        except BaseException:   # the step fails before the verifier heard of it: the releases are still owed there
            self._release_owed += released
            raise
        t1 = time.perf_counter()
        owed, self._release_owed = self._release_owed, []
        if not (prefills or verifying or released or owed):   # every item refused here: no round trip for nothing
            return draft_pb2.StepResponse(results=[results[i.request_id] for i in request.items
                                                   if i.request_id in results])
        reply = await self.verifier.step(prefills, [r.request_id for r in verifying], packed, released + owed)
        t_reply = time.perf_counter()
        features, row = reply.features, 0
        results_in = list(reply.response.prefills) + list(reply.response.verifies)
        rows = sum(_feature_rows(r) for r in results_in)
        if features.shape[0] != rows:   # short, a context would fall behind the verifier's, silently
            await self.verifier.close()   # its requests go at both ends: the stream is gone
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"verifier reply has {features.shape[0]} feature rows "
                                                            f"for {rows} committed tokens")
        commits: list[tuple[str, list[int], torch.Tensor]] = []
        n_prefills = len(reply.response.prefills)
        for i, res in enumerate(results_in):
            req = self._requests.get(res.request_id)
            n = _feature_rows(res)   # kept here or not: the rows are the reply's
            feats = features[row:row + n]
            row += n
            if res.error_code != 0 or req is None:
                if req is not None:   # a refused piece or tree leaves it held at the verifier: freed next call
                    self._release_owed.append(res.request_id)
                self._drop(res.request_id)
                results[res.request_id] = draft_pb2.StepResult(request_id=res.request_id,
                                                                error_code=res.error_code,
                                                                error_message=res.error_message)
                continue
            prefill = i < n_prefills
            # A prefill's committed tokens are the prompt (or this piece of it); a verify's the
            # pending root and the accepted path.
            commits.append((req.request_id, self._prompts.pop(req.request_id) if prefill else
                            [req.pending] + list(res.token_ids[:-1]), feats))
            req.length += res.committed
            if res.token_ids:   # none while the prompt is still arriving
                req.pending = int(res.token_ids[-1])
            results[res.request_id] = draft_pb2.StepResult(
                request_id=res.request_id, token_ids=list(res.token_ids),
                acceptance_length=0 if prefill else len(res.token_ids))
        if commits:   # the answer leaves now; the commit and the next trees follow it
            nxt = [r for r in (self._requests.get(rid) for rid, _, _ in commits)
                   if r is not None and not r.prefilling and r.pending >= 0]
            self._job = (commits, nxt)
        t2 = time.perf_counter()
        decoded = bool(prefills or verifying)   # not releases alone, nor items all refused
        if decoded:
            stage = self.metrics.step_ms.labels
            stage("draft").observe((t1 - t0) * 1e3)
            stage("verify").observe(reply.response.verify_ms)
            stage("transport").observe(max(0.0, (t2 - t1) * 1e3 - reply.response.verify_ms))
            stage("verifier_rpc").observe((t_reply - t1) * 1e3)
            stage("step").observe((t2 - t0) * 1e3)
        return draft_pb2.StepResponse(results=[results[i.request_id] for i in request.items
                                               if i.request_id in results],
                                      draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3, decoded=decoded)

    def _prompt_room(self, items: int) -> int | None:
        """The prompt tokens a step of ``items`` items may carry for the verifier's reply to fit its
        message, each item committing up to a block besides (None: the width is not known yet)."""
        hs = self.verifier.handshake
        rows = reply_feature_rows(hs.feature_bytes_per_token) if hs is not None else None
        return None if rows is None else rows - items * self.proposer.block_size

    def _admit(self, item: draft_pb2.StepItem, prefills: list, verifying: list, budgets: list, owner: int = 0) -> \
            ServiceError | None:
        """Sorts one batch item into a prefill or a verify, or says why it can't be either."""
        if item.budget < 0 or item.budget > MAX_BUDGET:
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"budget {item.budget} outside 0..{MAX_BUDGET}")
        if item.mode not in _MODES:
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"mode {item.mode} is not one of {sorted(_MODES)}")
        if item.prompt_offset < 0:
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_offset {item.prompt_offset} is negative")
        req = self._requests.get(item.request_id)
        if req is not None and req.owner != owner and (item.prompt_offset or not item.prompt_token_ids):
            # A step or prompt piece for a request another step stream admitted: as the verifier
            # says it, this stream has no such request (it could step or read another's output).
            return ServiceError(grpc.StatusCode.NOT_FOUND, f"request {item.request_id} is unknown to this stream")
        if req is None and item.request_id in self._lost and (item.prompt_offset or not item.prompt_token_ids):
            return self._lost[item.request_id]
        if item.prompt_token_ids:   # a prompt, or the next piece of one
            if item.prompt_offset == 0 and req is not None:
                return ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request {item.request_id} already running")
            if item.prompt_offset > 0 and (req is None or not req.prefilling or req.length != item.prompt_offset):
                return ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"request {item.request_id}: a prompt piece at {item.prompt_offset} does not follow "
                                    f"what this draft holds ({'nothing' if req is None else f'{req.length} tokens'})")
            piece = verifier_pb2.PrefillItem(request_id=item.request_id, token_ids=item.prompt_token_ids,
                                             prompt_continues=item.prompt_continues, prompt_offset=item.prompt_offset)
            most = _INT32_MAX - len(item.prompt_token_ids) - self.proposer.block_size   # the reservation's int32
            if req is None and not 1 <= item.max_new_tokens <= most:
                return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {item.request_id}: max_new_tokens {item.max_new_tokens} outside 1..{most}")
            if req is None:
                req = _Request(item.request_id, item.mode, owner=owner)
                self._lost.pop(item.request_id, None)
                self._requests[item.request_id] = req
                self.proposer.start(item.request_id, item.prompt_token_ids)
                piece.sampling.CopyFrom(item.sampling)
                piece.reserve_tokens = len(item.prompt_token_ids) + item.max_new_tokens + self.proposer.block_size
            req.prefilling = item.prompt_continues
            req.budget = _budget(req, item)
            self._prompts[item.request_id] = list(item.prompt_token_ids)
            prefills.append(piece)
            return None
        if req is None:
            return ServiceError(grpc.StatusCode.NOT_FOUND, f"request {item.request_id} is unknown to this draft")
        if req.prefilling:
            return ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {item.request_id}: its prompt has not all arrived")
        verifying.append(req)
        req.budget = _budget(req, item)
        budgets.append(req.budget)
        return None

    def run_ahead(self) -> None:
        """Runs the context commit and next trees the last step left, if nothing has yet.

        The draft service calls this on the event loop as soon as a step's answer has gone out:
        the next step cannot start before this work is done, and on the loop it starts at once. In
        a worker thread it waited for the interpreter lock while the loop sent the answer, and
        shared it after (0.1-0.4 ms a step at C=1 on the H200 host). A step that finds it not run
        (a caller other than the service, or a stream that ended before its answer went out) runs
        it in `_settle`.
        """
        job, self._job = self._job, None
        if job is None:
            return
        try:
            fresh = self._on_device(self._commit_and_draft, *job)
        except Exception as exc:  # noqa: BLE001 - the next step fails the requests it committed (`_settle`)
            self._ahead = _CommitFailed([rid for rid, _, _ in job[0]], exc)
            return
        # Trees drafted ahead for requests this step did not touch stay (another stream's, stepped
        # in turn with this one: replaced by this step's alone, every tree was drafted twice).
        kept = self._ahead if isinstance(self._ahead, dict) else {}
        self._ahead = {rid: e for rid, e in kept.items() if self._requests.get(rid) is e[0]} | fresh

    def _settle(self) -> _Ahead:
        """The last step's context commit done; returns the trees drafted ahead (`_Ahead`; the step
        takes those of its requests out). A commit that failed (device memory, say) left its requests' drafter
        contexts behind the verifier's: they go, here and with this step at the verifier, and a
        later item naming one fails INTERNAL. It used to fail the next step of whichever stream
        came, with every request of it, and leave the failed ones drafting from a stale context."""
        self.run_ahead()
        ahead = self._ahead
        if isinstance(ahead, _CommitFailed):
            self._ahead = {}
            gone = [rid for rid in ahead.request_ids if rid in self._requests]
            log.error("context_commit_failed", requests=gone, error=repr(ahead.error))
            self._mark_lost(gone, ServiceError(grpc.StatusCode.INTERNAL,
                                               f"the draft's context commit failed: {ahead.error!r}"))
            for rid in gone:
                self._drop(rid)
            self._release_owed += gone
            return {}
        return ahead

    def _commit_and_draft(self, commits: Sequence[tuple[str, list[int], torch.Tensor]],
                          nxt: Sequence[_Request]) -> _Ahead:
        """The step's context commit, then the next step's trees for ``nxt`` at their last budgets.
        A tree drafting that fails here is left to the next step."""
        # Requests dropped since the step that left this work (the verifier was lost, a stream
        # ended) have no context to commit to, and no next tree.
        commits = [c for c in commits if c[0] in self._requests]
        nxt = [r for r in nxt if self._requests.get(r.request_id) is r]
        t0 = time.perf_counter()
        self.proposer.commit_many(commits)
        t1 = time.perf_counter()
        self.metrics.step_ms.labels("context_commit").observe((t1 - t0) * 1e3)
        if not nxt:
            return {}
        try:
            trees = self._draft(nxt, [r.budget for r in nxt])
        except Exception as exc:  # noqa: BLE001 - drafted again, in the step that needs them
            log.warning("draft_ahead_failed", error=repr(exc))
            return {}
        self.metrics.step_ms.labels("draft_ahead").observe((time.perf_counter() - t1) * 1e3)
        return {r.request_id: (r, r.length, r.budget, t) for r, t in zip(nxt, trees)}

    async def _trees_for(self, reqs: Sequence[_Request], budgets: Sequence[int],
                         ahead: _Ahead) -> list[_Tree]:
        """Each request's tree: drafted ahead where it was drafted for this request, at its length
        and this budget, else drafted now. Taken out of ``ahead`` either way: the step moves them on."""
        trees: list[_Tree | None] = []
        for req, budget in zip(reqs, budgets):
            hit = ahead.pop(req.request_id, None)
            trees.append(hit[3] if hit is not None and hit[0] is req and hit[1] == req.length and hit[2] == budget
                         else None)
        missing = [i for i, t in enumerate(trees) if t is None]
        if missing:
            drafted = await asyncio.to_thread(self._on_device, self._draft, [reqs[i] for i in missing],
                                              [budgets[i] for i in missing])
            for i, t in zip(missing, drafted):
                trees[i] = t
        # A root alone (autoregressive, paused speculation, no room left) is no draft tree: the
        # counter keeps step with the scheduler's `tree_steps` and acceptance histogram.
        drafted = [i for i, t in enumerate(trees) if t.tokens.size > 1]
        now = len(set(drafted) & set(missing))
        self.metrics.draft_trees.labels("step").inc(now)
        self.metrics.draft_trees.labels("ahead").inc(len(drafted) - now)
        return trees   # type: ignore[return-value]

    def _on_device(self, fn, *args):
        """Runs ``fn`` with the drafter's GPU current: worker threads start on GPU 0, and kernels
        (Triton's, and anything using the current stream) launch on the current device."""
        with current(self.proposer.device):
            return fn(*args)

    def _draft(self, reqs: Sequence[_Request], budgets: Sequence[int]) -> list[_Tree]:
        """One proposal + one batched tree build per (budget, depth cap) group; root-only for AR."""
        trees: list[_Tree | None] = [None] * len(reqs)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (req, budget) in enumerate(zip(reqs, budgets)):
            depth = min(self.proposer.block_size - 1, self.max_context - 1 - req.length)
            if budget == 0 or depth <= 0:
                trees[i] = _Tree(np.array([req.pending]), np.array([-1]), np.array([0]))
            else:
                groups.setdefault((budget, depth), []).append(i)
        propose_s = propose_cpu_s = tree_s = 0.0
        for (budget, depth), idx in groups.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            bonus = torch.tensor([reqs[i].pending for i in idx])                     # [R]
            logits = self.proposer.propose([reqs[i].request_id for i in idx], bonus)  # [R, B-1, V]
            t1, c1 = time.perf_counter(), time.thread_time()
            sizes_t, tokens_t, parents_t, depths_t = self._trees(logits, budget, depth, bonus)
            sizes = sizes_t.tolist()
            tokens, parents, depths = tokens_t.numpy(), parents_t.numpy(), depths_t.numpy()   # views
            propose_s += t1 - t0            # the GPU work of propose lands in tree_s (its first sync)
            propose_cpu_s += c1 - c0        # this thread's CPU time: far below propose_s = waiting (GIL, locks)
            tree_s += time.perf_counter() - t1
            for j, i in enumerate(idx):
                n = sizes[j]
                trees[i] = _Tree(tokens[j, :n], parents[j, :n], depths[j, :n])
        if groups:
            self.metrics.step_ms.labels("propose").observe(propose_s * 1e3)
            self.metrics.step_ms.labels("propose_cpu").observe(propose_cpu_s * 1e3)
            self.metrics.step_ms.labels("tree").observe(tree_s * 1e3)
        return [t for t in trees if t is not None]

    def _trees(self, logits: torch.Tensor, budget: int, depth: int, roots: torch.Tensor) -> HostTrees:
        """A group's trees on the host: replayed where the propose was (``TreeGraphs``), else
        built eagerly; either way one copy to the host."""
        trees = self.tree_graphs.build(logits, budget, depth, roots) if self.tree_graphs is not None else None
        if trees is None:
            # The depth cap at run time: the kernel compiled for the full depth serves it.
            batch = build_trees_from_logits(logits, budget, roots.to(logits.device), max_depth=depth)
            trees = unpack_trees(pack_trees(batch).cpu(), len(roots))
        return trees

    def _drop_all(self) -> None:
        """Every request gone with the verifier's stream; a later step naming one is told so
        (UNAVAILABLE), not that it was never here."""
        self._mark_lost(self._requests)
        for rid in list(self._requests):
            self._drop(rid)

    def _mark_lost(self, ids, error: ServiceError | None = None) -> None:
        if len(self._lost) > MAX_LOST:   # ids no scheduler will release (it went away): forgotten
            self._lost.clear()
        for rid in ids:
            self._lost[rid] = error or ServiceError(
                grpc.StatusCode.UNAVAILABLE, f"request {rid} was lost with a stream that ended (verifier or scheduler)")

    def _drop(self, rid: str) -> None:
        if self._requests.pop(rid, None) is not None:
            self.proposer.drop(rid)
        if isinstance(self._ahead, dict):
            self._ahead.pop(rid, None)
        self._prompts.pop(rid, None)


@dataclass
class _CommitFailed:
    """A step's context commit that raised: the requests it was committing, and why."""

    request_ids: list[str]
    error: Exception


_MODES = frozenset(common_pb2.Mode.values())
_INT32_MAX = 2**31 - 1   # the verifier's reserve_tokens is an int32


def _budget(req: _Request, item: draft_pb2.StepItem) -> int:
    """The step's tree budget for this request: the item's, or 0 (root only) in autoregressive mode."""
    return item.budget if req.mode != common_pb2.MODE_AUTOREGRESSIVE else 0


def _feature_rows(res: verifier_pb2.ItemResult) -> int:
    """Feature rows the verifier sent for one result: one a committed token, none for a refused
    result whatever its `committed` says. The row check and the slicing both count with this."""
    return res.committed if res.error_code == 0 else 0


def _pack_trees(trees: Sequence[_Tree]) -> dict[str, torch.Tensor]:
    """Flat CSR tree tensors, the wire format the verifier reads (joined in numpy: see `_Tree`)."""
    def joined(field: str) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([getattr(t, field) for t in trees], dtype=np.int64))

    return {
        "tokens": joined("tokens"),    # [N]
        "parents": joined("parents"),  # [N]
        "depths": joined("depths"),    # [N]
        "sizes": torch.from_numpy(np.array([t.tokens.size for t in trees], dtype=np.int64)),  # [R]
    }
