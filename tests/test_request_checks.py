"""Request checks of the verifier, draft and shm transport at their edges (from a mutation run:
each test kills mutants no other test noticed). Fixtures from test_verifier_bad_input / test_draft_ahead."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch

from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2
from services.common import transport
from services.common.grpc_server import ServiceError
from services.common.settings import MAX_BUDGET, MAX_DRAFT_RING_SLOT_BYTES, MAX_DRAFT_RING_SLOTS
from services.common.transport import InlineReader, InlineWriter, make_reader, make_writer
from services.draft.server import DraftServicer
from services.draft.verifier_client import VerifyReply
from services.verifier.engine import PrefillInput
from services.verifier.sampling import Sampling
from tests.test_draft_ahead import BLOCK, FEATURES, admit, make_engine
from tests.test_verifier_bad_input import (CODES, chain, ckpt, hello, outcome, prefill, servicer,  # noqa: F401
                                           serving, shm_peer, verify)

I, F = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def _recording_calls(svc) -> list[str]:
    calls: list[str] = []
    call = svc.group.call
    svc.group.call = lambda method, *args: (calls.append(method), call(method, *args))[1]
    return calls


def _trees(seq: int, rids: list[str], tokens, parents, depths, sizes) -> verifier_pb2.VerifyRequest:
    """A verify step whose tree tensors are given as they are, malformed or not."""
    t = lambda v: v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int64)  # noqa: E731
    bundle = InlineWriter().write({"tokens": t(tokens), "parents": t(parents), "depths": t(depths), "sizes": t(sizes)})
    return verifier_pb2.VerifyRequest(sequence=seq, verify_ids=rids, trees=bundle)


# ------------------------------------------------------------------------------ verifier: handshake


def test_a_drafter_of_another_hidden_size_is_refused_at_its_handshake(ckpt):
    """Only the vocabulary half of the check was tested."""
    hidden = json.loads((ckpt / "config.json").read_text())["hidden_size"]

    async def run():
        async with serving(servicer(ckpt)) as stub:
            request = hello(ckpt, "d1")
            request.hidden_size = hidden + 1
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(request)
            return info.value
    err = asyncio.run(run())
    assert err.code() == F and f"drafter expects hidden_size={hidden + 1}" in err.details()


def test_feature_layers_outside_the_target_are_refused_before_any_call_to_the_ranks(ckpt):
    """A `set_feature_layers` the other ranks refuse would end the group. A negative layer passed
    (then every forward's assert failed)."""
    svc = servicer(ckpt)
    n = svc.engine.model.config.num_hidden_layers
    calls = _recording_calls(svc)

    async def run():
        async with serving(svc) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(hello(ckpt, "d1", layers=[n]))
            return info.value
    err = asyncio.run(run())
    assert err.code() == F and f"[{n}] outside the target's {n} layers" in err.details()
    assert "set_feature_layers" not in calls
    with pytest.raises(ServiceError) as negative:
        svc.engine.check_feature_layers([-1])
    assert negative.value.code == F and "[-1] outside the target's" in negative.value.message


def _shm_hello(ckpt, slots: int, slot_bytes: int) -> verifier_pb2.HandshakeRequest:
    request = hello(ckpt, "d1")
    request.transports[:] = ["shm"]
    request.draft_ring, request.draft_ring_slots, request.draft_ring_slot_bytes = "ddtree-draft-0-x", slots, slot_bytes
    return request


def test_a_draft_ring_of_the_largest_size_a_draft_may_make_is_taken_and_one_slot_more_is_refused(ckpt, monkeypatch):
    """DraftSettings allow these maxima; only the slot-bytes bound was tested."""
    attached = []
    monkeypatch.setattr("services.verifier.server.make_reader",
                        lambda kind, name, slot_bytes, slots, **kw: (attached.append((slots, slot_bytes)), InlineReader())[1])

    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            try:
                taken = await stub.Handshake(_shm_hello(ckpt, MAX_DRAFT_RING_SLOTS, MAX_DRAFT_RING_SLOT_BYTES))
            finally:
                svc._drop_peer("d1")   # its ring goes now, not at the peer's expiry
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(_shm_hello(ckpt, MAX_DRAFT_RING_SLOTS + 1, 4096))
            return taken, info.value
    taken, refused = asyncio.run(run())
    assert taken.transport == "shm" and attached == [(MAX_DRAFT_RING_SLOTS, MAX_DRAFT_RING_SLOT_BYTES)]
    assert refused.code() == I and f"draft ring of {MAX_DRAFT_RING_SLOTS + 1} x 4096 bytes" in refused.details()
    assert "draft.ring_slots" in refused.details()


# ------------------------------------------------------------------------------ verifier: stream and step


def test_a_verify_stream_without_a_handshake_is_failed_precondition(ckpt):
    """Not an AttributeError of the missing peer (UNKNOWN)."""
    async def run():
        async with serving(servicer(ckpt)) as stub:
            stream = stub.VerifyStream(metadata=(("draft-id", "nobody"),))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.read()
            return info.value
    err = asyncio.run(run())
    assert err.code() == F and "no handshake for draft-id 'nobody'" in err.details()


def test_a_prompt_piece_reaching_max_context_is_refused_before_its_call_goes_to_the_other_ranks(ckpt):
    """The server's length check counts the piece's offset, as for a whole prompt."""
    svc = servicer(ckpt)   # max_context 1024
    calls = _recording_calls(svc)
    with shm_peer(svc, ckpt, slots=4) as peer:
        first = verifier_pb2.VerifyRequest(sequence=1, prefills=[verifier_pb2.PrefillItem(
            request_id="a", token_ids=[5, 6, 7], reserve_tokens=2000, prompt_continues=True)])
        assert svc._step(peer, first).prefills[0].error_code == 0
        piece = verifier_pb2.VerifyRequest(sequence=2, prefills=[verifier_pb2.PrefillItem(
            request_id="a", token_ids=[5] * 1021, prompt_offset=3)])
        (item,) = svc._step(peer, piece).prefills
    assert calls == ["prefill"]   # the first piece's only
    assert (CODES[item.error_code], item.error_message) == (I, "prompt has 1024 tokens; max context is 1024")
    assert svc.engine._requests["a"].length == 3


def test_empty_prompts_and_later_pieces_do_not_count_toward_a_steps_tree_cap(ckpt):
    """An empty prompt starts no request; a later piece's request is held (and counted) already."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        refusals = []
        for seq, pieces in ((2, [verifier_pb2.PrefillItem(request_id=f"e{i}", reserve_tokens=8) for i in range(10)]),
                            (3, [verifier_pb2.PrefillItem(request_id=f"p{i}", token_ids=[5], prompt_offset=3)
                                 for i in range(10)])):
            step = verify(seq, [("a", *chain(svc.engine._requests["a"].pending, 1))])
            step.verify_ids.extend(f"x{i}" for i in range(10))
            step.prefills.extend(pieces)
            with pytest.raises(ServiceError) as refused:
                svc._step(peer, step)
            refusals.append(refused.value)
    for err in refusals:
        assert err.code == I and "a step of 11 trees, more than the 1 requests it could verify" in err.message


def test_prompts_of_ids_held_already_or_named_twice_do_not_count_toward_a_steps_tree_cap(ckpt):
    """Each new prompt raised the cap by one, also one the engine then refused as ALREADY_EXISTS:
    3000 prompts named "a" (held) or "n" (one new id) let 3000 trees of unknown ids through."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        refusals = []
        for seq, rid, could in ((2, "a", 1), (3, "n", 2)):
            step = verify(seq, [("a", *chain(svc.engine._requests["a"].pending, 1))])
            step.verify_ids.extend(f"x{i}" for i in range(10))
            step.prefills.extend(verifier_pb2.PrefillItem(request_id=rid, token_ids=[5], reserve_tokens=8)
                                 for _ in range(10))
            with pytest.raises(ServiceError) as refused:
                svc._step(peer, step)
            refusals.append((refused.value, could))
        assert sorted(svc.engine._requests) == ["a"]   # refused before any prompt ran
    for err, could in refusals:
        assert err.code == I and f"a step of 11 trees, more than the {could} requests it could verify" in err.message


def test_a_tree_bundle_of_thousands_of_names_is_refused_in_a_short_message(ckpt):
    """The refusal goes into every tree's result: it names the first eight only."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        named = verify(2, [("a", *chain(svc.engine._requests["a"].pending, 2))])
        for i in range(5000):
            named.trees.tensors.add(name=f"x{i}")
        code, message = outcome(svc._step(peer, named))["a"]
    assert code == I and len(message) < 1500 and ", ...]: expected each of ['tokens'" in message


def test_tree_tensors_of_unequal_lengths_floats_or_sizes_not_summing_fail_their_trees_and_the_stream_goes_on(ckpt):
    """Else numpy's broadcast error ends the draft's stream; float tokens are truncated and verified."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        root = svc.engine._requests["a"].pending
        bad = {
            "one length": _trees(2, ["a"], [root, 9], [-1], [0, 1], [2]),
            "must be integers": _trees(3, ["a"], torch.tensor([root, 9], dtype=torch.float32), [-1, 0], [0, 1], [2]),
            "summing to the node count": _trees(4, ["a"], [root, 9, 9], [-1, 0, 1], [0, 1, 2], [2]),
        }
        got = {why: outcome(svc._step(peer, req))["a"] for why, req in bad.items()}
        ok = outcome(svc._step(peer, verify(5, [("a", *chain(root, 2))])))["a"]
    for why, (code, message) in got.items():
        assert code == I and why in message, (why, message)
    assert ok[0] == grpc.StatusCode.OK


# ------------------------------------------------------------------------------ verifier engine


def test_a_prompt_token_outside_the_vocabulary_is_named_in_its_refusal(ckpt):
    engine = servicer(ckpt).engine
    (item,) = engine.prefill([PrefillInput("a", [5, engine.vocab_size + 7], Sampling(), 64)]).items
    assert item.error.code == I
    assert f"prompt token id {engine.vocab_size + 7} outside the vocabulary [0, {engine.vocab_size})" in item.error.message


def test_a_prompt_piece_that_is_empty_or_out_of_vocabulary_or_after_the_prompt_ended_is_refused_alone(ckpt):
    """An empty piece fails the whole call (no outcome: assert); -1 / vocab_size reach the embedding."""
    engine = servicer(ckpt).engine
    V = engine.vocab_size
    assert engine.prefill([PrefillInput("p", [5, 6, 7], Sampling(), 64, more=True),
                           PrefillInput("done", [5, 6, 7], Sampling(), 64)]).items[0].error is None
    pieces = {"empty": [], "negative": [-1], "past": [V]}
    got = {k: engine.prefill([PrefillInput("p", toks, Sampling(), 0, offset=3)]).items[0] for k, toks in pieces.items()}
    for item in got.values():
        assert item.error.code == I and "prompt piece is empty or has a token outside the vocabulary" in item.error.message
    assert engine._requests["p"].length == 3 and engine._requests["p"].prefilling
    (late,) = engine.prefill([PrefillInput("done", [8], Sampling(), 0, offset=3)]).items
    assert late.error.code == F and "does not follow what the cache holds" in late.error.message
    assert engine._requests["done"].length == 3 and not engine._requests["done"].prefilling
    assert engine.prefill([PrefillInput("p", [V - 1], Sampling(), 0, offset=3)]).items[0].error is None


def test_trees_of_a_deep_root_a_skipped_depth_an_orphan_or_a_self_parent_are_refused_alone(ckpt):
    """Depths are positions of the KV committed. The orphan's parent index -1 wraps to the batch's
    last node, whose depth it matches; a self-parent is a parent fault, not a depth one."""
    engine = servicer(ckpt).engine
    rids = ["deep", "skip", "self", "orphan"]
    out = engine.prefill([PrefillInput(r, [5, 6, 7], Sampling(), 64) for r in rids])
    root = {r: it.tokens[0] for r, it in zip(rids, out.items)}
    pack = lambda ts: [torch.tensor([v for t in ts for v in t[k]]) for k in range(3)] + [  # noqa: E731
        torch.tensor([len(t[0]) for t in ts])]
    three = [([root["deep"], 9], [-1, 0], [1, 2]), ([root["skip"], 9], [-1, 0], [0, 2]),
             ([root["self"], 9], [-1, 1], [0, 1])]
    res = engine.verify(rids[:3], *pack(three)).items
    orphan = engine.verify(["orphan"], *pack([([root["orphan"], 9, 9], [-1, -1, 0], [0, 2, 1])])).items[0]
    assert res[0].error.code == F and "tree root must be the pending token" in res[0].error.message
    assert res[1].error.code == I and "depths must be parent depth + 1" in res[1].error.message
    assert res[2].error.code == I and "parents must precede their children" in res[2].error.message
    assert orphan.error is not None and orphan.error.code == I
    assert "parents must precede their children" in orphan.error.message
    assert all(engine._requests[r].length == 3 for r in rids)


# ------------------------------------------------------------------------------ draft


def _draft_results(resp: draft_pb2.StepResponse) -> dict[str, tuple[grpc.StatusCode, str]]:
    return {r.request_id: (CODES[r.error_code], r.error_message) for r in resp.results}


def test_the_draft_refuses_a_negative_budget_alone():
    """Admitted, it fails the tree build: a ValueError that ends the scheduler's stream."""
    async def run():
        engine, verifier = make_engine()
        resp = await engine.step(draft_pb2.StepRequest(items=[admit("neg", -1), admit("ok", 4)]))
        engine._settle()
        return _draft_results(resp), [p.request_id for p in verifier.prefills]
    got, sent = asyncio.run(run())
    assert got["neg"] == (I, f"budget -1 outside 0..{MAX_BUDGET}") and got["ok"][0] == grpc.StatusCode.OK
    assert sent == ["ok"]


def test_the_draft_refuses_a_prompt_piece_for_a_request_whose_prompt_has_all_arrived():
    """Sent on, the verifier's refusal dropped the request."""
    async def run():
        engine, verifier = make_engine()
        await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        engine.run_ahead()
        sent = len(verifier.prefills)
        piece = draft_pb2.StepItem(request_id="a", prompt_token_ids=[5], prompt_offset=4, budget=4,
                                   mode=common_pb2.MODE_DDTREE)
        resp = await engine.step(draft_pb2.StepRequest(items=[piece]))
        engine._settle()
        return _draft_results(resp)["a"], len(verifier.prefills) - sent, engine._requests["a"]
    (code, message), sent, req = asyncio.run(run())
    assert code == F and "a prompt piece at 4 does not follow what this draft holds (4 tokens)" in message
    assert sent == 0 and req.length == 4 and not req.prefilling


def test_max_new_tokens_is_bounded_exactly_by_the_verifiers_int32_reservation():
    """prompt + max_new_tokens + a block must fit the int32 reserve_tokens (else a ValueError out of the step)."""
    most = 2**31 - 1 - 4 - BLOCK   # a 4-token prompt

    async def run():
        engine, verifier = make_engine()
        ok, over = admit("ok", 4), admit("over", 4)
        ok.max_new_tokens, over.max_new_tokens = most, most + 1
        resp = await engine.step(draft_pb2.StepRequest(items=[ok, over]))
        engine._settle()
        return _draft_results(resp), {p.request_id: p.reserve_tokens for p in verifier.prefills}
    got, reserved = asyncio.run(run())
    assert got["ok"][0] == grpc.StatusCode.OK and reserved == {"ok": 2**31 - 1}
    assert got["over"] == (I, f"request over: max_new_tokens {most + 1} outside 1..{most}")


def test_a_reply_with_more_feature_rows_than_committed_tokens_is_a_lost_step():
    async def run():
        engine, verifier = make_engine()
        real, closed = verifier.step, []

        async def extra(*args):
            reply = await real(*args)
            return VerifyReply(reply.response, torch.cat([reply.features, torch.zeros(1, FEATURES)]))

        async def close(final=False):
            closed.append(final)
        verifier.step, verifier.close = extra, close
        with pytest.raises(ServiceError) as lost:
            await engine.step(draft_pb2.StepRequest(items=[admit("a", 4)]))
        return lost.value, closed
    lost, closed = asyncio.run(run())
    assert lost.code == grpc.StatusCode.UNAVAILABLE and "5 feature rows for 4 committed tokens" in lost.message
    assert closed == [False]


def test_model_info_of_a_draft_without_its_verifier_is_unavailable():
    async def run():
        engine, _ = make_engine()   # its verifier stand-in has no handshake
        server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(engine), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await draft_pb2_grpc.DraftStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest())
                return info.value
        finally:
            await server.stop(0)
    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "not connected to a verifier yet" in err.details()


