"""The draft engine's rules a mutation run found unpinned: each test says which change it catches.

Engine-level tests use the fake verifier of ``test_draft_ahead`` (no sockets, no threads beyond the
engine's own); the last ones run the draft's servicer or client in this process.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
import torch

from ddtree.v1 import common_pb2, draft_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.grpc_server import ServiceError
from services.common.transport import make_writer
from services.draft import engine as draft_engine
from services.draft import server as draft_server
from services.draft import verifier_client
from services.draft.verifier_client import VerifierClient, VerifyReply
from tests.test_draft_ahead import FEATURES, HIDDEN, VOCAB, FakeVerifier, admit, make_engine


def decode(rid: str, budget: int = 4) -> draft_pb2.StepItem:
    return draft_pb2.StepItem(request_id=rid, budget=budget)


# Catches `piece.sampling.CopyFrom(item.sampling)` deleted: a request's temperature,
# top_p, top_k and seed never reached the verifier, which then decoded every request greedily.
def test_a_requests_sampling_parameters_reach_the_verifier_with_its_first_piece():
    sampling = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1234)

    async def run():
        engine, verifier = make_engine()
        item = admit("a", 4)
        item.sampling.CopyFrom(sampling)
        await engine.step(draft_pb2.StepRequest(items=[item]))
        engine._settle()
        return verifier.prefills
    prefills = asyncio.run(run())
    assert len(prefills) == 1 and prefills[0].sampling == sampling


# Catches `_budget` returning `item.budget` in every mode: an autoregressive request
# (MODE_AUTOREGRESSIVE) must send its root alone, whatever budget the step names.
def test_an_autoregressive_request_sends_its_root_alone_whatever_the_budget():
    async def run():
        engine, verifier = make_engine()
        item = admit("ar", 8)
        item.mode = common_pb2.MODE_AUTOREGRESSIVE
        await engine.step(draft_pb2.StepRequest(items=[item, admit("dd", 8)]))
        engine.run_ahead()
        for _ in range(2):
            await engine.step(draft_pb2.StepRequest(items=[decode("ar", 8), decode("dd", 8)]))
            engine.run_ahead()
        engine._settle()
        return verifier.sent
    sent = asyncio.run(run())
    assert len(sent) == 2
    assert all(len(s["ar"]) == 1 and len(s["dd"]) == 1 + 8 for s in sent)


class _Accepts:
    """A fake verifier that accepts ``accept`` tokens a verify (the last one sampled) and records
    each tree's root, and whether the last step's context commit had run when a call arrived."""

    connected = True
    handshake = None

    def __init__(self, engine_ref: list, accept: int = 3) -> None:
        self.engine_ref, self.accept = engine_ref, accept
        self.roots: list[dict[str, int]] = []
        self.answered: dict[str, list[int]] = {}
        self.calls: list[tuple[list[str], bool]] = []   # (release, the commit was still pending)
        self.next = 10

    def _tokens(self, n: int) -> list[int]:
        out = [(self.next + i) % VOCAB for i in range(n)]
        self.next += n
        return out

    async def step(self, prefills, verify_ids, packed, release) -> VerifyReply:
        self.calls.append((list(release), self.engine_ref[0]._job is not None))
        resp, feats = verifier_pb2.VerifyResponse(), []
        for p in prefills:
            tok = self._tokens(1)
            resp.prefills.add(request_id=p.request_id, token_ids=tok, committed=len(p.token_ids))
            feats.append(torch.zeros(len(p.token_ids), FEATURES))
            self.answered[p.request_id] = tok
        if verify_ids:
            sizes = packed["sizes"].tolist()
            roots = [int(t[0]) for t in packed["tokens"].split(sizes)]
            self.roots.append(dict(zip(verify_ids, roots)))
            for rid in verify_ids:
                tok = self._tokens(self.accept)
                resp.verifies.add(request_id=rid, token_ids=tok, committed=len(tok))
                feats.append(torch.zeros(len(tok), FEATURES))
                self.answered[rid] = tok
        return VerifyReply(resp, torch.cat(feats) if feats else torch.empty(0, FEATURES))


def _engine_with(verifier_cls, **kw):
    engine, _ = make_engine()
    verifier = verifier_cls([engine], **kw)
    engine.verifier = verifier
    return engine, verifier


# Catches `req.pending = int(res.token_ids[-1])` -> `res.token_ids[0]`: after a verify
# that accepted several tokens, the next tree must grow from the last token the verifier sampled
# (its bonus), and the drafter's context must hold the root and the accepted tokens before it.
def test_the_next_tree_grows_from_the_last_token_of_a_multi_token_verify():
    async def run():
        engine, verifier = _engine_with(_Accepts, accept=3)
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        engine.run_ahead()
        expected_roots, expected_history = [], [3, 9, 27, 17]
        for _ in range(3):
            root = verifier.answered["a"][-1]
            expected_roots.append(root)
            await engine.step(draft_pb2.StepRequest(items=[decode("a")]))
            engine.run_ahead()
            expected_history += [root] + verifier.answered["a"][:-1]
        engine._settle()
        return verifier.roots, expected_roots, engine.proposer._history["a"], expected_history, engine._requests["a"]
    roots, expected_roots, history, expected_history, req = asyncio.run(run())
    assert [r["a"] for r in roots] == expected_roots
    assert history == expected_history and req.length == len(expected_history)


# Catches `self.run_ahead()` deleted from `end_stream`: a stream that ends while another
# stream's answer is on its way (its commit not run yet) sends its releases, and with them the ring
# slot of the features that commit still has to read; the commit must run before that call goes.
def test_a_streams_end_runs_the_other_streams_pending_commit_before_its_releases_go():
    async def run():
        engine, verifier = _engine_with(_Accepts)
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]), owner=1)
        engine.run_ahead()
        await engine.step(draft_pb2.StepRequest(items=[admit("b", 4)]), owner=2)   # its answer is on its way
        await engine.end_stream(1)
        return verifier.calls, sorted(engine._requests), engine.proposer._history
    calls, held, history = asyncio.run(run())
    assert calls[-1] == (["a"], False)   # the release went out after b's commit had run
    assert held == ["b"] and history["b"] == [3, 9, 27, 17]


# Catches the `context_commit` stage observation deleted: the commit runs after the
# answer (run_ahead), off every other stage's clock; its time is reported nowhere else.
def test_each_context_commit_is_timed_as_its_own_stage():
    def counts(engine) -> dict[str, float]:
        return {s.labels["stage"]: s.value for m in engine.metrics.registry.collect() for s in m.samples
                if s.name == "ddtree_step_ms_count"}

    async def run():
        engine, _ = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        engine.run_ahead()
        for _ in range(2):
            await engine.step(draft_pb2.StepRequest(items=[decode("a")]))
            engine.run_ahead()
        return counts(engine)
    timed = asyncio.run(run())
    assert timed["context_commit"] == timed["step"] == 3


_HANDSHAKE = verifier_pb2.HandshakeResponse(
    transport="shm", model_type="qwen3", vocab_size=VOCAB, hidden_size=8, max_context=512, eos_token_id=2,
    eos_token_ids=[2, 7], tp_size=2, kv_capacity_tokens=4096, kv_page_size=16, verifier_id="verifier-x",
    feature_bytes_per_token=64, device="cpu")


class _HandShaking(FakeVerifier):
    """The fake verifier of test_draft_ahead, with a handshake."""

    connected = True
    handshake = None

    async def connect(self, feature_layer_ids, hidden_size, vocab_size, wait_s=0.0):
        self.handshake = _HANDSHAKE
        return _HANDSHAKE


# Catches `self.max_context = hs.max_context` deleted from `connect`: the draft took its
# context limit as 0, so every tree was the root alone (depth = max_context - 1 - length <= 0) and
# no request was ever speculated, losslessly and silently (other tests set engine.max_context by hand).
def test_a_drafts_trees_are_bounded_by_the_context_its_verifier_handshook():
    async def run():
        engine, _ = make_engine()
        engine.max_context = 0
        verifier = engine.verifier = _HandShaking([engine])
        await engine.connect()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        engine.run_ahead()
        await engine.step(draft_pb2.StepRequest(items=[decode("a")]))
        engine._settle()
        return engine.max_context, verifier.sent
    max_context, sent = asyncio.run(run())
    assert max_context == 512 and len(sent[0]["a"]) == 1 + 4


# Catches `max_budget=MAX_BUDGET` -> `MAX_BUDGET - 1` and `kv_page_size`
# left out of ModelInfo (and any other field dropped on the way): GetModelInfo is what clients and
# the scheduler size requests and KV by; it must carry the handshake's values and the draft's own.
def test_model_info_carries_the_handshake_and_the_drafts_limits():
    from services.common.settings import MAX_BUDGET

    async def run():
        engine, _ = make_engine()
        engine.verifier = _HandShaking([engine])
        await engine.connect()
        return engine.model_info()
    info = asyncio.run(run())
    assert info == common_pb2.ModelInfo(
        model_type="qwen3", vocab_size=VOCAB, max_context=512, block_size=6, max_budget=MAX_BUDGET, eos_token_id=2,
        eos_token_ids=[2, 7], tp_size=2, kv_capacity_tokens=4096, kv_page_size=16, transport="shm",
        verifier_id="verifier-x", feature_bytes_per_token=64, device="cpu")


# Catches `self.proposer.drop(rid)` deleted from `_drop`: every ended request kept its
# drafter context (on the GPU: its context cache and a row of the graphs' context pool) for ever.
def test_a_request_that_ends_frees_its_drafter_context():
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4), admit("b", 4), admit("c", 4)]), owner=1)
        engine.run_ahead()
        await engine.step(draft_pb2.StepRequest(items=[decode("b")], release=["a"]), owner=1)   # released
        engine.run_ahead()
        await engine.end_stream(1)   # b and c: their stream ended
        return sorted(engine.proposer._history), sorted(engine._requests)
    contexts, held = asyncio.run(run())
    assert contexts == [] and held == []


class _RefusesFirst(_Accepts):
    """Verifies as `_Accepts` does, but refuses the first tree of a verify step while saying it
    committed tokens for it (and sends no feature rows for it)."""

    async def step(self, prefills, verify_ids, packed, release) -> VerifyReply:
        reply = await super().step(prefills, verify_ids, packed, release)
        if not verify_ids:
            return reply
        first = reply.response.verifies[0]
        skip = first.committed
        first.ClearField("token_ids")
        first.error_code, first.error_message = 3, "refused"
        return VerifyReply(reply.response, reply.features[skip:])


# Catches the feature rows advanced past a refused result by its `committed`: the rows of the
# results after it were read from the wrong place (the count check above counts refused ones as 0).
def test_a_refused_result_takes_no_feature_rows_whatever_its_committed_says():
    async def run():
        engine, verifier = _engine_with(_Accepts)
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4), admit("b", 4)]))
        engine.run_ahead()
        refusing = _RefusesFirst([engine])
        engine.verifier = refusing
        committed = []
        commit_many = engine.proposer.commit_many

        def record(commits):
            committed.extend((rid, list(toks), feats.clone()) for rid, toks, feats in commits)
            commit_many(commits)
        engine.proposer.commit_many = record
        original = refusing.step

        async def marked(prefills, verify_ids, packed, release):
            reply = await original(prefills, verify_ids, packed, release)
            rows = torch.arange(reply.features.shape[0], dtype=torch.float32)[:, None]
            return VerifyReply(reply.response, rows.expand(-1, FEATURES).clone())
        refusing.step = marked
        response = await engine.step(draft_pb2.StepRequest(items=[decode("a"), decode("b")]))
        engine._settle()
        return response, committed
    response, committed = asyncio.run(run())
    assert [r.error_code for r in response.results] == [3, 0]
    (rid, tokens, feats), = committed
    assert rid == "b" and len(tokens) == 3 and feats.shape == (3, FEATURES)
    assert feats[:, 0].tolist() == [0.0, 1.0, 2.0]   # the reply's first rows: the refused tree had none


def _codes(response: draft_pb2.StepResponse) -> dict[str, str]:
    return {r.request_id: grpc.StatusCode.OK.name if r.error_code == 0 else
            next(c.name for c in grpc.StatusCode if c.value[0] == r.error_code) for r in response.results}


def _running(engine) -> float:
    return next(s.value for m in engine.metrics.registry.collect() for s in m.samples
                if s.name == "ddtree_running_requests")


# Catches `self._lost.pop(rid, None)` deleted from the release loop of `_step`: a lost id the
# scheduler has released stayed "lost", and a later item naming it was told UNAVAILABLE.
def test_a_lost_request_once_released_is_unknown_not_lost():
    """UNAVAILABLE says "this replica lost your request with a stream": once the scheduler has
    released the id, the request is over for both sides, and an item naming it again is a request
    this draft does not hold (NOT_FOUND). Kept as lost, the id also stayed in memory until the
    lost set filled up."""
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]), owner=1)
        engine.run_ahead()
        await engine.end_stream(1)   # "a" is lost with its stream
        lost = await engine.step(draft_pb2.StepRequest(items=[decode("a")]), owner=2)
        await engine.step(draft_pb2.StepRequest(release=["a"]), owner=2)
        after = await engine.step(draft_pb2.StepRequest(items=[decode("a")]), owner=2)
        engine._settle()
        return _codes(lost), _codes(after), after.results[0].error_message
    lost, after, message = asyncio.run(run())
    assert lost == {"a": "UNAVAILABLE"}
    assert after == {"a": "NOT_FOUND"} and "unknown to this draft" in message


# Catches another stream's new prompt for a running id answered NOT_FOUND (the owner check taking
# in first pieces): the id is taken, and the answer must say so (ALREADY_EXISTS).
def test_another_streams_new_prompt_for_a_running_id_is_refused_as_taken():
    """Two schedulers (or a restarted one next to its old stream) may pick the same id: the second
    must learn the id is in use (ALREADY_EXISTS), not that it is unknown (NOT_FOUND, which reads as
    "admit it" and loops); and the first stream's request goes on untouched, its prompt never
    sent again."""
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]), owner=1)
        engine.run_ahead()
        other = await engine.step(draft_pb2.StepRequest(items=[admit("a", 4, prompt=(5, 6))]), owner=2)
        own = await engine.step(draft_pb2.StepRequest(items=[decode("a")]), owner=1)
        engine._settle()
        return _codes(other), other.results[0].error_message, _codes(own), [p.request_id for p in verifier.prefills]
    other, message, own, prefills = asyncio.run(run())
    assert other == {"a": "ALREADY_EXISTS"} and "already running" in message
    assert own == {"a": "OK"} and prefills == ["a"]


class _RefusesPrefills(_Accepts):
    """Verifies as `_Accepts` does, but refuses every prefill (RESOURCE_EXHAUSTED, no rows)."""

    async def step(self, prefills, verify_ids, packed, release) -> VerifyReply:
        self.calls.append((list(release), False))
        resp = verifier_pb2.VerifyResponse()
        for p in prefills:
            resp.prefills.add(request_id=p.request_id, error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                              error_message="no KV pages")
        return VerifyReply(resp, torch.empty(0, FEATURES))


# Catches `self._lost.pop(item.request_id, None)` deleted from a new admission: an id readmitted
# after it was lost stayed "lost", and once the verifier refused the new request an item naming it
# was told UNAVAILABLE (lost with a stream) instead of NOT_FOUND.
def test_a_lost_id_admitted_again_is_no_longer_lost():
    """A lost id may be admitted again (the scheduler retries under the same id). The new request
    is not the lost one: when it ends here otherwise (the verifier refused it), an item naming it
    must not be told it was lost with a stream that ended, which the scheduler reads as this
    replica's stream failure; and the stale entry would sit in the lost set for ever."""
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]), owner=1)
        engine.run_ahead()
        await engine.end_stream(1)   # "a" lost
        engine.verifier = _RefusesPrefills([engine])
        again = await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]), owner=2)
        after = await engine.step(draft_pb2.StepRequest(items=[decode("a")]), owner=2)
        engine._settle()
        return _codes(again), _codes(after), "a" in engine._lost
    again, after, still_lost = asyncio.run(run())
    assert again == {"a": "RESOURCE_EXHAUSTED"}   # the verifier's word, passed on
    assert after == {"a": "NOT_FOUND"} and not still_lost


