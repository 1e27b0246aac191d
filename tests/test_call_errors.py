"""A handler's unexpected exception is logged with its traceback and ends the call INTERNAL; a
status the handler sets itself, and a client's cancellation, pass as before (every server of the
stack: `new_server`'s CallErrorInterceptor)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from services.common.call_errors import CallErrorInterceptor
from services.common.grpc_server import new_server


class Faulty(draft_pb2_grpc.DraftServicer):
    """GetModelInfo raises; a step stream answers once, then raises, aborts or waits (by request id)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def GetModelInfo(self, request, context):
        raise ValueError("Value out of range: 2147483664")

    async def StepStream(self, request_iterator, context):
        try:
            async for request in request_iterator:
                how = request.items[0].request_id
                yield draft_pb2.StepResponse()
                if how == "raise":
                    raise KeyError("secret-internal-detail")
                if how == "abort":
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "its own status")
        finally:
            self.closed.set()


def _step(request_id: str) -> draft_pb2.StepRequest:
    return draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id=request_id)])


@contextlib.asynccontextmanager
async def _serving(servicer: draft_pb2_grpc.DraftServicer) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a stack server (`new_server`, so its interceptors) serving ``servicer``."""
    server, _ = new_server([draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name])
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(0)


def test_an_unexpected_exception_is_logged_and_ends_the_call_internal() -> None:
    async def scenario() -> dict:
        servicer = Faulty()
        seen = {}
        async with _serving(servicer) as channel:
            stub = draft_pb2_grpc.DraftStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetModelInfo(common_pb2.GetModelInfoRequest())
            seen["unary"] = (info.value.code(), info.value.details())
            for how in ("raise", "abort"):
                call = stub.StepStream()
                await call.write(_step(how))
                assert isinstance(await call.read(), draft_pb2.StepResponse)   # the answer before it
                with pytest.raises(grpc.aio.AioRpcError):
                    await call.read()
                seen[how] = (await call.code(), await call.details())
            servicer.closed.clear()
            call = stub.StepStream()
            await call.write(_step("wait"))
            await call.read()
            call.cancel()                      # the handler's clean-up still runs
            await asyncio.wait_for(servicer.closed.wait(), 5)
        return seen

    with capture_logs() as logs:
        seen = asyncio.run(scenario())
    code, details = seen["unary"]
    assert code == grpc.StatusCode.INTERNAL
    assert "/ddtree.v1.Draft/GetModelInfo (ValueError)" in details and "2147483664" not in details
    code, details = seen["raise"]
    assert code == grpc.StatusCode.INTERNAL and "(KeyError)" in details and "secret" not in details
    assert seen["abort"] == (grpc.StatusCode.FAILED_PRECONDITION, "its own status")
    failed = [e for e in logs if e["event"] == "handler_failed"]
    assert [e["method"] for e in failed] == ["/ddtree.v1.Draft/GetModelInfo", "/ddtree.v1.Draft/StepStream"]
    assert "Value out of range: 2147483664" in failed[0]["error"] and "secret-internal-detail" in failed[1]["error"]
    assert all("Traceback" in e["traceback"] and e["log_level"] == "error" for e in failed)


class Wrapping(Faulty):
    """A handler that wraps what it meets in an exception of its own."""

    async def StepStream(self, request_iterator, context):
        try:
            async for response in super().StepStream(request_iterator, context):
                yield response
        except Exception as exc:
            raise RuntimeError("the step stream broke") from exc


class FailingCleanUp(Faulty):
    """A handler whose clean-up fails (a bug) while a bad message unwinds it."""

    async def StepStream(self, request_iterator, context):
        try:
            async for response in super().StepStream(request_iterator, context):
                yield response
        finally:
            {}["clean-up bug"]


@pytest.mark.parametrize("servicer_type", [Faulty, Wrapping])
def test_a_stream_message_that_does_not_parse_ends_the_call_invalid_argument_without_a_traceback(servicer_type) -> None:
    """Met by the handler as it reads (after a good message here): a client's bad bytes, not a bug.
    It ended INTERNAL with a traceback logged, a call at a time (reflection is a stream on the
    public port)."""
    async def scenario() -> tuple:
        servicer = servicer_type()
        async with _serving(servicer) as channel:
            call = channel.stream_stream("/ddtree.v1.Draft/StepStream")()   # bytes as they are
            await call.write(_step("wait").SerializeToString())
            first = draft_pb2.StepResponse.FromString(await call.read())
            await call.write(b"\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
            await asyncio.wait_for(servicer.closed.wait(), 5)   # its clean-up ran
            return first, await call.code(), await call.details()

    with capture_logs() as logs:
        first, code, details = asyncio.run(scenario())
    assert first == draft_pb2.StepResponse()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("the request does not parse as the message /ddtree.v1.Draft/StepStream takes")
    assert not [e for e in logs if e["event"] == "handler_failed"]
    (said,) = [e for e in logs if e["event"] == "requests_unparsed"]   # one line, no traceback
    assert (said["method"], said["calls"], said["log_level"]) == ("/ddtree.v1.Draft/StepStream", 1, "warning")


def test_a_handlers_own_failure_while_a_bad_message_unwinds_it_is_still_a_bug() -> None:
    """Raised during (not from) the parse failure: INTERNAL and its traceback, not the client's
    INVALID_ARGUMENT with nothing logged."""
    async def scenario() -> tuple:
        async with _serving(FailingCleanUp()) as channel:
            call = channel.stream_stream("/ddtree.v1.Draft/StepStream")()
            await call.write(b"\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
            return await call.code(), await call.details()

    with capture_logs() as logs:
        code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.INTERNAL and "(KeyError)" in details, details
    (failed,) = [e for e in logs if e["event"] == "handler_failed"]
    assert "clean-up bug" in failed["error"] and "Traceback" in failed["traceback"]


def test_a_sync_handler_stays_sync_and_an_async_one_async() -> None:
    """gRPC runs a handler by its kind: a sync one in its thread pool with a sync context (the
    library's sync health servicer's Watch needs that context's add_callback; run as a coroutine
    it failed)."""
    class Details:
        method = "/grpc.health.v1.Health/Watch"
        invocation_metadata = ()

    def wrapped(handler):
        async def continuation(details):
            return handler
        return asyncio.run(CallErrorInterceptor().intercept_service(continuation, Details()))

    watch = wrapped(grpc.unary_stream_rpc_method_handler(health.HealthServicer().Watch,
                                                         health_pb2.HealthCheckRequest.FromString))
    assert not inspect.iscoroutinefunction(watch.unary_stream) and not inspect.isasyncgenfunction(watch.unary_stream)
    step = wrapped(grpc.stream_stream_rpc_method_handler(Faulty().StepStream))
    assert inspect.isasyncgenfunction(step.stream_stream)
    info = wrapped(grpc.unary_unary_rpc_method_handler(Faulty().GetModelInfo))
    assert inspect.iscoroutinefunction(info.unary_unary)


class RaisesKeyError(Faulty):
    async def GetModelInfo(self, request, context):
        raise KeyError("secret-internal-detail")


def test_a_unary_handlers_exception_of_any_type_ends_the_call_internal_and_is_logged() -> None:
    """Not only a ValueError: a rule that caught too narrow a type would let gRPC end the call
    UNKNOWN with nothing in the log."""
    async def scenario() -> tuple:
        async with _serving(RaisesKeyError()) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await draft_pb2_grpc.DraftStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest())
            return info.value.code(), info.value.details()

    with capture_logs() as logs:
        code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.INTERNAL, details
    assert "/ddtree.v1.Draft/GetModelInfo (KeyError)" in details and "secret" not in details
    (failed,) = [e for e in logs if e["event"] == "handler_failed"]
    assert failed["method"] == "/ddtree.v1.Draft/GetModelInfo" and "secret-internal-detail" in failed["error"]


def test_an_unknown_method_is_unimplemented() -> None:
    """A client of another version reads UNIMPLEMENTED as such; an interceptor that wrapped the
    missing handler anyway would fail inside gRPC and answer UNKNOWN."""
    async def scenario() -> grpc.StatusCode:
        async with _serving(Faulty()) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/ddtree.v1.Draft/NoSuchMethod")(b"", timeout=5)
            return info.value.code()

    assert asyncio.run(scenario()) == grpc.StatusCode.UNIMPLEMENTED


def test_requests_that_do_not_parse_are_logged_once_a_minute_not_once_a_call() -> None:
    """Anyone may send bytes that do not parse to a public port: each call is refused, but without
    the rate limit every such call would write a log line and fill the log."""
    async def scenario() -> list:
        codes = []
        async with _serving(Faulty()) as channel:
            for _ in range(3):
                call = channel.stream_stream("/ddtree.v1.Draft/StepStream")()
                await call.write(b"\xff\xff")
                with pytest.raises(grpc.aio.AioRpcError):
                    await call.read()
                codes.append(await call.code())
        return codes

    with capture_logs() as logs:
        codes = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    said = [e for e in logs if e["event"] == "requests_unparsed"]
    assert len(said) == 1 and said[0]["calls"] == 1, said


def test_reflection_lists_the_servers_own_services() -> None:
    """grpcurl's `list` names them beside health; a server that left its own services out of
    reflection would list only health and reflection."""
    async def scenario() -> set:
        async with _serving(Faulty()) as channel:
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for response in call:
                return {s.name for s in response.list_services_response.service}
        return set()

    assert {draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name, "grpc.health.v1.Health"} <= asyncio.run(scenario())
