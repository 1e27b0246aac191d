"""The step socket: a draft of the verifier's host sends its steps on a Unix socket, not the gRPC stream.

The frames first (`services/common/step_socket.py`), then the real verifier servicer (in front of a
stand-in engine) and the real draft-side client over a real gRPC handshake and a real socket: which
lane a step takes, the fallbacks, and that every way a stream ends frees what the draft held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from types import SimpleNamespace

import grpc
import pytest
import torch

from ddtree.v1 import verifier_pb2, verifier_pb2_grpc
from services.common import step_socket
from services.common.grpc_server import MAX_MESSAGE_BYTES, ServiceError
from services.common.metrics import Metrics
from services.common.settings import VerifierSettings
from services.common.step_socket import StepSocketCall, StepSocketError
from services.draft.verifier_client import VerifierClient
from services.verifier.server import VerifierServicer

pytestmark = pytest.mark.skipif(not step_socket.available(), reason="abstract Unix socket names are Linux's")

HIDDEN, VOCAB = 32, 256


def _reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def _frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<BI", kind, len(payload)) + payload


def _read(data: bytes, max_bytes: int = 1 << 20):
    async def go():
        return await step_socket.read_frame(_reader_of(data), max_bytes)
    return asyncio.run(go())


def test_frames_read_back_as_written() -> None:
    req = verifier_pb2.VerifyRequest(sequence=7, verify_ids=["a", "b"])
    assert verifier_pb2.VerifyRequest.FromString(_read(_frame(step_socket.MESSAGE, req.SerializeToString()))) == req
    assert _read(_frame(step_socket.MESSAGE, b"")) == b""
    assert _read(b"") is None   # a clean end between frames


def test_an_error_frame_raises_its_status_even_past_the_message_limit() -> None:
    details = "no handshake for this step socket key " * 20
    error = struct.pack("<I", grpc.StatusCode.FAILED_PRECONDITION.value[0]) + details.encode()
    with pytest.raises(StepSocketError) as info:
        _read(_frame(step_socket.ERROR, error), max_bytes=0)   # (the key's acknowledgement allows no message bytes)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and info.value.details == details


@pytest.mark.parametrize("data, code, words", [
    (_frame(step_socket.MESSAGE, b"x" * 65), grpc.StatusCode.RESOURCE_EXHAUSTED, "65 bytes, more than the 64"),
    (struct.pack("<BI", step_socket.MESSAGE, 1 << 31), grpc.StatusCode.RESOURCE_EXHAUSTED, "more than the 64"),
    (_frame(7, b"x"), grpc.StatusCode.INVALID_ARGUMENT, "unknown kind 7"),
    (_frame(step_socket.MESSAGE, b"xyz")[:-1], grpc.StatusCode.UNAVAILABLE, "inside a frame"),
    (b"\x00\x01", grpc.StatusCode.UNAVAILABLE, "inside a frame"),
])
def test_bad_frames_are_refused_before_their_payload_is_read(data, code, words) -> None:
    with pytest.raises(StepSocketError) as info:
        _read(data, max_bytes=64)
    assert info.value.code == code and words in info.value.details


def test_a_frame_that_is_no_message_of_its_type_is_invalid_argument() -> None:
    async def go():
        async for _ in step_socket.messages(_reader_of(_frame(step_socket.MESSAGE, b"\xff\xff\xff")),
                                            verifier_pb2.VerifyRequest, 1024):
            pass
    with pytest.raises(StepSocketError) as info:
        asyncio.run(go())
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "VerifyRequest" in info.value.details


def test_a_call_reads_replies_then_the_end_and_tells_its_callbacks() -> None:
    """The verifier answers two requests and ends in order: the third read is EOF, every later
    one too, and the call is done without a read (health hears of it between steps)."""
    async def scenario():
        name = step_socket.socket_name(f"test-{os.getpid()}-end")

        async def verifier(reader, writer):
            await step_socket.read_frame(reader, step_socket.KEY_BYTES)
            step_socket.write_message(writer, b"")
            for _ in range(2):
                req = step_socket.parse(await step_socket.read_frame(reader, 1024), verifier_pb2.VerifyRequest)
                step_socket.write_message(writer, verifier_pb2.VerifyResponse(sequence=req.sequence))
            writer.close()
        server = await step_socket.listen(name, verifier)
        try:
            call = await StepSocketCall.open(name, os.urandom(step_socket.KEY_BYTES), verifier_pb2.VerifyResponse,
                                             MAX_MESSAGE_BYTES)
            ended = asyncio.Event()
            call.add_done_callback(lambda _: ended.set())
            got = []
            for seq in (3, 4):
                await call.write(verifier_pb2.VerifyRequest(sequence=seq))
                got.append((await call.read()).sequence)
            await asyncio.wait_for(ended.wait(), 5)
            ends = [await call.read(), await call.read()]
            with pytest.raises(StepSocketError, match="closed"):
                await call.write(verifier_pb2.VerifyRequest(sequence=5))
            return got, ends, call.done()
        finally:
            server.close()

    got, ends, done = asyncio.run(scenario())
    assert got == [3, 4] and ends == [grpc.aio.EOF, grpc.aio.EOF] and done


class _Group:
    """A stand-in engine: prefills answer one token and random features per prompt token."""

    def __init__(self) -> None:
        config = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, model_type="deepseek_v3", eos_token_id=[0])
        cache = SimpleNamespace(pages_free=64, num_pages=64, capacity_tokens=1024, page_size=16)
        self.engine = SimpleNamespace(model=SimpleNamespace(config=config, dtype=torch.float32), cache=cache,
                                      max_context=256, active_requests=0, holds=lambda request_id: False,
                                      model_device=torch.device("cpu"), check_feature_layers=lambda ids: None,
                                      cat_features=lambda parts: torch.cat(parts) if parts else torch.zeros(0, HIDDEN))
        self.released: list[str] = []

    def call(self, name: str, *args):
        if name == "prefill":
            items = [SimpleNamespace(request_id=p.request_id, error=None, tokens=[7], committed=len(p.token_ids))
                     for p in args[0]]
            return SimpleNamespace(items=items, features=torch.randn(sum(len(p.token_ids) for p in args[0]), HIDDEN))
        if name == "release_owner":
            self.released.append(args[0])
            return 0
        return None


@contextlib.asynccontextmanager
async def _verifier(step_socket_on: bool = True, folder: str = ""):
    servicer = VerifierServicer(_Group(), VerifierSettings(device="cpu", ring_slot_bytes=8192, step_socket=step_socket_on,
                                                           step_socket_dir=folder), Metrics("verifier"))
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.start_step_socket()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await servicer.close_step_socket(grace_s=5.0)
        await server.stop(None)


def _client(address: str) -> VerifierClient:
    return VerifierClient(address, "shm", ring_slots=4, ring_slot_bytes=8192, device="cpu")


def _prefill(rid: str, n: int) -> verifier_pb2.PrefillItem:
    return verifier_pb2.PrefillItem(request_id=rid, token_ids=list(range(1, n + 1)), reserve_tokens=16)


async def _one_prefill(folder: str = "") -> tuple[str, str, int]:
    """A draft's handshake and one prefill step: the socket offered, the lane taken, the feature rows."""
    async with _verifier(folder=folder) as (servicer, address):
        client = _client(address)
        try:
            hs = await client.connect([1], HIDDEN, VOCAB)
            rows = (await client.step([_prefill("a", 3)], [], None, [])).features.shape[0]
            return hs.step_socket, client.lane, rows
        finally:
            await client.close()