# Catches `self._drop(res.request_id)` deleted for a result the verifier refused: the request
# stayed running here until the scheduler released it, and a next item for it drafted a tree for
# a request the verifier no longer holds.
def test_a_request_the_verifier_refused_is_dropped_here_at_once():
    """The verifier dropped a request whose tree or piece it refused: held on here, it counted as
    running (ddtree_running_requests), kept its drafter context, and the scheduler's next step for
    it (a retry, or one already queued) was drafted and sent, for the verifier to fail again. It is
    NOT_FOUND here at once, and released at the verifier with the next call."""
    async def run():
        engine, verifier = _engine_with(_Accepts)
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4), admit("b", 4)]))
        engine.run_ahead()
        engine.verifier = refusing = _RefusesFirst([engine])
        refused = await engine.step(draft_pb2.StepRequest(items=[decode("a"), decode("b")]))
        engine.run_ahead()
        running = _running(engine)
        engine.verifier = verifier
        after = await engine.step(draft_pb2.StepRequest(items=[decode("a"), decode("b")]))
        engine._settle()
        return (_codes(refused), running, _codes(after), verifier.roots, verifier.calls[-1][0],
                refusing.roots, sorted(engine.proposer._history))
    refused, running, after, roots, released, refused_roots, contexts = asyncio.run(run())
    assert refused == {"a": "INVALID_ARGUMENT", "b": "OK"} and list(refused_roots[0]) == ["a", "b"]
    assert running == 1
    assert after == {"a": "NOT_FOUND", "b": "OK"}
    assert list(roots[-1]) == ["b"] and released == ["a"] and contexts == ["b"]


