"""The scheduler's step stream: many steps on one stream; a failed step closes it with the code the
lane acts on, and the next step opens another."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from structlog.testing import capture_logs

from ddtree.v1 import draft_pb2, draft_pb2_grpc
from services.common.grpc_server import IdleStreams, ServiceError
from services.draft.server import DraftServicer, _said_after_stream_end
from services.scheduler.draft_link import DraftLink, StepFailed
from tests.test_batcher import until


class Draft(draft_pb2_grpc.DraftServicer):
    """Echoes each item as one token; item "fail" aborts the stream, item "slow" takes 2 s."""

    def __init__(self) -> None:
        self.streams = 0

    async def StepStream(self, request_iterator, context):
        self.streams += 1
        async for request in request_iterator:
            ids = [i.request_id for i in request.items]
            if "fail" in ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad step")
            if "slow" in ids:
                await asyncio.sleep(2)
            yield draft_pb2.StepResponse(results=[draft_pb2.StepResult(request_id=i, token_ids=[len(i)])
                                                  for i in ids])


def step(*ids: str) -> draft_pb2.StepRequest:
    return draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id=i) for i in ids])


class QuietEngine:
    """A draft engine's interface to `DraftServicer` with nothing behind it; tests override `step`."""

    def run_ahead(self) -> None:
        pass

    async def end_stream(self, owner) -> None:
        pass


@contextlib.asynccontextmanager
async def served_draft(engine) -> AsyncIterator[tuple[DraftServicer, grpc.aio.Channel]]:
    """A `DraftServicer` over ``engine`` on a real port, and a channel to it; both closed after."""
    servicer = DraftServicer(engine)
    server = grpc.aio.server()
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel
    finally:
        await channel.close()
        await server.stop(0)


def test_steps_share_a_stream_and_a_failure_opens_a_new_one():
    async def run():
        servicer = Draft()
        server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = DraftLink(draft_pb2_grpc.DraftStub(channel))
        try:
            for n in range(5):
                resp = await link.step(step("a", "bb" * n), timeout=5)
                assert [list(r.token_ids) for r in resp.results] == [[1], [2 * n]]
            assert servicer.streams == 1
            with pytest.raises(StepFailed) as failed:
                await link.step(step("fail"), timeout=5)
            assert failed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "bad step" in failed.value.details
            resp = await link.step(step("ccc"), timeout=5)
            assert list(resp.results[0].token_ids) == [3] and servicer.streams == 2
            with pytest.raises(StepFailed) as failed:
                await link.step(step("slow"), timeout=0.2)
            assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            resp = await link.step(step("dddd"), timeout=5)
            assert list(resp.results[0].token_ids) == [4] and servicer.streams == 3
        finally:
            link.close()
            await channel.close()
            await server.stop(0)
    asyncio.run(run())


def test_a_draft_that_goes_away_is_unavailable_and_one_that_came_back_answers():
    async def serve(port: int = 0) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(Draft(), server)
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, port

    async def run():
        server, port = await serve()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.initial_reconnect_backoff_ms", 100),
                                                                            ("grpc.max_reconnect_backoff_ms", 200)])
        link = DraftLink(draft_pb2_grpc.DraftStub(channel))
        try:
            await link.step(step("a"), timeout=5)
            stopping = asyncio.ensure_future(server.stop(1))
            await asyncio.sleep(0.2)   # the step below reaches a server that is going away
            with pytest.raises(StepFailed) as failed:
                await link.step(step("slow"), timeout=5)
            assert failed.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert failed.value.delivered   # its stream was open: the step may have reached the draft
            await stopping
            # Back between two steps, on the same address: a step of running requests fails, for
            # the draft let go of what the ended stream admitted; the next opens a stream and is answered.
            server, _ = await serve(port)
            await link.step(step("a"), timeout=5)
            await server.stop(0)
            await asyncio.sleep(0.3)
            server, _ = await serve(port)
            with pytest.raises(StepFailed) as failed:
                await link.step(step("bb"), timeout=5)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "between steps" in failed.value.details
            resp = await link.step(step("bb"), timeout=5)
            assert list(resp.results[0].token_ids) == [2]
            new_prompt = draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="p", prompt_token_ids=[1, 2])])
            await server.stop(0)
            await asyncio.sleep(0.3)
            server, _ = await serve(port)
            assert (await link.step(new_prompt, timeout=5)).results[0].request_id == "p"   # new prompts only: a new stream
            await server.stop(0)
        finally:
            link.close()
            await channel.close()
    asyncio.run(run())