async def _gone(servicer: VerifierServicer) -> bool:
    for _ in range(250):   # a stream's end reaches the verifier asynchronously
        if not servicer._peers:
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.parametrize("on", [True, False])
def test_steps_take_the_socket_where_offered_and_the_grpc_stream_where_not(on: bool) -> None:
    """Same answers on both lanes: the features by ring reference, read in place."""
    async def scenario():
        async with _verifier(step_socket_on=on) as (servicer, address):
            client = _client(address)
            try:
                hs = await client.connect([1], HIDDEN, VOCAB)
                shapes = [tuple((await client.step([_prefill(r, n)], [], None, [])).features.shape)
                          for r, n in (("a", 5), ("b", 3))]
                return bool(hs.step_socket), len(hs.step_socket_key), client.lane, shapes, client.connected
            finally:
                await client.close()

    offered, key_bytes, lane, shapes, connected = asyncio.run(scenario())
    assert (offered, key_bytes, lane) == ((True, step_socket.KEY_BYTES, "socket") if on else (False, 0, "grpc"))
    assert shapes == [(5, HIDDEN), (3, HIDDEN)] and connected


def test_a_draft_that_cannot_reach_the_socket_keeps_the_grpc_stream(monkeypatch) -> None:
    """Another network namespace (compose's containers) does not see the abstract name."""
    async def refused(name):
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(step_socket, "connect", refused)

    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                await client.connect([1], HIDDEN, VOCAB)
                reply = await client.step([_prefill("a", 4)], [], None, [])
                return client.lane, reply.features.shape[0]
            finally:
                await client.close()

    assert asyncio.run(scenario()) == ("grpc", 4)