# Catches `self._lost.clear()` deleted from `_mark_lost`: ids no scheduler releases (it went away)
# piled up in the lost set for ever.
def test_the_lost_ids_remembered_are_bounded(monkeypatch):
    """Every stream that ends (a scheduler restarting, the verifier going) marks its requests lost
    until they are released; a scheduler that went away releases none. Without a bound a
    long-running draft's lost set grows by every request of every such stream, a slow leak; past
    the bound the oldest are forgotten (an item naming one is then NOT_FOUND)."""
    monkeypatch.setattr(draft_engine, "MAX_LOST", 4)

    async def run():
        engine, _ = make_engine()
        sizes = []
        for owner in range(1, 5):
            ids = [f"r{owner}-{i}" for i in range(3)]
            await engine.step(draft_pb2.StepRequest(items=[admit(rid, 0) for rid in ids]), owner=owner)
            engine.run_ahead()
            await engine.end_stream(owner)
            sizes.append(len(engine._lost))
        first = await engine.step(draft_pb2.StepRequest(items=[decode("r1-0")]), owner=9)
        last = await engine.step(draft_pb2.StepRequest(items=[decode("r4-0")]), owner=9)
        engine._settle()
        return sizes, _codes(first), _codes(last)
    sizes, first, last = asyncio.run(run())
    assert max(sizes) <= 4 + 3   # the bound, and at most one stream's ids past it
    assert first == {"r1-0": "NOT_FOUND"} and last == {"r4-0": "UNAVAILABLE"}