class _EndingCall:
    """A stream call that ends as it is written to: the write raises ``error``; the call's own
    end says ``end`` (UNAVAILABLE unless given)."""

    def __init__(self, error: BaseException, end: tuple[grpc.StatusCode, str] | None = None) -> None:
        self.error = error
        self.end = end or (grpc.StatusCode.UNAVAILABLE, "draft going away")
        self.cancelled = False

    def done(self) -> bool:
        return False

    async def write(self, request) -> None:
        raise self.error

    async def code(self) -> grpc.StatusCode:
        return self.end[0]

    async def details(self) -> str:
        return self.end[1]

    def cancel(self) -> None:
        self.cancelled = True


_CORE = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                             "Internal error from Core")


class _NoSocketStub:
    """A stub of a draft that offers no step socket: its streams open on gRPC (`StepStream`)."""

    async def OpenStepSocket(self, request, metadata=()):  # noqa: N802 - the gRPC method name
        return draft_pb2.StepSocketOffer()


@pytest.mark.parametrize("error, end", [
    (asyncio.InvalidStateError("RPC already finished"), None),
    (_CORE, None),
    # A draft killed mid-step: the call's own end said gRPC core's INTERNAL too, which failed the
    # request INTERNAL (a flaky CI failure of test_replicas) where a replica that went is UNAVAILABLE.
    (_CORE, (grpc.StatusCode.INTERNAL, "Internal error from Core")),
])
def test_a_stream_ending_under_a_write_fails_the_step_as_unavailable(error, end):
    class Stub(_NoSocketStub):
        def __init__(self) -> None:
            self.calls: list[_EndingCall] = []

        def StepStream(self, metadata=()):  # noqa: N802 - the gRPC method name
            self.calls.append(_EndingCall(error, end))
            return self.calls[-1]

    async def run():
        stub = Stub()
        link = DraftLink(stub)   # type: ignore[arg-type]
        for _ in range(2):
            with pytest.raises(StepFailed) as failed:
                await link.step(step("a"), timeout=5)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE   # the lane marks the replica down
        assert len(stub.calls) == 2 and all(c.cancelled for c in stub.calls)   # closed, then a new one
    asyncio.run(run())


def test_a_stopping_draft_ends_idle_step_streams_and_finishes_the_step_in_flight():
    class Engine(QuietEngine):
        async def step(self, request, owner=0):
            await asyncio.sleep(0.3 if request.items[0].request_id == "slow" else 0)
            return draft_pb2.StepResponse(results=[draft_pb2.StepResult(request_id=request.items[0].request_id)])

    async def run():
        async with served_draft(Engine()) as (servicer, channel):
            busy, idle = DraftLink(draft_pb2_grpc.DraftStub(channel)), DraftLink(draft_pb2_grpc.DraftStub(channel))
            try:
                await idle.step(step("a"), timeout=5)
                in_flight = asyncio.ensure_future(busy.step(step("slow"), timeout=5))
                await asyncio.sleep(0.1)
                servicer.end_idle_streams()
                # The idle stream ends at once (its lane would mark this replica down at its next step)...
                assert await asyncio.wait_for(idle._call.code(), 2) == grpc.StatusCode.OK
                # ...while the step in flight is answered.
                assert (await in_flight).results[0].request_id == "slow"
                # ...and then its stream ends too.
                assert await asyncio.wait_for(busy._call.code(), 2) == grpc.StatusCode.OK
            finally:
                busy.close()
                idle.close()
    asyncio.run(run())


def test_a_step_runs_to_its_end_when_the_scheduler_gives_up_on_its_stream():
    """The scheduler cancels a stream whose step outlasts its timeout; the step itself must finish
    (it holds the engine's state), or the next step would start beside a half-done one."""
    started, release, finished = asyncio.Event(), asyncio.Event(), []

    class Engine(QuietEngine):
        async def step(self, request, owner=0):
            started.set()
            await release.wait()
            finished.append(request.items[0].request_id)
            return draft_pb2.StepResponse()

    async def run():
        async with served_draft(Engine()) as (_, channel):
            link = DraftLink(draft_pb2_grpc.DraftStub(channel))
            try:
                with pytest.raises(StepFailed):
                    await link.step(step("slow"), timeout=0.3)   # the stream is cancelled mid-step
                assert started.is_set() and finished == []
                await asyncio.sleep(0.1)
                release.set()
                await until(lambda: finished, within_s=1.0)
                return finished
            finally:
                link.close()
    assert asyncio.run(run()) == ["slow"]