def test_a_key_no_handshake_gave_is_refused_with_a_status() -> None:
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                hs = await client.connect([1], HIDDEN, VOCAB)
                with pytest.raises(StepSocketError) as info:
                    await StepSocketCall.open(hs.step_socket, os.urandom(step_socket.KEY_BYTES),
                                              verifier_pb2.VerifyResponse, MAX_MESSAGE_BYTES)
                # ... and the draft that holds the key steps on as before
                reply = await client.step([_prefill("a", 2)], [], None, [])
                return info.value, reply.features.shape[0]
            finally:
                await client.close()

    error, rows = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "call Handshake first" in error.details
    assert rows == 2


def test_a_second_stream_of_one_handshake_is_refused() -> None:
    """The key opened one stream already: a second (socket or gRPC) would interleave its steps."""
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                hs = await client.connect([1], HIDDEN, VOCAB)
                call = await StepSocketCall.open(hs.step_socket, hs.step_socket_key, verifier_pb2.VerifyResponse,
                                                 MAX_MESSAGE_BYTES)
                with pytest.raises(StepSocketError) as info:
                    await call.read()
                return info.value
            finally:
                await client.close()

    error = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION and "already open" in error.details


def test_a_draft_that_dies_frees_what_its_stream_held(monkeypatch) -> None:
    """Its socket closes with a step's request half written: the verifier ends the stream and
    releases the handshake's requests and rings."""
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            await client.connect([1], HIDDEN, VOCAB)
            await client.step([_prefill("a", 3)], [], None, [])
            owner = next(iter(servicer._peers.values())).owner
            transport = client._call._writer.transport
            transport.write(struct.pack("<BI", step_socket.MESSAGE, 100) + b"part of a request")
            transport.abort()   # as a killed process's socket goes
            gone = await _gone(servicer)
            await client.close()
            return gone, owner, servicer.group.released

    gone, owner, released = asyncio.run(scenario())
    assert gone and released == [owner]


def test_a_garbled_request_ends_the_stream_with_invalid_argument() -> None:
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                await client.connect([1], HIDDEN, VOCAB)
                client._call._writer.write(struct.pack("<BI", step_socket.MESSAGE, 3) + b"\xff\xff\xff")
                with pytest.raises(StepSocketError) as info:
                    await client._call.read()
                return info.value, await _gone(servicer)
            finally:
                await client.close()

    error, gone = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "VerifyRequest" in error.details and gone


def test_a_stopping_verifier_ends_an_idle_socket_stream_at_once() -> None:
    """As it ends its gRPC streams: the draft sees the stream end between steps (health goes
    NOT_SERVING) and its next step hand-shakes again instead of writing into a closed socket."""
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                await client.connect([1], HIDDEN, VOCAB)
                await client.step([_prefill("a", 2)], [], None, [])
                client.stream_changed.clear()
                servicer.end_idle_streams()
                await asyncio.wait_for(client.stream_changed.wait(), 5)
                ended = (client.connected, await client._call.read(), await _gone(servicer))
                offered_after = servicer.step_socket
                return ended, offered_after
            finally:
                await client.close()

    (connected, read, gone), offered_after = asyncio.run(scenario())
    assert not connected and read is grpc.aio.EOF and gone and offered_after == ""


