"""How draft and verifier agree on a transport, over a real gRPC socket, no GPU.

The draft offers kinds in preference order with a ring of its first choice. When the verifier
cannot use that ring (it has no GPU, or the draft's GPU is invisible to it) it answers another kind
and the draft hand-shakes again with a ring of that kind; when the draft cannot map the verifier's
ring it drops that kind and tries the next. The verifier side is the real servicer, in front of a
stand-in engine (a handshake needs only the model's shape and the cache's size).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.grpc_server import ServiceError
from services.common.metrics import Metrics
from services.common.settings import VerifierSettings
from services.common.transport import InlineWriter, TensorReader, make_reader, make_writer
from services.draft import verifier_client
from services.draft.verifier_client import VerifierClient, auto_offer, next_offer, private_copy, readable_in_place
from services.verifier import server as verifier_server
from services.verifier.server import VerifierServicer

HIDDEN, VOCAB = 64, 512
# A draft that goes before its verify stream reached the verifier is dropped only after
# `peer_stream_timeout_s`, so the tests close once the stream is open.
_STREAM_OPEN_S = 0.05


class _FakeGpuWriter(InlineWriter):
    """What a draft on a GPU offers first: a cuda_ipc ring, here with a handle no one can map."""

    kind = "cuda_ipc"

    @property
    def ring_name(self) -> str:
        return "not-a-cuda-ipc-handle"


def _fake_make_writer(kind: str, *args, **kwargs):
    return _FakeGpuWriter() if kind == "cuda_ipc" else make_writer(kind, *args, **kwargs)


class _Group:
    def __init__(self) -> None:
        config = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, model_type="deepseek_v3", eos_token_id=[0])
        cache = SimpleNamespace(pages_free=64, num_pages=64, capacity_tokens=1024, page_size=16)
        self.engine = SimpleNamespace(model=SimpleNamespace(config=config, dtype=torch.float32), cache=cache, max_context=256,
                                      active_requests=0, holds=lambda request_id: False, model_device=torch.device("cpu"),
                                      check_feature_layers=lambda ids: None,
                                      cat_features=lambda parts: torch.cat(parts) if parts else torch.zeros(0, HIDDEN))

    def call(self, name: str, *args):
        return 0 if name == "release_owner" else None


async def _serve(verifier_device: str, peer_stream_timeout_s: float = 30.0, feature_layers: tuple[int, ...] = ()
                 ) -> tuple[grpc.aio.Server, VerifierServicer, Metrics, str]:
    metrics = Metrics("verifier")
    settings = VerifierSettings(device=verifier_device, ring_slot_bytes=8192, peer_stream_timeout_s=peer_stream_timeout_s,
                                feature_layers=feature_layers)
    servicer = VerifierServicer(_Group(), settings, metrics)
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, metrics, f"127.0.0.1:{port}"


async def _peers_after_close(servicer: VerifierServicer) -> int:
    for _ in range(150):   # the stream's end reaches the verifier asynchronously
        if not servicer._peers:
            break
        await asyncio.sleep(0.02)
    return len(servicer._peers)


async def _negotiate(verifier_device: str, draft_device: str, transport: str = "auto", target: str = "{}"):
    """Hand-shakes once; returns (negotiated kind, draft writer kind, verifier peers, peers gauge,
    (peers, peers gauge) after the draft closed). `target`: the gRPC target, `{}` the address."""
    server, servicer, metrics, address = await _serve(verifier_device)
    try:
        client = VerifierClient(target.format(address), transport, ring_slots=2, ring_slot_bytes=8192, device=draft_device)
        try:
            hs = await client.connect([1, 2], HIDDEN, VOCAB)
            peers = {k: p.writer.kind for k, p in servicer._peers.items()}
            writer_kind = client._writer.kind
            peers_gauge = metrics.peers._value.get()
            await asyncio.sleep(_STREAM_OPEN_S)
        finally:
            await client.close()
        after = (await _peers_after_close(servicer), metrics.peers._value.get())
    finally:
        await server.stop(None)
    return hs.transport, writer_kind, peers, peers_gauge, after


def test_gpu_draft_and_cpu_verifier_settle_on_shm(monkeypatch) -> None:
    monkeypatch.setattr(verifier_client, "make_writer", _fake_make_writer)
    kind, writer_kind, peers, gauge, after = asyncio.run(_negotiate("cpu", "cuda:1"))
    assert (kind, writer_kind) == ("shm", "shm")
    assert list(peers.values()) == ["shm"] and gauge == 1
    assert after == (0, 0)   # the closed stream dropped the peer


def test_draft_ring_the_verifier_cannot_map_falls_back_to_shm(monkeypatch) -> None:
    """Both on GPUs, but the draft's GPU is not visible to the verifier (its handle does not open)."""
    monkeypatch.setattr(verifier_client, "make_writer", _fake_make_writer)
    kind, writer_kind, peers, _, _ = asyncio.run(_negotiate("cuda", "cuda:1"))
    assert (kind, writer_kind, list(peers.values())) == ("shm", "shm", ["shm"])