def test_a_step_that_fails_after_the_scheduler_gave_up_on_its_stream_is_logged_not_left_to_asyncio():
    """Its error reached no one: asyncio printed "Task exception was never retrieved" with a plain
    traceback (outside the JSON logs) when the task was collected. It is a log event instead."""
    started, release = asyncio.Event(), asyncio.Event()

    class Engine(QuietEngine):
        async def step(self, request, owner=0):
            started.set()
            await release.wait()
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the verifier answered no step within 12 s")

    unretrieved: list[dict] = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        async with served_draft(Engine()) as (_, channel):
            link = DraftLink(draft_pb2_grpc.DraftStub(channel))
            try:
                with pytest.raises(StepFailed):
                    await link.step(step("slow"), timeout=0.3)   # the stream is cancelled mid-step
                assert started.is_set()
                await asyncio.sleep(0.1)
                release.set()
                await asyncio.sleep(0.2)
                gc.collect()
            finally:
                link.close()

    with capture_logs() as logs:
        asyncio.run(run())
    gc.collect()
    assert not [c for c in unretrieved if "never retrieved" in c.get("message", "")], unretrieved
    said = [e for e in logs if e["event"] == "step_failed_after_stream_ended"]
    assert [(e["error"], e["log_level"]) for e in said] == [("the verifier answered no step within 12 s", "warning")]


def test_the_draft_runs_its_work_ahead_after_each_answer_before_the_next_step():
    """The context commit and next trees (`DraftEngine.run_ahead`) run once the answer has gone
    out, and before the next step on the stream starts."""
    events: list[str] = []

    class Engine:
        async def step(self, request, owner=0):
            events.append(f"step {request.items[0].request_id}")
            return draft_pb2.StepResponse(results=[draft_pb2.StepResult(request_id=request.items[0].request_id)])

        def run_ahead(self) -> None:
            events.append("ahead")

        async def end_stream(self, owner) -> None:
            events.append("end")

    async def run():
        async with served_draft(Engine()) as (_, channel):
            link = DraftLink(draft_pb2_grpc.DraftStub(channel))
            try:
                for rid in "abc":
                    assert (await link.step(step(rid), timeout=5)).results[0].request_id == rid
                for _ in range(100):   # the last answer's work runs after the answer left
                    if len(events) == 6:
                        break
                    await asyncio.sleep(0.01)
            finally:
                link.close()
    asyncio.run(run())
    assert events == ["step a", "ahead", "step b", "ahead", "step c", "ahead", "end"]


def test_idle_streams_end_waits_at_once_and_leave_no_pending_cancel():
    """`IdleStreams.end` cancels the handlers waiting for a message; each takes the cancel back, so
    nothing later in its task (a timeout, a shielded clean-up) reads it as still pending."""
    async def run():
        idle, gate = IdleStreams(), asyncio.Queue()

        async def messages():
            while True:
                yield await gate.get()

        async def handler():
            got, stream = [], messages()
            while (msg := await idle.next(stream)) is not None:
                got.append(msg)
            await asyncio.sleep(0)   # a pending cancel would raise here
            return got, asyncio.current_task().cancelling()
        task = asyncio.ensure_future(handler())
        await gate.put("a")
        await asyncio.sleep(0.05)
        idle.end()
        assert await idle.next(messages()) is None   # a stream opened after the stop ends at once
        return await asyncio.wait_for(task, 2)
    assert asyncio.run(run()) == (["a"], 0)


def test_idle_streams_next_returns_none_at_a_streams_end() -> None:
    """A stream that ended (its caller closed it) is None to the handler, as a stop is: not a
    StopAsyncIteration raised inside the handler's own generator."""
    async def run() -> list:
        async def two():
            yield 1
            yield 2
        it = two().__aiter__()
        idle = IdleStreams()
        return [await idle.next(it), await idle.next(it), await idle.next(it)]
    assert asyncio.run(run()) == [1, 2, None]


def test_a_step_whose_new_stream_finds_no_connection_was_not_delivered():
    """A replica that died before its lane marked it down: the step reached nothing, which the
    lane's requests new in that step may be refused as (`StepFailed.delivered`); one that broke on
    a stream that was open reached the replica, which may have died of it."""
    async def run():
        with socket.socket() as held:   # a port nothing listens on
            held.bind(("127.0.0.1", 0))
            port = held.getsockname()[1]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = DraftLink(draft_pb2_grpc.DraftStub(channel))
        try:
            with pytest.raises(StepFailed) as failed:
                await link.step(step("p"), timeout=5)
        finally:
            link.close()
            await channel.close()
        return failed.value
    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.UNAVAILABLE and not failed.delivered, failed.details
    assert StepFailed(grpc.StatusCode.UNAVAILABLE, "the step stream's connection broke").delivered


