"""A draft stream that sends the verifier what it must not: each gets a clear status, fails only
what it names, and the stream and the other requests go on.

The verifier's servicer and engine run in this process on a tiny random target (CPU), behind a real
gRPC server; the tests speak its wire protocol directly, as a draft would.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.make_checkpoint import make_random_checkpoint
from services.common import transport
from services.common.grpc_server import ServiceError
from services.common.metrics import Metrics
from services.common.settings import MAX_BUDGET, VerifierSettings
from services.common.transport import InlineReader, InlineWriter, make_writer
from services.verifier.parallel import TensorParallel
from services.verifier.ranks import EngineGroup
from services.verifier.server import INLINE_MOST_NODES, VerifierServicer, _Peer, _tree_nodes, build_engine

CODES = {c.value[0]: c for c in grpc.StatusCode}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_random_checkpoint(tmp_path_factory.mktemp("bad-input") / "ckpt", vocab_size=512, seed=0)
    torch.set_num_threads(threads)


def servicer(ckpt: Path, **overrides) -> VerifierServicer:
    settings = VerifierSettings(model_path=str(ckpt), kv_capacity_tokens=4096, max_context=1024,
                                ring_slot_bytes=1 << 20, ring_slots=4, **overrides)
    engine = build_engine(settings, TensorParallel(0, 1))
    return VerifierServicer(EngineGroup(engine, TensorParallel(0, 1)), settings, Metrics("verifier"))


def hello(ckpt: Path, draft_id: str, layers: list[int] | None = None) -> verifier_pb2.HandshakeRequest:
    drafter = json.loads((ckpt / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    cfg = json.loads((ckpt / "config.json").read_text())
    return verifier_pb2.HandshakeRequest(draft_id=draft_id, feature_layer_ids=drafter if layers is None else layers,
                                         hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                                         transports=["inline"])


@contextlib.contextmanager
def shm_peer(svc: VerifierServicer, ckpt: Path, slots: int) -> Iterator[_Peer]:
    """A draft as a handshake would register it, its features through an shm ring of ``slots``."""
    svc.engine.set_feature_layers(list(hello(ckpt, "d1").feature_layer_ids))
    writer = make_writer("shm", slot_bytes=1 << 20, num_slots=slots, name_prefix="ddt-test")
    peer = svc._peers["d1"] = _Peer("d1", writer, InlineReader(), owner="d1#1")
    try:
        yield peer
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def serving(svc: VerifierServicer) -> AsyncIterator[verifier_pb2_grpc.VerifierStub]:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield verifier_pb2_grpc.VerifierStub(channel)
    finally:
        await channel.close()
        await server.stop(0)


def prefill(seq: int, *rids: str, **sampling) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(sequence=seq, prefills=[
        verifier_pb2.PrefillItem(request_id=r, token_ids=[5, 6, 7], reserve_tokens=256,
                                 sampling=common_pb2.SamplingParams(**sampling)) for r in rids])


def verify(seq: int, trees: list[tuple[str, list[int], list[int], list[int]]]) -> verifier_pb2.VerifyRequest:
    """One step's trees: (request, tokens, parents, depths) each."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    bundle = {"tokens": t([x for _, tok, _, _ in trees for x in tok]),
              "parents": t([x for _, _, par, _ in trees for x in par]),
              "depths": t([x for _, _, _, dep in trees for x in dep]),
              "sizes": t([len(tok) for _, tok, _, _ in trees])}
    return verifier_pb2.VerifyRequest(sequence=seq, verify_ids=[r for r, *_ in trees], trees=InlineWriter().write(bundle))


def chain(root: int, nodes: int) -> tuple[list[int], list[int], list[int]]:
    return [root] + [9] * (nodes - 1), list(range(-1, nodes - 1)), list(range(nodes))


async def roots(stream, seq: int, *rids: str) -> dict[str, int]:
    """Prefills `rids`; their pending tokens."""
    await stream.write(prefill(seq, *rids))
    resp = await stream.read()
    assert [p.error_code for p in resp.prefills] == [0] * len(rids), resp
    return {p.request_id: p.token_ids[-1] for p in resp.prefills}


def outcome(resp: verifier_pb2.VerifyResponse) -> dict[str, tuple[grpc.StatusCode, str]]:
    return {v.request_id: (CODES[v.error_code], v.error_message) for v in resp.verifies}