# Catches `self._prompts.pop(rid, None)` deleted from `_drop`: the prompt of a request dropped
# before its prefill's features came (refused by the verifier, lost with a stream) stayed for ever.
def test_a_dropped_requests_held_prompt_goes_with_it():
    """A prompt is held from its admission until its features arrive; one whose request was
    dropped first (the verifier refused it, or its stream was lost) is never read again. Kept, every
    such request leaked its whole prompt (up to the context length of tokens as Python ints), a
    slow leak no metric shows."""
    async def run():
        engine, _ = make_engine()
        engine.verifier = _RefusesPrefills([engine])
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))

        class _Lost(_RefusesPrefills):
            async def step(self, *args):
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "verifier stream broke")
        engine.verifier = _Lost([engine])
        with pytest.raises(ServiceError):
            await engine.step(draft_pb2.StepRequest(items=[admit("b", 4)]))
        engine._settle()
        return dict(engine._prompts), sorted(engine._requests)
    prompts, held = asyncio.run(run())
    assert prompts == {} and held == []


# Catches `_reconnect_when_lost`'s default interval raised (1 s -> 30 s): `serve` passes none, so a
# replica whose verifier came back stayed NOT_SERVING for up to the interval unless a step came.
def test_a_lost_verifier_is_hand_shaken_again_within_a_second(monkeypatch):
    """Health follows the verifier stream, so between the verifier's return and the next
    hand-shake the replica is down for every scheduler; a replica no one steps only comes back
    through this loop. Its first attempt waits 1 s (the loop runs here without a real clock)."""
    waits, attempts = [], []

    class _Stop(Exception):
        pass

    class _Engine:
        verifier = type("V", (), {"connected": False})()

        async def ensure_connected(self):
            attempts.append(len(waits))

    async def fake_sleep(s):
        waits.append(s)
        if len(waits) > 1:
            raise _Stop

    monkeypatch.setattr(draft_server.asyncio, "sleep", fake_sleep)
    with pytest.raises(_Stop):
        asyncio.run(draft_server._reconnect_when_lost(_Engine()))
    assert waits == [1.0, 1.0] and attempts == [1]   # a second, then the hand-shake, then a second


