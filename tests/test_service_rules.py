"""Rules mutation runs of the verifier's and scheduler's gRPC services (services/verifier/server.py,
services/scheduler/server.py) and the router (services/scheduler/router.py) found unpinned; each
test says which change it catches. Fixtures from test_batcher and test_verifier_bad_input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from ddtree.v1 import common_pb2, scheduler_pb2
from services.common.grpc_server import ServiceError
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings, SettingsError, VerifierSettings
from services.scheduler.batcher import StepLoop
from services.scheduler.request import Limits
from tests.test_batcher import SlowDraft, Stub, admitted, generate, request, scheduler
from tests.test_verifier_bad_input import (chain, ckpt, hello, outcome, prefill, roots,  # noqa: F401
                                           servicer, serving, verify)


# Catches (Router._budget) `known = info is not None` without `and info.verifier_id`: replicas
# whose verifier reports no id all share one budget keyed "".
def test_replicas_whose_verifiers_report_no_id_each_get_a_kv_budget_of_their_own() -> None:
    """A verifier that reports no id (an older build, or one not known yet) cannot be matched to a
    group: each replica in front of one must be admitted against its own verifier's cache. Put
    under one shared budget keyed "", two replicas of two separate 1000-token verifiers could hold
    only 1000 tokens between them: the second request waits although its verifier is idle."""
    from services.scheduler.router import Router

    async def scenario() -> tuple[bool, list[list[str]]]:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        no_id = common_pb2.ModelInfo(kv_capacity_tokens=1000)   # verifier_id ""
        lanes = [StepLoop(SchedulerSettings(), f"d{i}", None, Limits(64, 4096, 16, (0,), 1000), router._budget(no_id),
                          router.metrics) for i in range(2)]
        for i, lane in enumerate(lanes):
            lane.waiting.append(request(f"r{i}", 10, kv=900))
        return lanes[0].kv is lanes[1].kv, [admitted(lane) for lane in lanes]

    shared, started = asyncio.run(scenario())
    assert not shared
    assert started == [["r0"], ["r1"]]


# Catches (Router._forget_gone) `lane.healthy or` dropped from the keep condition: a healthy idle
# replica whose dns: name no longer resolves to it is forgotten.
def test_a_healthy_replica_its_dns_name_stops_resolving_to_is_kept() -> None:
    """A DNS record can drop a live replica for a while (a rolling update, a readiness flap, a slow
    look-up answering part of the set). A replica that is up and serving must stay in the router:
    forgotten, its channel is closed and its capacity is lost to every client until a later
    discovery round finds it again. Only a replica that is down and idle is forgotten."""
    from services.scheduler.router import Router

    async def scenario() -> list[str]:
        router = Router(SchedulerSettings(tokenizer_path="", draft_addresses=("dns:draft:50052",)),
                        Metrics("scheduler-test"))
        router.info = await Stub("v1").GetModelInfo(None)
        for ip in (1, 2, 3):
            router._add_lane(f"10.0.0.{ip}:50052", Stub("v1"), router.info)
        router.lanes[2].healthy = False          # down and idle: this one may go
        await router._forget_gone({"10.0.0.1:50052"})   # the name lost .2 (up, idle) and .3
        left = [lane.address for lane in router.lanes]
        await router.stop()
        return left

    assert asyncio.run(scenario()) == ["10.0.0.1:50052", "10.0.0.2:50052"]


# Catches (VerifierServicer._handshake) `kv_capacity_tokens=self.engine.cache.num_pages` for
# `.capacity_tokens`, and `feature_bytes_per_token=cfg.hidden_size` without `len(layers) *`.
def test_the_handshake_reports_the_kv_cache_in_tokens_and_the_feature_bytes_of_all_layers() -> None:
    """The draft passes these on to the scheduler: the KV budget every request is admitted against
    (counted in pages, a 1024-token cache admitted 64 tokens: nearly every request refused
    kv_too_large), and the features' bytes a token, which caps a step's prompt tokens under gRPC's
    message size (one layer's worth of several: steps whose replies are too large to send)."""
    from tests.test_transport_negotiation import HIDDEN, VOCAB, _serve
    from services.draft.verifier_client import VerifierClient

    async def scenario():
        server, servicer, _, address = await _serve("cpu")
        client = VerifierClient(address, "inline", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        try:
            return await client.connect([1, 2], HIDDEN, VOCAB), servicer.engine
        finally:
            await client.close()
            await server.stop(None)

    hs, engine = asyncio.run(scenario())
    assert hs.kv_capacity_tokens == engine.cache.capacity_tokens == 1024 and hs.kv_page_size == 16
    assert hs.feature_bytes_per_token == 2 * HIDDEN * engine.model.dtype.itemsize
    assert hs.max_context == engine.max_context


# Catches (VerifierServicer._handshake) `reader.close()` dropped where the verifier's ring cannot
# be made, that refusal's RESOURCE_EXHAUSTED changed (to INTERNAL), and `writer.close()` dropped
# where the switch to the draft's feature layers fails.
@pytest.mark.parametrize("fails", ["no_room_for_our_ring", "feature_layers_refused"])
def test_a_handshake_refused_after_its_rings_were_mapped_leaves_none_mapped(monkeypatch, fails: str) -> None:
    """A handshake the verifier refuses after mapping the draft's ring (and making its own) must
    unmap them: a draft retrying every second otherwise left a mapping (or a /dev/shm segment) each
    time, until the verifier ran out of memory or /dev/shm. A /dev/shm without room for our ring,
    the draft's only kind, is RESOURCE_EXHAUSTED (a retryable want of room, not a verifier bug)."""
    import errno

    from services.common.grpc_server import ServiceError
    from services.common.transport import make_reader, make_writer
    from services.draft.verifier_client import VerifierClient
    from services.verifier import server as verifier_server
    from tests.test_transport_negotiation import HIDDEN, VOCAB, _serve

    closed: list[str] = []

    def tracked(obj, what: str):
        close = obj.close
        obj.close = lambda: (closed.append(what), close())
        return obj

    def reader(*args, **kwargs):
        return tracked(make_reader(*args, **kwargs), "reader")

    def writer(kind, *args, **kwargs):
        if fails == "no_room_for_our_ring":
            raise OSError(errno.ENOSPC, "No space left on device")
        return tracked(make_writer(kind, *args, **kwargs), "writer")

    monkeypatch.setattr(verifier_server, "make_reader", reader)
    monkeypatch.setattr(verifier_server, "make_writer", writer)

    async def scenario() -> ServiceError:
        server, servicer, _, address = await _serve("cpu")
        if fails == "feature_layers_refused":
            def call(name: str, *args):
                if name == "set_feature_layers":
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "layer 2 is not in the target")
                return 0 if name == "release_owner" else None
            servicer.group.call = call
        client = VerifierClient(address, "shm", ring_slots=2, ring_slot_bytes=8192, device="cpu")
        try:
            with pytest.raises(ServiceError) as refused:
                await client.connect([1, 2], HIDDEN, VOCAB)
            assert not servicer._peers
            return refused.value
        finally:
            await client.close()
            await server.stop(None)

    refused = asyncio.run(scenario())
    if fails == "no_room_for_our_ring":
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "No space left" in refused.message
        assert closed == ["reader"]
    else:
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
        assert sorted(closed) == ["reader", "writer"]


class _Aborted(Exception):
    pass


class _Context:
    """The part of a gRPC servicer context Generate uses, its abort recorded (and raised, as gRPC's is)."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, dict[str, str]] | None = None

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details, trailing_metadata=()) -> None:
        self.status = (code, dict(trailing_metadata))
        raise _Aborted(details)


# Catches (SchedulerServicer.Generate) `refused=req.prompt_sent == 0` replaced by `refused=False`
# where a request fails in the queue.
@pytest.mark.parametrize("sent", [0, 3])
def test_a_request_failed_before_any_of_its_prompt_reached_a_replica_says_it_was_refused(sent: int) -> None:
    """A request whose replica went down while it waited in the queue never ran anywhere: the
    scheduler tells the client so (ddtree-refused: true), and the SDK's wait_for_ready stream sends
    it again by itself. Said "false", every such client saw UNAVAILABLE during a replica restart;
    said "true" of one whose prompt had gone out, a retry could run it twice."""
    from services.common.grpc_server import ServiceError
    from services.scheduler.client import REFUSED_METADATA, RETRYABLE_METADATA
    from tests.test_batcher import SlowDraft, generate, scheduler

    async def scenario():
        servicer, router, lane = scheduler(SlowDraft())
        await lane.stop()                          # its request stays queued
        context = _Context()
        stream = servicer.Generate(generate(8), context)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        (req,) = lane.waiting
        req.prompt_sent = sent
        req.fail(ServiceError(grpc.StatusCode.UNAVAILABLE, "draft replica down", "replica_down"))
        with pytest.raises(_Aborted):
            await first
        await router.stop()
        return context.status

    code, trailers = asyncio.run(scenario())
    assert code == grpc.StatusCode.UNAVAILABLE and trailers[RETRYABLE_METADATA] == "true"
    assert trailers[REFUSED_METADATA] == ("true" if sent == 0 else "false")


# Catches (SchedulerServicer._encode) `self.encoding -= 1` dropped, and `del self._encoding[rid]`
# dropped from its `finally`.
def test_a_text_request_that_finished_leaves_its_id_free_and_nothing_for_the_drain_to_wait_for() -> None:
    """Once a text prompt is tokenized, its id must leave the tokenizing table and the count the
    stop's drain waits on: kept in the table, the id was refused ALREADY_EXISTS for good (a client
    that reuses ids, or retries under the same one, could never send it again); counted on, every
    stop of the scheduler waited out its whole grace period for a tokenizing long done."""
    from services.scheduler.batcher import KvBudget
    from services.scheduler.router import Router
    from services.common.tokenizer_files import load_tokenizer
    from services.scheduler.server import SchedulerServicer
    from tests.test_batcher import SlowDraft, generate

    async def run(servicer, req) -> list:
        return [event async for event in servicer.Generate(req, _Context())]

    async def scenario():
        tokenizer = load_tokenizer("models/demo")
        settings = SchedulerSettings(tokenizer_path="")
        router = Router(settings, Metrics("scheduler-test"))
        router.info = common_pb2.ModelInfo(vocab_size=4096, max_context=4096, block_size=16, kv_capacity_tokens=10_000)
        lane = StepLoop(settings, "draft", SlowDraft(), Limits(4096, 4096, 16, (0,), 10_000), KvBudget(capacity=10_000),
                        router.metrics)
        lane.start()
        router.lanes.append(lane)
        servicer = SchedulerServicer(settings, router, router.info, tokenizer)
        text = await run(servicer, scheduler_pb2.GenerateRequest(request_id="t", text="def f(x):", max_tokens=2,
                                                                  ignore_eos=True))
        left = (servicer.encoding, dict(servicer._encoding))
        again = await run(servicer, generate(2, request_id="t"))   # the same id, once the first ended
        await router.stop()
        return text, left, again

    text, left, again = asyncio.run(scenario())
    assert text[-1].finish_reason and left == (0, {})
    assert again[-1].finish_reason and sum(len(e.token_ids) for e in again) == 2


# Catches (SchedulerServicer.unparsed) `if method == GENERATE_METHOD:` flipped to `!=`.
def test_only_a_generate_call_that_does_not_parse_counts_as_a_refused_request() -> None:
    """The refusals metric counts requests: a Generate whose bytes do not parse is one (label
    "unparsed"), an Abort or a health check that does not parse is not. Flipped, an operator's
    refusal rate counted garbage health probes and missed malformed requests (the existing
    end-to-end test sends as many of each, so it cannot tell)."""
    from services.scheduler.server import GENERATE_METHOD
    from tests.test_batcher import SlowDraft, scheduler

    async def scenario() -> list[float]:
        servicer, router, _ = scheduler(SlowDraft())
        def count() -> float:
            return router.metrics.registry.get_sample_value(
                "ddtree_requests_refused_total", {"code": "invalid_argument", "reason": "unparsed"}) or 0
        seen = [count()]
        servicer.unparsed(GENERATE_METHOD, "the request does not parse")
        seen.append(count())
        for method in ("/ddtree.v1.Scheduler/Abort", "/grpc.health.v1.Health/Check"):
            servicer.unparsed(method, "the request does not parse")
        seen.append(count())
        await router.stop()
        return seen

    first, after_generate, after_others = asyncio.run(scenario())
    assert after_generate == first + 1 and after_others == after_generate


# Catches (VerifierServicer._step) the tree cap counting every new prompt id, held ones too
# (`could = active_requests + len(new)`), and (VerifierServicer.VerifyStream) a refused step
# aborting the stream INTERNAL instead of with the refusal's own code.
def test_a_step_of_more_trees_than_held_requests_ends_the_stream_invalid_argument(ckpt):
    """A prompt under an id the engine already holds adds no request, so it must not raise the
    step's tree cap: two requests held, a step of three trees is a flood however many such
    prompts pad it. The draft must see the refusal's own status (INVALID_ARGUMENT, naming the
    step's trees) on its stream: INTERNAL reads as a verifier bug, not a draft out of step."""
    async def run():
        svc = servicer(ckpt)
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            pending = await roots(stream, 1, "a", "b")
            step = verify(2, [(r, *chain(pending[r], 1)) for r in ("a", "b")] + [("x", *chain(5, 1))])
            step.prefills.extend(prefill(2, "a").prefills)   # "a" is held: this prompt starts no request
            await stream.write(step)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream.read()
            return info.value
    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "draft d1: a step of 3 trees, more than the 2 requests it could verify" in err.details()