def test_a_malformed_tree_fails_alone_and_the_stream_goes_on(ckpt):
    """A parent index near 2**63 overflowed the tree check's index arithmetic (an IndexError that
    ended the stream and freed every request of the draft); a tree over the largest budget ran
    eagerly at any size. Each now fails its own request; the tree beside it commits."""
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            pending = await roots(stream, 1, "a", "b")
            tok, par, dep = chain(pending["b"], 2)
            await stream.write(verify(2, [("a", *chain(pending["a"], 3)), ("b", tok, [-1, 2**63 - 1], dep)]))
            huge_parent = outcome(await stream.read())
            pending["a"] = svc.engine._requests["a"].pending
            big = MAX_BUDGET + 2
            await stream.write(verify(3, [("a", *chain(pending["a"], 2)), ("b", *chain(pending["b"], big))]))
            too_big = outcome(await stream.read())
            lengths = {r: svc.engine._requests[r].length for r in ("a", "b")}
            return huge_parent, too_big, lengths
    huge_parent, too_big, lengths = asyncio.run(run())
    assert huge_parent["a"][0] == grpc.StatusCode.OK
    assert huge_parent["b"] == (grpc.StatusCode.INVALID_ARGUMENT, "request b: parents must precede their children")
    assert too_big["a"][0] == grpc.StatusCode.OK
    assert too_big["b"][0] == grpc.StatusCode.INVALID_ARGUMENT and f"tree of {MAX_BUDGET + 2} nodes" in too_big["b"][1]
    assert lengths["b"] == 3 and lengths["a"] >= 5   # b's prompt only; a committed its root both steps


def test_a_bundle_of_more_nodes_than_its_trees_may_hold_is_refused_before_its_walk(ckpt):
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            pending = await roots(stream, 1, "a")
            await stream.write(verify(2, [("a", *chain(pending["a"], 10 * MAX_BUDGET))]))
            refused = outcome(await stream.read())
            await stream.write(verify(3, [("a", *chain(pending["a"], 2))]))
            return refused, outcome(await stream.read())
    refused, after = asyncio.run(run())
    # refused on the message's shapes, before a byte of the bundle is read
    assert refused["a"][0] == grpc.StatusCode.INVALID_ARGUMENT and "1 trees have at most 129 nodes" in refused["a"][1]
    assert after["a"][0] == grpc.StatusCode.OK


def test_a_malformed_bundle_is_refused_before_its_call_goes_to_the_other_ranks(ckpt):
    """The shapes were checked inside the engine, on every rank, after the call was broadcast: with
    ranks a bundle of millions of nodes was pickled to each (onto every GPU with NCCL) first."""
    svc = servicer(ckpt)
    calls: list[str] = []
    call = svc.group.call
    svc.group.call = lambda method, *args: (calls.append(method), call(method, *args))[1]
    with shm_peer(svc, ckpt, slots=4) as peer:
        for seq, rid in ((1, "a"), (2, "c")):
            assert svc._step(peer, prefill(seq, rid)).prefills[0].error_code == 0
        bad = verify(3, [("a", *chain(svc.engine._requests["a"].pending, 3))])
        bad.verify_ids.append("c")   # two trees named, one sent
        resp = svc._step(peer, bad)
        big = svc._step(peer, verify(4, [("a", *chain(svc.engine._requests["a"].pending, 10 * MAX_BUDGET))]))
        many = verify(5, [("a", *chain(svc.engine._requests["a"].pending, 1))])
        many.verify_ids.extend(f"x{i}" for i in range(10))   # more trees than the two requests held here
        with pytest.raises(ServiceError) as refused:
            svc._step(peer, many)
    assert calls == ["prefill", "prefill"]   # no verify was broadcast
    assert outcome(resp)["a"][0] == grpc.StatusCode.INVALID_ARGUMENT and "expected 2 trees" in outcome(resp)["a"][1]
    assert outcome(big)["a"][0] == grpc.StatusCode.INVALID_ARGUMENT and "trees have at most" in outcome(big)["a"][1]
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "a step of 11 trees" in refused.value.message


def test_a_draft_naming_a_feature_layer_twice_is_refused(ckpt):
    """Each name widens every step's features and the graphs' outputs: a drafter naming many (a
    recapture out of memory) ended a tensor-parallel group on every hand-shake."""
    async def run():
        async with serving(servicer(ckpt)) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(hello(ckpt, "d1", layers=[1, 1, 1, 1]))
            return info.value
    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "name a layer twice" in err.details()


