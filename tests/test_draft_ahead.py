"""The draft answers before its context commit and drafts the next step's trees meanwhile.

A fake verifier stands in for the stream: it accepts each tree's root and a random continuation,
and checks, at every step, that the trees it was sent are the trees the draft would draft from its
state at that moment (so a tree drafted ahead is never stale).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from ddtree.v1 import common_pb2, draft_pb2, verifier_pb2
from services.draft.engine import DraftEngine
from services.draft.proposer import OracleProposer
from services.draft.verifier_client import VerifyReply

VOCAB, HIDDEN, LAYERS, BLOCK = 64, 8, (0, 1), 6
FEATURES = HIDDEN * len(LAYERS)


class FakeVerifier:
    """Accepts each tree's root plus one drawn token; records the trees it was sent."""

    connected = True
    handshake = None

    def __init__(self, engine_ref: list, bad_features: bool = False) -> None:
        self.engine_ref = engine_ref
        self.gen = torch.Generator().manual_seed(7)
        self.sent: list[dict[str, list[list[int]]]] = []
        self.released: list[str] = []
        self.prefills: list[verifier_pb2.PrefillItem] = []
        self.bad_features = bad_features

    async def step(self, prefills, verify_ids, packed, release) -> VerifyReply:
        engine: DraftEngine = self.engine_ref[0]
        self.released += release
        self.prefills += prefills
        resp = verifier_pb2.VerifyResponse()
        feats = []
        for p in prefills:
            resp.prefills.add(request_id=p.request_id, token_ids=[int(torch.randint(VOCAB, (), generator=self.gen))],
                              committed=len(p.token_ids))
            feats.append(torch.randn(len(p.token_ids), FEATURES, generator=self.gen))
        if verify_ids:
            sizes = packed["sizes"].tolist()
            tokens = packed["tokens"].split(sizes)
            self.sent.append({rid: t.tolist() for rid, t in zip(verify_ids, tokens)})
            self.depths = {rid: int(d.max()) for rid, d in zip(verify_ids, packed["depths"].split(sizes))}
            # What the draft would draft now, from the state this step runs on.
            reqs = [engine._requests[rid] for rid in verify_ids]
            fresh = engine._draft(reqs, [r.budget for r in reqs])
            assert [t.tokens.tolist() for t in fresh] == [t.tolist() for t in tokens]
            for rid in verify_ids:
                committed = 2 if self.bad_features else 1   # bad: more rows than the one token it names
                resp.verifies.add(request_id=rid, token_ids=[int(torch.randint(VOCAB, (), generator=self.gen))],
                                  committed=committed)
                feats.append(torch.randn(committed, FEATURES, generator=self.gen))
        return VerifyReply(resp, torch.cat(feats) if feats else torch.empty(0, FEATURES))


def make_engine(bad_features: bool = False) -> tuple[DraftEngine, FakeVerifier]:
    prompt = [3, 9, 27, 17]
    proposer = OracleProposer({"vocab_size": VOCAB, "hidden_size": HIDDEN, "block_size": BLOCK,
                               "target_layer_ids": list(LAYERS), "seed": 5,
                               "continuations": [{"prompt": prompt, "continuation": [1, 2, 3, 4, 5, 6, 7, 8]}]})
    ref: list = []
    verifier = FakeVerifier(ref, bad_features)
    engine = DraftEngine(proposer, verifier)   # type: ignore[arg-type]
    engine.max_context = 512
    ref.append(engine)
    return engine, verifier


def admit(rid: str, budget: int, prompt=(3, 9, 27, 17)) -> draft_pb2.StepItem:
    return draft_pb2.StepItem(request_id=rid, prompt_token_ids=list(prompt), budget=budget, max_new_tokens=32,
                              mode=common_pb2.MODE_DDTREE)


def stage_counts(engine: DraftEngine) -> dict[str, float]:
    """Steps each stage has timed (``ddtree_step_ms_count`` by stage)."""
    return {s.labels["stage"]: s.value for m in engine.metrics.registry.collect() for s in m.samples
            if s.name == "ddtree_step_ms_count"}


async def _admit_then(item: draft_pb2.StepItem):
    """A fresh engine's step admitting request "a", its work ahead, then a step of ``item``:
    (engine, verifier, first response, second response)."""
    engine, verifier = make_engine()
    first = await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
    engine.run_ahead()
    second = await engine.step(draft_pb2.StepRequest(items=[item]))
    engine._settle()
    return engine, verifier, first, second


def trees_by(engine: DraftEngine, drafted: str) -> float:
    return engine.metrics.draft_trees.labels(drafted)._value.get()