class _ScriptedVerifier(verifier_pb2_grpc.VerifierServicer):
    """A verifier that answers handshakes with ``choose(offered)`` and, on its stream, commits one
    token a prefill with its features in an shm ring of its own; it records each request."""

    def __init__(self, choose, target_digest: str = "") -> None:
        self.choose = choose
        self.target_digest = target_digest
        self.skew = 0   # added to the sequence each answer names
        self.offers: list[list[str]] = []
        self.requests: list[list[verifier_pb2.VerifyRequest]] = []
        self.ring = make_writer("shm", 4096, 4, "ddtree-verifier")   # unlinked at close()

    async def Handshake(self, request, context):
        self.offers.append(list(request.transports))
        kind = self.choose(list(request.transports))
        hs = verifier_pb2.HandshakeResponse(transport=kind, model_type="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
                                            max_context=512, verifier_id="v", target_digest=self.target_digest)
        if kind == "shm":
            hs.verifier_ring, hs.verifier_ring_slot_bytes, hs.verifier_ring_slots = (
                self.ring.ring_name, self.ring.slot_bytes, self.ring.num_slots)
        return hs

    async def VerifyStream(self, request_iterator, context):
        seen = []
        self.requests.append(seen)
        async for req in request_iterator:
            seen.append(req)
            self.ring.release(req.released_slots)
            resp = verifier_pb2.VerifyResponse(sequence=req.sequence + self.skew)
            for p in req.prefills:
                resp.prefills.add(request_id=p.request_id, token_ids=[1], committed=len(p.token_ids))
            n = sum(len(p.token_ids) for p in req.prefills)
            resp.features.CopyFrom(self.ring.write({"features": torch.ones(n, FEATURES)}))
            yield resp