def test_a_request_of_another_draft_stream_is_not_found_there(ckpt):
    """Releases were scoped to the draft that admitted a request; its trees and prompt pieces were
    not, so a stale stream could advance a request another draft now holds."""
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            await stub.Handshake(hello(ckpt, "d2"))
            mine = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            other = stub.VerifyStream(metadata=(("draft-id", "d2"),))
            pending = await roots(mine, 1, "a")
            await other.write(verify(1, [("a", *chain(pending["a"], 2))]))
            tree = outcome(await other.read())
            await other.write(verifier_pb2.VerifyRequest(sequence=2, prefills=[verifier_pb2.PrefillItem(
                request_id="a", token_ids=[8], reserve_tokens=256, prompt_offset=3)]))
            (piece,) = (await other.read()).prefills
            await mine.write(verify(2, [("a", *chain(pending["a"], 2))]))
            return tree, (CODES[piece.error_code], piece.error_message), outcome(await mine.read())
    tree, piece, own = asyncio.run(run())
    assert tree["a"] == (grpc.StatusCode.NOT_FOUND, "request a is not this draft stream's")
    assert piece == (grpc.StatusCode.NOT_FOUND, "request a is not this draft stream's")
    assert own["a"][0] == grpc.StatusCode.OK


def test_a_negative_prompt_offset_is_refused_not_taken_for_a_new_prompt(ckpt):
    """It made a new request; had the forward failed, the undo (which frees offset-0 admissions
    only) left it holding its pages, and a retry found it ALREADY_EXISTS."""
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            free = svc.engine.cache.pages_free
            await stream.write(verifier_pb2.VerifyRequest(sequence=1, prefills=[verifier_pb2.PrefillItem(
                request_id="a", token_ids=[5, 6, 7], reserve_tokens=64, prompt_offset=-3)]))
            (item,) = (await stream.read()).prefills
            return CODES[item.error_code], item.error_message, svc.engine.cache.pages_free == free, svc.engine._requests
    code, message, pages_back, held = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_offset -3 is negative" in message
    assert pages_back and not held


def test_a_negative_top_p_is_refused_not_read_as_unset(ckpt):
    """proto3's 0 means "not set" (nucleus off); -0.5 was read the same way."""
    async def run():
        async with serving(servicer(ckpt)) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            await stream.write(verifier_pb2.VerifyRequest(sequence=1, prefills=[
                verifier_pb2.PrefillItem(request_id=r, token_ids=[5, 6], reserve_tokens=64,
                                         sampling=common_pb2.SamplingParams(temperature=1.0, top_p=p))
                for r, p in (("neg", -0.5), ("nan", float("nan")), ("unset", 0.0))]))
            return {p.request_id: (CODES[p.error_code], p.error_message) for p in (await stream.read()).prefills}
    got = asyncio.run(run())
    for rid in ("neg", "nan"):
        assert got[rid][0] == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in got[rid][1]
    assert got["unset"][0] == grpc.StatusCode.OK


def test_released_slots_outside_the_ring_are_invalid_argument_and_release_nothing(ckpt):
    """It raised a ValueError out of the step: the stream ended as an internal error. A
    ServiceError from the step ends the stream with its own status (the draft hand-shakes again)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        features = svc._step(peer, prefill(1, "a")).features.tensors[0]
        assert features.WhichOneof("payload") == "slot"
        with pytest.raises(ServiceError) as refused:
            svc._step(peer, verifier_pb2.VerifyRequest(sequence=2, released_slots=[features.slot.slot, 7]))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "released_slots: slot 7 out of range for a ring of 4 slots" in refused.value.message
        assert peer.writer.slots_in_use == 1


def test_more_released_slots_than_the_ring_has_are_refused_before_a_walk(ckpt):
    """A list of millions of slots of a 4-slot ring was walked under the ring's lock, on the event
    loop (50 MB of them: 3.6 s)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        features = svc._step(peer, prefill(1, "a")).features.tensors[0]
        t0 = time.perf_counter()
        with pytest.raises(ServiceError) as refused:
            svc._step(peer, verifier_pb2.VerifyRequest(sequence=2, released_slots=[features.slot.slot] * 2_000_000))
        assert time.perf_counter() - t0 < 0.5
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "more slots released than the ring's 4" in refused.value.message
        assert peer.writer.slots_in_use == 1


