"""grpc.health.v1 on every server of the stack (`services.common.health`): checks, watchers that
come and go, and a shutdown that ends the watchers' streams."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.v1 import draft_pb2
from services.common.grpc_server import new_server

DRAFT = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


async def _started():
    server, health = new_server([DRAFT])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, health, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def _request(service: str = "") -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


async def _rest(call) -> list[int]:
    """The statuses a watch sends until its stream ends."""
    out = []
    while (response := await call.read()) is not grpc.aio.EOF:
        out.append(response.status)
    return out


def test_checks_answer_what_was_set_and_not_found_for_another_name() -> None:
    async def scenario() -> list:
        server, health, channel = await _started()
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            seen = [(await stub.Check(_request(DRAFT))).status, (await stub.Check(_request())).status]
            health.set(DRAFT, NOT_SERVING)
            seen.append((await stub.Check(_request(DRAFT))).status)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(_request("nobody"))
            seen += [info.value.code(), "nobody" in info.value.details()]
            # A long name is cut short: echoed whole it passed the client's 16 KB header limit,
            # and the client got RESOURCE_EXHAUSTED instead of NOT_FOUND.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Check(_request("n" * 20_000))
            seen += [info.value.code(), info.value.details() == f"no service {'n' * 200 + '...'!r} here"]
            return seen
        finally:
            await channel.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == [SERVING, SERVING, NOT_SERVING, grpc.StatusCode.NOT_FOUND, True,
                                       grpc.StatusCode.NOT_FOUND, True]


def test_watchers_that_left_hold_nothing_and_the_others_still_hear_changes() -> None:
    """The library's sync servicer held a server thread for each watch a client had cancelled:
    after about forty, every check hung. Its asyncio one forgot a service's other watchers when one
    of them ended."""
    async def scenario() -> dict:
        server, health, channel = await _started()
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            staying = stub.Watch(_request(DRAFT))
            first = (await staying.read()).status
            for _ in range(100):   # watchers of the same service and of the whole server, gone again
                for name in (DRAFT, ""):
                    call = stub.Watch(_request(name))
                    assert (await call.read()).status == SERVING
                    call.cancel()
            check = (await stub.Check(_request(), timeout=5)).status
            unknown = stub.Watch(_request("later"))
            before = (await asyncio.wait_for(unknown.read(), 5)).status
            health.set(DRAFT, NOT_SERVING)
            health.set("later", SERVING)
            after = (await asyncio.wait_for(staying.read(), 5)).status
            later = (await asyncio.wait_for(unknown.read(), 5)).status
            health.set(DRAFT, NOT_SERVING)   # no change: nothing is sent
            health.set(DRAFT, SERVING)
            again = (await asyncio.wait_for(staying.read(), 5)).status
            staying.cancel()
            unknown.cancel()
            return {"first": first, "check": check, "before": before, "after": after, "later": later, "again": again}
        finally:
            await channel.close()
            await server.stop(0)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == {
        "first": SERVING, "check": SERVING, "before": UNKNOWN, "after": NOT_SERVING, "later": SERVING, "again": SERVING}


def test_a_graceful_shutdown_tells_watchers_then_ends_their_streams() -> None:
    """NOT_SERVING to every watcher, then each stream ends OK, so a stopping server does not wait
    out its grace period; statuses set later are ignored."""
    async def scenario() -> dict:
        server, health, channel = await _started()
        stub = health_pb2_grpc.HealthStub(channel)
        watches = [stub.Watch(_request(name)) for name in ("", DRAFT, "nobody")]
        firsts = [(await w.read()).status for w in watches]
        health.enter_graceful_shutdown()
        health.set(DRAFT, SERVING)
        seen = [await _rest(w) for w in watches]
        codes = [await w.code() for w in watches]
        check = (await stub.Check(_request(DRAFT))).status
        t0 = time.perf_counter()
        await server.stop(30)
        stop_s = time.perf_counter() - t0
        await channel.close()
        return {"firsts": firsts, "seen": seen, "codes": codes, "check": check, "fast_stop": stop_s < 5}

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == {
        "firsts": [SERVING, SERVING, UNKNOWN], "seen": [[NOT_SERVING], [NOT_SERVING], []],
        "codes": [grpc.StatusCode.OK] * 3, "check": NOT_SERVING, "fast_stop": True}


def test_a_shutdown_during_a_write_still_sends_not_serving() -> None:
    """A watcher in the middle of sending SERVING when the shutdown comes reads the status again:
    it sends NOT_SERVING before its stream ends (it ended with SERVING as the last word)."""
    from services.common.health import HealthServicer

    class SlowContext:
        def __init__(self) -> None:
            self.sent: list[int] = []

        async def write(self, response) -> None:
            await asyncio.sleep(0.01)
            self.sent.append(response.status)

    async def scenario() -> list[int]:
        health, context = HealthServicer(), SlowContext()
        watch = asyncio.ensure_future(health.Watch(_request(), context))
        await asyncio.sleep(0)   # the watcher is inside its first write
        health.enter_graceful_shutdown()
        await asyncio.wait_for(watch, 5)
        return context.sent

    assert asyncio.run(scenario()) == [SERVING, NOT_SERVING]


def test_report_health_says_nothing_while_nothing_changes_and_once_a_change() -> None:
    """The status is set and logged when it changes, not every interval ("serving_again" each
    half second)."""
    from structlog.testing import capture_logs

    from services.common.grpc_server import report_health

    async def run() -> list[str]:
        _, health = new_server(["x"])
        state = {"up": True}
        with capture_logs() as logs:
            task = asyncio.ensure_future(report_health(health, ["x"], lambda: state["up"], "no peer", interval_s=0.01))
            await asyncio.sleep(0.1)
            state["up"] = False
            await asyncio.sleep(0.1)
            state["up"] = True
            await asyncio.sleep(0.1)
            task.cancel()
        return [e["event"] for e in logs]
    assert asyncio.run(run()) == ["not_serving", "serving_again"]