def test_next_trees_are_drafted_ahead_and_match_a_fresh_draft():
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4), admit("b", 4)]))
        for i in range(3):
            resp = await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=4),
                                                                  draft_pb2.StepItem(request_id="b", budget=4)]))
            assert all(not r.error_code and len(r.token_ids) == 1 for r in resp.results)
            if i != 1:   # as the service does once the answer has left; else the next step runs it
                engine.run_ahead()
        assert len(verifier.sent) == 3 and all(len(t["a"]) == 1 + 4 for t in verifier.sent)   # root + budget
        assert trees_by(engine, "ahead") == 6 and trees_by(engine, "step") == 0
        # A new budget for one request: its tree is drafted in the step, the other's is used.
        await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=8),
                                                       draft_pb2.StepItem(request_id="b", budget=4)]))
        assert len(verifier.sent[-1]["a"]) == 1 + 8 and len(verifier.sent[-1]["b"]) == 1 + 4
        assert trees_by(engine, "ahead") == 7 and trees_by(engine, "step") == 1
        # Released, then admitted again under the same id: a prefill first, then fresh trees.
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4, prompt=(5, 6, 7)),
                                                       draft_pb2.StepItem(request_id="b", budget=4)],
                                                release=["a"]))
        await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=4),
                                                       draft_pb2.StepItem(request_id="b", budget=4)]))
        assert engine._requests["a"].length == 3 + 1   # the new prompt and one step, nothing of the old
        # A step that only releases is no decode step: it times no stage.
        engine.run_ahead()
        timed = stage_counts(engine)
        assert timed["step"] == timed["ahead_wait"] == 7
        await engine.step(draft_pb2.StepRequest(release=["a", "b"]))
        assert not engine._requests
        assert stage_counts(engine) == timed
        engine._settle()
    asyncio.run(run())


def test_a_step_whose_items_the_draft_refuses_is_no_decode_step():
    """Every item refused before the verifier (a request this draft does not hold): the step makes
    no round trip and times no stage, and says so; the scheduler timed it with zeros beside the
    draft's decode steps, and its `step_rpc` count ran past the draft's `step`."""
    engine, _, first, refused = asyncio.run(_admit_then(draft_pb2.StepItem(request_id="gone", budget=4)))
    timed = stage_counts(engine)
    assert first.decoded and not refused.decoded and refused.results[0].error_code
    assert timed["step"] == timed["ahead_wait"] == timed["draft"] == 1


def test_a_root_alone_is_counted_as_no_draft_tree():
    """Autoregressive steps send the root alone: counted as trees, `draft_trees_total` ran past the
    scheduler's `tree_steps` (and the acceptance histogram) it is read beside."""
    async def run():
        engine, verifier = make_engine()
        ar = draft_pb2.StepItem(request_id="ar", prompt_token_ids=[3, 9, 27, 17], budget=0, max_new_tokens=32,
                                mode=common_pb2.MODE_AUTOREGRESSIVE)
        await engine.step(draft_pb2.StepRequest(items=[ar, admit("dd", 4)]))
        for _ in range(3):
            engine.run_ahead()
            await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="ar", budget=0),
                                                           draft_pb2.StepItem(request_id="dd", budget=4)]))
        engine._settle()
        assert all(len(t["ar"]) == 1 and len(t["dd"]) == 1 + 4 for t in verifier.sent)
        return trees_by(engine, "ahead") + trees_by(engine, "step")
    assert asyncio.run(run()) == 3   # the DDTree request's three, none of the other's


def test_an_admission_reserves_prompt_output_and_a_block_and_its_first_token_is_no_tree_step():
    """The verifier's reservation is what the scheduler admitted by (prompt + output + one block:
    the last trees reach a block past the output); one block less and a full cache failed a
    request near its end. The prefill's token is no verify step: counted as one, it skewed
    steps, mean acceptance and the speculation pause's window."""
    _, verifier, first, second = asyncio.run(_admit_then(draft_pb2.StepItem(request_id="a", budget=4)))
    prefills, first, second = verifier.prefills, first.results[0], second.results[0]
    assert [p.reserve_tokens for p in prefills] == [4 + 32 + BLOCK]
    assert len(first.token_ids) == 1 and first.acceptance_length == 0
    assert second.acceptance_length == len(second.token_ids) == 1