def test_a_tree_bundle_of_huge_shapes_or_names_is_refused_at_once_in_a_short_message(ckpt):
    """A shape of 40k dimensions was multiplied out on the event loop (3.8 s, twice), and a
    refusal spelled out the whole shape or every name in each tree's result: a 2 MB message made a
    384 MB reply (64 trees)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        pending = svc.engine._requests["a"].pending
        deep = verify(2, [("a", *chain(pending, 2))])
        deep.trees.tensors[0].ClearField("shape")
        deep.trees.tensors[0].shape.extend([3**30] * 40_000)
        named = verify(3, [("a", *chain(pending, 2))])
        for ref in named.trees.tensors:
            ref.name = ref.name + "x" * 1_000_000
        t0 = time.perf_counter()
        assert _tree_nodes(deep.trees) > INLINE_MOST_NODES
        results = [outcome(svc._step(peer, req))["a"] for req in (deep, named)]
        took = time.perf_counter() - t0
        ok = outcome(svc._step(peer, verify(4, [("a", *chain(pending, 2))])))["a"]
    assert took < 0.5, took
    for code, message in results:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and len(message) < 1500, message[:200]
    assert "... (40000 dimensions)]" in results[0][1] and "(1000006 characters)" in results[1][1]
    assert ok[0] == grpc.StatusCode.OK


def test_features_go_inline_when_the_draft_holds_every_slot(ckpt):
    """The step is committed before its features are written: a full ring (a draft that does not
    release its slots) raised out of the step and lost the accepted tokens with the stream."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=2) as peer:
        kinds = []
        for seq, rid in enumerate(("a", "b", "c"), start=1):
            resp = svc._step(peer, prefill(seq, rid))
            assert resp.prefills[0].error_code == 0
            features = resp.features.tensors[0]
            assert list(features.shape) == [3, svc.engine._feature_width]
            kinds.append(features.WhichOneof("payload"))
        assert kinds == ["slot", "slot", "inline_data"] and peer.writer.inline_fallbacks == 1
        fallbacks = svc.metrics.ring_inline_fallbacks
        assert (fallbacks.labels("ring_full")._value.get(), fallbacks.labels("slot_too_small")._value.get()) == (1, 0)


def test_features_go_inline_when_their_slot_cannot_be_written(ckpt, monkeypatch):
    """/dev/shm without room for a ring page (a filesystem that reserves nothing, or a ring its
    draft shrank): a store into the mapping was SIGBUS, the end of the verifier. The write is now
    a call that fails, the step's features go inline, and the slot is not held."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=2) as peer:
        def full(fd, data, offset):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(transport.os, "pwrite", full)
        resp = svc._step(peer, prefill(1, "a"))
        assert resp.prefills[0].error_code == 0
        assert resp.features.tensors[0].WhichOneof("payload") == "inline_data"
        assert peer.writer.slots_in_use == 0 and peer.writer.inline_fallbacks == 1
        assert svc.metrics.ring_inline_fallbacks.labels("ring_error")._value.get() == 1
        monkeypatch.undo()
        assert svc._step(peer, prefill(2, "b")).features.tensors[0].WhichOneof("payload") == "slot"


def test_two_handshakes_of_other_feature_layers_at_once_cannot_both_pass(ckpt):
    """Each checked the connected drafts' layers, then awaited the engine's switch to its own, then
    registered: side by side, both passed, and the first draft got the second's features."""
    async def run():
        svc = servicer(ckpt)
        switch = svc.engine.set_feature_layers

        def slow_switch(layers):   # as a GPU's graph recapture takes: the second handshake arrives meanwhile
            time.sleep(0.3)
            switch(layers)
        svc.engine.set_feature_layers = slow_switch
        async with serving(svc) as stub:
            calls = [stub.Handshake(hello(ckpt, "d1", [0, 1])), stub.Handshake(hello(ckpt, "d2", [1]))]
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, {p.draft_id: p.feature_layers for p in svc._peers.values()}, svc.engine.feature_layers
    results, peers, engine_layers = asyncio.run(run())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(peers) == 1 and list(peers.values()) == [engine_layers]


def test_features_travel_in_the_models_dtype(ckpt):
    """A bf16 target's features went out as float32: twice the bytes through the ring or the gRPC
    message, for values the drafter casts straight back."""
    svc = servicer(ckpt, dtype="bfloat16")
    with shm_peer(svc, ckpt, slots=4) as peer:
        resp = svc._step(peer, prefill(1, "a"))
        ref = resp.features.tensors[0]
        empty = svc._step(peer, verifier_pb2.VerifyRequest(sequence=2, release=["a"])).features.tensors[0]
    assert resp.prefills[0].error_code == 0
    assert (ref.dtype, list(ref.shape)) == ("bfloat16", [3, svc.engine._feature_width])
    assert ref.slot.nbytes == 3 * svc.engine._feature_width * 2
    assert empty.dtype == "bfloat16" and list(empty.shape) == [0, svc.engine._feature_width]