# Catches (VerifierServicer._verify) a ServiceError the engine raises for the step's trees
# re-raised (ending the whole stream) instead of failing those trees with it.
def test_trees_the_engine_refuses_fail_with_its_error_and_the_stream_goes_on(ckpt):
    """The engine checks a step's trees again on every rank and may refuse them: that is the
    trees' fault, not the stream's. Each tree's result carries the engine's code and message, a
    warning names the draft, nothing is committed, and the next step verifies as usual. Ended
    instead, the stream freed every request of the draft (their KV and progress lost)."""
    from structlog.testing import capture_logs

    async def run():
        svc = servicer(ckpt)
        call, refuse = svc.group.call, [True]

        def refusing(method, *args):
            if method == "verify" and refuse:
                refuse.clear()
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "the engine refuses these trees")
            return call(method, *args)
        svc.group.call = refusing
        async with serving(svc) as stub:
            await stub.Handshake(hello(ckpt, "d1"))
            stream = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            pending = await roots(stream, 1, "a", "b")
            lengths = {r: svc.engine._requests[r].length for r in pending}
            with capture_logs() as logs:
                await stream.write(verify(2, [(r, *chain(pending[r], 3)) for r in ("a", "b")]))
                refused = await stream.read()
            kept = {r: svc.engine._requests[r].length for r in pending}
            await stream.write(verify(3, [(r, *chain(pending[r], 3)) for r in ("a", "b")]))
            after = outcome(await stream.read())
            return refused, logs, lengths, kept, after
    refused, logs, lengths, kept, after = asyncio.run(run())
    assert [v.request_id for v in refused.verifies] == ["a", "b"]
    assert set(outcome(refused).values()) == {(grpc.StatusCode.INVALID_ARGUMENT, "the engine refuses these trees")}
    assert refused.features.tensors[0].shape[0] == 0 and kept == lengths
    assert [(e["event"], e["draft_id"], e["requests"], e["error"]) for e in logs if e["event"] == "verify_refused"] \
        == [("verify_refused", "d1", 2, "the engine refuses these trees")]
    assert {code for code, _ in after.values()} == {grpc.StatusCode.OK}