def test_a_failed_context_commit_fails_its_requests_not_the_next_step():
    """The commit runs after the answer has left: one that fails (device memory, here features that
    do not match the tokens) used to fail the next step of whichever stream came, with all its
    requests, and leave the failed request drafting from a context behind the verifier's. Now
    that request alone fails (INTERNAL) and is released at the verifier; the step goes on."""
    async def run():
        engine, verifier = make_engine(bad_features=True)
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        resp = await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=4)]))
        assert not resp.results[0].error_code
        engine.run_ahead()   # the service's call after the answer: the commit fails here
        resp = await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=4),
                                                              admit("b", 4)]))
        return ({r.request_id: (r.error_code, r.error_message) for r in resp.results}, verifier.released,
                sorted(engine._requests))
    results, released, held = asyncio.run(run())
    code, message = results["a"]
    assert code == grpc.StatusCode.INTERNAL.value[0] and "context commit failed" in message
    assert "features have 2 rows for 1 committed tokens" in message
    assert results["b"] == (0, "") and released == ["a"] and held == ["b"]


def test_closing_waits_for_the_step_in_flight_before_the_verifiers_rings_go():
    """The service closed the verifier's client while a stream's clean-up still awaited its answer:
    the clean-up then failed on the closed client (a task exception nobody retrieved)."""
    async def run():
        engine, verifier = make_engine()
        order = []

        async def slow_step(*args):
            await asyncio.sleep(0.2)
            order.append("step")
            return await FakeVerifier.step(verifier, *args)

        async def close(final=False):
            order.append("close" if final else "stream end")
        verifier.step, verifier.close = slow_step, close
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        order.clear()
        cleanup = asyncio.ensure_future(engine.end_stream(0))
        await asyncio.sleep(0.05)   # the clean-up holds the lock, awaiting the verifier
        await engine.close()
        await cleanup
        return order
    assert asyncio.run(run()) == ["step", "close"]


@pytest.mark.parametrize("then", ["step", "end_stream"])
def test_releases_of_a_step_whose_drafting_failed_still_reach_the_verifier(then):
    """The step dropped its released requests here, then failed drafting before the verifier call:
    their ids never reached the verifier, which held their KV pages until the stream ended. They
    go with the next step, or with the stream's end (a failed step ends it)."""
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4), admit("b", 4)]), owner=1)
        engine.run_ahead()
        engine._ahead, engine._settle = {}, lambda: {}   # the next trees are drafted in the step

        def failing(*args, **kwargs):
            raise RuntimeError("CUDA error: out of memory")
        propose, engine.proposer.propose = engine.proposer.propose, failing
        with pytest.raises(RuntimeError, match="out of memory"):
            await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="b", budget=4)],
                                                    release=["a"]), owner=1)
        engine.proposer.propose = propose
        before = list(verifier.released)
        if then == "step":
            await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="b", budget=4)]), owner=1)
        else:
            await engine.end_stream(1)
        return before, verifier.released, sorted(engine._requests)

    before, after, held = asyncio.run(run())
    assert "a" not in before and after.count("a") == 1 and held == (["b"] if then == "step" else [])


def test_a_reply_with_fewer_feature_rows_than_committed_tokens_is_a_lost_step():
    """The rows were sliced without a count: a reply one row short advanced the request by its
    committed tokens and its drafter context by one fewer, and the drafts went on from the wrong
    position without a word. The step fails as lost, and the verifier stream ends (its requests go
    at both ends)."""
    from services.common.grpc_server import ServiceError

    class Short(FakeVerifier):
        closed = 0

        async def step(self, prefills, verify_ids, packed, release):
            reply = await super().step(prefills, verify_ids, packed, release)
            return VerifyReply(reply.response, reply.features[:-1])

        async def close(self, final=False):
            self.closed += 1

    async def run():
        engine, _ = make_engine()
        verifier = engine.verifier = Short([engine])
        with pytest.raises(ServiceError) as lost:
            await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        return lost.value, verifier.closed

    lost, closed = asyncio.run(run())
    assert lost.code == grpc.StatusCode.UNAVAILABLE and "3 feature rows for 4 committed tokens" in lost.message
    assert closed == 1


def test_trees_drafted_ahead_for_another_streams_requests_are_kept_for_them() -> None:
    """Two scheduler streams stepped in turn: each step replaced the trees drafted ahead with its
    own, so the other stream's were thrown away and every tree was drafted twice. They stay now,
    and one is used only by the request object it was drafted for (an id may come back)."""
    async def run() -> tuple[float, float, float]:
        engine, _ = make_engine()
        for owner, rid in enumerate(("r0", "r1")):
            await engine.step(draft_pb2.StepRequest(items=[admit(rid, 4)]), owner=owner)
            engine.run_ahead()
        for _ in range(5):
            for owner, rid in enumerate(("r0", "r1")):
                await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id=rid, budget=4)]),
                                  owner=owner)
                engine.run_ahead()   # as the service does once the answer has left
        ahead, step = trees_by(engine, "ahead"), trees_by(engine, "step")
        # r1 ends and comes back under its id: the tree drafted for the old one is not the new one's
        await engine.step(draft_pb2.StepRequest(release=["r1"]), owner=1)
        await engine.step(draft_pb2.StepRequest(items=[admit("r1", 4)]), owner=1)
        stale = engine._ahead.get("r1")
        return ahead, step, stale is None or stale[0] is engine._requests["r1"]
    ahead, step, fresh = asyncio.run(run())
    assert (ahead, step) == (10, 0) and fresh