def test_a_failed_group_ends_the_stream_not_only_the_steps_trees(ckpt):
    """The group's failure came back as a ServiceError that `_verify` took for a refusal of the
    trees: the stream went on sending steps to a group out of step."""
    from services.verifier.ranks import GroupFailed

    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        call = svc.group.call

        def failing(method, *args):
            if method == "verify":
                raise GroupFailed("verifier rank 1 exited with code 9")
            return call(method, *args)
        svc.group.call = failing
        with pytest.raises(GroupFailed, match="rank 1 exited"):
            svc._step(peer, verify(2, [("a", *chain(svc.engine._requests["a"].pending, 3))]))


def test_trees_read_from_the_drafts_ring_are_copied_before_they_are_checked(ckpt):
    """The trees came to the engine as views of the draft's ring: checked once, then read again,
    so a draft that changed them in between could put an index past its table on the GPU (a device
    assert ends the verifier for every draft). What the engine gets owns its memory."""
    from services.common.transport import make_reader

    svc = servicer(ckpt)
    seen: list[torch.Tensor] = []
    call = svc.group.call
    svc.group.call = lambda method, *args: (seen.extend(a for a in args if isinstance(a, torch.Tensor)),
                                            call(method, *args))[1]
    with shm_peer(svc, ckpt, slots=4) as peer, \
            make_writer("shm", slot_bytes=1 << 16, num_slots=2, name_prefix="ddt-test") as tree_ring:
        peer.reader = make_reader("shm", tree_ring.ring_name, tree_ring.slot_bytes, tree_ring.num_slots)
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        step = verify(2, [("a", *chain(svc.engine._requests["a"].pending, 3))])
        inline = {k: v for k, v in InlineReader().read(step.trees).items()}
        step.trees.CopyFrom(tree_ring.write(inline))
        resp = svc._step(peer, step)
        ring = torch.frombuffer(peer.reader._shm.buf, dtype=torch.uint8)
        lo, hi = ring.data_ptr(), ring.data_ptr() + ring.numel()
        peer.reader.close()
    assert outcome(resp)["a"][0] == grpc.StatusCode.OK
    assert len(seen) == 4 and not any(lo <= t.data_ptr() < hi for t in seen)


def test_a_peer_whose_release_fails_still_gives_its_rings_back(ckpt):
    """`release_owner` ran before the peer's rings were dropped: one that raised left them mapped
    (and registered) until the verifier restarted."""
    svc = servicer(ckpt)
    call = svc.group.call

    def failing(method, *args):
        if method == "release_owner":
            raise RuntimeError("release failed")
        return call(method, *args)
    with shm_peer(svc, ckpt, slots=4) as peer:
        svc.group.call = failing
        closed: list[str] = []
        peer.writer.close = lambda: closed.append("writer")
        peer.reader.close = lambda: closed.append("reader")
        with pytest.raises(RuntimeError, match="release failed"):
            svc._end_stream("d1", peer)
        assert "d1" not in svc._peers and closed == ["writer", "reader"]
        svc._peers["d1"] = peer
        with pytest.raises(RuntimeError, match="release failed"):
            svc._retire_peer("d1")
        assert "d1" not in svc._peers and closed == ["writer", "reader"] * 2
        del peer.writer.close   # the fixture closes the ring itself


def test_handshakes_past_max_peers_are_refused_and_a_returning_draft_is_not(ckpt):
    """Every handshake under a new draft id made a ring here and mapped the draft's, held until its
    stream ended: a token holder looping on new ids could fill /dev/shm or the GPU."""
    async def run():
        svc = servicer(ckpt, max_peers=2)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            await stub.Handshake(hello(ckpt, "d2"))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Handshake(hello(ckpt, "d3"))
            again = await stub.Handshake(hello(ckpt, "d2"))   # a draft coming back replaces its own entry
            return err.value, again, sorted(svc._peers)
    refused, again, peers = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "verifier.max_peers" in refused.details()
    assert again.transport == "inline" and peers == ["d1", "d2"]


def test_a_draft_ring_larger_than_any_draft_makes_is_refused_at_the_handshake(ckpt):
    """A ring is the draft's to declare, and a sparse segment of gigabytes costs it nothing: a slot
    declared 4 GiB long was read in full (4 GiB of the verifier's memory, seconds of its event loop,
    a tensor-parallel group's timeout), however stale the message. The draft's own settings bound
    its rings, and the verifier maps no larger one."""
    from services.common.settings import MAX_DRAFT_RING_SLOT_BYTES, DraftSettings, SettingsError

    async def run():
        async with serving(servicer(ckpt)) as stub:
            request = hello(ckpt, "d1")
            request.transports[:] = ["shm"]
            request.draft_ring, request.draft_ring_slots = "ddtree-draft-0-huge", 2
            request.draft_ring_slot_bytes = MAX_DRAFT_RING_SLOT_BYTES + 1
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(request)
            return info.value

    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "draft.ring_slot_bytes" in refused.details()
    with pytest.raises(SettingsError, match="draft.ring_slot_bytes"):
        DraftSettings(ring_slot_bytes=MAX_DRAFT_RING_SLOT_BYTES + 1)