# Catches (check_feature_layers_setting) `i >= depth` turned into `i > depth`.
def test_a_feature_layer_equal_to_the_models_depth_is_refused_before_the_weights_load(monkeypatch) -> None:
    """Layers count 0..depth-1: ``verifier.feature_layers`` naming layer ``depth`` must fail the
    start-up from the config alone, naming the setting, not after minutes of loading a large
    model's weights (and then as an engine error that does not name the setting)."""
    from services.verifier import server

    depth = json.loads(Path("models/demo/config.json").read_text())["num_hidden_layers"]

    def load(*args, **kwargs):
        pytest.fail("the weights loaded before verifier.feature_layers was checked")
    monkeypatch.setattr(server.TargetModel, "load", load)
    with pytest.raises(SettingsError) as refused:
        server.build_engine(VerifierSettings(model_path="models/demo", feature_layers=(1, depth),
                                             kv_capacity_tokens=256))
    assert str(refused.value) == (f"verifier.feature_layers: [{depth}] outside the target's {depth} layers "
                                  f"(0..{depth - 1})")


class _FailingEncoder:
    """A tokenizer that raises its own error type for the text (a lone surrogate, say)."""

    async def encode(self, text: str) -> list[int]:
        raise Exception("unexpected character in the input")   # noqa: TRY002 - as the tokenizers library does