async def _scripted(choose, transport="shm"):
    servicer = _ScriptedVerifier(choose)
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = VerifierClient(f"127.0.0.1:{port}", transport, ring_slots=2, ring_slot_bytes=4096, device="cpu")
    return servicer, server, client


def _recording_rings(monkeypatch) -> list:
    """Every ring the draft's client makes, held by the test as anything else holding one would."""
    made = []

    def recording(kind, *args, **kwargs):
        made.append(make_writer(kind, *args, **kwargs))
        return made[-1]
    monkeypatch.setattr(verifier_client, "make_writer", recording)
    return made


# Catches FAILED_PRECONDITION -> INTERNAL for a verifier that picks a transport the draft never
# offered: a misconfiguration (a verifier of another version), not a fault of this process.
def test_a_verifier_choosing_a_transport_never_offered_fails_the_handshake_as_a_precondition(monkeypatch):
    """The draft offered shm then inline; a verifier answering cuda_ipc speaks another protocol
    version or is misconfigured. The operator must read FAILED_PRECONDITION with both sides' kinds
    named (start-up fails fast on it), not INTERNAL, which reads as a bug of the draft; and the ring
    made for the offer must not stay behind in /dev/shm."""
    made = _recording_rings(monkeypatch)

    async def run():
        servicer, server, client = await _scripted(lambda offered: "cuda_ipc", transport="auto")
        try:
            with pytest.raises(ServiceError) as failed:
                await client.connect([0, 1], HIDDEN, VOCAB)
            left = [w.ring_name for w in made if w.ring_name and os.path.exists(f"/dev/shm/{w.ring_name}")]
            return failed.value, left, client.connected
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)
    error, left, connected = asyncio.run(run())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'cuda_ipc'" in error.message and "did not offer" in error.message
    assert made and left == [] and not connected