def test_a_step_whose_stream_broke_names_the_status(monkeypatch) -> None:
    """The verifier's refusal mid-stream reaches the draft's step as UNAVAILABLE with its words."""
    async def scenario():
        async with _verifier() as (servicer, address):
            client = _client(address)
            try:
                await client.connect([1], HIDDEN, VOCAB)
                servicer._peers.clear()   # as after the draft's handshake expired
                with pytest.raises(ServiceError) as info:
                    await client.step([_prefill("a", 2)], [], None, [])
                return info.value, client.connected
            finally:
                await client.close()

    error, connected = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.UNAVAILABLE and "no longer current" in error.message and not connected


def test_the_setting_and_the_lane_are_documented() -> None:
    readme = open("README.md").read()
    assert "verifier.step_socket" in readme and "draft.step_socket" in readme


# The scheduler's step streams to its draft (`DraftLink` against `DraftServicer`).

class _EchoEngine:
    """A draft engine's interface to `DraftServicer`: each item answered with one token (its id's
    length); item "refuse" fails the step INVALID_ARGUMENT. Records which stream stepped and ended."""

    def __init__(self) -> None:
        self.stepped: list[int] = []
        self.ended: list[int] = []

    async def step(self, request, owner: int = 0):
        from ddtree.v1 import draft_pb2
        self.stepped.append(owner)
        ids = [i.request_id for i in request.items]
        if "refuse" in ids:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "refused step")
        if "crash" in ids:
            raise RuntimeError("a fault in the engine")
        return draft_pb2.StepResponse(results=[draft_pb2.StepResult(request_id=i, token_ids=[len(i)]) for i in ids])

    def run_ahead(self) -> None:
        pass

    async def end_stream(self, owner: int) -> None:
        self.ended.append(owner)


@contextlib.asynccontextmanager
async def _draft(enabled: bool = True, folder: str = ""):
    from ddtree.v1 import draft_pb2_grpc
    from services.draft.server import DraftServicer
    engine = _EchoEngine()
    servicer = DraftServicer(engine)
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.start_step_socket(enabled, folder)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, engine, draft_pb2_grpc.DraftStub(channel)
    finally:
        await channel.close()
        await servicer.close_step_socket(grace_s=5.0)
        await server.stop(0)


def _step(*ids: str):
    from ddtree.v1 import draft_pb2
    return draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id=i) for i in ids])