def test_a_prompt_past_max_context_is_refused_before_its_call_goes_to_the_other_ranks(ckpt):
    """Its length was checked inside the engine, on every rank, after the call was broadcast (a
    57 MB prompt became an 86 MB broadcast, onto every GPU with NCCL)."""
    svc = servicer(ckpt)
    calls: list[str] = []
    call = svc.group.call
    svc.group.call = lambda method, *args: (calls.append(method), call(method, *args))[1]
    with shm_peer(svc, ckpt, slots=4) as peer:
        long = prefill(1, "long")
        long.prefills[0].token_ids[:] = [5] * 1024   # max_context 1024
        resp = svc._step(peer, long)
    assert calls == [] and resp.prefills[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert resp.prefills[0].error_message == "prompt has 1024 tokens; max context is 1024"


def test_a_tree_bundle_naming_other_or_repeated_tensors_is_refused_before_a_read(ckpt):
    """Each named tensor of a draft's ring was read into a private copy: one span named under a
    thousand names cost a thousand copies (1.5 GB for a 250 KB message)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        pending = svc.engine._requests["a"].pending
        extra = verify(2, [("a", *chain(pending, 2))])
        extra.trees.tensors.append(extra.trees.tensors[0])
        extra.trees.tensors[-1].name = "tokens_again"
        twice = verify(3, [("a", *chain(pending, 2))])
        twice.trees.tensors.append(twice.trees.tensors[1])
        results = [outcome(svc._step(peer, req))["a"] for req in (extra, twice)]
        ok = outcome(svc._step(peer, verify(4, [("a", *chain(pending, 2))])))["a"]
    for code, message in results:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "expected each of ['tokens', 'parents'" in message
    assert ok[0] == grpc.StatusCode.OK


def test_a_tree_bundle_over_two_slots_is_refused_before_a_read(ckpt):
    """One bundle holds one slot, the one the verifier gives back: a bundle naming two was read,
    its trees verified, and neither slot given back (both held until the stream ended)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        pending = svc.engine._requests["a"].pending
        split = verify(2, [("a", *chain(pending, 2))])
        for k, ref in enumerate(split.trees.tensors[:2]):
            ref.slot.slot, ref.slot.offset, ref.slot.nbytes, ref.slot.sequence = k, 0, 8 * ref.shape[0], 1
        resp = svc._step(peer, split)
        ok = outcome(svc._step(peer, verify(3, [("a", *chain(pending, 2))])))["a"]
    code, message = outcome(resp)["a"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "several slots [0, 1]" in message, message
    assert list(resp.released_slots) == [] and ok[0] == grpc.StatusCode.OK


def test_a_tree_bundle_lacking_a_tensor_fails_its_trees_and_the_stream_goes_on(ckpt):
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        pending = svc.engine._requests["a"].pending
        short = verify(2, [("a", *chain(pending, 2))])
        gone = short.trees.tensors.pop(2).name
        code, message = outcome(svc._step(peer, short))["a"]
        ok = outcome(svc._step(peer, verify(3, [("a", *chain(pending, 2))])))["a"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lacks" in message and gone in message
    assert ok[0] == grpc.StatusCode.OK


def test_as_many_trees_as_requests_held_pass_the_cap(ckpt):
    """The cap counts the requests held and the new prompts: a step of exactly that many trees
    (one each) is no flood."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        first = svc._step(peer, prefill(1, "a", "b"))
        assert [p.error_code for p in first.prefills] == [0, 0]
        held = svc.engine._requests
        step = verify(2, [(r, *chain(held[r].pending, 1)) for r in ("a", "b")])
        got = outcome(svc._step(peer, step))
    assert got["a"][0] == got["b"][0] == grpc.StatusCode.OK


def test_prefills_refused_in_the_step_do_not_let_more_trees_through(ckpt):
    """The cap on a step's trees counted every prefill, the ones the server refuses too: padded
    with bad-sampling prefills, 300k trees of unknown ids went through (5 s under the lock)."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        step = verify(2, [("a", *chain(svc.engine._requests["a"].pending, 1))])
        step.verify_ids.extend(f"x{i}" for i in range(10))
        step.prefills.extend(prefill(2, *(f"p{i}" for i in range(10)), top_p=-1.0).prefills)
        with pytest.raises(ServiceError) as refused:
            svc._step(peer, step)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "a step of 11 trees" in refused.value.message


def test_a_refused_handshake_leaves_the_feature_layers_alone(ckpt):
    """The layers were switched before the transport check: a handshake refused for want of a
    common transport re-pointed the draft's live stream at its layers (and recaptured the graphs)."""
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            before = list(svc.engine.feature_layers)
            other = hello(ckpt, "d1", layers=[0])
            del other.transports[:]
            other.transports.append("cuda_ipc")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Handshake(other)
            return before, list(svc.engine.feature_layers), info.value, svc._peers["d1"].feature_layers
    before, after, err, registered = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no common transport" in err.details()
    assert after == before == list(registered) and before != [0]


def _poison_logits(engine, on: bool) -> dict[str, bool]:
    """Makes the target's logits NaN (one token) at the rows of requests whose id starts with
    "bad", while the returned switch's "on" is set: a float16 target overflowing on their context."""
    forward, poison = engine._forward, {"on": on}

    def poisoned(flat, positions, reqs, masks, routing_groups=None):
        out = forward(flat, positions, reqs, masks, routing_groups)
        if poison["on"]:
            out.logits = out.logits.clone()
            row = 0
            for r, m in zip(reqs, masks):
                if r.request_id.startswith("bad"):
                    out.logits[row:row + m.shape[0], 3] = float("nan")
                row += m.shape[0]
        return out

    engine._forward = poisoned
    return poison


def test_a_request_whose_logits_are_not_finite_fails_alone(ckpt):
    """A sampled request whose target logits held NaN or inf (a float16 target overflowing on its
    context, say) raised for the whole step: the stream ended INTERNAL and every request of the
    draft was freed (with ranks, the group ended); a greedy one emitted the NaN's index as its
    token. Either now fails alone; the step's other requests commit."""
    svc = servicer(ckpt)
    engine = svc.engine
    poison = _poison_logits(engine, on=False)
    with shm_peer(svc, ckpt, slots=4) as peer:
        resp = svc._step(peer, prefill(1, "bad", "good", temperature=0.8, seed=1))
        resp2 = svc._step(peer, prefill(2, "bad_greedy", "greedy"))
        assert [p.error_code for p in [*resp.prefills, *resp2.prefills]] == [0, 0, 0, 0]
        pending = {r: engine._requests[r].pending for r in ("bad", "good", "bad_greedy", "greedy")}
        lengths = {r: engine._requests[r].length for r in pending}
        poison["on"] = True
        got = outcome(svc._step(peer, verify(3, [(r, *chain(pending[r], 3)) for r in pending])))
    for bad in ("bad", "bad_greedy"):
        assert got[bad][0] == grpc.StatusCode.INTERNAL and "NaN or inf" in got[bad][1]
        assert engine._requests[bad].length == lengths[bad]
    assert got["good"][0] == got["greedy"][0] == grpc.StatusCode.OK
    assert engine._requests["good"].length > lengths["good"] and engine._requests["greedy"].length > lengths["greedy"]


def test_only_small_verify_steps_run_on_the_event_loop(ckpt):
    """A verify-only step ran on the event loop whatever its size: 128 trees of 129 nodes held
    every health check and handshake for 7 s on a CPU (0.5 s on the K2 slice). Past
    `INLINE_MOST_NODES` it takes a worker thread, as prefills do."""
    from services.verifier.server import INLINE_MOST_NODES

    async def run():
        svc = servicer(ckpt)
        inline, calls = svc._inline, []
        svc._inline = lambda fn, *args: (calls.append(fn), inline(fn, *args))[1]
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            pending = await roots(stream, 1, "a", "b")
            sizes = []
            for seq, nodes in ((2, 3), (3, MAX_BUDGET + 1)):
                await stream.write(verify(seq, [(r, *chain(pending[r], nodes)) for r in ("a", "b")]))
                got = outcome(await stream.read())
                assert {c for c, _ in got.values()} == {grpc.StatusCode.OK}
                pending = {r: svc.engine._requests[r].pending for r in ("a", "b")}
                sizes.append(len(calls))
            return sizes
    assert 2 * (MAX_BUDGET + 1) > INLINE_MOST_NODES >= 2 * 3
    assert asyncio.run(run()) == [1, 1]   # the first step inline, the second (258 nodes) not


def test_prompts_past_the_whole_cache_in_one_step_are_refused_before_the_engine(ckpt):
    """A step's prompts were each copied, broadcast to the ranks and admitted one by one however
    many there were: 10k prompts of 1023 tokens (a 19 MiB message) took 563 MB and 30 MiB pickled
    to each rank, for 4 admitted. What passes the cache's whole size fails RESOURCE_EXHAUSTED at
    the server; the prompts before it go on."""
    svc = servicer(ckpt)   # 4096 tokens of KV
    calls: list[int] = []
    call = svc.group.call
    svc.group.call = lambda method, *args: (calls.append(len(args[0]) if method == "prefill" else -1), call(method, *args))[1]
    step = verifier_pb2.VerifyRequest(sequence=1, prefills=[
        verifier_pb2.PrefillItem(request_id=f"p{i}", token_ids=[5] * 1000, reserve_tokens=1000) for i in range(10)])
    with shm_peer(svc, ckpt, slots=4) as peer:
        resp = svc._step(peer, step)
    codes = [CODES[p.error_code] for p in resp.prefills]
    assert codes == [grpc.StatusCode.OK] * 4 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
    assert calls == [4]   # the engine saw the four that fit the cache's size, not ten


def test_empty_prompt_pieces_do_not_let_more_trees_through_and_refused_prompts_take_no_room(ckpt):
    """The step's tree cap counted prompt pieces of no tokens (the engine refuses them cheaply):
    2000 of them let 2001 trees through. And prompts refused for their length used up the step's
    room, so a small one after them failed "KV cache full" with every page free."""
    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=4) as peer:
        assert svc._step(peer, prefill(1, "a")).prefills[0].error_code == 0
        step = verify(2, [("a", *chain(svc.engine._requests["a"].pending, 1))])
        step.verify_ids.extend(f"x{i}" for i in range(10))
        step.prefills.extend(verifier_pb2.PrefillItem(request_id=f"p{i}", prompt_offset=3, reserve_tokens=8)
                             for i in range(10))
        with pytest.raises(ServiceError) as refused:
            svc._step(peer, step)
        long = [verifier_pb2.PrefillItem(request_id=f"l{i}", token_ids=[5] * 1100, reserve_tokens=8) for i in range(4)]
        small = verifier_pb2.PrefillItem(request_id="small", token_ids=[5, 6], reserve_tokens=8)
        resp = svc._step(peer, verifier_pb2.VerifyRequest(sequence=3, prefills=[*long, small]))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "a step of 11 trees" in refused.value.message
    assert [CODES[p.error_code] for p in resp.prefills] == [grpc.StatusCode.INVALID_ARGUMENT] * 4 + [grpc.StatusCode.OK]


def test_a_prompt_whose_first_draw_meets_nan_logits_fails_alone(ckpt):
    """A sampled prompt's last row of NaN logits failed the whole prefill call (every prompt of the
    step, and the stream). It now fails alone, freed, its features not sent; the others start."""
    svc = servicer(ckpt)
    engine = svc.engine
    _poison_logits(engine, on=True)
    with shm_peer(svc, ckpt, slots=4) as peer:
        resp = svc._step(peer, prefill(1, "good", "bad", "other", temperature=0.8, seed=1))
        pages = engine.cache.pages_free
    got = {p.request_id: (CODES[p.error_code], p.error_message, p.committed) for p in resp.prefills}
    assert got["bad"][0] == grpc.StatusCode.INTERNAL and "NaN or inf" in got["bad"][1] and got["bad"][2] == 0
    assert got["good"][0] == got["other"][0] == grpc.StatusCode.OK and got["good"][2] == got["other"][2] == 3
    assert sorted(engine._requests) == ["good", "other"]
    assert resp.features.tensors[0].shape[0] == 6   # the two prompts' rows, not the failed one's
    assert pages == engine.cache.num_pages - 2 * len(engine.cache.page_ids("good"))


def test_a_stream_that_ends_after_its_group_failed_ends_without_a_handler_error(ckpt) -> None:
    """A rank's death fails the group; the streams' clean-ups then asked the failed group to release
    their requests and raised its GroupFailed out of the handler: logged as `handler_failed` (a
    bug, with a traceback) and the stream ended INTERNAL. The group goes with what they held."""
    from structlog.testing import capture_logs

    svc = servicer(ckpt)
    with shm_peer(svc, ckpt, slots=2) as peer:
        svc.group.failed = "verifier ranks out of step: verifier rank 1 exited with code -9"
        with capture_logs() as logs:
            assert svc._end_stream("d1", peer) == 0
        assert "d1" not in svc._peers   # its rings unmapped all the same
        assert [e["event"] for e in logs] == ["stream_closed"]
        svc._peers["d1"] = peer
        svc._retire_peer("d1")   # a draft's new handshake retires its old stream alike
        assert "d1" not in svc._peers