def test_the_draft_takes_budgets_up_to_the_largest_and_refuses_past_it():
    from services.common.settings import MAX_BUDGET

    async def run():
        engine, _ = make_engine()
        resp = await engine.step(draft_pb2.StepRequest(items=[admit("a", MAX_BUDGET), admit("b", MAX_BUDGET + 1)]))
        engine._settle()
        return {r.request_id: (r.error_code, r.error_message) for r in resp.results}
    results = asyncio.run(run())
    assert results["a"][0] == 0
    assert results["b"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and f"budget {MAX_BUDGET + 1} outside 0..{MAX_BUDGET}" in results["b"][1]


def test_releases_owed_go_out_with_a_step_whose_items_are_all_refused():
    """A step of refused items only makes no round trip, but releases still owed (a stream that
    ended, a failed step) must go with it: dropped there, the verifier held those requests' KV."""
    async def run():
        engine, verifier = make_engine()
        engine._release_owed = ["gone"]
        resp = await engine.step(draft_pb2.StepRequest(items=[admit("bad", 999)]))
        engine._settle()
        return resp, verifier.released
    resp, released = asyncio.run(run())
    assert resp.results[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert released == ["gone"]


def test_a_tree_near_the_context_end_reaches_its_last_position_and_no_further():
    """The deepest node of a tree sits at the request's length + depth, which must stay below
    max_context (the verifier refuses past it, OUT_OF_RANGE) and use the room there is."""
    async def run():
        engine, verifier = make_engine()
        engine.max_context = 4 + 1 + 3      # prompt 4, one token, then room for a tree 2 deep
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 8)]))
        length = engine._requests["a"].length   # the tree's root, the pending token, sits here
        engine.run_ahead()
        await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=8)]))
        engine._settle()
        return verifier.depths["a"], length, engine.max_context
    depth, length, max_context = asyncio.run(run())
    assert length == 4 and length + depth == max_context - 1   # the last position, no further


async def _prompt_arriving() -> tuple[DraftEngine, FakeVerifier]:
    """A draft holding the first piece ([3, 9]) of request "a", whose prompt goes on."""
    engine, verifier = make_engine()
    first = draft_pb2.StepItem(request_id="a", prompt_token_ids=[3, 9], prompt_continues=True, budget=4,
                               max_new_tokens=32, mode=common_pb2.MODE_DDTREE)
    await engine.step(draft_pb2.StepRequest(items=[first]))
    engine.run_ahead()
    return engine, verifier


def test_a_draft_prompt_piece_behind_what_it_holds_is_refused_and_the_request_kept() -> None:
    """A resent piece (its offset behind what the draft holds) is refused here, the request kept:
    sent on, the verifier's refusal dropped the whole request."""
    async def run():
        engine, verifier = await _prompt_arriving()
        sent = len(verifier.prefills)
        again = draft_pb2.StepItem(request_id="a", prompt_token_ids=[9, 27, 17], prompt_offset=1, budget=4,
                                   mode=common_pb2.MODE_DDTREE)
        resp = await engine.step(draft_pb2.StepRequest(items=[again]))
        engine._settle()
        return resp.results[0], engine, verifier, sent
    res, engine, verifier, sent = asyncio.run(run())
    assert res.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert len(verifier.prefills) == sent           # never sent on
    assert engine._requests["a"].length == 2 and engine._requests["a"].prefilling


def test_a_draft_step_for_a_request_whose_prompt_is_still_arriving_is_refused_alone() -> None:
    """A decode step before the prompt's last piece: refused alone, no tree drafted from a root
    that does not exist yet (sent on, it dropped the request at the verifier)."""
    async def run():
        engine, verifier = await _prompt_arriving()
        resp = await engine.step(draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="a", budget=4)]))
        engine._settle()
        return resp.results[0], engine, verifier
    res, engine, verifier = asyncio.run(run())
    assert res.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert verifier.sent == [] and engine._requests["a"].prefilling
