"""A peer whose connection goes silent without closing (its host crashed, the network was cut) is
found by keepalive pings on both ends, and its streams end: what it held can be freed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common import grpc_server


class FreezingProxy:
    """Relays TCP between a client and a server until frozen; then holds every byte, both ways,
    without closing anything (what a vanished host looks like from either end)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.tasks += [asyncio.ensure_future(self._pump(reader, up_writer)),
                       asyncio.ensure_future(self._pump(up_reader, writer))]

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            if self.frozen.is_set():
                await asyncio.Event().wait()
            dst.write(data)
            await dst.drain()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.server.close()


def test_a_silent_peer_is_found_by_keepalive_at_both_ends(monkeypatch) -> None:
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIME_MS", 400)
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIMEOUT_MS", 400)

    async def scenario() -> tuple[float, float, grpc.StatusCode]:
        ended = asyncio.Event()

        async def watch(request: bytes, context: grpc.aio.ServicerContext):
            try:
                yield b"serving"
                await asyncio.Event().wait()   # an idle stream, as a verify stream between steps
            finally:
                ended.set()

        server, _ = grpc_server.new_server([])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Idle", {"Watch": grpc.unary_stream_rpc_method_handler(watch)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = FreezingProxy(port)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{await proxy.start()}",
                                            options=grpc_server.server_options())
        call = channel.unary_stream("/test.Idle/Watch")(b"")
        assert await call.read() == b"serving"
        await asyncio.sleep(2.0)   # five ping rounds on an idle stream: the server accepts them all
        assert not ended.is_set() and not call.done()
        proxy.frozen.set()
        t0 = time.monotonic()
        await asyncio.wait_for(ended.wait(), 10)
        server_s = time.monotonic() - t0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 10)
        client_s = time.monotonic() - t0
        proxy.close()
        await channel.close()
        await server.stop(0)
        return server_s, client_s, err.value.code()

    server_s, client_s, code = asyncio.run(scenario())
    assert server_s < 3 and client_s < 3   # a ping and its wait (0.8 s), not TCP's hours
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_verifier_reply_of_the_most_feature_rows_fits_grpcs_message_cap() -> None:
    for width in (7 * 2 * 7168, 3 * 2 * 7168, 1000, 1):
        rows = grpc_server.reply_feature_rows(width)
        assert rows * width + grpc_server.REPLY_OVERHEAD_BYTES <= grpc_server.MAX_MESSAGE_BYTES \
            < (rows + 1) * width + grpc_server.REPLY_OVERHEAD_BYTES


def test_the_receive_cap_is_the_callers_and_idle_connections_are_pinged() -> None:
    """The scheduler's public port caps a request at twice max_request_bytes, not at 1 GiB; pings
    go on while no call is open (a half-open idle link is found, not kept for hours)."""
    options = dict(grpc_server.server_options(max_receive_bytes=4 << 20))
    assert options["grpc.max_receive_message_length"] == 4 << 20
    assert options["grpc.max_send_message_length"] == grpc_server.MAX_MESSAGE_BYTES
    assert dict(grpc_server.keepalive_options())["grpc.keepalive_permit_without_calls"] == 1