# Catches `self._close_writer()` deleted where the verifier picks another offered kind: the ring
# of the refused kind (an shm segment) stayed open, its name in /dev/shm, beside the one in use.
def test_a_ring_of_a_kind_the_verifier_passed_over_is_closed_at_once(monkeypatch):
    """The draft offers shm first; a verifier on another host answers inline. The shm ring it made
    for the offer is never used: it must go at once (its name out of /dev/shm, where `ipc: host`
    rings share the host's space), not stay open for the life of the stream."""
    made = _recording_rings(monkeypatch)

    async def run():
        servicer, server, client = await _scripted(lambda offered: "inline", transport="auto")
        try:
            hs = await client.connect([0, 1], HIDDEN, VOCAB)
            names = [w.ring_name for w in made]
            return hs.transport, servicer.offers, names, [os.path.exists(f"/dev/shm/{n}") for n in names if n]
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)
    kind, offers, names, exist = asyncio.run(run())
    assert kind == "inline" and offers == [["shm", "inline"], ["inline"]]
    assert names[0].startswith("ddtree-draft") and exist == [False]


# Catches `self.handshake = None` deleted from `close`: a draft whose verifier stream was lost
# still reported the old verifier's ModelInfo (its id, context, transport) as if connected.
def test_a_lost_verifier_stream_forgets_the_handshake():
    """ModelInfo (and its verifier_id) is what schedulers and operators read to know which verifier
    a replica serves through: after the stream is lost it must say so (UNAVAILABLE), not describe a
    verifier this draft no longer reaches, until a new handshake names the one it reaches then."""
    async def run():
        servicer, server, client = await _scripted(lambda offered: "shm")
        engine, _ = make_engine()
        engine.verifier = client
        try:
            await engine.connect()
            before = engine.model_info().verifier_id
            await server.stop(None)   # the verifier goes: the next step finds the stream lost
            with pytest.raises(ServiceError) as lost:
                await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
            with pytest.raises(ServiceError) as after:
                engine.model_info()
            return before, lost.value.code, after.value.code, client.handshake
        finally:
            await client.close(final=True)
            servicer.ring.close()
    before, lost, after, handshake = asyncio.run(run())
    assert before == "v" and lost == grpc.StatusCode.UNAVAILABLE
    assert after == grpc.StatusCode.UNAVAILABLE and handshake is None


# Catches `self._to_release = []` deleted from `close`: the slot of the last reply read on an old
# stream was sent as released on the next stream, whose verifier ring never lent it.
def test_a_new_verifier_stream_is_sent_no_slot_of_the_old_one():
    """A reply's features hold a slot of the verifier's ring until the draft's next step gives it
    back. When the stream ends in between (here the draft closes it), that slot is the old ring's:
    sent on the new stream, it would free a slot of the new ring that the verifier may have just
    written a reply into, and the draft would read features being overwritten."""
    async def run():
        servicer, server, client = await _scripted(lambda offered: "shm")
        prefill = verifier_pb2.PrefillItem(request_id="a", token_ids=[1, 2, 3], reserve_tokens=16)
        try:
            await client.connect([0, 1], HIDDEN, VOCAB)
            await client.step([prefill], [], None, [])
            await client.step([prefill], [], None, [])   # gives the first reply's slot back
            await client.close()   # the stream ends with the second reply's slot held
            await client.connect([0, 1], HIDDEN, VOCAB)
            await client.step([prefill], [], None, [])
            return [[list(r.released_slots) for r in stream] for stream in servicer.requests]
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)
    released = asyncio.run(run())
    assert len(released[0]) == 2 and released[0][0] == [] and len(released[0][1]) == 1
    assert released[-1] == [[]]