# ------------------------------------------------------------------------------ transport: a slot reference


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copying"])
def test_a_slot_reference_past_the_ring_into_the_header_or_past_the_written_bytes_is_refused(copy):
    """Slot one past the ring was refused only as "its owner shrank it"; header words and bytes past `used` were read."""
    with make_writer("shm", slot_bytes=256, num_slots=2, name_prefix="ddt-test") as writer:
        reader = make_reader("shm", writer.ring_name, writer.slot_bytes, writer.num_slots, copy=copy)
        bundle = writer.write({"v": torch.arange(4)})

        def changed(**slot) -> common_pb2.TensorBundle:
            out = common_pb2.TensorBundle()
            out.CopyFrom(bundle)
            for k, v in slot.items():
                setattr(out.tensors[0].slot, k, v)
            return out
        assert transport.SLOT_HEADER_BYTES + 128 + 32 <= transport.SLOT_HEADER_BYTES + reader._payload_bytes
        with pytest.raises(ValueError, match="tensor 'v' names slot 2 but the ring has 2"):
            reader.read(changed(slot=2))
        for offset in (0, transport.SLOT_HEADER_BYTES + 128):
            with pytest.raises(ValueError, match=r"tensor 'v': bytes \[\d+, \d+\) fall outside the payload written"):
                reader.read(changed(offset=offset))
        assert torch.equal(reader.read(bundle)["v"], torch.arange(4))
        reader.close()