class _AbortsUnavailable(draft_pb2_grpc.DraftServicer):
    """Answers ``answered`` steps, then aborts its stream UNAVAILABLE with ``details``."""

    def __init__(self, answered: int, details: str) -> None:
        self.answered, self.details = answered, details

    async def StepStream(self, request_iterator, context):
        n = 0
        async for request in request_iterator:
            if n == self.answered:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.details)
            n += 1
            yield draft_pb2.StepResponse(results=[draft_pb2.StepResult(request_id=i.request_id, token_ids=[1])
                                                  for i in request.items])


@pytest.mark.parametrize("answered, details", [
    (0, "verifier stream broke: Socket closed"),   # a new stream the draft itself failed
    (1, "verifier stream broke: failed to connect to all addresses; last error: x"),   # an open one, gRPC's words
])
def test_a_step_the_draft_answered_unavailable_was_delivered(answered, details):
    """Only gRPC's own "no connection" on a stream opened for the step means the step reached no
    replica. A draft that failed the step itself (on a new stream or an open one, whatever words
    it passes on) had the prompts: refused as unsent, wait_for_ready clients would send again a
    prompt that may have killed the replica."""
    async def run():
        server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(_AbortsUnavailable(answered, details), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = DraftLink(draft_pb2_grpc.DraftStub(channel))
        prompt = draft_pb2.StepRequest(items=[draft_pb2.StepItem(request_id="p", prompt_token_ids=[1, 2])])
        try:
            for _ in range(answered):
                await link.step(prompt, timeout=5)
            with pytest.raises(StepFailed) as failed:
                await link.step(prompt, timeout=5)
        finally:
            link.close()
            await channel.close()
            await server.stop(0)
        return failed.value
    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.UNAVAILABLE and failed.details == details and failed.delivered


class _AnsweringCall:
    """A stream call that answers each write with ``answer`` (an empty StepResponse unless given;
    grpc.aio.EOF: the draft ended the stream); ``ended`` makes it done between steps."""

    def __init__(self, answer=None) -> None:
        self.answer = answer if answer is not None else draft_pb2.StepResponse()
        self.ended, self.cancelled, self.written = False, False, []

    def done(self) -> bool:
        return self.ended

    async def write(self, request) -> None:
        self.written.append(request)

    async def read(self):
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class _CallsStub(_NoSocketStub):
    """Hands out the given calls in order, then answering ones."""

    def __init__(self, *calls) -> None:
        self.script, self.calls = list(calls), []

    def StepStream(self, metadata=()):  # noqa: N802 - the gRPC method name
        self.calls.append(self.script.pop(0) if self.script else _AnsweringCall())
        return self.calls[-1]


def _item(rid: str, prompt=(), offset: int = 0) -> draft_pb2.StepItem:
    return draft_pb2.StepItem(request_id=rid, prompt_token_ids=list(prompt), prompt_offset=offset)


def test_a_step_naming_any_request_of_an_ended_stream_fails_between_steps():
    """The stream ended between steps: a step of a new prompt beside a running request, or a later
    piece of a long prompt (offset > 0), names requests whose draft state went with the stream. It
    fails UNAVAILABLE without reaching a new stream (it would have met "unknown request" there);
    a step of new prompts only opens one."""

    async def run():
        stub = _CallsStub()
        link = DraftLink(stub)   # type: ignore[arg-type]
        await link.step(step("a"), timeout=5)
        for request in (draft_pb2.StepRequest(items=[_item("p", [1, 2]), _item("a")]),
                        draft_pb2.StepRequest(items=[_item("q", [3, 4], offset=5)])):
            stub.calls[-1].ended = True
            opened = len(stub.calls)
            with pytest.raises(StepFailed) as failed:
                await link.step(request, timeout=5)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "between steps" in failed.value.details
            assert len(stub.calls) == opened and not failed.value.delivered   # sent nowhere: its new prompts are refused
            await link.step(draft_pb2.StepRequest(items=[_item("n", [5])]), timeout=5)
            assert len(stub.calls) == opened + 1 and stub.calls[-1].written
    asyncio.run(run())


def test_a_draft_that_ends_the_stream_instead_of_answering_fails_the_step_and_the_next_opens_a_new_one():
    """grpc.aio.EOF for an answer is no StepResponse: the step fails UNAVAILABLE, the ended call is
    let go of, and the next step goes on a new stream."""
    prompt = draft_pb2.StepRequest(items=[_item("p", [1])])

    async def run():
        stub = _CallsStub(_AnsweringCall(answer=grpc.aio.EOF))
        link = DraftLink(stub)   # type: ignore[arg-type]
        with pytest.raises(StepFailed) as failed:
            await link.step(prompt, timeout=5)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "ended the step stream" in failed.value.details
        assert isinstance(await link.step(prompt, timeout=5), draft_pb2.StepResponse)
        assert len(stub.calls) == 2 and stub.calls[0].cancelled and stub.calls[1].written
    asyncio.run(run())


@pytest.mark.parametrize("error, end, told", [
    # A write failed INTERNAL on a stream that is ending: the call's own end is what the lane is told.
    (grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "write failed"),
     (grpc.StatusCode.RESOURCE_EXHAUSTED, "draft is full"), (grpc.StatusCode.RESOURCE_EXHAUSTED, "draft is full")),
    # An error without details is named by its code, never an empty message.
    (grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), ""),
     (grpc.StatusCode.UNAVAILABLE, ""), (grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE")),
])
def test_a_failed_write_tells_the_lane_why_the_stream_ended(error, end, told):
    async def run() -> StepFailed:
        link = DraftLink(_CallsStub(_EndingCall(error, end)))   # type: ignore[arg-type]
        with pytest.raises(StepFailed) as failed:
            await link.step(step("a"), timeout=5)
        return failed.value
    failed = asyncio.run(run())
    assert (failed.code, failed.details) == told