def test_an_answer_to_another_step_ends_the_stream_instead_of_being_taken_for_this_one():
    """Each answer names the step it answers; one that names another (a step cut between its write
    and its read leaves its answer for the next) would fold one step's tokens and features into
    another's requests. The step fails as lost, and the stream is closed."""
    async def run():
        servicer, server, client = await _scripted(lambda offered: "shm")
        try:
            await client.connect([0, 1], HIDDEN, VOCAB)
            piece = verifier_pb2.PrefillItem(request_id="a", token_ids=[1, 2, 3])
            first = await client.step([piece], [], None, [])
            servicer.skew = 1
            with pytest.raises(ServiceError) as lost:
                await client.step([verifier_pb2.PrefillItem(request_id="b", token_ids=[4])], [], None, [])
            return first, lost.value, client.connected
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)
    first, error, connected = asyncio.run(run())
    assert first.features.shape[0] == 3
    assert error.code == grpc.StatusCode.UNAVAILABLE and "answered step 3 to step 2" in error.message, error.message
    assert not connected


def test_a_draft_waiting_for_its_verifier_holds_no_ring_until_the_verifier_answers():
    """Only the verifier's mapping of a draft's shm ring lets its name go: a ring made for the
    whole start-up wait (up to draft.verifier_wait_s) stayed in /dev/shm when the waiting draft
    was killed, and a SIGTERM then warned of a leaked segment. The ring is made once the
    verifier's port answers; the handshake then goes through as before."""
    from services.common.launcher import free_port

    port = free_port()
    mine = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(f"ddtree-draft-{os.getpid()}-")]  # noqa: E731

    async def run():
        client = VerifierClient(f"127.0.0.1:{port}", "shm", ring_slots=2, ring_slot_bytes=4096, device="cpu")
        connecting = asyncio.ensure_future(client.connect([0, 1], HIDDEN, VOCAB, wait_s=10))
        await asyncio.sleep(0.5)
        waiting = mine()
        servicer = _ScriptedVerifier(lambda offered: "shm")
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            hs = await asyncio.wait_for(connecting, 10)
            return waiting, hs.transport, client.connected, mine()
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)

    waiting, transport, connected, after = asyncio.run(run())
    assert waiting == [] and transport == "shm" and connected
    assert after == []   # mapped by the verifier in its handshake: the name went

    async def nobody():
        client = VerifierClient(f"127.0.0.1:{free_port()}", "shm", ring_slots=2, ring_slot_bytes=4096, device="cpu")
        with pytest.raises(ServiceError) as err:
            await client.connect([0, 1], HIDDEN, VOCAB, wait_s=0.5)
        return err.value
    error = asyncio.run(nobody())
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no connection within 0.5 s" in error.message
    assert mine() == []


def test_a_verifier_serving_another_target_than_the_drafts_is_refused_at_the_handshake():
    """The draft reads the target's embedding and lm_head from draft.target_path, the verifier its
    model from verifier.model_path: another model of the same shapes (a fine-tune beside its base)
    passed every check and drafted at an acceptance of 1, without a word. An empty digest on
    either side (an older verifier, a draft that read no target) is not checked."""
    async def connect(ours: str, theirs: str):
        servicer = _ScriptedVerifier(lambda offered: "inline", target_digest=theirs)
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = VerifierClient(f"127.0.0.1:{port}", "inline", ring_slots=2, ring_slot_bytes=4096, device="cpu",
                                target_digest=ours)
        try:
            try:
                await client.connect([0, 1], HIDDEN, VOCAB)
            except ServiceError as exc:
                return exc, client.connected
            return None, client.connected
        finally:
            await client.close(final=True)
            servicer.ring.close()
            await server.stop(None)
    error, connected = asyncio.run(connect("aaaa", "bbbb"))
    assert error is not None and error.code == grpc.StatusCode.FAILED_PRECONDITION and not connected
    assert "the verifier's target is another model than draft.target_path" in error.message
    assert "bbbb against aaaa" in error.message
    for ours, theirs in (("aaaa", "aaaa"), ("", "bbbb"), ("aaaa", "")):
        assert asyncio.run(connect(ours, theirs)) == (None, True), (ours, theirs)