async def _until(condition, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_scheduler_lane_steps_on_the_drafts_socket_where_offered(enabled: bool) -> None:
    from services.scheduler.draft_link import DraftLink, StepFailed

    async def scenario():
        async with _draft(enabled) as (servicer, engine, stub):
            link = DraftLink(stub)
            answers = [[list(r.token_ids) for r in (await link.step(_step("a", "bbb"), timeout=5)).results]
                       for _ in range(3)]
            lane = link.lane
            with pytest.raises(StepFailed) as failed:   # the draft's refusal ends the stream with its status
                await link.step(_step("refuse"), timeout=5)
            await link.step(_step("cc"), timeout=5)   # on a new stream
            link.close()
            ended = await _until(lambda: len(engine.ended) == 2)
            return answers, lane, failed.value, engine.stepped, engine.ended, ended

    answers, lane, failed, stepped, ended, all_ended = asyncio.run(scenario())
    assert answers == [[[1], [3]]] * 3 and lane == ("socket" if enabled else "grpc")
    assert failed.code == grpc.StatusCode.INVALID_ARGUMENT and failed.details == "refused step" and failed.delivered
    first, second = stepped[0], stepped[-1]
    assert stepped == [first] * 4 + [second] and first != second   # one owner a stream
    assert all_ended and sorted(ended) == sorted([first, second])   # each stream's end frees what it admitted


def test_a_socket_key_opens_one_stream_and_expires(monkeypatch) -> None:
    from ddtree.v1 import draft_pb2
    from services.draft import server as draft_server

    async def scenario():
        async with _draft() as (servicer, engine, stub):
            offer = await stub.OpenStepSocket(draft_pb2.OpenStepSocketRequest())
            call = await StepSocketCall.open(offer.name, offer.key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
            await call.write(_step("a"))
            first = list((await call.read()).results[0].token_ids)
            errors = []
            for key in (offer.key, os.urandom(step_socket.KEY_BYTES)):   # used already; never given
                with pytest.raises(StepSocketError) as info:
                    await StepSocketCall.open(offer.name, key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
                errors.append(info.value)
            monkeypatch.setattr(draft_server, "SOCKET_KEY_LIFE_S", -1.0)   # keys given from here on are void at once
            late = await stub.OpenStepSocket(draft_pb2.OpenStepSocketRequest())
            with pytest.raises(StepSocketError) as info:
                await StepSocketCall.open(late.name, late.key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
            errors.append(info.value)
            call.cancel()
            return first, errors

    first, errors = asyncio.run(scenario())
    assert first == [1]
    assert all(e.code == grpc.StatusCode.FAILED_PRECONDITION and "call OpenStepSocket first" in e.details
               for e in errors)


def test_offered_keys_are_bounded(monkeypatch) -> None:
    from ddtree.v1 import draft_pb2
    from services.draft import server as draft_server
    monkeypatch.setattr(draft_server, "MAX_SOCKET_KEYS", 4)

    async def scenario():
        async with _draft() as (servicer, engine, stub):
            offers = [await stub.OpenStepSocket(draft_pb2.OpenStepSocketRequest()) for _ in range(10)]
            opened = []
            for offer in (offers[0], offers[-1]):   # the oldest went; the newest opens
                try:
                    call = await StepSocketCall.open(offer.name, offer.key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
                    call.cancel()
                    opened.append(True)
                except StepSocketError:
                    opened.append(False)
            return len(servicer._socket_keys), opened

    held, opened = asyncio.run(scenario())
    assert held <= 4 and opened == [False, True]


def test_a_lane_that_cannot_reach_the_drafts_socket_steps_on_grpc_and_asks_again_next_stream(monkeypatch) -> None:
    """Unreachable (another network namespace, or a draft restarting between offer and connect):
    that stream goes on gRPC; the next stream asks again, and takes the socket once it answers."""
    from services.scheduler.draft_link import DraftLink
    tries = []
    reachable = step_socket.connect

    async def refused(name):
        tries.append(name)
        if len(tries) <= 2:
            raise ConnectionRefusedError(111, "Connection refused")
        return await reachable(name)
    monkeypatch.setattr(step_socket, "connect", refused)

    async def scenario():
        async with _draft() as (servicer, engine, stub):
            link = DraftLink(stub)
            lanes = []
            for _ in range(3):
                assert (await link.step(_step("ab"), timeout=5)).results[0].token_ids[0] == 2
                lanes.append(link.lane)
                link.close()
            return lanes

    assert asyncio.run(scenario()) == ["grpc", "grpc", "socket"] and len(tries) == 3


def test_a_stopping_draft_ends_an_idle_socket_stream_and_the_next_step_knows() -> None:
    """As with its gRPC streams: a step naming running requests of the ended stream fails
    UNAVAILABLE without being sent (the draft let go of them)."""
    from services.scheduler.draft_link import DraftLink, StepFailed

    async def scenario():
        async with _draft() as (servicer, engine, stub):
            link = DraftLink(stub)
            await link.step(_step("a"), timeout=5)
            servicer.end_idle_streams()
            ended = await _until(lambda: link._call.done())
            with pytest.raises(StepFailed) as failed:
                await link.step(_step("a"), timeout=5)
            return ended, failed.value, servicer.step_socket

    ended, failed, offered_after = asyncio.run(scenario())
    assert ended and failed.code == grpc.StatusCode.UNAVAILABLE and not failed.delivered and offered_after == ""


def test_a_scheduler_gone_mid_stream_frees_what_its_stream_admitted() -> None:
    from ddtree.v1 import draft_pb2

    async def scenario():
        async with _draft() as (servicer, engine, stub):
            offer = await stub.OpenStepSocket(draft_pb2.OpenStepSocketRequest())
            call = await StepSocketCall.open(offer.name, offer.key, draft_pb2.StepResponse, MAX_MESSAGE_BYTES)
            await call.write(_step("a"))
            await call.read()
            call._writer.transport.abort()
            return await _until(lambda: engine.ended == engine.stepped[:1])

    assert asyncio.run(scenario())


def test_a_host_without_unix_sockets_serves_on_grpc_alone(monkeypatch) -> None:
    async def no_sockets(name, handle):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(step_socket, "listen", no_sockets)

    assert asyncio.run(_one_prefill()) == ("", "grpc", 3)


def test_a_stream_whose_opening_takes_the_whole_step_timeout_was_not_delivered() -> None:
    from services.scheduler.draft_link import DraftLink, StepFailed

    class SlowOffer:
        async def OpenStepSocket(self, request, metadata=()):  # noqa: N802 - the gRPC method name
            await asyncio.sleep(5)

    async def scenario():
        with pytest.raises(StepFailed) as failed:
            await DraftLink(SlowOffer()).step(_step("a"), timeout=0.1)   # type: ignore[arg-type]
        return failed.value

    failed = asyncio.run(scenario())
    assert failed.code == grpc.StatusCode.DEADLINE_EXCEEDED and not failed.delivered


@pytest.mark.parametrize("enabled", [True, False])
def test_a_fault_in_the_service_reaches_the_lane_as_unknown_on_both_lanes(enabled: bool) -> None:
    from services.scheduler.draft_link import DraftLink, StepFailed

    async def scenario():
        async with _draft(enabled) as (servicer, engine, stub):
            link = DraftLink(stub)
            with pytest.raises(StepFailed) as failed:
                await link.step(_step("crash"), timeout=5)
            link.close()
            ended = await _until(lambda: len(engine.ended) == 1)
            return failed.value, ended

    failed, ended = asyncio.run(scenario())
    assert failed.code == grpc.StatusCode.UNKNOWN and "a fault in the engine" in failed.details and ended


def test_a_connection_without_a_key_neither_holds_a_stop_nor_piles_up(monkeypatch) -> None:
    monkeypatch.setattr(step_socket, "MAX_KEYLESS", 3)

    async def scenario():
        async with _verifier() as (servicer, address):
            silent = [await step_socket.connect(servicer.step_socket) for _ in range(5)]
            await asyncio.sleep(0.1)
            # past the cap, a connection is closed at once: its read ends
            over = await asyncio.wait_for(silent[-1][0].read(1), 2)
            t0 = asyncio.get_running_loop().time()
            await servicer.close_step_socket(grace_s=5.0)
            took = asyncio.get_running_loop().time() - t0
            ends = [await asyncio.wait_for(r.read(1), 2) for r, _ in silent[:3]]
            for _, w in silent:
                w.close()
            return over, took, ends

    over, took, ends = asyncio.run(scenario())
    assert over == b"" and took < 1.0 and ends == [b""] * 3


def test_a_connect_to_a_listener_that_takes_no_one_fails_at_once() -> None:
    """A full backlog (the serving loop stalled) refuses the connect; it never holds the caller's loop."""
    import socket
    import threading
    name = step_socket.socket_name(f"test-{os.getpid()}-backlog")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(0)
    outcome = []

    def attempt():
        async def go():
            held = []
            try:
                for _ in range(8):
                    held.append(await step_socket.connect(name))
            except OSError as exc:
                outcome.append(exc)
            for _, w in held:
                w.close()
        asyncio.run(go())

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(10)
    listener.close()
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], BlockingIOError)


def test_a_call_ended_by_a_status_says_it_on_write_and_a_cancelled_one_never_blocks_a_read() -> None:
    async def scenario():
        name = step_socket.socket_name(f"test-{os.getpid()}-status")

        async def refusing(reader, writer):
            await step_socket.read_frame(reader, step_socket.KEY_BYTES)
            step_socket.write_message(writer, b"")
            step_socket.write_error(writer, grpc.StatusCode.FAILED_PRECONDITION, "handshake no longer current")
            writer.close()
        server = await step_socket.listen(name, refusing)
        try:
            call = await StepSocketCall.open(name, b"k", verifier_pb2.VerifyResponse, 1024)
            ended = asyncio.Event()
            call.add_done_callback(lambda _: ended.set())
            await asyncio.wait_for(ended.wait(), 5)
            with pytest.raises(StepSocketError) as on_write:
                await call.write(verifier_pb2.VerifyRequest(sequence=1))
            other = await StepSocketCall.open(name, b"k", verifier_pb2.VerifyResponse, 1024)
            other.cancel()   # before its reader ran
            with pytest.raises(StepSocketError) as on_read:
                await asyncio.wait_for(other.read(), 2)
            return on_write.value, on_read.value
        finally:
            server.close()

    on_write, on_read = asyncio.run(scenario())
    assert on_write.code == grpc.StatusCode.FAILED_PRECONDITION and "no longer current" in on_write.details
    assert on_read.code == grpc.StatusCode.CANCELLED


# Socket files (`*.step_socket_dir`): what compose's containers, each in a network namespace of its
# own, share through a volume instead of the abstract names.

@pytest.fixture
def short_dir():
    """A folder short enough for a socket path (pytest's tmp_path may pass the 64-byte limit)."""
    import shutil
    import tempfile
    folder = tempfile.mkdtemp(prefix="steps-", dir="/tmp" if os.path.isdir("/tmp") else None)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_verifier_with_a_socket_folder_serves_steps_on_a_file_there_and_removes_it(short_dir) -> None:
    from pathlib import Path
    folder = Path(short_dir) / "steps"   # made at the start

    async def scenario():
        async with _verifier(folder=str(folder)) as (servicer, address):
            client = _client(address)
            try:
                hs = await client.connect([1], HIDDEN, VOCAB)
                mode = os.stat(hs.step_socket).st_mode & 0o777
                rows = [(await client.step([_prefill(r, n)], [], None, [])).features.shape[0]
                        for r, n in (("a", 5), ("b", 3))]
                return hs.step_socket, mode, oct(folder.stat().st_mode & 0o777), client.lane, rows
            finally:
                await client.close()

    name, mode, folder_mode, lane, rows = asyncio.run(scenario())
    assert name.startswith(str(folder) + os.sep) and name.endswith(".sock") and "\0" not in name
    assert (mode, folder_mode, lane, rows) == (0o600, oct(0o700), "socket", [5, 3])
    assert not os.path.exists(name)   # removed at the stop


def test_a_scheduler_lane_steps_on_a_drafts_socket_file(short_dir) -> None:
    from services.scheduler.draft_link import DraftLink

    async def scenario(folder: str):
        async with _draft(True, folder) as (servicer, engine, stub):
            link = DraftLink(stub)
            answers = [[list(r.token_ids) for r in (await link.step(_step("a", "bbb"), timeout=5)).results]
                       for _ in range(2)]
            named = servicer.step_socket
            link.close()
            return answers, link.lane, named

    answers, lane, named = asyncio.run(scenario(short_dir))
    assert answers == [[[1], [3]]] * 2 and lane == "socket"
    assert os.path.dirname(named) == short_dir and not os.listdir(short_dir)   # its file went at the stop


def test_a_socket_folder_that_cannot_be_made_leaves_the_grpc_stream(short_dir) -> None:
    from pathlib import Path
    blocker = Path(short_dir) / "a-file"
    blocker.write_text("")

    assert asyncio.run(_one_prefill(folder=str(blocker / "steps"))) == ("", "grpc", 3)


def test_a_socket_file_whose_server_fails_to_start_is_removed(short_dir, monkeypatch) -> None:
    async def out_of_files(*args, **kwargs):
        raise OSError(24, "Too many open files")

    async def serve():
        return await step_socket.open_server(True, "verifier-abc", lambda key: None, None,
                                             verifier_pb2.VerifyRequest, 1.0, folder=short_dir)

    monkeypatch.setattr(step_socket.asyncio, "start_unix_server", out_of_files)
    assert asyncio.run(serve()) is None   # the service serves on gRPC alone
    assert os.listdir(short_dir) == []    # and leaves no socket file in the shared folder
    # a file already there (another server's) is not this start's to remove
    taken = step_socket.socket_name("verifier-abc", short_dir)
    open(taken, "w").close()
    assert asyncio.run(serve()) is None and os.listdir(short_dir) == [os.path.basename(taken)]


@pytest.mark.parametrize("cls, field", [(VerifierSettings, "verifier.step_socket_dir"),
                                        ("draft", "draft.step_socket_dir")])
def test_a_socket_folder_too_long_for_a_socket_path_or_relative_is_refused_at_start(cls, field) -> None:
    from services.common.settings import MAX_STEP_SOCKET_DIR_BYTES, DraftSettings, SettingsError
    cls = DraftSettings if cls == "draft" else cls
    cls(step_socket_dir="/run/" + "x" * (MAX_STEP_SOCKET_DIR_BYTES - 5))   # at the limit: taken
    with pytest.raises(SettingsError, match=field.replace(".", r"\.") + ".*longer than 64 bytes"):
        cls(step_socket_dir="/run/" + "x" * (MAX_STEP_SOCKET_DIR_BYTES - 4))
    with pytest.raises(SettingsError, match=field.replace(".", r"\.") + ".*must be an absolute path"):
        cls(step_socket_dir="run/steps")   # the peer would resolve it against its own working folder
    longest = step_socket.socket_name("verifier-" + "f" * 12, "/" + "x" * (MAX_STEP_SOCKET_DIR_BYTES - 1))
    assert len(longest.encode()) < 108   # sockaddr_un's path, with its NUL


def _netns_ok() -> bool:
    import shutil
    import subprocess
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_ok(), reason="needs `unshare -n` (a new network namespace: root)")
def test_a_socket_file_reaches_another_network_namespace_where_an_abstract_name_does_not(short_dir) -> None:
    """compose's premise, with this module's own ends: a caller in a network namespace of its own
    (`unshare -n`, as a container has) steps on the socket file, and cannot reach the abstract name."""
    import subprocess
    import sys
    key = os.urandom(step_socket.KEY_BYTES)

    async def echo(handle, requests):
        async for req in requests:
            yield verifier_pb2.VerifyResponse(sequence=req.sequence + handle)

    def start(presented):
        if not step_socket.same_key(key, presented):
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, "wrong key")
        return 100

    caller = ("import asyncio, sys\n"
              "from ddtree.v1 import verifier_pb2\n"
              "from services.common.step_socket import StepSocketCall\n"
              "async def go(name):\n"
              "    try:\n"
              "        call = await StepSocketCall.open(name, bytes.fromhex(sys.argv[1]), verifier_pb2.VerifyResponse, 1 << 20)\n"
              "    except OSError as exc:\n"
              "        return f'refused {exc.errno}'\n"
              "    await call.write(verifier_pb2.VerifyRequest(sequence=7))\n"
              "    return f'answered {(await call.read()).sequence}'\n"
              "for name in sys.argv[2:]:\n"
              "    print(asyncio.run(go(bytes.fromhex(name).decode())))\n")

    async def scenario():
        servers = [step_socket.StepSocketServer(step_socket.socket_name("netns-test", folder), start, echo,
                                                verifier_pb2.VerifyRequest, 5.0) for folder in (short_dir, "")]
        for s in servers:
            await s.open()
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.path.join(os.getcwd(), "protos")])}
            proc = await asyncio.create_subprocess_exec(
                "unshare", "-n", sys.executable, "-c", caller, key.hex(), *(s.name.encode().hex() for s in servers),
                env=env, stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 120)
            return out.decode().split("\n")[:2]
        finally:
            for s in servers:
                await s.close(grace_s=1.0)

    file_lane, abstract_lane = asyncio.run(scenario())
    assert file_lane == "answered 107"
    assert abstract_lane == "refused 111"   # ECONNREFUSED: no such name in that namespace