class _GatedEncoder:
    """Tokenizes a text once ``gate`` is set (a long text in the worker process); ``texts``: each call."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.texts: list[str] = []

    async def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        await self.gate.wait()
        return [1, 2, 3]


def _text_servicer(draft, encoder):
    """``scheduler``'s servicer, router and lane, the servicer taking text prompts through ``encoder``."""
    from services.common.tokenizer_files import load_tokenizer
    from services.scheduler.server import SchedulerServicer

    servicer, router, lane = scheduler(draft)
    tokenizer = load_tokenizer("models/demo")
    return SchedulerServicer(servicer.settings, router, router.info, tokenizer, encoder), router, lane


# Catches (SchedulerServicer._encode) a tokenizer's error on a text prompt refused INTERNAL instead
# of INVALID_ARGUMENT.
def test_a_text_the_tokenizer_cannot_encode_is_refused_invalid_argument() -> None:
    """A text the tokenizer rejects is the client's input to fix, not a server fault: the client
    sees INVALID_ARGUMENT saying so (not retryable), and the refusal is counted as invalid input,
    so an operator's INTERNAL alerts do not fire for bad prompts."""
    from services.scheduler.client import REFUSED_METADATA, RETRYABLE_METADATA

    async def scenario():
        servicer, router, _ = _text_servicer(SlowDraft(), _FailingEncoder())
        context = _Context()
        request = scheduler_pb2.GenerateRequest(request_id="t", text="def f(x):", max_tokens=4)
        with pytest.raises(_Aborted) as aborted:
            await servicer.Generate(request, context).__anext__()
        value = router.metrics.registry.get_sample_value
        counts = tuple(value("ddtree_requests_refused_total", {"code": code, "reason": code}) or 0
                       for code in ("invalid_argument", "internal"))
        await router.stop()
        return context.status, str(aborted.value), counts, servicer._encoding

    (code, trailers), message, counts, encoding = asyncio.run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message == "prompt text cannot be tokenized: unexpected character in the input"
    assert trailers[RETRYABLE_METADATA] == "false" and trailers[REFUSED_METADATA] == "true"
    assert counts == (1, 0) and encoding == {}


