"""The draft engine's rules a mutation run found unpinned: each test says which change it catches.

Engine-level tests use the fake verifier of ``test_draft_ahead`` (no sockets, no threads beyond the
engine's own); the last ones run the draft's servicer or client in this process.
"""

from __future__ import annotations

import asyncio

import torch

from ddtree.v1 import common_pb2, draft_pb2, verifier_pb2
from services.draft.verifier_client import VerifyReply
from tests.test_draft_ahead import FEATURES, VOCAB, FakeVerifier, admit, make_engine


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
