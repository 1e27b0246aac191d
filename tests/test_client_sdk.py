"""The client SDK (`Client`, `AsyncClient`) against a real scheduler server: the public gRPC server with
the SchedulerServicer, in front of one lane to a fake draft, on the CPU in a thread of its own.

A stream kept in a variable and left is cancelled on the server when its `with` block exits or it is
closed (a generator held in a variable ran on to max_tokens until it was collected); the TLS
arguments are checked when the client is made; `stream` and `generate` take typed keyword arguments,
checked at the call; `abort` is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import contextlib
import dataclasses
import inspect
import math
import subprocess
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, draft_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.auth import BearerTokenInterceptor
from services.common.grpc_server import ServiceError, new_server
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler import client as sdk
from services.scheduler.batcher import KvBudget, StepLoop
from services.scheduler.client import AsyncClient, Client, ClientError, build_request
from services.scheduler.request import ActiveRequest, Limits
from services.scheduler.router import Router
from services.scheduler.server import SchedulerServicer
from tokenizers import Tokenizer

IDS = [1, 2, 3]                                            # the server has no tokenizer: token-id prompts
LONG = dict(max_tokens=4000, ignore_eos=True)              # ~20 s of 5 ms steps: runs until it is ended
ABORTED = scheduler_pb2.FINISH_REASON_ABORTED


class Draft:
    """Every step in flight for 5 ms, a token a request."""

    async def step(self, req, timeout):
        await asyncio.sleep(0.005)
        return draft_pb2.StepResponse(results=[draft_pb2.StepResult(
            request_id=i.request_id, token_ids=[5], acceptance_length=0 if i.prompt_token_ids else 1)
            for i in req.items])

    def close(self) -> None:
        pass


class Server:
    """The scheduler's public server as `serve` builds it, in front of one lane to `Draft`, on an
    event loop in a thread of its own, so that sync and asyncio clients alike reach it."""

    def __init__(self, tokenizer: Tokenizer | None = None, encoder: object | None = None, token: str = "") -> None:
        self.tokenizer, self.encoder, self.token = tokenizer, encoder, token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.submitted: list[str] = []     # request ids that reached the router
        self.address = self.call(self._start())

    async def _start(self) -> str:
        settings = SchedulerSettings(tokenizer_path="")
        self.router = Router(settings, Metrics(f"client-sdk-test-{id(self)}"))
        vocab = 64 if self.tokenizer is None else self.tokenizer.get_vocab_size()
        self.router.info = common_pb2.ModelInfo(vocab_size=vocab, max_context=4096, block_size=16,
                                                kv_capacity_tokens=10_000)
        limits = Limits(vocab_size=vocab, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000)
        lane = StepLoop(settings, "draft", Draft(), limits, KvBudget(capacity=10_000), self.router.metrics)
        lane.start()
        self.router.lanes.append(lane)
        submit = self.router.submit

        def recorded(req: ActiveRequest) -> None:
            self.submitted.append(req.request_id)
            submit(req)
        self.router.submit = recorded
        name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
        servicer = self.servicer = SchedulerServicer(settings, self.router, self.router.info, self.tokenizer, self.encoder)
        interceptors = [BearerTokenInterceptor(self.token, on_refused=servicer.unauthenticated)] if self.token else []
        self.server, _ = new_server([name], interceptors, max_receive_bytes=2 * settings.max_request_bytes,
                                    on_unparsed=servicer.unparsed)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def request(self, request_id: str) -> ActiveRequest | None:
        """The server's request with this id, running or queued (read on the server's loop)."""
        async def find() -> ActiveRequest | None:
            for lane in self.router.lanes:
                found = lane.find(request_id) or next((r for r in lane.waiting if r.request_id == request_id), None)
                if found is not None:
                    return found
            return None
        return self.call(find())

    @staticmethod
    def ended_aborted(req: ActiveRequest, within_s: float = 1.0) -> bool:
        """Whether the request ends aborted within `within_s` (its steps are 5 ms apart)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if req.finish == ABORTED:
                return True
            time.sleep(0.01)
        return req.finish == ABORTED

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server's event loop blocked, as in a process that stopped answering: connections are
        taken (gRPC's core threads) but no call is answered."""
        blocked, release = threading.Event(), threading.Event()

        def block() -> None:
            blocked.set()
            release.wait(30)
        self.loop.call_soon_threadsafe(block)
        assert blocked.wait(5)
        try:
            yield
        finally:
            release.set()

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.call(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    try:
        yield s
    finally:
        s.stop()


def running(server: Server, request_id: str) -> ActiveRequest:
    req = server.request(request_id)
    assert req is not None and not req.done, f"{request_id} is not running on the server"
    return req


# 1. A stream left early is cancelled on the server.

def test_a_sync_stream_kept_in_a_variable_is_cancelled_when_its_with_block_exits_or_it_is_closed(server) -> None:
    with Client(server.address) as c:
        with c.stream(IDS, request_id="sync-with", **LONG) as s:
            assert iter(s) is s and isinstance(s, collections.abc.Iterator)
            for _ in s:
                break
            req = running(server, "sync-with")
            time.sleep(0.2)
            assert not req.done         # held in `s`: `break` alone does not end it
        assert server.ended_aborted(req)  # the block's exit did, `s` still held
        assert list(s) == []            # a closed stream ends at once

        kept = c.stream(IDS, request_id="sync-close", **LONG)
        next(kept)
        req = running(server, "sync-close")
        kept.close()
        assert server.ended_aborted(req)
        assert list(kept) == []

        with pytest.raises(RuntimeError):   # an exception leaving the block ends the request too
            with c.stream(IDS, request_id="sync-raise", **LONG) as s:
                next(s)
                req = running(server, "sync-raise")
                raise RuntimeError
        assert server.ended_aborted(req)

        for _ in c.stream(IDS, request_id="sync-inline", **LONG):   # inline: `break` still ends it
            req = running(server, "sync-inline")
            break
        assert server.ended_aborted(req)
        assert c.generate(IDS, max_tokens=3, ignore_eos=True).token_ids == [5, 5, 5]   # read to its end


def test_a_request_whose_deadline_passes_is_counted_and_logged_as_that_not_as_an_abort(server) -> None:
    """A client's deadline ended its request as a deliberate abort did: `aborted` in the metric and
    the log alike. Now `deadline_exceeded`, and `request_end` carries the metric's label."""
    statuses = server.router.metrics.requests
    before = {s: statuses.labels(s)._value.get() for s in ("aborted", "deadline_exceeded")}
    with capture_logs() as logs, Client(server.address) as c:
        with pytest.raises(ClientError) as late:
            c.generate(IDS, request_id="late", timeout_s=0.2, **LONG)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with c.stream(IDS, request_id="left", **LONG) as s:
            next(s)
            req = running(server, "left")
        assert server.ended_aborted(req)
        with c.stream(IDS, request_id="called", **LONG) as s:
            next(s)
            assert c.abort("called", timeout_s=5)
            assert [m.finish_reason for m in s][-1] == "aborted"
        for _ in range(100):
            if statuses.labels("deadline_exceeded")._value.get() > before["deadline_exceeded"] and \
                    statuses.labels("aborted")._value.get() >= before["aborted"] + 2:
                break
            time.sleep(0.01)
    assert statuses.labels("deadline_exceeded")._value.get() == before["deadline_exceeded"] + 1
    assert statuses.labels("aborted")._value.get() == before["aborted"] + 2
    ends = {e["request_id"]: e for e in logs if e.get("event") == "request_end"}
    assert ends["late"]["status"] == "deadline_exceeded" and ends["late"]["code"] == "DEADLINE_EXCEEDED"
    assert ends["left"]["status"] == "aborted" and ends["left"]["finish"] == "FINISH_REASON_ABORTED"
    # Both aborted, told apart in the log: a client that left, an Abort call.
    assert (ends["left"]["aborted_by"], ends["called"]["aborted_by"], ends["late"]["aborted_by"]) == \
        ("client_left", "abort_call", None)
    assert ends["late"]["log_level"] == ends["left"]["log_level"] == "info"   # the client's choices, no fault


def test_an_async_stream_kept_in_a_variable_is_cancelled_when_its_with_block_exits_or_it_is_closed(server) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.address) as c:
            async with c.stream(IDS, request_id="async-with", **LONG) as s:
                assert s.__aiter__() is s and isinstance(s, collections.abc.AsyncIterator)
                async for _ in s:
                    break
                req = await asyncio.to_thread(running, server, "async-with")
                await asyncio.sleep(0.2)
                assert not req.done
            assert await asyncio.to_thread(server.ended_aborted, req)
            assert [chunk async for chunk in s] == []

            kept = c.stream(IDS, request_id="async-close", **LONG)
            await kept.__anext__()
            req = await asyncio.to_thread(running, server, "async-close")
            await kept.aclose()
            assert await asyncio.to_thread(server.ended_aborted, req)
            assert [chunk async for chunk in kept] == []

            async for _ in c.stream(IDS, request_id="async-inline", **LONG):
                req = await asyncio.to_thread(running, server, "async-inline")
                break
            assert await asyncio.to_thread(server.ended_aborted, req)

            # A task cancelled while it reads ends its request too.
            async def read_forever() -> None:
                async for _ in c.stream(IDS, request_id="async-task", **LONG):
                    pass
            task = asyncio.create_task(read_forever())
            while (req := await asyncio.to_thread(server.request, "async-task")) is None:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(server.ended_aborted, req)
            assert (await c.generate(IDS, max_tokens=3, ignore_eos=True)).token_ids == [5, 5, 5]

    asyncio.run(scenario())


def test_closing_an_async_client_under_open_streams_is_a_client_error_in_each_reader(server) -> None:
    """The readers got a bare CancelledError, as if their tasks had been cancelled (`except
    ClientError` missed it, and gather / TaskGroup took it for a cancellation); `Client` says
    CANCELLED."""
    async def scenario() -> list[object]:
        c = AsyncClient(server.address)

        async def read() -> None:
            async for _ in c.stream(IDS, request_id="closed-under", **LONG):
                pass
        readers = [asyncio.create_task(read()), asyncio.create_task(c.generate(IDS, **LONG))]
        while await asyncio.to_thread(server.request, "closed-under") is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await c.close()
        return await asyncio.gather(*readers, return_exceptions=True)

    for outcome in asyncio.run(scenario()):
        assert isinstance(outcome, ClientError) and outcome.code == grpc.StatusCode.CANCELLED, repr(outcome)


def test_a_cancelled_read_of_an_async_stream_makes_later_reads_fail_not_end(server) -> None:
    """An idle timeout (``wait_for`` on one read) cancels the read and, with it, the request; the
    next read ended the loop as if the output were whole (1 of 400 tokens, no finish_reason)."""
    async def scenario() -> None:
        async with AsyncClient(server.address) as c:
            s = c.stream(IDS, request_id="read-timeout", **LONG)
            await s.__anext__()
            req = await asyncio.to_thread(running, server, "read-timeout")
            with pytest.raises(asyncio.TimeoutError):
                while True:   # a token every 5 ms: some read outlasts 0.1 ms
                    await asyncio.wait_for(s.__anext__(), 1e-4)
            with pytest.raises(ClientError, match="cancelled") as info:
                await s.__anext__()
            assert info.value.code == grpc.StatusCode.CANCELLED
            assert await asyncio.to_thread(server.ended_aborted, req)
            await s.aclose()   # closed by its reader: later reads end
            assert [chunk async for chunk in s] == []

    asyncio.run(scenario())


def test_unary_calls_of_an_async_client_closed_under_them_are_client_errors(server) -> None:
    """``abort`` and ``model_info`` raised a bare CancelledError (as if their task were cancelled)
    when the client was closed under them; streams already said CANCELLED."""
    async def scenario() -> list[object]:
        c = AsyncClient(server.address)
        await c.model_info()   # connected before the server stops answering
        with server.frozen():
            calls = [asyncio.create_task(c.abort("x", timeout_s=20)), asyncio.create_task(c.model_info(timeout_s=20))]
            await asyncio.sleep(0.2)
            await c.close()
            return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    for outcome in outcomes:
        assert isinstance(outcome, ClientError) and outcome.code == grpc.StatusCode.CANCELLED, repr(outcome)


def test_refused_tokens_are_counted_and_a_stream_the_stop_cuts_is_no_abort(monkeypatch) -> None:
    """Calls the interceptor refused for their token left no count and no log (a token-guessing run
    left no trace); a stream cut by the server's stop was counted as the client's abort."""
    from services.scheduler import server as scheduler_server

    said: list[dict] = []
    monkeypatch.setattr(scheduler_server.log, "warning", lambda event, **kw: said.append(kw))
    server = Server(token="s3cret")
    count = lambda status: server.router.metrics.requests.labels(status)._value.get()   # noqa: E731
    try:
        for i in range(3):
            with Client(server.address, token=f"guess{i}") as c, pytest.raises(ClientError) as info:
                c.generate(IDS, max_tokens=2)
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert server.router.metrics.refused.labels("unauthenticated", "unauthenticated")._value.get() == 3
        assert [kw["calls"] for kw in said] == [1]   # logged at most once a minute
        aborted, unavailable = count("aborted"), count("unavailable")
        with Client(server.address, token="s3cret") as c:
            with c.stream(IDS, request_id="cut", **LONG) as s:
                next(s)
                server.servicer.stopping = True   # `serve`'s on_stop, a drain that was told to end now
                server.router.closed = True       # (a second signal), then the stop cuts the stream
                server.call(server.server.stop(0.1))
                with pytest.raises(ClientError):
                    list(s)
        deadline = time.monotonic() + 5
        while count("unavailable") == unavailable and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (count("aborted"), count("unavailable")) == (aborted, unavailable + 1)
    finally:
        server.stop()


def _stop(server: Server, timeout_s: float, now: asyncio.Event | None = None):
    """`serve`'s stop: on_stop, then the drain (on the server's loop); returns its future."""
    async def stop() -> int:
        server.servicer.stopping = True
        return await server.router.drain(timeout_s, now, arriving=lambda: server.servicer.encoding)
    return asyncio.run_coroutine_threadsafe(stop(), server.loop)


def test_a_stopping_scheduler_lets_running_requests_finish_in_its_grace_and_ends_the_rest_unavailable() -> None:
    """Stopped (SIGTERM, Ctrl-C), the scheduler refuses new requests, lets the running ones go on
    for `scheduler.stop_grace_s`, then ends the rest with a status that says so, each one logged
    and counted; a client that leaves meanwhile aborted its request. Before, gRPC's end of the
    grace period told the client only "Cancelling all calls", and the request was never logged."""
    server = Server()
    count = lambda status: server.router.metrics.requests.labels(status)._value.get()   # noqa: E731
    before = {s: count(s) for s in ("length", "unavailable", "aborted")}
    short: dict[str, object] = {}
    try:
        with Client(server.address) as c, c.stream(IDS, request_id="long", **LONG) as long_stream, \
                c.stream(IDS, request_id="leaves", **LONG) as leaving:
            next(long_stream)
            next(leaving)
            worker = threading.Thread(target=lambda: short.update(
                out=c.generate(IDS, max_tokens=20, ignore_eos=True, request_id="short")))
            worker.start()
            deadline = time.monotonic() + 5
            while server.request("short") is None and time.monotonic() < deadline:
                time.sleep(0.005)
            t_stop = time.monotonic()
            draining = _stop(server, 3.0)
            with pytest.raises(ClientError) as refused:
                c.generate(IDS, max_tokens=2)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "stopping" in refused.value.message
            leaving.close()                                  # the client's choice, not the stop's
            assert draining.result(timeout=10) == 1          # the long one; the short one finished
            assert time.monotonic() - t_stop >= 3.0          # it had its whole grace
            worker.join(timeout=10)
            assert "out" in short, "the short request did not finish within the drain"
            assert short["out"].finish_reason == "length" and len(short["out"].token_ids) == 20
            with pytest.raises(ClientError) as cut:
                list(long_stream)
        assert cut.value.code == grpc.StatusCode.UNAVAILABLE
        assert "the scheduler stopped before this request finished (it waits up to 3 s" in cut.value.message
        deadline = time.monotonic() + 5
        while count("aborted") == before["aborted"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [count(s) - before[s] for s in ("length", "unavailable", "aborted")] == [1, 1, 1]
        assert server.router.metrics.refused.labels("unavailable", "stopping")._value.get() == 1
        assert not any(lane.load for lane in server.router.lanes)
    finally:
        server.stop()


def test_the_drain_waits_for_texts_being_tokenized_and_a_second_signal_ends_it(monkeypatch) -> None:
    """A text still in the tokenizer when the stop came was not waited for: the drain ended at
    once, and the request was refused when its tokens came. A second signal (``now``) ends the
    wait: the running requests fail at once."""
    tokenizer = Tokenizer.from_file("models/demo/tokenizer.json")
    encoder = HeldEncoder(tokenizer)
    server = Server(tokenizer, encoder)
    out: dict[str, object] = {}
    try:
        with Client(server.address) as c:
            worker = threading.Thread(target=lambda: out.update(text=c.generate("def f():", max_tokens=5, ignore_eos=True)))
            worker.start()
            deadline = time.monotonic() + 5
            while not encoder.texts and time.monotonic() < deadline:
                time.sleep(0.005)
            draining = _stop(server, 10.0)
            time.sleep(0.3)
            assert not draining.done()                      # waits for the text in the tokenizer
            encoder.release.set()
            assert draining.result(timeout=10) == 0
            worker.join(timeout=10)
            assert out["text"].finish_reason == "length" and len(out["text"].token_ids) == 5
    finally:
        server.stop()
    from services.scheduler import router as router_module

    cut_logs: list[dict] = []
    monkeypatch.setattr(router_module.log, "warning", lambda event, **kw: cut_logs.append({"event": event, **kw}))
    server = Server()
    try:
        with Client(server.address) as c, c.stream(IDS, **LONG) as stream:
            next(stream)
            now = asyncio.Event()
            t0 = time.monotonic()
            draining = _stop(server, 30.0, now)
            time.sleep(1.2)
            server.loop.call_soon_threadsafe(now.set)
            assert draining.result(timeout=10) == 1 and time.monotonic() - t0 < 6
            waited = time.monotonic() - t0
            with pytest.raises(ClientError) as cut:
                list(stream)
            assert cut.value.code == grpc.StatusCode.UNAVAILABLE
            # said as what happened, not the grace it did not have (30 s here): after how long, and why
            said = float(cut.value.message.split("told to stop without waiting longer after ")[1].split(" s ")[0])
            # (from when the server's loop took the stop up: a moment after the test's clock started)
            assert 0.6 <= said <= waited + 0.1, cut.value.message
            assert "of its 30 s grace: a second signal, or its launcher is gone" in cut.value.message
            cut_log = [e for e in cut_logs if e["event"] == "requests_cut_by_stop"]
            assert len(cut_log) == 1 and cut_log[0]["requests"] == 1 and 0.6 <= cut_log[0]["waited_s"] <= waited + 0.1

            async def late_submit() -> None:   # a text whose tokens come after the drain ended
                server.router.submit(ActiveRequest(request_id="late", prompt_ids=IDS, sampling=common_pb2.SamplingParams(),
                                                   max_tokens=4, budget=8, mode=common_pb2.MODE_DDTREE, stop=(),
                                                   stop_ids=frozenset(), eos_ids=frozenset(), tokenizer=None))
            with pytest.raises(ServiceError, match="the scheduler is stopping"):
                server.call(late_submit())
    finally:
        server.stop()


def test_generate_says_its_timeout_passed(capsys) -> None:
    """gRPC's own text for a deadline ("Stream removed (Deadline Exceeded)") did not say which."""
    from services.cli import main

    server = Server()
    try:
        rc = main(["generate", "--address", server.address, "--token-ids", "--prompt", "1,2,3", "--max-tokens", "4000",
                   "--ignore-eos", "--timeout", "0.3"])
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert rc == 1 and "DEADLINE_EXCEEDED" in err and "(--timeout 0.3 s passed)" in err, err


def test_generate_exits_2_where_the_server_says_no_retry_mends_the_failure(server, monkeypatch, capsys) -> None:
    """Exit 1 is "may work later": a full queue is; a text that killed the tokenizer is not."""
    from services.cli import main

    args = ["generate", "--address", server.address, "--token-ids", "--prompt", "1,2,3", "--max-tokens", "2"]
    for error, rc in ((ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full"), 1),
                      (ServiceError(grpc.StatusCode.UNAVAILABLE, "died twice", retryable=False), 2)):
        def refuse(req, error=error):
            raise error
        monkeypatch.setattr(server.router, "submit", refuse)
        assert main(args) == rc
        assert error.message in capsys.readouterr().err


class HeldEncoder:
    """A `PromptEncoder` whose texts wait until `release`: a long text in the tokenizer's worker."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: list[str] = []
        self.release = threading.Event()
        self.released: set[str] = set()   # texts let through before `release`

    async def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        while not self.release.is_set() and text not in self.released:
            await asyncio.sleep(0.005)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


@contextlib.contextmanager
def held_text_server() -> Iterator[tuple[Server, HeldEncoder]]:
    """A server whose texts wait in their tokenizing until the encoder lets them through."""
    encoder = HeldEncoder(Tokenizer.from_file("models/demo/tokenizer.json"))
    server = Server(encoder.tokenizer, encoder)
    try:
        yield server, encoder
    finally:
        server.stop()


def generate_held(c: Client, encoder: HeldEncoder, out: dict, key: str, text: str, **kwargs) -> threading.Thread:
    """``c.generate(text, **kwargs)`` in a thread, its result in ``out[key]``; returns once the
    text waits in ``encoder``."""
    thread = threading.Thread(target=lambda: out.setdefault(key, c.generate(text, **kwargs)))
    thread.start()
    deadline = time.monotonic() + 10
    while text not in encoder.texts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert text in encoder.texts
    return thread


def test_a_request_aborted_while_its_text_is_tokenized_ends_aborted_and_bad_fields_wait_for_no_tokenizer() -> None:
    """A long text is tokenized before the request reaches the router: an abort then found nothing
    and the request ran to max_tokens. Its id is taken meanwhile (ALREADY_EXISTS), and a request
    whose other fields are bad is refused before its text is tokenized (it waited behind the long
    texts, or got the tokenizer queue's RESOURCE_EXHAUSTED, which clients retry)."""
    with held_text_server() as (server, encoder), Client(server.address) as c:
        out: dict[str, object] = {}
        reader = generate_held(c, encoder, out, "done", "def f(x): return x", request_id="tokenizing", **LONG)
        for prompt in ("another text", IDS):   # a token-id one too: the abort would find only the first
            with pytest.raises(ClientError) as info:
                c.generate(prompt, request_id="tokenizing", max_tokens=2)
            assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert server.router.metrics.refused.labels("already_exists", "id_in_use")._value.get() == 2
        stub = scheduler_pb2_grpc.SchedulerStub(c._channel)
        for bad, field in ((dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2, budget=999), "budget")):
            with pytest.raises(grpc.RpcError) as rpc:
                stub.Generate(scheduler_pb2.GenerateRequest(text="x " * 100, **bad), timeout=5).next()
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in rpc.value.details()
        assert len(encoder.texts) == 1   # neither the refused nor the bad ones reached the tokenizer
        aborted = server.router.metrics.requests.labels("aborted")._value.get()
        assert c.abort("tokenizing", timeout_s=5)
        assert not c.abort("tokenizing", timeout_s=5)   # already being aborted
        # The id is free again at once, as an aborted running request's is.
        assert c.generate(IDS, request_id="tokenizing", max_tokens=2, ignore_eos=True).token_ids == [5, 5]
        encoder.release.set()
        reader.join(10)
        done = out["done"]
        assert done.finish_reason == "aborted" and done.token_ids == [], done
        assert server.submitted.count("tokenizing") == 1   # the token-id one only
        assert server.router.metrics.requests.labels("aborted")._value.get() == aborted + 1


def _ends(logs: list[dict], rid: str) -> list[str]:
    return [e["status"] for e in logs if e.get("event") == "request_end" and e.get("request_id") == rid]


def test_a_call_that_ends_while_its_text_is_tokenized_is_counted_and_logged_by_why() -> None:
    """`requests_total` counts requests that end while their text is tokenized: a deadline that
    passed there, or a client that left, cancelled the handler inside the tokenizing, and the
    request was neither counted nor logged."""
    with held_text_server() as (server, encoder), capture_logs() as logs:
        count = lambda status: server.router.metrics.requests.labels(status)._value.get()   # noqa: E731
        before = {s: count(s) for s in ("deadline_exceeded", "aborted")}
        with Client(server.address) as c:
            with pytest.raises(ClientError) as info:
                c.generate("def f(x): return x", request_id="late", timeout_s=0.3, **LONG)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            call = scheduler_pb2_grpc.SchedulerStub(c._channel).Generate(
                scheduler_pb2.GenerateRequest(text="def g(y): return y", request_id="leaves", max_tokens=4000))
            deadline = time.monotonic() + 10
            while "def g(y): return y" not in encoder.texts and time.monotonic() < deadline:
                time.sleep(0.01)
            call.cancel()   # the client leaves
            deadline = time.monotonic() + 5
            while count("aborted") == before["aborted"] and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [count(s) - before[s] for s in ("deadline_exceeded", "aborted")] == [1, 1]
        assert (_ends(logs, "late"), _ends(logs, "leaves")) == (["deadline_exceeded"], ["aborted"])
        assert server.servicer.encoding == 0 and not server.submitted


def test_a_text_still_tokenized_when_the_stop_grace_ends_is_cut_as_the_queued_ones_are() -> None:
    """The stop's grace waits for texts being tokenized; one still there when it ends was refused
    as a new request when its tokens came ("send the request to another one", counted as refused,
    not logged). It ends as the stop's README says: UNAVAILABLE "the scheduler stopped before this
    request finished", counted unavailable, logged, and in the drain's count."""
    with held_text_server() as (server, encoder), capture_logs() as logs:
        unavailable = server.router.metrics.requests.labels("unavailable")._value.get()
        with Client(server.address) as c:
            errors: list[ClientError] = []

            def call() -> None:
                try:
                    c.generate("def f(x): return x", request_id="cut", **LONG)
                except ClientError as exc:
                    errors.append(exc)
            worker = threading.Thread(target=call)
            worker.start()
            deadline = time.monotonic() + 10
            while "def f(x): return x" not in encoder.texts and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _stop(server, 0.2).result(timeout=10) == 1
            encoder.release.set()
            worker.join(10)
        assert len(errors) == 1 and errors[0].code == grpc.StatusCode.UNAVAILABLE
        assert "the scheduler stopped before this request finished" in errors[0].message, errors[0].message
        assert server.router.metrics.requests.labels("unavailable")._value.get() == unavailable + 1
        assert _ends(logs, "cut") == ["unavailable"] and not server.submitted


def test_an_aborted_text_that_ends_its_tokenizing_leaves_the_id_to_the_request_that_took_it_since() -> None:
    """An aborted request gives its id up while its text is tokenized; a second text request took
    it. The first one's tokenizing then ended: had it cleared the id's entry (the second's), the id
    was free to a third request while the second still tokenized, and an abort of it found nothing."""
    with held_text_server() as (server, encoder), Client(server.address) as c:
        out: dict[str, object] = {}
        first = generate_held(c, encoder, out, "first", "first text", request_id="t", **LONG)
        assert c.abort("t", timeout_s=5)
        second = generate_held(c, encoder, out, "second", "second text", request_id="t", **LONG)
        encoder.released.add("first text")
        first.join(10)
        assert out["first"].finish_reason == "aborted"
        with pytest.raises(ClientError) as info:   # still the second's, tokenizing
            c.generate(IDS, request_id="t", max_tokens=2)
        assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert c.abort("t", timeout_s=5)
        encoder.release.set()
        second.join(10)
        assert out["second"].finish_reason == "aborted" and out["second"].token_ids == []
        assert server.submitted.count("t") == 0


def test_a_requests_times_count_from_its_arrival_its_texts_tokenizing_included() -> None:
    """A long text can wait seconds for the tokenizer's worker before the request exists as one:
    its queue wait and time to first token counted from after that, under-reporting them under load."""
    with held_text_server() as (server, encoder):
        with Client(server.address) as c, capture_logs() as logs:
            out: dict[str, object] = {}
            reader = generate_held(c, encoder, out, "done", "def f(x): return x", max_tokens=2, ignore_eos=True)
            time.sleep(0.3)
            encoder.release.set()
            reader.join(10)
        assert len(out["done"].token_ids) == 2
        (end,) = [e for e in logs if e["event"] == "request_end"]
        assert end["queue_ms"] >= 300 and end["ttft_ms"] >= 300
        metrics = server.router.metrics.registry.get_sample_value
        assert metrics("ddtree_request_queue_seconds_sum") >= 0.3
        assert metrics("ddtree_time_to_first_token_seconds_sum") >= 0.3


def test_a_request_aborted_while_tokenized_ends_aborted_even_where_its_prompt_would_be_refused() -> None:
    """`Abort` said it found the request; its text then tokenized to more than the context holds.
    It ended INVALID_ARGUMENT, counted as a refusal, not as the abort it was told of."""
    text = "a " * 4100
    with held_text_server() as (server, encoder), Client(server.address) as c:
        tokens = len(encoder.tokenizer.encode(text, add_special_tokens=False).ids)
        assert tokens > 4096
        out: dict[str, object] = {}
        reader = generate_held(c, encoder, out, "done", text, request_id="t", max_tokens=4)
        aborted = server.router.metrics.requests.labels("aborted")._value.get()
        refused = server.router.metrics.refused.labels("invalid_argument", "prompt_too_long")._value.get()
        assert c.abort("t", timeout_s=5)
        encoder.release.set()
        reader.join(10)
        done = out["done"]
        assert done.finish_reason == "aborted" and done.token_ids == [] and done.usage.prompt_tokens == tokens
        assert server.router.metrics.requests.labels("aborted")._value.get() == aborted + 1
        assert server.router.metrics.refused.labels("invalid_argument", "prompt_too_long")._value.get() == refused
        assert server.submitted.count("t") == 0


# 2. TLS arguments are checked when the client is made.

def test_a_tls_ca_that_is_no_pem_certificate_and_a_server_name_without_one_are_refused_at_once(server, tmp_path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    der = tmp_path / "cert.der"
    subprocess.run(["openssl", "x509", "-in", str(cert), "-outform", "DER", "-out", str(der)], check=True)
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    empty = tmp_path / "empty.pem"   # (empty bytes mean the system's roots; an empty file is a mistake)
    empty.write_bytes(b"")

    def refused(make, *needles: str) -> None:
        with pytest.raises(ClientError) as info:
            make()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        for needle in needles:
            assert needle in info.value.message, info.value.message

    async def make_async(**kwargs) -> None:
        await AsyncClient(server.address, **kwargs).close()

    for path in (key, der, text, empty):   # a private key, a DER certificate, any other file, nothing
        refused(lambda: Client(server.address, tls_ca=str(path)), "tls_ca", str(path), "not a PEM certificate")
        refused(lambda: asyncio.run(make_async(tls_ca=str(path))), "tls_ca", str(path))
    refused(lambda: Client(server.address, tls_ca=key.read_bytes()), "tls_ca", "not a PEM certificate")
    refused(lambda: Client(server.address, tls_server_name="api.example"), "tls_server_name", "tls_ca")
    refused(lambda: asyncio.run(make_async(tls_server_name="api.example")), "tls_server_name", "tls_ca")
    refused(lambda: Client(server.address, tls_ca=str(tmp_path / "missing.pem")), "tls_ca: cannot read")

    # What is a certificate still makes a client (b"": the system's roots).
    for tls_ca in (str(cert), cert.read_bytes(), b""):
        Client(server.address, tls_ca=tls_ca, tls_server_name="localhost").close()
        asyncio.run(make_async(tls_ca=tls_ca, tls_server_name="localhost"))
    with Client(server.address) as c:   # and plaintext to this server still works
        assert c.model_info().vocab_size == 64


# 3. Typed keyword arguments, checked at the call.

def test_stream_and_generate_take_build_requests_arguments_by_name_with_types_and_docstrings() -> None:
    want = [p for p in inspect.signature(build_request).parameters.values() if p.kind is p.KEYWORD_ONLY]
    for method in (Client.stream, Client.generate, AsyncClient.stream, AsyncClient.generate):
        params = list(inspect.signature(method).parameters.values())
        assert [p.name for p in params] == ["self", "prompt", *(p.name for p in want), "timeout_s"], method
        assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params)
        by_name = {p.name: p for p in params}
        for p in want:
            assert by_name[p.name].kind is p.KEYWORD_ONLY and by_name[p.name].default == p.default, (method, p.name)
        assert all(p.annotation is not p.empty for p in params[1:]), method
        assert method.__doc__ and "timeout_s" in (method.__doc__ + Client.stream.__doc__)
    for name in ("max_tokens", "temperature", "seed", "budget", "mode", "stop", "stop_token_ids", "ignore_eos",
                 "request_id", "timeout_s", "ClientError", "TypeError"):
        assert name in Client.stream.__doc__, name


BAD_TIMEOUTS = [0, -1, math.nan, math.inf, "5", True]


def test_a_misspelt_or_unsendable_argument_fails_at_the_call_and_nothing_reaches_the_server(server) -> None:
    before = list(server.submitted)
    with Client(server.address) as c:
        with pytest.raises(TypeError, match="max_token"):
            c.stream(IDS, max_token=5)                      # at the call, not at the first chunk
        with pytest.raises(TypeError, match="max_token"):
            c.generate(IDS, max_token=5)
        with pytest.raises(ClientError, match="mode") as info:
            c.stream(IDS, mode="fast")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        for bad in BAD_TIMEOUTS:
            for call in (c.stream, c.generate):
                with pytest.raises(ClientError, match="timeout_s") as info:
                    call(IDS, max_tokens=3, timeout_s=bad)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad
            with pytest.raises(ClientError, match="timeout_s"):
                Client(server.address, timeout_s=bad)

        # Every argument by name reaches the server; an explicit None is no deadline.
        out = c.generate(IDS, max_tokens=3, temperature=0.0, top_p=1.0, top_k=0, seed=1, budget=4,
                         mode="autoregressive", stop=(), stop_token_ids=[7], ignore_eos=True, request_id="named",
                         timeout_s=None)
        assert (out.request_id, out.token_ids, out.finish_reason) == ("named", [5, 5, 5], "length")
        assert [ch.token_ids for ch in c.stream(IDS, max_tokens=2, ignore_eos=True, timeout_s=5)] == [[5], [5]]

    async def scenario() -> None:
        async with AsyncClient(server.address) as c:
            with pytest.raises(TypeError, match="max_token"):
                c.stream(IDS, max_token=5)
            with pytest.raises(TypeError, match="max_token"):
                await c.generate(IDS, max_token=5)
            with pytest.raises(ClientError, match="mode"):
                c.stream(IDS, mode="fast")
            for bad in BAD_TIMEOUTS:
                with pytest.raises(ClientError, match="timeout_s"):
                    c.stream(IDS, max_tokens=3, timeout_s=bad)
                with pytest.raises(ClientError, match="timeout_s"):
                    await c.generate(IDS, max_tokens=3, timeout_s=bad)
            out = await c.generate(IDS, max_tokens=3, ignore_eos=True, request_id="named-async", timeout_s=5)
            assert (out.request_id, out.token_ids) == ("named-async", [5, 5, 5])
    asyncio.run(scenario())
    sent = server.submitted[len(before):]   # the three calls that were made, nothing else
    assert len(sent) == 3 and sent[0] == "named" and sent[2] == "named-async"


# 4. abort is bounded by a deadline.

def test_abort_gives_up_at_its_deadline_on_a_server_that_does_not_answer(server, monkeypatch) -> None:
    monkeypatch.setattr(sdk, "ABORT_TIMEOUT_S", 0.3)   # the default where neither call nor client gives one

    def timed_out(call) -> None:
        started = time.monotonic()
        with pytest.raises(ClientError) as info:
            call()
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 3

    async def async_aborts() -> None:
        async with AsyncClient(server.address) as c, AsyncClient(server.address, timeout_s=0.3) as bounded:
            for call in (lambda: c.abort("x", timeout_s=0.3), lambda: bounded.abort("x"), lambda: c.abort("x"),
                         c.model_info):
                started = time.monotonic()
                with pytest.raises(ClientError) as info:
                    await call()
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - started < 3

    with Client(server.address) as c, Client(server.address, timeout_s=0.3) as bounded:
        assert c.model_info().vocab_size == 64   # connected before the server stops answering
        with server.frozen():
            timed_out(lambda: c.abort("x", timeout_s=0.3))    # the call's deadline
            timed_out(lambda: bounded.abort("x"))             # the client's
            timed_out(lambda: c.abort("x"))                   # ABORT_TIMEOUT_S
            timed_out(c.model_info)                           # it waited for good too
            timed_out(lambda: c.model_info(timeout_s=0.3))
            asyncio.run(async_aborts())
        for bad in (None, 0, -1, "1"):
            with pytest.raises(ClientError, match="timeout_s") as info:
                c.abort("x", timeout_s=bad)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # Answered again: an abort ends a running request, and finds no unknown one.
        with c.stream(IDS, request_id="to-abort", **LONG) as s:
            next(s)
            assert c.abort("to-abort", timeout_s=5)
            assert [ch.finish_reason for ch in s][-1] == "aborted"
        assert not c.abort("no-such-request")


def test_a_stream_closed_while_its_call_is_being_made_cancels_the_call() -> None:
    """close() from another thread can land while the reader creates the call: the call must be
    cancelled then too (it saw no call to cancel, and the request decoded on for nobody)."""
    from services.scheduler.client import Stream

    class Cancelled(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.CANCELLED

        def details(self):
            return "cancelled"

    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

        def __next__(self):
            if self.cancelled:
                raise Cancelled()
            return scheduler_pb2.GenerateResponse(request_id="r")

    call = Call()
    stream: Stream

    def start():
        stream.close()   # the other thread's close(), while the call is made
        return call

    stream = Stream(start)
    assert list(stream) == [] and call.cancelled


# 6. A request that does not parse is refused by name, and the server goes on.
def test_a_request_that_does_not_parse_gets_invalid_argument_and_the_server_goes_on(server) -> None:
    good = scheduler_pb2.GenerateRequest(text="aXb", max_tokens=1).SerializeToString()
    not_utf8 = good.replace(b"aXb", b"a\xffb")          # a string field that is not UTF-8
    truncated = scheduler_pb2.GenerateRequest(token_ids=scheduler_pb2.TokenIds(ids=IDS), max_tokens=3).SerializeToString()[:-1]
    refused = server.router.metrics.refused.labels("invalid_argument", "unparsed")
    before = refused._value.get()
    with grpc.insecure_channel(server.address) as channel:
        generate = channel.unary_stream("/ddtree.v1.Scheduler/Generate")   # bytes as they are
        abort = channel.unary_unary("/ddtree.v1.Scheduler/Abort")
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        for call, data in ((generate, b"\xff\xff"), (generate, not_utf8), (generate, truncated),
                           (abort, b"\xff\xff"), (check, b"\xff\xff")):
            with pytest.raises(grpc.RpcError) as info:
                out = call(data, timeout=5)
                list(out) if call is generate else out
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (data, info.value.details())
            assert "does not parse" in info.value.details() and "Unexpected" not in info.value.details()
        # Reflection, a stream on the public port: INVALID_ARGUMENT, and no traceback logged for it
        # (INTERNAL and a logged traceback a call let anyone fill the log).
        reflect = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        with capture_logs() as logs, pytest.raises(grpc.RpcError) as info:
            list(reflect(iter([b"\xff\xff"]), timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "does not parse" in info.value.details() and "ServerReflectionInfo" in info.value.details()
        assert not [e for e in logs if e["event"] == "handler_failed"]
    assert refused._value.get() == before + 3   # Generate's, with the scheduler's other refusals
    with Client(server.address) as c:   # undisturbed
        assert c.generate(IDS, max_tokens=2, ignore_eos=True, timeout_s=5).token_ids == [5, 5]
        assert c.abort("nobody") is False


def test_a_client_error_survives_pickling_as_a_process_pool_sends_it() -> None:
    """Its default reduction rebuilt it from the one formatted string: a pool worker that raised it
    broke the pool (TypeError: missing 'message')."""
    import copy
    import pickle

    err = ClientError(grpc.StatusCode.UNAVAILABLE, "no scheduler", True, sdk.Completion("r", "ab", [1, 2]))
    for back in (pickle.loads(pickle.dumps(err)), copy.copy(err)):
        assert (type(back), back.code, back.message, str(back)) == (ClientError, err.code, err.message, str(err))
        assert (back.retryable, back.partial) == (True, err.partial)


def test_an_unknown_finish_reason_is_named_not_a_key_error() -> None:
    """A newer server's reason: a KeyError escaped from inside the stream's read."""
    assert sdk._chunk(scheduler_pb2.GenerateResponse(finish_reason=97)).finish_reason == "unknown(97)"
    assert sdk._chunk(scheduler_pb2.GenerateResponse()).finish_reason is None
    assert sdk._chunk(scheduler_pb2.GenerateResponse(finish_reason=scheduler_pb2.FINISH_REASON_STOP)).finish_reason \
        == "stop"


def test_usage_mean_acceptance_reads_as_the_float32_the_server_sent_not_its_widened_double() -> None:
    for mean in (2.072072072072072, 3.5, 1.0, 4.123456789, 0.0):
        msg = scheduler_pb2.GenerateResponse(usage=scheduler_pb2.Usage(mean_acceptance=mean))
        wire = msg.usage.mean_acceptance                      # the double protobuf widens the float32 to
        got = sdk._chunk(msg).usage.mean_acceptance
        assert got == pytest.approx(mean, rel=1e-6)
        assert scheduler_pb2.Usage(mean_acceptance=got).mean_acceptance == wire   # the same float32
        assert len(repr(got)) <= len(repr(wire)) and len(repr(got)) <= 10     # 2.072072, not 2.0720720291137695


def test_a_deadline_gRPC_cannot_hold_is_refused_by_name(server) -> None:
    """Above ~9.2e9 s the deadline overflows gRPC's nanoseconds: the call failed at once with an
    unnamed DEADLINE_EXCEEDED, nothing sent."""
    with Client(server.address) as c:
        with pytest.raises(ClientError, match="timeout_s must be a positive number of seconds up to") as info:
            c.stream(IDS, timeout_s=1e12)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        out = c.generate(IDS, max_tokens=2, ignore_eos=True, timeout_s=sdk.MAX_TIMEOUT_S)   # the largest: works
        assert out.token_ids == [5, 5]


def test_threads_sharing_one_stream_each_take_the_next_chunk(server) -> None:
    """Two reads at once made gRPC raise a raw ValueError in one thread, which closed the stream:
    the others saw a clean end although the request was cut."""
    got: list[int] = []
    errors: list[BaseException] = []
    with Client(server.address) as c, c.stream(IDS, max_tokens=60, ignore_eos=True) as s:
        def read() -> None:
            try:
                for chunk in s:
                    got.extend(chunk.token_ids)
            except BaseException as exc:   # noqa: BLE001 - any error is the finding
                errors.append(exc)
        threads = [threading.Thread(target=read) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors and len(got) == 60


def test_a_request_of_exactly_max_request_bytes_is_taken_and_one_byte_more_refused(server, monkeypatch) -> None:
    servicer = server.servicer   # (the server is the module's: its settings come back after the test)
    monkeypatch.setattr(servicer, "settings", dataclasses.replace(servicer.settings, max_request_bytes=2048))
    n = next(n for n in range(1900, 2100) if build_request([1] * n, max_tokens=2, ignore_eos=True).ByteSize() == 2048)
    refused = server.router.metrics.refused.labels("invalid_argument", "request_too_large")
    before = refused._value.get()   # the server is the module's: another test's refusals may be counted already
    with Client(server.address) as c:
        assert len(c.generate([1] * n, max_tokens=2, ignore_eos=True).token_ids) == 2
        assert build_request([1] * (n + 1), max_tokens=2, ignore_eos=True).ByteSize() == 2049
        with pytest.raises(ClientError, match="request is 2049 bytes; scheduler.max_request_bytes allows 2048") as info:
            c.generate([1] * (n + 1), max_tokens=2, ignore_eos=True)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused._value.get() == before + 1


def test_a_refusal_is_counted_by_its_kind_and_logged_with_the_clients_request_id_and_address(server) -> None:
    """`request_refused` had the code and reason only: a user's report of a refused request could
    not be matched to its line. And its count was by code alone: a prompt too long for the context
    and a bad field were both `invalid_argument`."""
    count = server.router.metrics.refused.labels
    before = {kind: count("invalid_argument", kind)._value.get() for kind in ("invalid_argument", "prompt_too_long")}
    bad = scheduler_pb2.GenerateRequest(token_ids=scheduler_pb2.TokenIds(ids=IDS), max_tokens=0, request_id="r-bad")
    long = scheduler_pb2.GenerateRequest(token_ids=scheduler_pb2.TokenIds(ids=[1] * 4090), max_tokens=2)
    with grpc.insecure_channel(server.address) as channel, capture_logs() as logs:
        for request in (bad, long):
            with pytest.raises(grpc.RpcError) as rpc:
                scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=5).next()
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    refused = [e for e in logs if e["event"] == "request_refused"]
    assert len(refused) == 2 and refused[0]["request_id"] == "r-bad" and "max_tokens" in refused[0]["reason"]
    assert refused[0]["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:[::1]:"))
    assert [e["kind"] for e in refused] == ["invalid_argument", "prompt_too_long"]
    assert {kind: count("invalid_argument", kind)._value.get() - before[kind] for kind in before} == \
        {"invalid_argument": 1, "prompt_too_long": 1}


def test_the_readme_sdk_example_runs_as_printed() -> None:
    """Pasted as it was, its asyncio half never ran (`main()` was defined, `asyncio.run` only named
    in a comment). Run here against a scheduler on the demo tokenizer, only the address changed."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("## Client SDK", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    printed: list[tuple] = []
    server = Server(Tokenizer.from_file("models/demo/tokenizer.json"))
    try:
        code = example.replace("127.0.0.1:50051", server.address)
        assert code.count(server.address) == 2 and "asyncio.run(main())" in code
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example", "print": lambda *a, **k: printed.append(a)})
    finally:
        server.stop()
    text, finish, acceptance = printed[0]
    assert text and finish == "length" and acceptance >= 1.0
    ends = [i for i, args in enumerate(printed) if args == ()]   # the newline after each stream
    assert len(ends) == 2 and ends[1] == len(printed) - 1
    sync_chunks, async_part = printed[1:ends[0]], printed[ends[0] + 1:ends[1]]
    assert "".join(a[0] for a in sync_chunks) and async_part[0][0] and "".join(a[0] for a in async_part[1:])


def test_abort_refuses_an_id_that_is_not_text(server) -> None:
    """abort(5) raised a raw TypeError; abort(None) looked for "" and said False."""
    with Client(server.address) as c:
        for bad in (5, None, b"x"):
            with pytest.raises(ClientError, match="request_id must be text") as info:
                c.abort(bad)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_abort_refuses_an_id_no_request_can_have_and_says_false_of_one_that_ended(server) -> None:
    """An empty, overlong or unprintable id was answered False, as an id that had ended is: the
    server refuses them with the words Generate uses; a well-formed id that ended, or never ran,
    is still False."""
    with Client(server.address) as c:
        for bad, words in (("", "request_id is required"), ("x" * 1000, "request_id has 1000 characters"),
                           ("a\nb", "request_id must be printable text")):
            with pytest.raises(ClientError, match=words) as info:
                c.abort(bad)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and not info.value.retryable
        assert c.generate(IDS, max_tokens=2, request_id="ended").finish_reason == "length"
        assert c.abort("ended") is False and c.abort("no-such-request") is False


def test_an_async_client_is_refused_outside_its_event_loop(server) -> None:
    """Made outside a running loop, or used from another, gRPC failed with RuntimeErrors ("attached
    to a different loop", "Event loop is closed")."""
    with pytest.raises(ClientError, match="inside a running event loop") as info:
        AsyncClient(server.address)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION

    async def make() -> AsyncClient:
        return AsyncClient(server.address)
    client = asyncio.run(make())

    async def use_elsewhere() -> None:
        with pytest.raises(ClientError, match="another event loop"):
            await client.generate(IDS, max_tokens=1)
        with pytest.raises(ClientError, match="another event loop"):
            client.stream(IDS, max_tokens=1)
        with pytest.raises(ClientError, match="another event loop"):
            await client.abort("x")
    asyncio.run(use_elsewhere())

    async def in_its_loop() -> list[int]:
        async with AsyncClient(server.address) as c:
            return (await c.generate(IDS, max_tokens=2, ignore_eos=True)).token_ids
    assert asyncio.run(in_its_loop()) == [5, 5]


def test_a_token_sent_in_clear_to_another_host_is_warned_about(recwarn) -> None:
    """A plaintext channel sent `authorization: Bearer ...` to any address without a word."""
    import warnings

    with pytest.warns(UserWarning, match="bearer token goes to 10.1.2.3:50051 without TLS"):
        Client("10.1.2.3:50051", token="s3cret").close()
    # a DNS name that starts with "127." is no loopback address
    with pytest.warns(UserWarning, match="bearer token goes to 127.example.com:1 without TLS"):
        Client("127.example.com:1", token="s3cret").close()
    with pytest.warns(UserWarning, match="without TLS"):   # a list is loopback only if every entry is
        Client("ipv4:127.0.0.1:1,10.0.0.2:1", token="s3cret").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # loopback, no token, or TLS: nothing to say
        for address, kwargs in (("127.0.0.1:50051", {"token": "t"}), ("localhost:1", {"token": "t"}),
                                ("[::1]:1", {"token": "t"}), ("10.1.2.3:1", {}), ("unix:/tmp/x", {"token": "t"}),
                                ("ipv4:127.0.0.1:1", {"token": "t"}), ("ipv6:[::1]:1", {"token": "t"}),
                                ("dns:///localhost:1", {"token": "t"}), ("127.1.2.3:1", {"token": "t"}),
                                ("ipv6:::1", {"token": "t"}), ("10.1.2.3:1", {"token": "t", "tls_ca": b""})):
            Client(address, **kwargs).close()


def test_the_cli_says_a_token_in_clear_in_one_line_once(tmp_path) -> None:
    """It printed Python's warning (the file, line and source of the CLI), and again from the probe
    it makes after an UNAVAILABLE."""
    import os
    import sys

    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--address", "192.0.2.1:9",
                          "--prompt", "x", "--token", "s3cret"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONWARNINGS": "default"})
    said = [line for line in out.stderr.splitlines() if "bearer token" in line]
    assert said == ["ddtree generate: warning: the bearer token goes to 192.0.2.1:9 without TLS: anyone on the "
                    "way can read it (tls_ca= makes the channel TLS)"], out.stderr
    assert "cli.py" not in out.stderr and out.returncode == 1


def test_the_cli_names_a_plaintext_server_asked_for_tls() -> None:
    """A TLS hello to a plaintext server fails WRONG_VERSION_NUMBER, whose "ssl" read as a CA or
    host-name mismatch."""
    from types import SimpleNamespace

    from services import cli
    args = SimpleNamespace(tls_ca="ca.pem", address="127.0.0.1:50051")
    details = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50051: Ssl handshake "
               "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
               "WRONG_VERSION_NUMBER")
    assert cli._unavailable_hint(args, details) == ("the scheduler at --address 127.0.0.1:50051 does not speak "
                                                    "TLS: leave out --tls-ca")
    assert "does --tls-ca hold the CA" in cli._unavailable_hint(args, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED")


def test_the_sdk_pings_a_quiet_stream_as_often_as_its_keepalive_says() -> None:
    """A stream sends no data after its request: without max_pings_without_data 0, gRPC sent two
    pings, then one a minute, and a vanished scheduler took about 70 s to find, not 30."""
    assert ("grpc.http2.max_pings_without_data", 0) in sdk._KEEPALIVE
    assert dict(sdk._KEEPALIVE)["grpc.keepalive_time_ms"] >= 10_000   # the servers' least ping interval


def test_tasks_sharing_one_async_stream_each_take_the_next_chunk(server) -> None:
    """Two tasks reading one AsyncStream at once: one of them waited for ever."""
    async def scenario() -> list[int]:
        got: list[int] = []
        async with AsyncClient(server.address) as c, c.stream(IDS, max_tokens=40, ignore_eos=True) as s:
            async def read() -> None:
                async for chunk in s:
                    got.extend(chunk.token_ids)
            await asyncio.wait_for(asyncio.gather(*(read() for _ in range(4))), 30)
        return got
    assert len(asyncio.run(scenario())) == 40


def test_the_cli_takes_the_token_from_the_environment(monkeypatch) -> None:
    from services import cli

    monkeypatch.setenv("DDTREE_TOKEN", "from-env")
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).token == "from-env"
    assert parser.parse_args(["generate", "--prompt", "x", "--token", "flag"]).token == "flag"
    assert parser.parse_args(["bench"]).token == "from-env"


def test_an_address_without_a_port_or_as_a_url_is_refused_when_the_client_is_made() -> None:
    """`Client("localhost")` dialled port 443 and failed UNAVAILABLE, as if no server ran; the CLI
    already refused such an `--address`."""
    for address in ("localhost", "http://127.0.0.1:50051", "127.0.0.1:", ":50051", "127.0.0.1:99999",
                    "127.0.0.1:0", "dns:///scheduler:70000", "ipv4:127.0.0.1:65536", "dns:scheduler",
                    "ipv4:10.0.0.1:1,10.0.0.2:99999"):
        with pytest.raises(ClientError) as info:   # gRPC dialled :99999 as :34463
            Client(address)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert any(w in info.value.message for w in ("HOST:PORT", "no TCP port (1..65535)", "dns:HOST:PORT"))

        async def make(address=address):
            return AsyncClient(address)
        with pytest.raises(ClientError) as info:
            asyncio.run(make())
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ClientError, match=r"brackets, \[ADDRESS\]:PORT") as info:   # gRPC read it all as a host name
        Client("::1:50051")
    for ok in ("127.0.0.1:50051", "[::1]:50051", "unix:/tmp/ddtree.sock", "dns:///scheduler:50051", "dns:scheduler:1",
               "127.0.0.1:65535", "ipv6:[::1]:50051", "ipv6:::1", "ipv4:10.0.0.1:1,10.0.0.2:2"):
        Client(ok).close()


def test_seed_zero_is_a_seed_from_the_client_to_the_verifier() -> None:
    """0 is the seed most often picked; it must be sent as set (proto3 would otherwise read an
    unset field as 0 too) and taken as set where the verifier fixes a request's seed."""
    from services.verifier.server import sampling_from_proto

    req = build_request("x", temperature=1.0, seed=0)
    assert req.sampling.HasField("seed") and req.sampling.seed == 0
    assert not build_request("x", temperature=1.0).sampling.HasField("seed")
    assert sampling_from_proto(req.sampling).seed == 0
    unset = {sampling_from_proto(common_pb2.SamplingParams(temperature=1.0)).seed for _ in range(4)}
    assert 0 not in unset and len(unset) > 1   # no seed: one drawn a request
    assert sdk.address_error("127.0.0.1:65536") is not None and sdk.address_error("127.0.0.1:65535") is None


def test_no_mode_leaves_the_servers_default_and_a_bool_is_no_token_id() -> None:
    assert build_request("x").mode == 0   # unset: scheduler.default_mode decides
    assert build_request("x", mode="autoregressive").mode == common_pb2.MODE_AUTOREGRESSIVE
    for bad in ({"prompt": [1, True]}, {"prompt": [1], "stop_token_ids": [False]}):
        with pytest.raises(ClientError, match="token ids must be integers"):
            build_request(**bad)



# 7. Whether a retry can mend a failure; wait_for_ready through a restart; the output before an error.
def _lane_up(server: Server, up: bool) -> None:
    async def flip() -> None:
        server.router.lanes[0].healthy = up
    server.call(flip())


def test_a_failure_says_whether_the_same_request_may_succeed_later(server, monkeypatch) -> None:
    """A queue full and a replica lost (RESOURCE_EXHAUSTED, UNAVAILABLE) share their codes with
    failures no retry mends (a request over gRPC's message size, a text that killed the tokenizer):
    the scheduler says which in the call's trailing metadata."""
    with Client(server.address) as c:
        _lane_up(server, False)
        try:
            with pytest.raises(ClientError) as down:
                c.generate(IDS, max_tokens=2)
        finally:
            _lane_up(server, True)
        assert (down.value.code, down.value.retryable) == (grpc.StatusCode.UNAVAILABLE, True)
        with pytest.raises(ClientError) as bad:
            c.generate(IDS, max_tokens=2, budget=999)
        assert (bad.value.code, bad.value.retryable) == (grpc.StatusCode.INVALID_ARGUMENT, False)
        with pytest.raises(ClientError) as large:
            c.generate("a" * (5 << 20), max_tokens=2)
        assert (large.value.code, large.value.retryable) == (grpc.StatusCode.INVALID_ARGUMENT, False)
        with pytest.raises(ClientError) as huge:   # gRPC's own refusal: no word from the scheduler
            c.generate("a" * (9 << 20), max_tokens=2)
        assert (huge.value.code, huge.value.retryable) == (grpc.StatusCode.RESOURCE_EXHAUSTED, False)
        for error, retryable in ((ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full"), True),
                                 (ServiceError(grpc.StatusCode.UNAVAILABLE, "died twice", retryable=False), False)):
            def refuse(req, error=error):
                raise error
            monkeypatch.setattr(server.router, "submit", refuse)
            with pytest.raises(ClientError) as info:
                c.generate(IDS, max_tokens=2)
            assert (info.value.code, info.value.retryable) == (error.code, retryable)
        monkeypatch.undo()
        assert c.generate(IDS, max_tokens=2, ignore_eos=True).token_ids == [5, 5]
    with Client("127.0.0.1:1") as nobody, pytest.raises(ClientError) as info:   # no scheduler answered
        nobody.generate(IDS)
    assert (info.value.code, info.value.retryable) == (grpc.StatusCode.UNAVAILABLE, True)


def test_a_wait_for_ready_stream_waits_through_a_refusal_until_its_deadline(server, monkeypatch) -> None:
    """`wait_for_ready` waited only for a connection: a stream the scheduler refused while no draft
    replica was up (a restart) failed at once, though the README says such a client waits."""
    _lane_up(server, False)
    try:
        threading.Timer(0.5, _lane_up, (server, True)).start()
        t0 = time.monotonic()
        with Client(server.address, timeout_s=10, wait_for_ready=True) as c:
            assert c.generate(IDS, max_tokens=2, ignore_eos=True).token_ids == [5, 5]
        assert time.monotonic() - t0 >= 0.45

        async def waits() -> list[int]:
            async with AsyncClient(server.address, timeout_s=10, wait_for_ready=True) as c:
                return (await c.generate(IDS, max_tokens=2, ignore_eos=True)).token_ids
        _lane_up(server, False)
        threading.Timer(0.5, _lane_up, (server, True)).start()
        assert asyncio.run(waits()) == [5, 5]

        _lane_up(server, False)
        with Client(server.address, wait_for_ready=True) as c:
            t0 = time.monotonic()
            with pytest.raises(ClientError) as late:
                c.generate(IDS, max_tokens=2, timeout_s=0.8)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "no draft replica is up" in late.value.message
            # Retried after 0.1 and 0.2 s (each x 0.8..1.2), then given up where the next wait
            # (0.4 s x 0.8..1.2) would pass the deadline: as early as 0.24 s (0.36 s seen in CI).
            assert 0.2 < time.monotonic() - t0 < 3
            # no deadline: it waits until closed, and close() ends the wait at once (a 5 s one here)
            monkeypatch.setattr(sdk, "RETRY_FIRST_S", 5.0)
            s = c.stream(IDS, max_tokens=2)
            got: list = []
            reader = threading.Thread(target=lambda: got.append(list(s)))
            reader.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            s.close()
            reader.join(timeout=5)
            assert got == [[]] and time.monotonic() - t0 < 1.5

        async def closed_while_waiting() -> float:
            async with AsyncClient(server.address, wait_for_ready=True) as c:
                s = c.stream(IDS, max_tokens=2)
                reader = asyncio.ensure_future(s.__anext__())
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                await s.aclose()
                with pytest.raises(StopAsyncIteration):
                    await asyncio.wait_for(reader, 5)
                return time.monotonic() - t0
        assert asyncio.run(closed_while_waiting()) < 1.5
        monkeypatch.undo()
        with Client(server.address) as c, pytest.raises(ClientError) as refused:   # without it: at once
            c.generate(IDS, max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        _lane_up(server, True)


def test_a_failure_after_the_first_chunk_is_not_sent_again_and_generate_keeps_the_output_before_it() -> None:
    """A stream is sent again only where the request never ran on a replica: not after a chunk, nor
    after a replica failed under it (the request itself may have crashed it); generate's error
    carried nothing of the output before it (a deadline after 50 tokens lost them all)."""
    from services.scheduler.draft_link import StepFailed

    server = Server()
    try:
        class Crashed:
            async def step(self, req, timeout):
                raise StepFailed(grpc.StatusCode.UNAVAILABLE, "Socket closed")

            def close(self) -> None:
                pass

        async def crash_next_step() -> object:
            lane = server.router.lanes[0]
            lane.draft, kept = Crashed(), lane.draft
            return kept
        kept = server.call(crash_next_step())
        with Client(server.address, wait_for_ready=True) as c, pytest.raises(ClientError) as lost:
            c.generate(IDS, request_id="crashes", timeout_s=10, **LONG)
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE and "draft replica draft failed" in lost.value.message
        assert lost.value.retryable and server.submitted.count("crashes") == 1

        async def recover() -> None:
            lane = server.router.lanes[0]
            lane.draft, lane.rejoin_after = kept, 0.0
            lane.mark_healthy()
        server.call(recover())
        with Client(server.address, wait_for_ready=True) as c:
            with pytest.raises(ClientError) as late:
                c.generate(IDS, request_id="late", timeout_s=0.3, **LONG)
            partial = late.value.partial
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not late.value.retryable
            assert partial.request_id == "late" and partial.finish_reason is None
            assert len(partial.token_ids) >= 5 and set(partial.token_ids) == {5}

            async def async_partial() -> ClientError:
                async with AsyncClient(server.address) as ac:
                    with pytest.raises(ClientError) as info:
                        await ac.generate(IDS, timeout_s=0.3, **LONG)
                    return info.value
            err = asyncio.run(async_partial())
            assert err.partial.request_id and len(err.partial.token_ids) >= 5   # the server's id, from a chunk
            with c.stream(IDS, request_id="once", timeout_s=10, **LONG) as s:
                next(s)
                draining = _stop(server, 0.1)
                with pytest.raises(ClientError) as cut:
                    list(s)
                draining.result(timeout=10)
            assert cut.value.code == grpc.StatusCode.UNAVAILABLE and cut.value.retryable
            assert server.submitted.count("once") == 1
    finally:
        server.stop()


def test_a_client_closed_under_a_sync_stream_says_so_and_bad_client_arguments_are_refused(server) -> None:
    """The sync reader got gRPC's "Stream removed (Channel closed!)"; an address with a space (an
    env file's) failed each call UNAVAILABLE "Misformatted"; wait_for_ready="no" read as true; an
    unhashable mode raised a bare TypeError."""
    c = Client(server.address)
    s = c.stream(IDS, **LONG)
    next(s)
    c.close()
    with pytest.raises(ClientError) as info:
        next(s)
    assert (info.value.code, info.value.message) == (grpc.StatusCode.CANCELLED,
                                                      "the client was closed while this stream was open")
    for address in (" 127.0.0.1:50051", "127.0.0.1:50051 ", "127.0.0.1: 50051", "127.0.0.1:50051\n"):
        with pytest.raises(ClientError, match="white space") as info:
            Client(address)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    Client("unix:/tmp/a dir/ddtree.sock").close()   # a socket path may hold one
    with pytest.raises(ClientError, match="wait_for_ready must be True or False"):
        Client(server.address, wait_for_ready="no")
    with pytest.raises(ClientError, match="mode must be") as info:
        build_request("x", mode=["ddtree"])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_package_says_it_is_typed() -> None:
    """PEP 561: without py.typed an installed SDK's annotations were ignored by type checkers."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["services"] and (root / "services" / "py.typed").is_file()
    assert "py.typed" in data["ddtree"] and (root / "protos" / "ddtree" / "py.typed").is_file()
    assert "*.pyi" in data["ddtree.v1"] and (root / "protos" / "ddtree" / "v1" / "scheduler_pb2.pyi").is_file()


def test_a_stream_its_client_does_not_read_holds_one_message_of_every_step_since_not_one_a_step(server) -> None:
    """A message was queued a step, ~650 bytes each, for as long as the client did not read (300
    unread streams of 1000 tokens grew the scheduler by 110 MB). With HTTP/2 flow control holding the
    server back, what the client reads late comes merged, every token and acceptance length in it."""
    slow = [("grpc.http2.lookahead_bytes", 128), ("grpc.http2.bdp_probe", 0)]   # a window that fills at once
    with grpc.insecure_channel(server.address, options=slow) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Generate(scheduler_pb2.GenerateRequest(
            token_ids=scheduler_pb2.TokenIds(ids=IDS), max_tokens=200, ignore_eos=True))
        first = next(call)
        time.sleep(1.6)   # ~200 steps of 5 ms run meanwhile
        rest = list(call)
    assert len(rest) < 20
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 200
    assert sum(len(m.acceptance_lengths) for m in (first, *rest)) == 199   # the prefill's token has none
    assert rest[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 200


def test_refusals_for_the_servers_state_are_logged_once_each_10_s_with_their_count(server) -> None:
    """Clients retrying a full queue or an outage in a loop logged a line a refusal (756 a second,
    168 KB/s of log); a bad request is still a line each, its id and address to match a report."""
    server.servicer._busy_refusals.clear()
    count = server.router.metrics.refused.labels("unavailable", "no_replica")._value.get
    before = count()
    with Client(server.address) as c, capture_logs() as logs:
        _lane_up(server, False)
        try:
            for i in range(5):
                with pytest.raises(ClientError):
                    c.generate(IDS, max_tokens=2, request_id=f"busy-{i}")
            server.servicer._busy_refusals["no_replica"]._said -= 10   # ten seconds on
            with pytest.raises(ClientError):
                c.generate(IDS, max_tokens=2, request_id="busy-5")
        finally:
            _lane_up(server, True)
        for i in range(2):
            with pytest.raises(ClientError):
                c.generate(IDS, max_tokens=0, request_id=f"bad-{i}")
    lines = [(e["kind"], e["request_id"], e["calls"]) for e in logs if e["event"] == "request_refused"]
    assert lines == [("no_replica", "busy-0", 1), ("no_replica", "busy-5", 5),
                     ("invalid_argument", "bad-0", 1), ("invalid_argument", "bad-1", 1)]
    assert count() - before == 6


# 8. From a tenth mutation run.
def test_a_wait_for_ready_stream_sends_again_only_what_the_scheduler_says_may_succeed(server, monkeypatch) -> None:
    """Only UNAVAILABLE the scheduler calls retryable is sent again: a text that killed its tokenizer
    twice would kill it again each time until the deadline; a full queue is the caller's to retry."""
    for error in (ServiceError(grpc.StatusCode.UNAVAILABLE, "died twice", retryable=False),
                  ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", "queue_full")):
        calls: list[str] = []

        def refuse(req, error=error):
            calls.append(req.request_id)
            raise error
        monkeypatch.setattr(server.router, "submit", refuse)
        with Client(server.address, wait_for_ready=True) as c:
            with pytest.raises(ClientError) as info:
                c.generate(IDS, max_tokens=2, timeout_s=5)
            assert info.value.code == error.code
        assert len(calls) == 1

        async def once() -> ClientError:
            async with AsyncClient(server.address, wait_for_ready=True) as ac:
                with pytest.raises(ClientError) as info:
                    await ac.generate(IDS, max_tokens=2, timeout_s=5)
                return info.value
        calls.clear()
        assert asyncio.run(once()).code == error.code and len(calls) == 1
        monkeypatch.undo()


def test_an_async_client_without_wait_for_ready_fails_a_refused_stream_at_once(server) -> None:
    async def refused() -> ClientError:
        async with AsyncClient(server.address) as c:
            with pytest.raises(ClientError) as info:
                await c.generate(IDS, max_tokens=2, timeout_s=5)
            return info.value
    _lane_up(server, False)
    try:
        t0 = time.monotonic()
        err = asyncio.run(refused())
        assert (err.code, err.retryable) == (grpc.StatusCode.UNAVAILABLE, True) and time.monotonic() - t0 < 2.5
    finally:
        _lane_up(server, True)


def test_retries_count_down_one_deadline_and_their_waits_stay_bounded() -> None:
    r = sdk._Retries(0.4)
    assert r.left() == pytest.approx(0.4, abs=0.05)
    time.sleep(0.15)
    assert r.left() < 0.3                                 # the same deadline, not a new one each attempt
    r = sdk._Retries(None)
    waits = [r.pause(ClientError(grpc.StatusCode.UNAVAILABLE, "x")) for _ in range(12)]
    assert waits[0] <= sdk.RETRY_FIRST_S * 1.2 and max(waits) <= sdk.RETRY_MAX_S * 1.2


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "no draft replica is up"

    def trailing_metadata(self):
        return ((sdk.RETRYABLE_METADATA, "true"), (sdk.REFUSED_METADATA, "true"))


def test_a_retried_stream_sends_the_time_left_of_its_deadline_not_the_whole_timeout(server) -> None:
    sent: list[float] = []

    class SyncCall:
        def __init__(self, fail):
            self.fail, self.done = fail, False

        def __next__(self):
            if self.fail:
                raise _Refused()
            if self.done:
                raise StopIteration
            self.done = True
            return scheduler_pb2.GenerateResponse(request_id="r", token_ids=[5])

        def cancel(self):
            pass

    class AsyncCall:
        def __init__(self, fail):
            self.fail, self.done = fail, False

        async def read(self):
            if self.fail:
                raise _Refused()
            if self.done:
                return grpc.aio.EOF
            self.done = True
            return scheduler_pb2.GenerateResponse(request_id="r", token_ids=[5])

        def cancel(self):
            pass

    class Stub:
        def __init__(self, call):
            self.call = call

        def Generate(self, req, timeout, wait_for_ready, metadata):  # noqa: N802 - the gRPC method name
            sent.append(timeout)
            return self.call(fail=len(sent) == 1)

    with Client(server.address, wait_for_ready=True) as c:
        c._stub = Stub(SyncCall)
        assert c.generate(IDS, timeout_s=5).token_ids == [5]
    assert sent[0] == pytest.approx(5, abs=0.05) and sent[1] < 5 - 0.05

    async def async_generate() -> list[int]:
        async with AsyncClient(server.address, wait_for_ready=True) as ac:
            ac._stub = Stub(AsyncCall)
            return (await ac.generate(IDS, timeout_s=5)).token_ids
    sent.clear()
    assert asyncio.run(async_generate()) == [5]
    assert sent[0] == pytest.approx(5, abs=0.05) and sent[1] < 5 - 0.05


def test_abort_and_model_info_take_the_clients_timeout_before_the_default(server, monkeypatch) -> None:
    monkeypatch.setattr(sdk, "ABORT_TIMEOUT_S", 20.0)

    async def async_calls() -> None:
        async with AsyncClient(server.address, timeout_s=0.3) as bounded:
            for call in (lambda: bounded.abort("x"), bounded.model_info):
                t0 = time.monotonic()
                with pytest.raises(ClientError) as info:
                    await call()
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5

    with Client(server.address, timeout_s=0.3) as bounded:
        assert bounded.model_info().vocab_size == 64
        with server.frozen():
            for call in (lambda: bounded.abort("x"), bounded.model_info):
                t0 = time.monotonic()
                with pytest.raises(ClientError) as info:
                    call()
                assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
            asyncio.run(async_calls())


def test_a_client_error_keeps_the_servers_retryable_word_through_pickling() -> None:
    import copy
    import pickle

    for err in (ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", True),
                ClientError(grpc.StatusCode.UNAVAILABLE, "died twice", False)):
        for back in (pickle.loads(pickle.dumps(err)), copy.copy(err)):
            assert (back.code, back.retryable) == (err.code, err.retryable)


def test_a_refusal_whose_request_id_is_its_fault_logs_a_bounded_line(server) -> None:
    for rid in ("r" * 100_000, "r" * 250 + "\n"):
        request = scheduler_pb2.GenerateRequest(token_ids=scheduler_pb2.TokenIds(ids=IDS), max_tokens=2, request_id=rid)
        with grpc.insecure_channel(server.address) as channel, capture_logs() as logs:
            with pytest.raises(grpc.RpcError) as rpc:
                scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=5).next()
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        line = next(e for e in logs if e["event"] == "request_refused")
        assert line["request_id"] == rid[:200] and len(line["reason"]) <= 200


def test_tls_server_name_is_the_name_the_servers_certificate_is_checked_for(tmp_path) -> None:
    """A certificate for api.example, served on 127.0.0.1: with tls_server_name the handshake takes
    it (the call reaches the server, which has no such service), without it the name does not match."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=api.example", "-addext", "subjectAltName=DNS:api.example",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())]))
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", tls_ca=str(cert), tls_server_name="api.example") as c:
            with pytest.raises(ClientError) as info:
                c.model_info(timeout_s=10)
            assert info.value.code == grpc.StatusCode.UNIMPLEMENTED   # past the handshake
        with Client(f"127.0.0.1:{port}", tls_ca=str(cert)) as c:
            with pytest.raises(ClientError) as info:
                c.model_info(timeout_s=10)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE    # 127.0.0.1 is not api.example
    finally:
        server.stop(0)


def test_an_exception_while_a_sync_stream_waits_cancels_its_request() -> None:
    """Ctrl-C (or any exception) inside a read ends the request, as the Stream docstring says, and
    later reads end at once (else the request would decode on for nobody)."""
    class Call:
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

        def __next__(self):
            raise KeyboardInterrupt

    call = Call()
    stream = sdk.Stream(lambda: call)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    assert call.cancelled and list(stream) == []


def test_usage_and_completion_objects_keep_what_the_server_and_caller_said() -> None:
    """Usage.tree_steps comes from the wire; a Completion with no steps has mean acceptance 0; a
    failed generate's (empty) partial keeps the request id it was asked for."""
    usage = sdk._chunk(scheduler_pb2.GenerateResponse(usage=scheduler_pb2.Usage(
        prompt_tokens=3, completion_tokens=4, steps=2, tree_steps=2, mean_acceptance=2.0))).usage
    assert usage == sdk.Usage(prompt_tokens=3, completion_tokens=4, steps=2, mean_acceptance=2.0, tree_steps=2)
    empty = sdk.Completion()
    assert empty.mean_acceptance == 0.0 and empty.prompt_tokens == 0
    with sdk.Client("127.0.0.1:1") as c:   # nothing listens: UNAVAILABLE at once
        with pytest.raises(sdk.ClientError) as info:
            c.generate([1, 2], request_id="mine", timeout_s=10)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.value.partial == sdk.Completion(request_id="mine")
    # Refused before anything is sent (a bad argument, a closed client): an empty partial too, as
    # the docstring says of every error of generate (it was None, and err.partial.text raised).
    with sdk.Client("127.0.0.1:1") as c, pytest.raises(sdk.ClientError) as bad:
        c.generate([1, 2], request_id="mine", budget=True)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and bad.value.partial == sdk.Completion(request_id="mine")
    with pytest.raises(sdk.ClientError) as closed:
        c.generate([1, 2])
    assert closed.value.partial == sdk.Completion()

    async def async_refused() -> sdk.ClientError:
        async with sdk.AsyncClient("127.0.0.1:1") as ac:
            with pytest.raises(sdk.ClientError) as err:
                await ac.generate([1, 2], request_id="a", max_tokens=0)
        return err.value
    assert asyncio.run(async_refused()).partial == sdk.Completion(request_id="a")


def test_a_calls_timeout_none_is_no_deadline_even_where_the_client_has_one() -> None:
    """`timeout_s=None` on a stream means no deadline; not given, the client's applies."""
    sent: list[object] = []

    class Call:   # a call whose output ends at once
        def __next__(self):
            raise StopIteration

        def cancel(self) -> None:
            pass

    class Stub:
        def Generate(self, req, timeout, wait_for_ready, metadata):
            sent.append(timeout)
            return Call()

    with Client("127.0.0.1:1", timeout_s=5) as c:
        c._stub = Stub()
        for timeout_s in (None, 2.5):
            assert list(c.stream([1], timeout_s=timeout_s)) == []
        assert list(c.stream([1])) == []
    assert sent == [None, 2.5, 5.0]


def test_a_closed_clients_stream_is_refused_at_the_call() -> None:
    """As `stream`'s docstring says: at the call, not at its first read (a stream kept for later
    would fail far from the line that made it)."""
    c = Client("127.0.0.1:1")
    c.close()
    with pytest.raises(ClientError, match="closed") as info:
        c.stream([1, 2])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