def test_a_refused_step_reaches_the_scheduler_with_its_code_and_message():
    """A step the engine refuses (ServiceError) ends the stream with that status and its words:
    the scheduler names them to its clients."""
    class Engine(QuietEngine):
        async def step(self, request, owner=0):
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the verifier's vocab_size=301 is not 300")

    async def run():
        async with served_draft(Engine()) as (_, channel):
            link = DraftLink(draft_pb2_grpc.DraftStub(channel))
            try:
                with pytest.raises(StepFailed) as failed:
                    await link.step(step("a"), timeout=5)
                return failed.value
            finally:
                link.close()
    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "the verifier's vocab_size=301 is not 300" in failed.details


def test_a_step_that_ended_after_its_stream_is_logged_by_its_type_when_wordless_and_not_when_cancelled():
    """A step cancelled (the loop shutting down) is no failure and must not raise in its done
    callback (asyncio would print "Exception in callback"); an exception without a message is
    named by its type, not logged as an empty error."""
    async def run():
        loop = asyncio.get_running_loop()
        cancelled, wordless = loop.create_future(), loop.create_future()
        cancelled.cancel()
        wordless.set_exception(TimeoutError())
        _said_after_stream_end(cancelled)
        _said_after_stream_end(wordless)

    with capture_logs() as logs:
        asyncio.run(run())
    assert [(e["event"], e["error"], e["log_level"]) for e in logs] == [
        ("step_failed_after_stream_ended", "TimeoutError", "warning")]


def test_a_stream_clean_up_runs_to_its_end_when_the_handler_is_cancelled_again():
    """An ended step stream's clean-up (`end_stream`: its requests go, here and at the verifier)
    is shielded: a second cancel of the handler (the server stopping while the clean-up waits for
    the engine's lock) must not abandon it half-way, leaving the requests and their KV pages held."""
    gate, entered, ended = asyncio.Event(), asyncio.Event(), []

    class Engine(QuietEngine):
        async def step(self, request, owner=0):
            return draft_pb2.StepResponse()

        async def end_stream(self, owner) -> None:
            entered.set()
            await gate.wait()   # as behind the engine's lock, held by another stream's step
            ended.append(owner)

    async def run():
        server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(Engine()), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = DraftLink(draft_pb2_grpc.DraftStub(channel))
        try:
            await link.step(step("a"), timeout=5)
            link.close()                                # the scheduler ends its stream
            await asyncio.wait_for(entered.wait(), 2)   # its clean-up waits
            await server.stop(0)                        # and the server stops under it
            gate.set()
            await until(lambda: ended, within_s=1.0)
            return ended
        finally:
            await channel.close()
    assert asyncio.run(run()) == [1]