# Catches (SchedulerServicer._encode) the in-use check `any(lane.has_live(rid) ...)` dropped, or
# made with `lane.find(rid)` (which misses a queued request and counts an aborted one).
def test_a_text_requests_id_is_in_use_exactly_while_a_live_request_holds_it() -> None:
    """A text request reusing the id of a live request (running or queued) is refused
    ALREADY_EXISTS at once, before its text is tokenized: let through, it sat in the tokenizing
    table, and an Abort of that id hit it (answering "found") while the live request ran on to
    max_tokens, holding its slot and KV. Once that request is aborted its id is free at once
    (as for token-id prompts), even while its last step is still in flight."""
    async def drain(stream) -> list:
        return [event async for event in stream]

    def result(task, context):
        if not task.done():
            return None   # let through to the tokenizer
        try:
            return task.result()
        except _Aborted as exc:
            return context.status[0], str(exc)

    async def scenario():
        encoder = _GatedEncoder()
        servicer, router, lane = _text_servicer(SlowDraft(delay=10.0), encoder)   # the first step stays in flight
        running = asyncio.ensure_future(drain(servicer.Generate(generate(1000, "run"), _Context())))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(drain(servicer.Generate(generate(1000, "queued"), _Context())))
        await asyncio.sleep(0.05)
        assert lane.find("run") is not None and [w.request_id for w in lane.waiting] == ["queued"]
        texts = {}
        for rid in ("run", "queued"):
            context = _Context()
            text = scheduler_pb2.GenerateRequest(request_id=rid, text="def f(x):", max_tokens=4)
            texts[rid] = (asyncio.ensure_future(servicer.Generate(text, context).__anext__()), context)
        await asyncio.sleep(0.05)
        refusals = {rid: result(*texts[rid]) for rid in texts}
        tokenized = list(encoder.texts)
        found = (await servicer.Abort(scheduler_pb2.AbortRequest(request_id="run"), _Context())).found
        try:
            ended = (await asyncio.wait_for(asyncio.shield(running), 0.5))[-1].finish_reason
        except asyncio.TimeoutError:
            ended = None   # the abort did not reach the running request
        finishing = lane.find("run") is not None and lane.find("run").aborted   # its step is still in flight
        context = _Context()
        reuse = asyncio.ensure_future(servicer.Generate(
            scheduler_pb2.GenerateRequest(request_id="run", text="def f(x):", max_tokens=4), context).__anext__())
        await asyncio.sleep(0.05)
        encoder.gate.set()
        await asyncio.sleep(0.05)
        reused = (result(reuse, context), [w.request_id for w in lane.waiting])
        for task in (running, queued, reuse, *(t for t, _ in texts.values())):
            task.cancel()
        await asyncio.gather(running, queued, reuse, *(t for t, _ in texts.values()), return_exceptions=True)
        await router.stop()
        return refusals, tokenized, found, ended, finishing, reused

    refusals, tokenized, found, ended, finishing, (reused, waiting) = asyncio.run(scenario())
    for rid in ("run", "queued"):
        assert refusals[rid] == (grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid} is already in use"), refusals
    assert tokenized == []   # refused before their text reached the tokenizer
    assert found and ended == scheduler_pb2.FINISH_REASON_ABORTED
    assert finishing and reused is None and waiting == ["queued", "run"]   # the aborted one's id taken again