def test_verifier_ring_the_draft_cannot_map_falls_back_to_inline(monkeypatch) -> None:
    def refuse_shm(kind, *args, **kwargs):
        if kind == "shm":
            raise ValueError("cannot map it here")
        return make_reader(kind, *args, **kwargs)

    monkeypatch.setattr(verifier_client, "make_reader", refuse_shm)
    kind, writer_kind, peers, _, _ = asyncio.run(_negotiate("cpu", "cpu"))
    assert (kind, writer_kind) == ("inline", "inline")
    assert list(peers.values()) == ["inline"]   # the shm peer of the first round was dropped


def test_a_single_kind_that_cannot_attach_fails_with_a_clear_status(monkeypatch) -> None:
    monkeypatch.setattr(verifier_server, "make_reader",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("no such segment")))
    with pytest.raises(ServiceError) as err:
        asyncio.run(_negotiate("cpu", "cpu", transport="shm"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no such segment" in err.value.message


def test_auto_offers_shared_rings_first() -> None:
    assert auto_offer(torch.device("cpu")) == ["shm", "inline"]
    assert auto_offer(torch.device("cuda", 1)) == ["cuda_ipc", "shm", "inline"]


def test_auto_uses_a_shared_ring_behind_a_service_name() -> None:
    """Compose's draft reaches its verifier by service name (`verifier:50053`), not loopback, yet
    both share the host's IPC namespace: `auto` must still settle on a shared ring. The target
    `ipv4:127.0.0.1:PORT` stands for such a name (it is no loopback address as text)."""
    kind, writer_kind, peers, _, _ = asyncio.run(_negotiate("cpu", "cpu", target="ipv4:{}"))
    assert (kind, writer_kind, list(peers.values())) == ("shm", "shm", ["shm"])


def test_auto_falls_back_to_inline_where_the_verifier_cannot_see_the_ring(monkeypatch) -> None:
    """A verifier on another host finds no segment of the draft's ring name: inline, no error."""
    def other_host(kind, *args, **kwargs):
        if kind == "shm":
            raise FileNotFoundError(2, "No such file or directory", "/ddtree-draft-ring")
        return make_reader(kind, *args, **kwargs)

    monkeypatch.setattr(verifier_server, "make_reader", other_host)
    kind, writer_kind, peers, _, after = asyncio.run(_negotiate("cpu", "cpu", target="ipv4:{}"))
    assert (kind, writer_kind, list(peers.values())) == ("inline", "inline", ["inline"])
    assert after == (0, 0)


def test_next_offer() -> None:
    assert next_offer(["cuda_ipc", "shm", "inline"], "shm") == ["shm", "inline"]
    assert next_offer(["cuda_ipc", "shm", "inline"], "inline") == ["inline"]
    for bad in ("cuda_ipc", "carrier-pigeon"):
        with pytest.raises(ValueError, match="did not offer"):
            next_offer(["cuda_ipc", "shm", "inline"], bad)


def test_private_copy_owns_its_memory() -> None:
    ring = torch.arange(12, dtype=torch.float32)
    view = ring[4:10].view(2, 3)
    out = private_copy(view, "cpu")
    ring.zero_()   # the slot is rewritten after release
    assert out.tolist() == [[4, 5, 6], [7, 8, 9]] and out.device.type == "cpu"


def test_readable_in_place() -> None:
    host = torch.zeros(2, 3)
    assert readable_in_place(host, torch.device("cpu"))
    assert readable_in_place(host, torch.device("cuda", 1))   # a shm ring read by a draft on a GPU


class _PrefillGroup(_Group):
    """Prefills answer one token and random features per prompt token."""

    def call(self, name: str, *args):
        if name == "prefill":
            items = [SimpleNamespace(request_id=p.request_id, error=None, tokens=[7], committed=len(p.token_ids))
                     for p in args[0]]
            n = sum(len(p.token_ids) for p in args[0])
            return SimpleNamespace(items=items, features=torch.randn(n, HIDDEN))
        return super().call(name, *args)


@contextlib.asynccontextmanager
async def _prefill_link(metrics: Metrics, **client_kw):
    """A verifier over `_PrefillGroup` with 8 KB shm slots, and a connected draft-side client."""
    servicer = VerifierServicer(_PrefillGroup(), VerifierSettings(device="cpu", ring_slot_bytes=8192), metrics)
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = VerifierClient(f"127.0.0.1:{port}", "shm", ring_slots=4, ring_slot_bytes=8192, device="cpu", **client_kw)
    try:
        await client.connect([1, 2], HIDDEN, VOCAB)
        yield servicer, client
    finally:
        await client.close()
        await server.stop(None)


def test_features_are_read_in_the_ring_and_their_slot_held_until_the_next_step() -> None:
    """The answer's features are a view of the verifier's ring, not a copy; their slot goes back
    with the next step, so the verifier never writes into it while the draft may still read it."""
    async def scenario():
        async with _prefill_link(Metrics("verifier")) as (servicer, client):
            peer = next(iter(servicer._peers.values()))
            held, replies = [], []
            for rid, n in (("a", 5), ("b", 3), ("c", 2)):
                prefill = verifier_pb2.PrefillItem(request_id=rid, token_ids=list(range(1, n + 1)), reserve_tokens=16)
                reply = await client.step([prefill], [], None, [])
                ring = np.frombuffer(client._reader._shm.buf, dtype=np.uint8)
                replies.append((reply.features.shape, np.shares_memory(ring, reply.features.numpy())))
                held.append(peer.writer.slots_in_use)
            return replies, held

    replies, held = asyncio.run(scenario())
    assert replies == [((5, HIDDEN), True), ((3, HIDDEN), True), ((2, HIDDEN), True)]
    assert held == [1, 1, 1]   # each step's features hold one slot; the step after gives it back


def test_messages_too_big_for_a_slot_go_inline_and_are_counted() -> None:
    """A ring slot smaller than the traffic costs a copy through gRPC on every such message: both
    sides count those (`ddtree_ring_inline_fallbacks`), so the operator sees when to raise it."""
    draft_fallbacks = []

    async def scenario():
        metrics = Metrics("verifier")
        counted = lambda: metrics.registry.get_sample_value("ddtree_ring_inline_fallbacks_total",  # noqa: E731
                                                            {"reason": "slot_too_small"})
        async with _prefill_link(metrics, on_inline_fallback=lambda: draft_fallbacks.append(1)) as (_, client):
            seen = []
            for rid, n in (("small", 4), ("big", 64), ("small2", 4)):   # 64 x 64 float32 = 16 KB > 8 KB
                prefill = verifier_pb2.PrefillItem(request_id=rid, token_ids=list(range(1, n + 1)), reserve_tokens=128)
                reply = await client.step([prefill], [], None, [])
                seen.append((reply.features.shape[0], counted()))
            big_trees = {"tokens": torch.arange(2048), "parents": torch.arange(2048)}   # 32 KB of trees
            with contextlib.suppress(ServiceError):   # what the verifier makes of them does not matter here
                await client.step([], ["small"], big_trees, [])
            return seen

    assert asyncio.run(scenario()) == [(4, 0.0), (64, 1.0), (4, 1.0)]
    assert draft_fallbacks == [1]


def test_a_vanishing_draft_always_leaves_nothing_behind() -> None:
    """gRPC cancels the stream handler of a draft that went away; the clean-up must still run
    (unshielded, it was cancelled before its thread started in about 1 of 3 such ends)."""
    async def cycles() -> list[int]:
        server, servicer, _, address = await _serve("cpu")
        left = []
        try:
            for delay in (_STREAM_OPEN_S, 0.1, 0.2) * 4:
                client = VerifierClient(address, "auto", ring_slots=2, ring_slot_bytes=8192, device="cpu")
                await client.connect([1, 2], HIDDEN, VOCAB)
                await asyncio.sleep(delay)
                await client.close()
                left.append(await _peers_after_close(servicer))
        finally:
            await server.stop(None)
        return left

    assert asyncio.run(cycles()) == [0] * 12


def test_a_draft_that_never_opens_its_stream_is_dropped() -> None:
    """Hand-shake, then die (or give up on our ring) before the verify stream: nothing would end a
    stream, so the verifier drops the peer and its rings after `peer_stream_timeout_s`."""
    async def scenario() -> tuple[list[str], list[str], float]:
        server, servicer, metrics, address = await _serve("cpu", peer_stream_timeout_s=0.3)
        try:
            stub = verifier_pb2_grpc.VerifierStub(grpc.aio.insecure_channel(address))
            await stub.Handshake(verifier_pb2.HandshakeRequest(
                draft_id="silent", feature_layer_ids=[1, 2], hidden_size=HIDDEN, vocab_size=VOCAB,
                transports=["inline"]))
            before = sorted(servicer._peers)
            streaming = VerifierClient(address, "auto", ring_slots=2, ring_slot_bytes=8192, device="cpu")
            await streaming.connect([1, 2], HIDDEN, VOCAB)
            await asyncio.sleep(0.8)
            after = sorted(servicer._peers)
            gauge = metrics.peers._value.get()
            await streaming.close()
            return before, after, gauge
        finally:
            await server.stop(None)

    before, after, gauge = asyncio.run(scenario())
    assert before == ["silent"]
    assert len(after) == 1 and "silent" not in after and gauge == 1   # the streaming draft stays


def test_a_prefill_with_unusable_sampling_fails_alone() -> None:
    """A request whose sampling the verifier refuses gets its own INVALID_ARGUMENT; the step's other
    prefills run, in order. Before, the ValueError ended the verify stream, failing every request."""
    from services.common.transport import InlineReader

    seen = []

    class Group(_Group):
        def call(self, name: str, *args):
            if name == "prefill":
                seen.extend(p.request_id for p in args[0])
                items = [SimpleNamespace(request_id=p.request_id, error=None, tokens=[7], committed=1) for p in args[0]]
                return SimpleNamespace(items=items, features=torch.zeros(len(items), HIDDEN))
            return super().call(name, *args)

    servicer = VerifierServicer(Group(), VerifierSettings(device="cpu"), Metrics("verifier"))
    peer = verifier_server._Peer("d", InlineWriter(), InlineReader())
    servicer._peers["d"] = peer
    prefills = [verifier_pb2.PrefillItem(request_id=r, token_ids=[1, 2], reserve_tokens=8,
                                         sampling=common_pb2.SamplingParams(temperature=t))
                for r, t in (("a", 0.0), ("bad", float("inf")), ("c", 0.7))]
    resp = servicer._step(peer, verifier_pb2.VerifyRequest(sequence=1, prefills=prefills))
    assert seen == ["a", "c"]
    assert [(i.request_id, i.error_code) for i in resp.prefills] == [
        ("a", 0), ("bad", grpc.StatusCode.INVALID_ARGUMENT.value[0]), ("c", 0)]
    assert "temperature" in resp.prefills[1].error_message and list(resp.prefills[2].token_ids) == [7]


def test_a_release_only_step_times_no_stage() -> None:
    """A step that only gives requests back is no decode step: the verifier's stage histograms
    (what an operator reads as step time) leave it out, and a prefill step is still timed. The
    stream observes a step's stages once its answer has gone (at C=1 the draft waits on the path
    from the engine's result to the answer, not on the metrics)."""
    from services.common.transport import InlineReader

    class Group(_Group):
        def call(self, name: str, *args):
            if name == "prefill":
                items = [SimpleNamespace(request_id=p.request_id, error=None, tokens=[7], committed=2) for p in args[0]]
                return SimpleNamespace(items=items, features=torch.ones(2 * len(items), HIDDEN))
            if name == "release":
                return None
            return super().call(name, *args)

    metrics = Metrics("verifier")
    servicer = VerifierServicer(Group(), VerifierSettings(device="cpu"), metrics)
    peer = verifier_server._Peer("d", InlineWriter(), InlineReader())
    servicer._peers["d"] = peer

    def timed() -> dict[str, float]:
        return {s.labels["stage"]: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name == "ddtree_step_ms_count"}

    async def requests():
        yield verifier_pb2.VerifyRequest(sequence=1, prefills=[verifier_pb2.PrefillItem(
            request_id="a", token_ids=[1, 2], reserve_tokens=8)])
        yield verifier_pb2.VerifyRequest(sequence=2, release=["a"])

    async def stream():
        answers = servicer._serve_steps(peer, requests())
        first = await answers.__anext__()
        seen = [timed()]   # the answer is out; its stages are observed when the stream goes on
        second = await answers.__anext__()
        seen.append(timed())
        await answers.aclose()
        return first, second, seen + [timed()]

    first, second, seen = asyncio.run(stream())
    assert first.sequence == 1 and second.sequence == 2 and not second.prefills and not second.verifies
    assert seen == [{}, {"verify": 1, "features": 1, "stream_step": 1}, {"verify": 1, "features": 1, "stream_step": 1}]


def test_a_shm_ring_without_room_is_refused_and_the_handshake_falls_back(monkeypatch) -> None:
    """A POSIX segment is only sized: touching a page /dev/shm had no room for killed the verifier
    with SIGBUS in a handshake. The space is reserved when the ring is made, so a full /dev/shm is
    an OSError naming it, and both ends fall back to the next kind (here: inline)."""
    import errno
    import os

    from services.common import transport

    def no_room(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError, match="no room for a .* shared-memory ring in /dev/shm"):
        transport.ShmWriter(1 << 20, 4, "ddtree-test")
    assert set(os.listdir("/dev/shm")) == before          # the segment went with the error
    kind, writer_kind, peers, _, after = asyncio.run(_negotiate("cpu", "cpu", transport="auto"))
    assert (kind, writer_kind, list(peers.values())) == ("inline", "inline", ["inline"]) and after == (0, 0)


def test_a_draft_of_other_feature_layers_is_refused_while_another_is_connected() -> None:
    """The engine keeps one set of feature layers: a second drafter naming others re-pointed the
    first draft's features (same width: no error, acceptance just fell)."""
    async def scenario():
        server, servicer, _, address = await _serve("cpu")
        first = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        other = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        same = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        try:
            await first.connect([1, 2], HIDDEN, VOCAB)
            with pytest.raises(ServiceError) as refused:
                await other.connect([0, 2], HIDDEN, VOCAB)
            await same.connect([1, 2], HIDDEN, VOCAB)
            await first.connect([0, 2], HIDDEN, VOCAB)     # the same draft may not change them under `same`
            return refused.value, None
        except ServiceError as exc:
            return refused.value, exc
        finally:
            for c in (first, other, same):
                await c.close()
            await server.stop(None)

    refused, second = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "[0, 2]" in refused.message
    assert second is not None and second.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_draft_of_other_feature_layers_than_the_setting_is_refused() -> None:
    """``verifier.feature_layers`` set: the graphs were captured with them at start-up, so a drafter
    naming others is refused (even alone), with the setting named; one naming them connects."""
    async def scenario():
        server, _, _, address = await _serve("cpu", feature_layers=(1, 2))
        other = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        same = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        try:
            with pytest.raises(ServiceError) as refused:
                await other.connect([0, 2], HIDDEN, VOCAB)
            await same.connect([1, 2], HIDDEN, VOCAB)
            return refused.value
        finally:
            for c in (other, same):
                await c.close()
            await server.stop(None)

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "[0, 2]" in refused.message and "verifier.feature_layers = [1, 2]" in refused.message


def test_a_peer_that_opens_its_stream_while_its_expiry_waits_is_kept() -> None:
    """The expiry of a draft that opened no stream after its handshake waits for the engine lock;
    a stream opened meanwhile was accepted, then its peer dropped under it (its steps failed on a
    closed ring)."""
    async def scenario():
        server, servicer, _, address = await _serve("cpu", peer_stream_timeout_s=0.2)
        stub = verifier_pb2_grpc.VerifierStub(grpc.aio.insecure_channel(address))
        try:
            await stub.Handshake(verifier_pb2.HandshakeRequest(
                draft_id="late", feature_layer_ids=[1, 2], hidden_size=HIDDEN, vocab_size=VOCAB,
                transports=["inline"]))
            peer = servicer._peers["late"]
            servicer._engine_lock.acquire()               # the engine is busy with another draft's step
            await asyncio.sleep(0.4)                      # the expiry is waiting for the lock
            peer.streamed = True                          # ... when the stream opens
            servicer._engine_lock.release()
            await asyncio.sleep(0.2)
            return servicer._peers.get("late") is peer
        finally:
            await server.stop(None)

    assert asyncio.run(scenario())


def test_a_step_of_a_stale_handshake_is_refused_before_the_engine() -> None:
    from services.common.transport import InlineReader

    calls = []

    class Group(_Group):
        def call(self, name: str, *args):
            calls.append(name)
            return super().call(name, *args)

    servicer = VerifierServicer(Group(), VerifierSettings(device="cpu"), Metrics("verifier"))
    peer = verifier_server._Peer("d", InlineWriter(), InlineReader())   # not (any more) the peer of "d"
    with pytest.raises(ServiceError) as stale:
        servicer._step(peer, verifier_pb2.VerifyRequest(sequence=1, release=["a"]))
    assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION and calls == []


def test_with_ranks_a_verify_call_carries_its_trees_not_the_ring_they_lie_in() -> None:
    """With TP the call is pickled to every worker, and a tree read in place is a view of the ring:
    pickled, it took the whole ring (16 MiB a step for a cuda_ipc ring)."""
    import pickle

    from services.verifier.server import TREE_FIELDS

    ring = torch.zeros(1 << 22, dtype=torch.int64)            # 32 MiB of ring
    ring[16:32], ring[32:48], ring[48] = torch.arange(-1, 15), torch.arange(16), 16   # one 16-node chain
    trees = {k: ring[i * 16:i * 16 + (1 if k == "sizes" else 16)] for i, k in enumerate(TREE_FIELDS)}
    sizes = []

    class Group(_Group):
        def call(self, name: str, *args):
            if name == "verify":
                sizes.append(len(pickle.dumps(args)))
                return SimpleNamespace(items=[], features=torch.zeros(0, HIDDEN))
            return super().call(name, *args)

    class Reader(TensorReader):   # reads in place: views of the ring
        def read(self, bundle):
            return trees

    servicer = VerifierServicer(Group(), VerifierSettings(device="cpu", tp=2), Metrics("verifier"))
    peer = verifier_server._Peer("d", InlineWriter(), Reader())
    req = verifier_pb2.VerifyRequest(sequence=1, verify_ids=["a"])
    for i, k in enumerate(TREE_FIELDS):   # the bundle names the slot the reader's views lie in
        ref = req.trees.tensors.add(name=k, dtype="int64", shape=[trees[k].numel()])
        ref.slot.slot, ref.slot.offset, ref.slot.nbytes = 0, i * 128, trees[k].numel() * 8
    servicer._verify(peer, req)
    assert sizes and sizes[0] < 64 * 1024, sizes


def test_both_rings_lose_their_names_once_the_stream_is_open() -> None:
    """A named ring outlived an owner killed with its resource tracker (a container's kill) in
    /dev/shm; once both ends map both rings, neither needs its name."""
    async def scenario() -> tuple[str, str, list[str], list[bool]]:
        async with _prefill_link(Metrics("verifier")) as (servicer, client):
            prefill = verifier_pb2.PrefillItem(request_id="a", token_ids=[1, 2, 3], reserve_tokens=16)
            reply = await client.step([prefill], [], None, [])
            peer = next(iter(servicer._peers.values()))
            listed = os.listdir("/dev/shm")   # while both ends are open (their close unlinks anyway)
            again = await client.step([], [], None, ["a"])   # the rings go on working
            return (client._writer.ring_name, peer.writer.ring_name, listed,
                    [reply.features.shape == (3, HIDDEN), again.response is not None])

    draft_ring, verifier_ring, listed, ok = asyncio.run(scenario())
    assert draft_ring and verifier_ring and ok == [True, True]
    assert draft_ring not in listed and verifier_ring not in listed


@pytest.mark.parametrize("side", ["verifier", "draft"])
def test_a_ring_that_cannot_be_made_for_want_of_gpu_memory_falls_back(monkeypatch, side) -> None:
    """CUDA's out-of-memory is a RuntimeError, not the OSError of a full /dev/shm: the verifier's
    handshake failed UNKNOWN on every retry, the draft's connect raised it raw."""
    module = verifier_server if side == "verifier" else verifier_client
    real = module.make_writer

    def no_memory(kind: str, *args, **kwargs):
        if kind == "shm":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")
        return real(kind, *args, **kwargs)
    monkeypatch.setattr(module, "make_writer", no_memory)
    kind, writer_kind, peers, _, after = asyncio.run(_negotiate("cpu", "cpu", transport="auto"))
    assert (kind, writer_kind, list(peers.values())) == ("inline", "inline", ["inline"]) and after == (0, 0)
    if side == "draft":   # the only kind offered: a status that says why
        async def only_shm() -> None:
            server, _, _, address = await _serve("cpu")
            try:
                client = VerifierClient(address, "shm", ring_slots=2, ring_slot_bytes=8192, device="cpu")
                with pytest.raises(ServiceError, match="cannot make a shm ring: CUDA out of memory") as info:
                    await client.connect([1, 2], HIDDEN, VOCAB)
                assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                await server.stop(None)
        asyncio.run(only_shm())


def test_a_ring_fault_on_the_draft_ends_the_stream_as_a_lost_step() -> None:
    """A full draft ring (RingFull) or a reply the draft cannot read (ValueError) escaped
    `VerifierClient.step` raw: the draft engine, which fails its requests on ServiceError, left
    the stream open and the requests to fail later on a root they no longer had."""
    from services.common.transport import RingFull

    async def scenario() -> list[tuple[grpc.StatusCode, str, bool]]:
        seen = []
        for fault in ("write", "read", "other"):   # other: not a bad message, any exception reading the reply
            async with _prefill_link(Metrics("verifier")) as (servicer, client):
                def raise_(*args, fault=fault):
                    if fault == "other":
                        raise RuntimeError("stride calculation overflowed")
                    raise RingFull("every slot is held") if fault == "write" else ValueError("stale message")
                if fault == "write":
                    client._writer.write = raise_
                else:
                    client._reader.read = raise_
                prefill = verifier_pb2.PrefillItem(request_id="a", token_ids=[1, 2], reserve_tokens=16)
                trees = {"tokens": torch.arange(3)} if fault == "write" else None
                with pytest.raises(ServiceError) as info:
                    await client.step([prefill], [], trees, [])
                seen.append((info.value.code, info.value.message, client.connected))
        return seen

    with capture_logs() as logs:
        (w_code, w_msg, w_open), (r_code, r_msg, r_open), (o_code, o_msg, o_open) = asyncio.run(scenario())
    assert (w_code, r_code, o_code) == (grpc.StatusCode.UNAVAILABLE,) * 3
    # Each is a lost stream in the log as well (a reconnect followed with no loss before it).
    assert [e["error"] for e in logs if e["event"] == "verifier_stream_lost"] == [w_msg, r_msg, o_msg]
    assert "draft ring: every slot is held" in w_msg and "unreadable verifier reply: stale message" in r_msg
    assert "unreadable verifier reply: stride calculation overflowed" in o_msg   # escaped the stream's clean-up before
    assert not w_open and not r_open and not o_open


def test_a_handshake_naming_a_segment_that_is_no_draft_ring_is_refused() -> None:
    """The verifier attached any shared-memory segment a handshake named and sent bytes of its
    slot headers back in its refusals: anyone reaching its port read 16 of every 64 bytes of any
    segment the verifier's user could open."""
    from multiprocessing import shared_memory

    other = shared_memory.SharedMemory(create=True, size=1 << 16, name=f"not-a-ring-{os.getpid()}")
    other.buf[:16] = b"API_KEY=sk-live-"
    try:
        async def scenario():
            server, servicer, _, address = await _serve("cpu")
            try:
                channel = grpc.aio.insecure_channel(address)
                stub = verifier_pb2_grpc.VerifierStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.Handshake(verifier_pb2.HandshakeRequest(
                        draft_id="x", feature_layer_ids=[1, 2], hidden_size=HIDDEN, vocab_size=VOCAB,
                        transports=["shm"], draft_ring=other.name, draft_ring_slot_bytes=64, draft_ring_slots=4))
                await channel.close()
                return info.value, len(servicer._peers)
            finally:
                await server.stop(None)
        err, peers = asyncio.run(scenario())
    finally:
        other.close()
        other.unlink()
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "is not a ddtree-draft-* ring" in err.details()
    assert peers == 0
    with pytest.raises(ValueError, match="is not a ddtree-verifier-\\* ring"):
        make_reader("shm", "ddtree-draft-1-ab", 64, 4, prefix="ddtree-verifier-")


def test_an_shm_ring_of_another_user_is_refused(monkeypatch) -> None:
    writer = make_writer("shm", 4096, 2, "ddtree-draft")
    try:
        monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
        with pytest.raises(ValueError, match="belongs to another user"):
            make_reader("shm", writer.ring_name, 4096, 2, prefix="ddtree-draft-")
    finally:
        writer.close()


class _KeptGpuWriter(_FakeGpuWriter):
    """A cuda_ipc ring the verifier 'maps' (an inline reader stands in), which records its fate."""

    made: list[_KeptGpuWriter] = []

    def __init__(self) -> None:
        self.closed = self.reclaimed = 0
        _KeptGpuWriter.made.append(self)

    def close(self) -> None:
        self.closed += 1

    def release_all(self) -> None:
        self.reclaimed += 1


def test_a_drafts_cuda_ipc_ring_outlives_its_stream_until_the_verifier_lets_go(monkeypatch) -> None:
    """The draft freed its cuda_ipc ring the moment a step timed out, while the verifier could still
    read a step it had queued through its mapping of it (undefined in CUDA). The ring is offered
    again on the next handshake; it goes once a handshake settles on another kind (the verifier
    retired the old peer before answering) or when the draft itself goes."""
    _KeptGpuWriter.made = []
    cuda_ok = [True]

    def draft_writer(kind, *args, **kwargs):
        return _KeptGpuWriter() if kind == "cuda_ipc" else make_writer(kind, *args, **kwargs)

    def draft_reader(kind, *args, **kwargs):
        return make_reader("inline") if kind == "cuda_ipc" else make_reader(kind, *args, **kwargs)

    def verifier_reader(kind, *args, **kwargs):
        if kind == "cuda_ipc":
            if not cuda_ok[0]:
                raise ValueError("the draft's GPU is not visible here")
            return make_reader("inline")
        return make_reader(kind, *args, **kwargs)

    def verifier_writer(kind, *args, **kwargs):
        return _FakeGpuWriter() if kind == "cuda_ipc" else make_writer(kind, *args, **kwargs)

    monkeypatch.setattr(verifier_client, "make_writer", draft_writer)
    monkeypatch.setattr(verifier_client, "make_reader", draft_reader)
    monkeypatch.setattr(verifier_server, "make_reader", verifier_reader)
    monkeypatch.setattr(verifier_server, "make_writer", verifier_writer)

    async def scenario():
        server, servicer, _, address = await _serve("cuda")
        client = VerifierClient(address, "auto", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        client._offer = ["cuda_ipc", "shm", "inline"]   # what a draft on a GPU offers
        seen = []
        try:
            for _ in range(2):   # a stream ends (a step timed out) and the draft connects again
                hs = await client.connect([1, 2], HIDDEN, VOCAB)
                await asyncio.sleep(_STREAM_OPEN_S)
                ring = client._writer
                await client.close()
                seen.append((hs.transport, len(_KeptGpuWriter.made), ring.closed, ring.reclaimed))
            cuda_ok[0] = False   # the next verifier answer settles on shm: our old peer is gone there
            hs = await client.connect([1, 2], HIDDEN, VOCAB)
            seen.append((hs.transport, len(_KeptGpuWriter.made), _KeptGpuWriter.made[0].closed))
            await client.close(final=True)
            cuda_ok[0] = True
            await client.connect([1, 2], HIDDEN, VOCAB)   # a fresh ring after that
            await client.close(final=True)   # the draft goes
            seen.append((len(_KeptGpuWriter.made), _KeptGpuWriter.made[1].closed))
        finally:
            await client.close(final=True)
            await server.stop(None)
        return seen

    assert asyncio.run(scenario()) == [("cuda_ipc", 1, 0, 0), ("cuda_ipc", 1, 0, 1), ("shm", 1, 1), (2, 1)]


def test_a_draft_without_its_verifier_fails_a_reconnect_at_once() -> None:
    """Past start-up (no wait), a reconnect to a verifier that is down must fail UNAVAILABLE at once:
    waiting for it held the draft's engine, and every step of its requests, for 10 s a try."""
    import socket
    import time

    from services.common.grpc_server import ServiceError
    from services.draft.verifier_client import VerifierClient

    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def run() -> tuple[ServiceError, float]:
        client = VerifierClient(f"127.0.0.1:{port}", "shm", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        t0 = time.monotonic()
        try:
            await client.connect([1], 64, 128, wait_s=0)
        except ServiceError as exc:
            return exc, time.monotonic() - t0
        finally:
            await client.close()
        raise AssertionError("connected to nothing")
    err, took = asyncio.run(run())
    assert err.code == grpc.StatusCode.UNAVAILABLE and took < 5.0, (err, took)
