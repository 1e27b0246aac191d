"""The scheduler's admission (StepLoop._schedule): batch, KV and per-step prefill limits."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import grpc
import pytest
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, scheduler_pb2
from services.common.grpc_server import ServiceError
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler.batcher import KvBudget, StepLoop
from services.scheduler.draft_link import StepFailed
from services.scheduler.request import ActiveRequest, Limits


def request(rid: str, prompt_len: int, kv: int = 100) -> ActiveRequest:
    return ActiveRequest(request_id=rid, prompt_ids=list(range(2, 2 + prompt_len)),
                         sampling=common_pb2.SamplingParams(), max_tokens=8, budget=8,
                         mode=common_pb2.MODE_DDTREE, stop=(), stop_ids=frozenset(), eos_ids=frozenset(),
                         tokenizer=None, kv_tokens=kv)


def loop(**settings) -> StepLoop:
    limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000)
    return StepLoop(SchedulerSettings(**settings), "draft", None, limits, KvBudget(capacity=10_000),
                    Metrics("scheduler-test"))


async def run_one(draft, rid: str) -> ActiveRequest:
    """One request through a lane to ``draft``, until it ends (or 1 s)."""
    lane = loop()
    lane.draft = draft
    req = request(rid, 10)
    lane.waiting.append(req)
    lane.start()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if req.done:
            break
    await lane.stop()
    return req


def started(draft, req: ActiveRequest, **settings) -> StepLoop:
    """A lane to ``draft`` with ``req`` submitted and its loop running (call on an event loop)."""
    lane = loop(**settings)
    lane.draft = draft
    lane.submit(req)
    lane.start()
    return lane


async def until(done, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def client_id(wire_id: str) -> str:
    """The request_id an item's wire id was made from (``batcher.wire_id``)."""
    head, sep, _ = wire_id.rpartition("#")
    return head if sep else wire_id


def admitted(step: StepLoop) -> list[str]:
    return [client_id(i.request_id) for i in step._schedule() if i.prompt_token_ids]


def pieces(step: StepLoop) -> tuple[dict[str, tuple[int, bool]], list[str]]:
    """One step: each prompt piece's (length, more to come), and the requests it verifies."""
    items = step._schedule()
    return ({client_id(i.request_id): (len(i.prompt_token_ids), i.prompt_continues) for i in items
             if i.prompt_token_ids},
            [client_id(i.request_id) for i in items if not i.prompt_token_ids])


def test_prompt_tokens_a_step_are_bounded_and_long_prompts_go_in_pieces() -> None:
    async def scenario() -> None:
        step = loop(max_prefill_tokens=1000, max_batch=64)
        step.waiting.extend([request("a", 600), request("b", 300), request("c", 200), request("d", 50)])
        assert pieces(step) == ({"a": (600, False), "b": (300, False), "c": (100, True)}, [])
        assert pieces(step) == ({"c": (100, False), "d": (50, False)}, ["a", "b"])
        long = request("long", 2500)
        step.waiting.append(long)
        sent, verified = [], []
        for _ in range(3):
            items = step._schedule()
            sent += [i for i in items if i.prompt_token_ids]
            verified.append([client_id(i.request_id) for i in items if not i.prompt_token_ids])
        assert [(client_id(i.request_id), len(i.prompt_token_ids), i.prompt_continues) for i in sent] == [
            ("long", 1000, True), ("long", 1000, True), ("long", 500, False)]
        assert [t for i in sent for t in i.prompt_token_ids] == long.prompt_ids
        assert verified == [["a", "b", "c", "d"]] * 3     # the running requests decode between the pieces
        assert sent[0].max_new_tokens == long.max_tokens + 1500 and sent[0].mode == common_pb2.MODE_DDTREE
        assert not sent[1].HasField("sampling") and sent[1].max_new_tokens == 0
        assert step.kv.reserved == 500                    # the KV of every request, reserved once

    asyncio.run(scenario())


def test_a_steps_prompt_tokens_keep_its_replys_features_under_grpcs_message_cap() -> None:
    """The verifier's reply carries the features of every token a step commits, in the message where
    they exceed a ring slot: at Kimi-K2 widths (3 layers x 7168 in bf16) a step past about 24K prompt
    tokens outgrew gRPC's 1 GiB cap, and the stream failed with every request on it."""
    from services.common.grpc_server import MAX_MESSAGE_BYTES
    from services.scheduler.request import step_prompt_tokens

    k2 = Limits(vocab_size=64, max_context=131072, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000,
                feature_bytes_per_token=3 * 7168 * 2)
    unknown = dataclasses.replace(k2, feature_bytes_per_token=0)   # a draft that does not say
    assert step_prompt_tokens(SchedulerSettings(max_prefill_tokens=8192), k2) == 8192
    assert step_prompt_tokens(SchedulerSettings(max_prefill_tokens=65536), unknown) == 65536
    capped = step_prompt_tokens(SchedulerSettings(max_prefill_tokens=65536, max_batch=64), k2)
    assert 20_000 < capped < 24_000
    assert (capped + 64 * 16) * k2.feature_bytes_per_token < MAX_MESSAGE_BYTES   # running requests' blocks too
    assert (capped + 64 * 16 + 400) * k2.feature_bytes_per_token > MAX_MESSAGE_BYTES * 0.98   # and not far below it
    huge = dataclasses.replace(k2, feature_bytes_per_token=1 << 20)   # 1 MiB a token: 64 x 16 tokens alone are 1 GiB
    assert step_prompt_tokens(SchedulerSettings(max_batch=64), huge) == 0

    async def scenario() -> None:   # the batcher admits by it
        narrow = dataclasses.replace(k2, feature_bytes_per_token=(MAX_MESSAGE_BYTES - (16 << 20)) // (64 * 16 + 700))
        step = StepLoop(SchedulerSettings(max_prefill_tokens=5000, max_batch=64), "draft", None, narrow,
                        KvBudget(capacity=10_000), Metrics("scheduler-test"))
        step.waiting.extend([request("a", 600), request("b", 300)])
        assert pieces(step) == ({"a": (600, False), "b": (100, True)}, [])

    asyncio.run(scenario())


def test_batch_and_kv_limits_hold_too() -> None:
    async def scenario() -> None:
        step = loop(max_prefill_tokens=10_000, max_batch=2)
        step.waiting.extend([request("a", 10), request("b", 10), request("c", 10)])
        assert admitted(step) == ["a", "b"]
        step2 = loop(max_prefill_tokens=10_000, max_batch=8)
        step2.waiting.extend([request("x", 10, kv=6000), request("y", 10, kv=6000)])
        assert admitted(step2) == ["x"]                   # y's KV does not fit beside x's

    asyncio.run(scenario())


def test_speculation_gate_falls_back_while_drafts_are_rejected_and_probes_again() -> None:
    from services.scheduler.speculation import SpeculationGate

    gate = SpeculationGate(min_acceptance=1.5, backoff=3, max_backoff=6, window=2)
    sent = []

    def step(acceptance: float) -> None:
        spec = gate.speculate()
        sent.append(int(spec))
        gate.observe(spec, acceptance if spec else 1.0)   # an AR step accepts exactly 1

    for _ in range(2):
        step(1)                      # a window of rejected drafts ...
    for _ in range(3):
        step(5)                      # ... three AR steps, whatever the drafts would have done
    for _ in range(2):
        step(1.2)                    # the probe fails: the pause doubles
    assert gate.window_mean == pytest.approx(1.2)   # what the pause was decided on (the log says it)
    for _ in range(6):
        step(1)
    for _ in range(4):
        step(4)                      # accepted again: stays speculative, and the pause resets
    step(1)                          # one bad step in a good window: no fallback (mean 2.5)
    assert sent == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert gate.fallbacks == 2 and gate._next_backoff == 3
    off = SpeculationGate(min_acceptance=0)
    for _ in range(10):
        assert not off.observe(True, 1.0)
    assert off.speculate() and off.fallbacks == 0


def test_the_speculation_pause_doubles_up_to_its_cap_and_a_window_at_the_bar_keeps_speculating() -> None:
    from services.scheduler.speculation import SpeculationGate

    gate = SpeculationGate(min_acceptance=1.5, backoff=2, max_backoff=8, window=2)
    pauses = []
    for _ in range(6):                       # every probe fails
        for _ in range(2):
            assert gate.speculate()
            gate.observe(True, 1.0)
        pauses.append(gate.pause_left)
        while not gate.speculate():          # the pause's autoregressive steps, then a probe
            pass
    assert pauses == [2, 4, 8, 8, 8, 8]       # doubles, then stays at the cap
    at_bar = SpeculationGate(min_acceptance=1.5, backoff=2, window=4)
    for a in (1, 2, 1, 2, 1, 2, 1, 2):       # integer acceptances whose mean is exactly the bar
        assert at_bar.speculate()
        assert not at_bar.observe(True, float(a))
    assert at_bar.fallbacks == 0 and at_bar.window_mean == 1.5


def test_step_loop_pauses_speculation_for_the_whole_batch() -> None:
    async def scenario() -> None:
        step = loop(max_batch=8, spec_min_acceptance=1.5, spec_backoff_steps=2)
        step.gate.window = 2
        sampled = request("s", 10)
        sampled.sampling.temperature = 0.8
        step.waiting.extend([request("a", 10), request("b", 10), sampled])
        step._schedule()                                  # the prefill step
        budgets = []
        for accepted in (1.0, 1.5, 9.0, 9.0, 3.0, 3.0):
            items = step._schedule()
            budgets.append([i.budget for i in items])
            step.gate.observe(step._speculating, accepted)
        # Two DDTree steps averaging 1.25 < 1.5: every request decodes AR for two steps (no tree
        # of one pads the other's), the sampled one too (its draws do not follow its trees), then
        # all probe again. A sampled request kept its trees, and with them every tree's size.
        assert budgets == [[8, 8, 8], [8, 8, 8], [0, 0, 0], [0, 0, 0], [8, 8, 8], [8, 8, 8]]
        # A prompt admitted while speculation is paused carries budget 0 too (the draft drafts its
        # first tree at that budget), a sampled one as well.
        step.gate.observe(True, 1.0), step.gate.observe(True, 1.0)   # two poor steps: paused again
        late, late_sampled = request("c", 10), request("t", 10)
        late_sampled.sampling.temperature = 0.8
        step.waiting.extend([late, late_sampled])
        items = {client_id(i.request_id): i for i in step._schedule()}
        assert not step._speculating and items["a"].budget == 0
        assert list(items["c"].prompt_token_ids) and items["c"].budget == 0 and items["t"].budget == 0
        # The batch empties: the pause, the doubled backoff and the window go with the requests they
        # were decided on (a pause kept over an idle spell judged the next batch, in `ddtree bench`
        # the next budget's cell, by the last one's drafts); a request into it speculates.
        assert not step.gate.observe(True, 1.0)           # half a window (2) seen before the batch ends
        for r in list(step.running.values()):
            step._finish(r)
        assert step.gate.pause_left == 1                  # the pause of 2 had a step left; the next is 4
        assert step._schedule() == [] and step.gate.pause_left == 0
        step.waiting.append(request("new", 10))
        assert [i.budget for i in step._schedule()] == [8] and step._speculating
        assert not step.gate.observe(True, 1.0)           # the window starts empty: one step decides nothing
        assert step.gate.observe(True, 1.0) and step.gate.pause_left == 2   # the first pause again, not 4

    asyncio.run(scenario())


@pytest.mark.parametrize("release_step", ["hangs", "fails"])
def test_a_release_step_that_hangs_or_fails_gives_its_kv_back(release_step: str) -> None:
    """A replica forgotten (its name no longer resolves) while its release step hung kept that
    step's KV in the cancelled step; a release step that failed (the replica went down) kept it
    out of the replica's give-back. Either way the group's budget lost it for good."""
    class Draft(SlowDraft):   # answers a request's step, then hangs on, or fails, the release
        async def step(self, req, timeout):
            if not req.items:
                if release_step == "fails":
                    raise StepFailed(grpc.StatusCode.UNAVAILABLE, "gone")
                await asyncio.sleep(60)
            return await super().step(req, timeout)

    async def scenario() -> None:
        req = request("r", 10, kv=600)
        req.max_tokens = 1
        lane = started(Draft(delay=0.0), req)
        await until(lambda: not lane.healthy if release_step == "fails" else bool(lane._releasing))
        assert req.done
        if release_step == "hangs":
            assert lane._releasing and lane.kv.reserved == 600
        else:
            assert not lane.healthy and lane.kv.reserved == 0
        await lane.stop()
        assert lane.kv.reserved == 0

    asyncio.run(scenario())


def test_a_pause_is_spent_on_decoding_steps_and_a_prompt_piece_follows_it() -> None:
    """A pause of 4 steps spent on a long prompt's pieces left none for decoding (the first decode
    speculated again); a prompt piece sent while paused carries the gate's state, not the last
    decision (budget 8 while paused)."""
    async def scenario() -> None:
        lane = loop(spec_min_acceptance=1.5, spec_backoff_steps=4, max_prefill_tokens=100)
        lane.gate.window = 2
        lane.waiting.append(request("long", 500))                     # 5 pieces of 100
        first = lane._schedule()[0]
        assert first.prompt_token_ids and first.budget == 8
        lane.gate.observe(True, 1.0), lane.gate.observe(True, 1.0)   # a poor window: 4 steps without trees
        assert lane._speculating and lane.gate.pause_left == 4
        steps = [lane._schedule()[0] for _ in range(8)]
        assert [bool(i.prompt_token_ids) for i in steps] == [True] * 4 + [False] * 4
        assert [i.budget for i in steps] == [0] * 8 and lane.gate.pause_left == 0
        assert lane._schedule()[0].budget == 8                        # the pause is over: trees again

    asyncio.run(scenario())


def test_usage_counts_the_steps_verified_with_a_tree_apart_from_paused_ones() -> None:
    """While the scheduler paused speculation a DDTree request's steps decode one token and count 1
    in its mean_acceptance: a user's first request read as a poor drafter (1.75 where the drafter
    accepted 2.4). Usage now says how many of its steps were tree steps."""
    from ddtree.v1 import draft_pb2

    class Draft:   # a tree step accepts 3 tokens, an autoregressive one 1
        async def step(self, req, timeout):
            return draft_pb2.StepResponse(results=[draft_pb2.StepResult(
                request_id=i.request_id, token_ids=[5] * (1 if i.prompt_token_ids or not i.budget else 3),
                acceptance_length=0 if i.prompt_token_ids else 3 if i.budget else 1) for i in req.items])

        def close(self) -> None:
            pass

    metrics = Metrics("scheduler-test")

    async def scenario() -> ActiveRequest:
        limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000)
        step = StepLoop(SchedulerSettings(spec_min_acceptance=4.0, spec_backoff_steps=4), "draft", Draft(), limits,
                        KvBudget(capacity=10_000), metrics)
        req = request("a", 10)
        req.max_tokens = 60
        step.submit(req)
        step.start()
        for _ in range(500):
            if req.done:
                break
            await asyncio.sleep(0.005)
        await step.stop()
        return req

    with capture_logs() as logs:
        req = asyncio.run(scenario())
    usage = req.usage()
    assert req.done and usage.steps == len(req.acceptance)
    assert 0 < usage.tree_steps < usage.steps   # the window of 4 tree steps, then paused ones, then a probe
    pauses = sum(e["event"] == "speculation_paused" for e in logs)
    assert pauses >= 1 and metrics.registry.get_sample_value("ddtree_speculation_pauses_total",
                                                            {"draft": "draft"}) == pauses
    assert sum(req.acceptance) == 59 and usage.tree_steps == sum(1 for a in req.acceptance if a > 1)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_failed_replica_fails_its_requests_unavailable_whatever_ended_its_stream(code) -> None:
    """A replica whose stream ended UNAUTHENTICATED (a new token volume), FAILED_PRECONDITION (its
    verifier refused the handshake) or with a bug passed that code to clients with good requests,
    who took it for their own fault and did not retry."""
    class Failing(SlowDraft):
        async def step(self, req, timeout):
            raise StepFailed(code, "the draft stream ended")

    with capture_logs() as logs:
        err = asyncio.run(run_one(Failing(), "a")).error
    assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE
    assert err.message == f"draft replica draft failed ({code.name}): the draft stream ended"
    # At warning: a filter on warnings finds the requests a failure ended.
    assert [e["log_level"] for e in logs if e["event"] == "request_end"] == ["warning"]


def test_requests_of_a_failed_step_are_released_when_the_replica_is_back() -> None:
    import grpc

    from ddtree.v1 import draft_pb2

    class FlakyDraft:
        """Fails the first step (a timeout), then answers every step with no results."""

        def __init__(self) -> None:
            self.calls: list[draft_pb2.StepRequest] = []

        async def step(self, request, timeout):
            self.calls.append(request)
            if len(self.calls) == 1:
                raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "step timed out")
            return draft_pb2.StepResponse()

        def close(self) -> None:
            pass

    async def scenario() -> None:
        step = loop(max_batch=8)
        step.draft = FlakyDraft()
        step.waiting.extend([request("a", 10), request("b", 10)])
        step._release.append("old")                        # finished earlier; its release rides the failing step
        step.start()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not step.healthy:
                break
        assert not step.healthy and step.running == {}   # both requests failed with the step
        await asyncio.sleep(0.05)
        assert len(step.draft.calls) == 1                  # nothing is sent to a replica marked down
        step.mark_healthy()                                # the same process answers again
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(step.draft.calls) > 1:
                break
        await step.stop()
        # It still holds the failed requests' contexts, pool rows and KV: they are released.
        assert list(step.draft.calls[0].release) == ["old"]
        assert sorted(map(client_id, step.draft.calls[1].release)) == ["a", "b", "old"]

    asyncio.run(scenario())


class SlowDraft:
    """Every step in flight for ``delay`` s, a token a request."""

    def __init__(self, delay: float = 0.1) -> None:
        self.delay = delay
        self.seen: list = []   # every item of every step

    async def step(self, req, timeout):
        from ddtree.v1 import draft_pb2

        self.seen.extend(req.items)
        await asyncio.sleep(self.delay)
        return draft_pb2.StepResponse(results=[draft_pb2.StepResult(
            request_id=i.request_id, token_ids=[5], acceptance_length=0 if i.prompt_token_ids else 1) for i in req.items])

    def close(self) -> None:
        pass


class Stub:
    """A replica's model info as the router probes it; ``down``: the probe fails; ``silent``: it
    waits out its deadline (a host that does not answer)."""

    def __init__(self, verifier_id: str, down: bool = False, capacity: int = 10_000, silent: bool = False) -> None:
        self.verifier_id = verifier_id
        self.down = down
        self.capacity = capacity
        self.silent = silent

    async def GetModelInfo(self, request, wait_for_ready=True, timeout=None, metadata=()):
        import grpc

        if self.silent:
            await asyncio.sleep(timeout)
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "")
        if self.down:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
        return common_pb2.ModelInfo(verifier_id=self.verifier_id, kv_capacity_tokens=self.capacity)


class Draft(SlowDraft):
    """A SlowDraft the router can probe."""

    def __init__(self, verifier_id: str, down: bool = False) -> None:
        super().__init__(delay=0.01)
        self.stub = Stub(verifier_id, down)


def scheduler(draft):
    """A scheduler servicer in front of one lane to ``draft``: (servicer, router, lane). Stop the router."""
    from services.scheduler.router import Router
    from services.scheduler.server import SchedulerServicer

    settings = SchedulerSettings(tokenizer_path="")
    router = Router(settings, Metrics("scheduler-test"))
    router.info = common_pb2.ModelInfo(vocab_size=64, max_context=4096, block_size=16, kv_capacity_tokens=10_000)
    limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000)
    lane = StepLoop(settings, "draft", draft, limits, KvBudget(capacity=10_000), router.metrics)
    lane.start()
    router.lanes.append(lane)
    return SchedulerServicer(settings, router, router.info, None), router, lane


class NoDeadline:
    """The part of a gRPC servicer context a stream reads when its client leaves (and a refusal's
    log, its peer)."""

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def generate(max_tokens: int, request_id: str = "x"):
    from ddtree.v1 import scheduler_pb2

    req = scheduler_pb2.GenerateRequest(request_id=request_id, max_tokens=max_tokens, ignore_eos=True)
    req.token_ids.ids.extend([1, 2, 3])
    return req


def test_a_stream_closed_while_it_sends_an_event_cancels_its_request() -> None:
    """A client that leaves while gRPC sends it an event closes the stream at its yield
    (GeneratorExit, not a cancellation in its await): the request must end there too, not decode
    on to max_tokens holding its slot and KV."""
    async def scenario() -> tuple[bool, bool]:
        servicer, router, lane = scheduler(SlowDraft(delay=0.005))
        stream = servicer.Generate(generate(4000), NoDeadline())
        await stream.__anext__()    # the first token
        running = lane.find("x") is not None
        await stream.aclose()       # closed at the yield
        for _ in range(100):
            await asyncio.sleep(0.01)
            if lane.find("x") is None:
                break
        gone = lane.find("x") is None and all(r.request_id != "x" for r in lane.waiting)
        await router.stop()
        return running, gone

    assert asyncio.run(scenario()) == (True, True)


@pytest.mark.parametrize("leaves", ["cancelled_while_it_waits", "closed_with_its_abort_unread"])
def test_a_reused_id_survives_the_end_of_the_stream_it_replaced(leaves: str) -> None:
    """Abort request "x", reuse the id at once, then the old stream ends: its client goes away
    while it waits, or closes it before it read its aborted event (abort, then cancel the call:
    there the stream's own clean-up runs). Either ends the old request object only, not the new one
    with its id."""
    async def scenario() -> list[scheduler_pb2.GenerateResponse]:
        servicer, router, lane = scheduler(SlowDraft())
        old = servicer.Generate(generate(50), NoDeadline())
        await old.__anext__()
        waiting = asyncio.create_task(old.__anext__()) if leaves == "cancelled_while_it_waits" else None
        await asyncio.sleep(0.01)
        assert router.abort("x")
        new = servicer.Generate(generate(3), NoDeadline())
        first = asyncio.create_task(new.__anext__())
        await asyncio.sleep(0.01)
        if waiting is not None:
            waiting.cancel()  # the old stream's client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        else:
            await old.aclose()   # its finally runs, its aborted event unread
        messages = [await first]
        while not messages[-1].finish_reason:
            messages.append(await new.__anext__())
        await router.stop()
        return messages

    messages = asyncio.run(scenario())
    assert messages[-1].finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 3


def test_kv_freed_on_one_replica_admits_a_request_queued_on_another() -> None:
    """Two draft replicas in front of one verifier share its KV: a request queued on one for want
    of KV is admitted when a request of the other finishes (before, only the finishing lane woke,
    and the other slept on until its deadline)."""
    async def scenario() -> tuple[bool, bool]:
        limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=3000)
        budget = KvBudget(capacity=3000)
        lanes = [StepLoop(SchedulerSettings(), f"draft{i}", SlowDraft(delay=0.01), limits, budget,
                          Metrics("scheduler-test")) for i in range(2)]
        first, second = request("a", 10, kv=2018), request("b", 10, kv=2018)
        lanes[0].submit(first)
        for lane in lanes:
            lane.start()
        await asyncio.sleep(0.02)
        lanes[1].submit(second)           # does not fit beside "a"
        for _ in range(200):
            await asyncio.sleep(0.01)
            if second.finish:
                break
        for lane in lanes:
            await lane.stop()
        return bool(first.finish), bool(second.finish)

    assert asyncio.run(scenario()) == (True, True)


def test_the_router_places_a_request_where_its_kv_fits() -> None:
    """Replicas in front of verifier groups of different sizes: a request goes to one whose cache
    holds it, however loaded the others are; otherwise to the least loaded."""
    from services.scheduler.router import Router

    async def scenario() -> tuple[str, str]:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        small, big = (StepLoop(SchedulerSettings(), name, SlowDraft(), Limits(64, 4096, 16, (0,), cap), KvBudget(cap),
                               router.metrics) for name, cap in (("small", 1024), ("big", 4096)))
        router.lanes += [small, big]
        big.waiting.append(request("queued", 10))                  # the big lane is the busier one
        large = request("large", 10, kv=2018)
        router.submit(large)
        small.waiting.extend(request(f"q{i}", 10) for i in range(3))   # now the small lane is the busier one
        fresh = request("y", 10)
        router.submit(fresh)
        return large.draft, fresh.draft

    assert asyncio.run(scenario()) == ("big", "big")


def test_a_failed_round_of_the_replica_watcher_does_not_end_it(monkeypatch) -> None:
    """An error in one round (a probe, a discovery) is logged; the next round runs. A watcher that
    died would leave every replica that went down out for good."""
    from services.scheduler import router as router_module

    async def scenario() -> int:
        router = router_module.Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        rounds = []

        async def flaky_round(n: int) -> None:
            rounds.append(n)
            if n == 1:
                raise RuntimeError("a probe that blew up")

        monkeypatch.setattr(router_module, "PROBE_INTERVAL_S", 0.01)
        monkeypatch.setattr(router, "_watch_round", flaky_round)
        watcher = asyncio.create_task(router._watch_replicas())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(rounds) >= 3:
                break
        watcher.cancel()
        return len(rounds)

    assert asyncio.run(scenario()) >= 3


def test_an_id_reused_while_its_release_is_in_flight_goes_downstream_under_another_wire_id() -> None:
    """A request's last event reaches its client while the next step, which carries its release,
    is in flight: the id may be reused at once, on any replica, since the draft and verifier know
    each admission by an id of its own (under the bare id, the new prefill could reach a shared
    verifier before the old release, or before a failed replica's clean-up: ALREADY_EXISTS)."""
    from services.scheduler.router import Router

    async def scenario() -> tuple[list[str], ActiveRequest, ActiveRequest, list[str]]:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        limits = Limits(64, 4096, 16, (0,), 10_000)
        busy, idle = (StepLoop(SchedulerSettings(), name, SlowDraft(delay=0.05), limits, KvBudget(10_000),
                               router.metrics) for name in ("busy", "idle"))
        router.lanes += [busy, idle]
        for i in range(3):   # the busier lane, for longer than "x"
            busy.waiting.append(request(f"q{i}", 10))
            busy.waiting[-1].max_tokens = 1000
        first = request("x", 10)
        busy.submit(first)
        for lane in router.lanes:
            lane.start()
        for _ in range(400):
            if first.finish:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.01)          # the step that releases "x" is in flight now
        in_flight = list(busy.pending_releases)
        again = request("x", 10)
        router.submit(again)
        for _ in range(100):
            await asyncio.sleep(0.005)
            if again.started:
                break
        await router.stop()
        return in_flight, first, again, [i.request_id for i in idle.draft.seen]

    in_flight, first, again, idle_items = asyncio.run(scenario())
    assert first.wire_id in in_flight and again.draft == "idle"     # the least loaded replica
    assert first.wire_id.startswith("x#") and again.wire_id.startswith("x#") and again.wire_id != first.wire_id
    assert again.wire_id in idle_items and "x" not in idle_items


def test_a_lane_follows_its_replicas_verifier_to_that_groups_kv_budget() -> None:
    """A verifier restarts with a new id; its replicas reconnect and stay up. Each lane's KV budget
    follows (a lane that rejoined later would get the new group's, and one group would be admitted
    against two budgets); a request admitted before gives its KV back where it took it. The model
    info the scheduler tells is the new group's (it told the start's for good)."""
    from services.scheduler.router import Router

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        router.info = common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)
        old = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))
        lanes = [StepLoop(SchedulerSettings(), f"d{i}", Draft("v1"), Limits(64, 4096, 16, (0,), 10_000), old,
                          router.metrics) for i in range(2)]
        router.lanes += lanes
        before = request("before", 10, kv=500)
        lanes[0].waiting.append(before)
        lanes[0]._schedule()                      # admitted against v1's budget
        told = [router.served_info().verifier_id]
        for lane in lanes:
            lane.draft.stub.verifier_id = "v2"    # the verifier restarted
            lane.draft.stub.capacity = 20_000
        await router._follow_verifiers()
        told.append((router.served_info().verifier_id, router.served_info().kv_capacity_tokens))
        new = lanes[0].kv
        lanes[0]._finish(before)
        owed = old.reserved                       # until the step that releases it is answered
        lanes[0].start()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not lanes[0].pending_releases:
                break
        await lanes[0].stop()
        return old, new, lanes[1].kv, owed, told

    old, new, other, owed, told = asyncio.run(scenario())
    assert told == ["v1", ("v2", 20_000)]
    assert new is other and new is not old and new.verifier_id == "v2"
    assert owed == 500 and old.reserved == 0 and new.reserved == 0


def test_a_replica_rejoining_behind_a_restarted_verifier_moves_its_groups_other_replicas_at_once() -> None:
    """One replica's step failed as its verifier restarted; the other, idle, stayed up. The first
    rejoins on the new group's budget; the second moves to it in the same round, not up to five
    seconds later at the next discovery round: meanwhile the new group was admitted against the
    old budget and the new one, twice its cache. Beside the watch round, and all at once: two silent
    replicas of the old group held the round (every other recovery) for a probe's timeout each."""
    from services.scheduler.router import Router

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        old = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))
        other = router._budget(common_pb2.ModelInfo(verifier_id="w1", kv_capacity_tokens=10_000))
        lanes = [StepLoop(SchedulerSettings(), f"d{i}", Draft("v1"), Limits(64, 4096, 16, (0,), 10_000), old,
                          router.metrics) for i in range(4)]
        apart = StepLoop(SchedulerSettings(), "w", Draft("w1"), Limits(64, 4096, 16, (0,), 10_000), other, router.metrics)
        router.lanes += lanes + [apart]
        lanes[0].healthy = False
        for lane in lanes:
            lane.draft.stub.verifier_id = "v2"    # the verifier restarted
        lanes[2].draft.stub.silent = lanes[3].draft.stub.silent = True   # gone without a word
        apart.draft.stub.down = True              # another group's replica, not probed for this
        t0 = time.monotonic()
        await router._recover(lanes[0])
        recovered_s = time.monotonic() - t0
        await asyncio.gather(*router._follows)
        followed_s = time.monotonic() - t0
        return lanes[0].kv, [x.kv for x in lanes[1:]], [x.healthy for x in lanes], old, apart, recovered_s, followed_s

    new, others, healthy, old, apart, recovered_s, followed_s = asyncio.run(scenario())
    assert new is not old and new.verifier_id == "v2"
    assert others[0] is new and healthy == [True, True, False, False]   # the silent ones are marked down
    assert apart.healthy
    assert recovered_s < 0.5 and followed_s < 1.8, (recovered_s, followed_s)   # one probe timeout (1 s), not two


def test_the_rejoin_hold_grows_from_the_second_failed_step_in_a_row() -> None:
    from services.scheduler.batcher import REJOIN_HOLD_MAX_S, rejoin_hold_s

    assert [rejoin_hold_s(n) for n in range(0, 5)] == [0.0, 0.0, 1.0, 2.0, 4.0]
    assert rejoin_hold_s(7) == REJOIN_HOLD_MAX_S == rejoin_hold_s(10**6)


def test_a_replica_whose_steps_keep_failing_while_it_answers_probes_is_held_down() -> None:
    """A broken verifier behind a live draft: each step fails, yet each probe answers. It rejoined
    every probe round and, least loaded (its requests failed at once), took the next requests and
    failed them. From its second failed step in a row it stays down for a while: its queue is not
    kept, and it is not probed; once the hold is over it rejoins, and an answered step of work (not
    the release-only step a rejoined replica sends first) clears it."""
    from services.scheduler.router import Router

    class Flaky(Draft):
        failing = True
        release_only = 0

        async def step(self, req, timeout):
            if self.failing and req.items:
                raise StepFailed(grpc.StatusCode.INTERNAL, "verifier broken")
            self.release_only += not req.items
            return await super().step(req, timeout)

    async def failed(lane: StepLoop, req: ActiveRequest) -> None:
        lane.submit(req)
        for _ in range(200):
            if not lane.healthy:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the step did not fail")

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        lane = StepLoop(SchedulerSettings(), "d0", Flaky("v1"), Limits(64, 4096, 16, (0,), 10_000),
                        router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)), router.metrics)
        router.lanes.append(lane)
        lane.start()
        await failed(lane, request("a", 10))
        first = (lane.failed_steps, lane.rejoin_after <= time.monotonic())
        await router._recover(lane)                 # one failed step: back at the next probe
        back_after_one = lane.healthy
        await asyncio.sleep(0.1)                    # its release-only step is answered: no step of work
        await failed(lane, request("b", 10))
        queued = request("c", 10)
        lane.waiting.append(queued)
        await router._recover(lane)                 # two in a row: held down, its queue not kept
        held = (lane.healthy, lane.failed_steps, queued.error is not None and queued.error.code, list(lane.waiting),
                lane.draft.release_only > 0)
        lane.draft.failing = False
        lane.rejoin_after = time.monotonic()        # the hold is over
        await router._recover(lane)
        back = lane.healthy
        ok = request("d", 10)
        lane.submit(ok)
        for _ in range(200):
            if ok.done:
                break
            await asyncio.sleep(0.01)
        await lane.stop()
        return first, back_after_one, held, back, ok.error, lane.failed_steps

    first, back_after_one, held, back, error, failed_steps = asyncio.run(scenario())
    assert first == (1, True) and back_after_one
    assert held == (False, 2, grpc.StatusCode.UNAVAILABLE, [], True)
    assert back and error is None and failed_steps == 0


def test_a_queue_whose_verifier_came_back_smaller_refuses_what_no_longer_fits() -> None:
    """The verifier restarts with a smaller KV cache and its replicas stay up: a queued request
    larger than the new cache sat at the head of the queue for good, and every request behind it.
    It goes to a replica whose cache holds it, else fails as `submit` would refuse it now:
    OUT_OF_RANGE where no replica holds it (a retry cannot succeed; it was RESOURCE_EXHAUSTED,
    which clients retry for ever), RESOURCE_EXHAUSTED where one that is down does. The rest run."""
    import grpc

    from services.scheduler.router import Router

    async def scenario(other_holds: bool, other_up: bool = True):
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        old = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))
        small = StepLoop(SchedulerSettings(), "small", Draft("v1"), Limits(64, 4096, 16, (0,), 10_000), old,
                         router.metrics)
        big_budget = router._budget(common_pb2.ModelInfo(verifier_id="big", kv_capacity_tokens=10_000))
        other = StepLoop(SchedulerSettings(), "other", Draft("big"), Limits(64, 4096, 16, (0,), 10_000), big_budget,
                         router.metrics)
        other.healthy = other_up
        router.lanes += [small] + ([other] if other_holds else [])
        running = request("running", 10, kv=6000)
        small.waiting.append(running)
        small._schedule()                         # holds 6000 of v1's 10000
        big, after = request("big", 10, kv=6000), request("after", 10, kv=100)
        small.waiting += [big, after]
        small.draft.stub.verifier_id, small.draft.stub.capacity = "v2", 5000   # restarted with 5000
        await router._follow_verifiers()
        small._schedule()
        return ([r.request_id for r in small.waiting], [r.request_id for r in small.running.values()], big.error,
                [r.request_id for r in other.waiting])

    waiting, running, error, moved = asyncio.run(scenario(other_holds=False))
    assert waiting == [] and "after" in running and running[0] == "running"
    assert error is not None and error.code == grpc.StatusCode.OUT_OF_RANGE and "the cache holds 5000" in error.message
    assert "lower max_tokens" in error.message
    waiting, running, error, moved = asyncio.run(scenario(other_holds=True, other_up=False))
    assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and moved == []
    waiting, running, error, moved = asyncio.run(scenario(other_holds=True))
    assert error is None and moved == ["big"] and waiting == [] and "after" in running


def test_a_request_no_cache_can_ever_hold_is_out_of_range_and_one_a_down_replica_could_is_exhausted() -> None:
    """Both were RESOURCE_EXHAUSTED, which `ddtree generate` (and a client's retry policy) reads as
    "try later", for a request that can never be served as it is."""
    import grpc

    from services.common.grpc_server import ServiceError
    from services.scheduler.router import Router

    router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
    lanes = [StepLoop(SchedulerSettings(), name, Draft(name), Limits(64, 4096, 16, (0,), cap),
                      router._budget(common_pb2.ModelInfo(verifier_id=name, kv_capacity_tokens=cap)), router.metrics)
             for name, cap in (("small", 1000), ("big", 5000))]
    router.lanes += lanes
    lanes[1].healthy = False
    codes = []
    for kv in (3000, 9000):
        with pytest.raises(ServiceError) as info:
            router.submit(request("r", 10, kv=kv))
        codes.append((info.value.code, info.value.reason))
        assert "the cache holds 1000" in info.value.message
    assert codes == [(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica_down"), (grpc.StatusCode.OUT_OF_RANGE, "kv_too_large")]
    assert "lower max_tokens" in info.value.message


def test_an_idle_replica_that_stops_answering_is_marked_down_without_a_request_failing() -> None:
    """Only a failed step marked a replica down: a scheduler whose only draft had died said
    SERVING (health, ``ddtree_draft_replica_up``) until a client's request failed there. A busy
    replica is left to its step, whose failure says more than a probe's timeout."""
    from services.scheduler.router import Router

    async def scenario(busy: bool) -> bool:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        lane = StepLoop(SchedulerSettings(), "d0", Draft("v1", down=True), Limits(64, 4096, 16, (0,), 10_000),
                        router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)),
                        router.metrics)
        router.lanes.append(lane)
        if busy:
            lane.waiting.append(request("r", 10))
            lane._schedule()
        await router._follow_verifiers()
        return lane.healthy

    assert asyncio.run(scenario(busy=False)) is False
    assert asyncio.run(scenario(busy=True)) is True


@pytest.mark.parametrize("field, value", [("vocab_size", 999), ("max_context", 512), ("kv_page_size", 64),
                                          ("tokenizer_digest", "bbbb")])
def test_a_replica_whose_verifier_came_back_with_another_model_is_kept_down(field, value) -> None:
    """The scheduler's tokenizer, vocabulary and end-of-sequence ids are the model it started with:
    a replica in front of a verifier restarted on another checkpoint served it on, detokenized with
    the wrong tokenizer. So do the limits it checks requests against: a verifier back with a
    shorter context refused prompts the scheduler had taken, one with larger pages reserved more
    KV than the scheduler counted. It is kept down (logged once) until the scheduler restarts. So
    is a replica whose target's tokenizer is not the scheduler's (the start checked the first only)."""
    from services.scheduler.router import Router

    class Model(Stub):
        changed: dict = {}

        async def GetModelInfo(self, request, wait_for_ready=True, timeout=None, metadata=()):
            info = await super().GetModelInfo(request, wait_for_ready, timeout)
            for k, v in self.changed.items():
                setattr(info, k, v)
            return info

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        router.tokenizer_digest = "aaaa"   # the scheduler's (its first replica's target held no tokenizer)
        stub = Model("v1")
        router.info = await stub.GetModelInfo(None)
        router._add_lane("d0", stub, router.info)
        lane = router.lanes[0]
        await router._follow_verifiers()
        healthy = [lane.healthy]
        stub.verifier_id, stub.changed = "v2", {field: value}   # the verifier restarted on another checkpoint
        await router._follow_verifiers()
        healthy.append(lane.healthy)
        await router._recover(lane)
        healthy.append(lane.healthy)
        await router.stop()
        return healthy, router._other_models

    healthy, logged = asyncio.run(scenario())
    assert healthy == [True, False, False] and logged == {"d0"}


def test_each_lane_caps_its_steps_by_its_own_verifiers_feature_width_and_a_refused_token_is_said() -> None:
    """The prompt tokens a step may carry follow the width of the replica's own verifier replies
    (the first replica's width served every lane, so one in front of a float32 verifier could
    outgrow gRPC's message cap); a replica whose replies cannot hold a step of ``max_batch`` is kept
    down, and one refusing the internal token is logged once as that, not as a dead replica."""
    import grpc

    from services.scheduler.request import step_prompt_tokens
    from services.scheduler.router import Router

    class Wide(Stub):
        width = 3 * 7168 * 2   # K2, bf16
        refuse = False

        async def GetModelInfo(self, request, wait_for_ready=True, timeout=None, metadata=()):
            if self.refuse:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAUTHENTICATED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "missing or wrong internal token")
            info = await super().GetModelInfo(request, wait_for_ready, timeout)
            info.vocab_size, info.block_size, info.feature_bytes_per_token = 64, 16, self.width
            return info

    async def scenario():
        settings = SchedulerSettings(tokenizer_path="", max_prefill_tokens=65536)
        router = Router(settings, Metrics("scheduler-test"))
        narrow, wide = Wide("v1"), Wide("v2")
        wide.width *= 2   # a float32 verifier
        router.info = await narrow.GetModelInfo(None)
        router._add_lane("d0", narrow, router.info)
        router._add_lane("d1", wide, await wide.GetModelInfo(None))
        caps = [step_prompt_tokens(settings, lane.limits) for lane in router.lanes]
        wide.width *= 100   # its verifier came back wider still: no step of 64 requests fits a message
        with capture_logs() as logs:
            await router._follow_verifiers()
            await router._follow_verifiers()
        kept_down = [lane.healthy for lane in router.lanes]
        narrow.refuse = True
        with capture_logs() as refused:
            for _ in range(3):
                await router._probe(narrow, 1.0, "d0")
        await router.stop()
        return caps, kept_down, logs, refused

    caps, kept_down, logs, refused = asyncio.run(scenario())
    assert 20_000 < caps[0] < 24_000 and 10_000 < caps[1] < 12_000
    assert kept_down == [True, False]
    assert [e["event"] for e in logs] == ["draft_replica_replies_too_large", "draft_replica_down"]
    assert logs[1]["reason"] == "replies larger than a message"
    assert [e["event"] for e in refused] == ["draft_replica_refused_token"]   # once, not each probe


def test_start_up_serves_once_one_replica_answers_not_after_the_silent_ones_time_out(monkeypatch) -> None:
    """``Router.start`` gathered every probe: one configured replica that did not answer held the
    scheduler's start for the whole ``draft_wait_s``. The silent one is brought in by the watcher."""
    import time

    from services.scheduler import router as router_module

    stubs = {"127.0.0.1:1": Stub("v1"), "127.0.0.1:2": Stub("v1", silent=True)}

    async def scenario():
        router = router_module.Router(SchedulerSettings(tokenizer_path="", draft_addresses=tuple(stubs)),
                                      Metrics("scheduler-test"))
        monkeypatch.setattr(router, "_stub", lambda address: stubs[address])
        t0 = time.monotonic()
        info = await router.start(timeout_s=30.0)
        took = time.monotonic() - t0
        up = {lane.address: lane.healthy for lane in router.lanes}
        await router.stop()
        return info, took, up

    info, took, up = asyncio.run(scenario())
    assert info.verifier_id == "v1" and took < 5.0, took
    assert up == {"127.0.0.1:1": True, "127.0.0.1:2": False}


def test_a_lone_replica_marked_down_keeps_its_queue_if_it_answers_again() -> None:
    """One replica, marked down by a slow step: its queued requests wait for it when its probe
    answers (before, they failed UNAVAILABLE before it was probed), and fail when it does not."""
    from services.scheduler.router import Router

    async def scenario(down: bool) -> tuple[bool, list[str], bool, float]:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        lane = StepLoop(SchedulerSettings(), "d0", Draft("v1", down=down), Limits(64, 4096, 16, (0,), 10_000),
                        router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)), router.metrics)
        router.lanes.append(lane)
        lane.healthy = False
        queued = request("q", 10)
        lane.waiting.append(queued)
        await router._recover(lane)
        counted = router.metrics.requests.labels("unavailable")._value.get()   # each ended request is counted
        return lane.healthy, [r.request_id for r in lane.waiting], queued.error is not None, counted

    assert asyncio.run(scenario(down=False)) == (True, ["q"], False, 0)
    assert asyncio.run(scenario(down=True)) == (False, [], True, 1)


def test_a_slow_dns_lookup_does_not_hold_up_a_down_replicas_recovery(monkeypatch) -> None:
    """Discovery (a DNS look-up that may take seconds) runs beside the watcher's probes: a replica
    that is down is probed, and rejoins, in the same round."""
    import socket
    import time

    from services.scheduler import router as router_module

    def slow_getaddrinfo(host, port, *args, **kwargs):
        time.sleep(1.5)
        raise socket.gaierror("timed out")
    monkeypatch.setattr(router_module.socket, "getaddrinfo", slow_getaddrinfo)

    async def scenario() -> tuple[bool, float]:
        router = router_module.Router(SchedulerSettings(tokenizer_path="", draft_addresses=("127.0.0.1:1", "dns:draft:50052")),
                                      Metrics("scheduler-test"))
        lane = StepLoop(SchedulerSettings(), "127.0.0.1:1", Draft("v1"), Limits(64, 4096, 16, (0,), 10_000),
                        router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)), router.metrics)
        router.lanes.append(lane)
        lane.healthy = False
        t0 = time.monotonic()
        await router._watch_round(router_module.DISCOVERY_EVERY)   # a round that also discovers
        took = time.monotonic() - t0
        await router.stop()
        return lane.healthy, took

    healthy, took = asyncio.run(scenario())
    assert healthy and took < 1.0, took


def test_a_request_goes_where_it_starts_at_once_before_where_fewer_requests_are() -> None:
    """Two verifier groups of 1000 KV tokens: A runs one long request (900 reserved), B two small
    ones (200). By request count a 300-token request went to A, and waited there for as long as
    A's long request ran, while B had room; it goes to B. Where no replica can start it now, the
    least-loaded one that holds it queues it, as before."""
    from services.scheduler.router import Router

    router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
    limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=1000)

    def lane(address: str, reserved: int, running: int) -> StepLoop:
        x = StepLoop(SchedulerSettings(), address, None, limits, KvBudget(capacity=1000, reserved=reserved),
                     router.metrics)
        x.running = {f"{address}-{i}": request(f"{address}-{i}", 4) for i in range(running)}
        router.lanes.append(x)
        return x
    a, b = lane("a", 900, 1), lane("b", 200, 2)
    router.submit(request("new", 10, kv=300))
    assert [r.request_id for r in b.waiting] == ["new"] and not a.waiting
    router.submit(request("huge", 10, kv=850))   # nowhere now: the least-loaded replica queues it
    assert [r.request_id for r in a.waiting] == ["huge"]


def test_down_replicas_are_probed_at_once_and_their_queues_move_first() -> None:
    """Each down replica was probed in turn, a silent one taking its whole 1 s timeout: with three
    dead addresses ahead of it, a failed replica's queued request waited 3 s to move to a live one,
    and a recovered replica waited as long to rejoin."""
    import time

    from services.scheduler import router as router_module

    async def scenario() -> tuple[float, bool, list[str], bool]:
        router = router_module.Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        budget = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))

        def lane(address: str, draft: Draft) -> StepLoop:
            x = StepLoop(SchedulerSettings(), address, draft, Limits(64, 4096, 16, (0,), 10_000), budget, router.metrics)
            router.lanes.append(x)
            return x
        dead = [lane(f"dead-{i}", Draft("v1")) for i in range(3)]
        for x in dead:
            x.draft.stub.silent, x.healthy = True, False
        failed, back, live = lane("failed", Draft("v1", down=True)), lane("back", Draft("v1")), lane("live", Draft("v1"))
        failed.healthy = back.healthy = False
        queued = request("q", 10)
        failed.waiting.append(queued)
        moved = []
        submit = live.submit
        live.submit = lambda req: (moved.append((req.request_id, time.monotonic() - t0)), submit(req))
        t0 = time.monotonic()
        await router._watch_round(1)
        took = time.monotonic() - t0
        await router.stop()
        return took, moved[0][1] < 0.1, [m[0] for m in moved], back.healthy and not failed.healthy

    took, moved_at_once, moved, rejoined = asyncio.run(scenario())
    assert took < 1.8, took   # one probe timeout, not three
    assert moved == ["q"] and moved_at_once and rejoined


def test_a_replica_its_dns_name_no_longer_resolves_to_is_forgotten_once_down_and_idle(monkeypatch) -> None:
    """A replica scaled away (or back under another address) stayed in the list for good, probed
    every round with its gauge at 0. Forgotten once its name stops resolving to it, it is down and
    it holds no request; a look-up that fails forgets nothing, a static address beside it or not."""
    from services.scheduler import router as router_module

    names: list[list[str]] = []

    async def resolve(entries, failed=None):   # a look-up's addresses, or None: the name failed
        found = names.pop(0)
        if found is None and failed is not None:
            failed.append("dns:draft:50052")
        return ["10.0.0.9:50052"] + (found or [])   # a static entry beside the name
    monkeypatch.setattr(router_module, "resolve", resolve)

    async def scenario():
        router = router_module.Router(SchedulerSettings(tokenizer_path="", draft_addresses=("dns:draft:50052",)),
                                      Metrics("scheduler-test"))
        router.info = await Stub("v1").GetModelInfo(None)
        for ip, down in ((1, False), (2, True), (3, True)):
            router._add_lane(f"10.0.0.{ip}:50052", Stub("v1", down=down), router.info)
        up, gone, busy = router.lanes
        gone.healthy = busy.healthy = False
        busy.waiting.append(request("q", 10))
        names.extend([None, ["10.0.0.1:50052"]])
        await router._discover()   # a failed look-up (the static entry still resolves)
        kept_on_failure = sum(x.address != "10.0.0.9:50052" for x in router.lanes)
        await router._discover()
        left = [x.address for x in router.lanes if x.address != "10.0.0.9:50052"]
        value = router.metrics.registry.get_sample_value
        gone_series = (value("ddtree_draft_replica_up", {"draft": gone.address}),
                       value("ddtree_speculation_pauses_total", {"draft": gone.address}))
        kept_series = value("ddtree_speculation_pauses_total", {"draft": "10.0.0.1:50052"})
        await router.stop()
        return kept_on_failure, left, gone_series, kept_series

    kept_on_failure, left, gone_series, kept_series = asyncio.run(scenario())
    assert kept_on_failure == 3 and left == ["10.0.0.1:50052", "10.0.0.3:50052"]
    assert gone_series == (None, None) and kept_series == 0   # a forgotten replica's series go


def test_a_refused_request_is_counted_and_the_scheduler_reports_whether_it_can_serve() -> None:
    """Refusals (queue full, no replica up, invalid) were in no metric and no log; and the health
    check said SERVING while no draft replica was up and every request failed."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.grpc_server import new_server, report_health

    class Context(NoDeadline):
        async def abort(self, code, message, trailing_metadata=()):
            raise RuntimeError(code)

    async def scenario() -> tuple[float, list[str]]:
        servicer, router, lane = scheduler(SlowDraft())
        lane.healthy = False
        stream = servicer.Generate(generate(4), Context())
        try:
            await stream.__anext__()
        except RuntimeError:
            pass
        refused = router.metrics.refused.labels("unavailable", "no_replica")._value.get()
        server, health = new_server(["ddtree.v1.Scheduler"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        lane.on_health_change = router.health_changed.set   # as Router._add_lane wires it
        # Polled every 30 s, so only the wake can tell health in time.
        watch = asyncio.ensure_future(report_health(health, ["ddtree.v1.Scheduler"],
                                                    lambda: any(x.healthy for x in router.lanes), "no replica", 30.0,
                                                    wake=router.health_changed))
        seen = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for healthy in (False, True):
                lane.healthy = healthy
                await asyncio.sleep(0.05)
                for name in ("", "ddtree.v1.Scheduler"):
                    status = (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
                    seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        watch.cancel()
        await server.stop(0)
        await router.stop()
        return refused, seen

    refused, seen = asyncio.run(scenario())
    assert refused == 1 and seen == ["NOT_SERVING", "NOT_SERVING", "SERVING", "SERVING"]


def test_a_replica_added_by_the_router_tells_it_when_it_goes_down_or_up() -> None:
    from services.scheduler.router import Router

    async def scenario() -> list[bool]:
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        router.info = common_pb2.ModelInfo(vocab_size=64, max_context=4096, block_size=16, kv_capacity_tokens=10_000)
        router._add_lane("draft-a", object(), router.info)
        lane, seen = router.lanes[0], []
        for up in (True, False, False, True):
            router.health_changed.clear()
            lane.healthy = up
            seen.append(router.health_changed.is_set())
        await router.stop()
        return seen

    assert asyncio.run(scenario()) == [False, True, False, True]   # told of changes only


def test_metrics_count_tree_steps_only_and_read_the_lanes_when_scraped() -> None:
    """The acceptance histogram holds tree steps as verified (an autoregressive step's single
    token is no acceptance), release-only steps time no stage, every request's end is logged with
    its mode, and the gauges say the lanes' state at the scrape, not at the last probe round."""
    from ddtree.v1 import draft_pb2
    from services.scheduler.router import Router

    class TreeDraft:
        """Accepts 3 tokens a tree step, 1 an autoregressive one; records every step."""

        def __init__(self) -> None:
            self.calls: list[draft_pb2.StepRequest] = []
            self.modes: dict[str, int] = {}

        async def step(self, req, timeout):
            self.calls.append(req)
            out = []
            for i in req.items:
                if i.prompt_token_ids:
                    self.modes[i.request_id] = i.mode
                    out.append(draft_pb2.StepResult(request_id=i.request_id, token_ids=[5]))
                else:
                    n = 1 if self.modes[i.request_id] == common_pb2.MODE_AUTOREGRESSIVE else 3
                    out.append(draft_pb2.StepResult(request_id=i.request_id, token_ids=[5] * n,
                                                    acceptance_length=n))
            # The second step says it was no decode step (as one whose items the draft refused
            # would): the scheduler times the draft's decode steps only, as the draft does.
            stepped = sum(1 for c in self.calls if c.items)
            return draft_pb2.StepResponse(results=out, decoded=bool(req.items) and stepped != 2)

        def close(self) -> None:
            pass

    async def scenario():
        metrics = Metrics("scheduler-test")
        value = metrics.registry.get_sample_value
        settings = SchedulerSettings(tokenizer_path="", spec_min_acceptance=0)
        router = Router(settings, metrics)
        budget = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))
        draft = TreeDraft()
        lane = StepLoop(settings, "d0", draft, Limits(64, 4096, 16, (0,), 10_000), budget, metrics)
        router.lanes.append(lane)
        metrics.replica_up.labels("d0").set_function(lambda: float(lane.healthy))
        tree, ar = request("tree", 4), request("ar", 4)
        tree.max_tokens, ar.max_tokens = 1 + 3 * 3, 1 + 4
        ar.mode = common_pb2.MODE_AUTOREGRESSIVE
        lane.waiting.extend([tree, ar])
        assert value("ddtree_queue_depth") == 2 and value("ddtree_running_requests") == 0
        lane._schedule()   # admitted, as the loop's first step does
        assert value("ddtree_queue_depth") == 0 and value("ddtree_running_requests") == 2
        assert value("ddtree_kv_tokens_reserved", {"verifier": "v1"}) == 200
        assert value("ddtree_kv_tokens_capacity", {"verifier": "v1"}) == 10_000
        lane.running.clear()
        lane.waiting.extend([tree, ar])
        budget.reserved = 0
        for r in (tree, ar):
            r.prompt_sent = 0
        with capture_logs() as logs:
            lane.start()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if not lane.running and not lane.pending_releases and draft.calls and not draft.calls[-1].items:
                    break
            await lane.stop()
        assert value("ddtree_draft_replica_up", {"draft": "d0"}) == 1
        lane.healthy = False
        assert value("ddtree_draft_replica_up", {"draft": "d0"}) == 0
        return metrics, draft, logs, router

    metrics, draft, logs, router = asyncio.run(scenario())
    value = metrics.registry.get_sample_value
    stepped = [c for c in draft.calls if c.items]
    assert len(stepped) == 5 and len(draft.calls) == len(stepped) + 1   # the last one only releases
    assert list(map(client_id, draft.calls[-1].release)) == ["ar"]
    assert value("ddtree_acceptance_length_count") == 3 and value("ddtree_acceptance_length_sum") == 9
    assert value("ddtree_step_ms_count", {"stage": "step_rpc"}) == value("ddtree_step_ms_count", {"stage": "draft"}) == 4
    assert value("ddtree_step_ms_count", {"stage": "scheduler"}) == 4
    ends = {e["request_id"]: e for e in logs if e["event"] == "request_end"}
    assert ends["tree"]["mode"] == "ddtree" and ends["ar"]["mode"] == "autoregressive"
    assert ends["tree"]["budget"] > 0 and ends["ar"]["budget"] is None   # no tree, no budget (16 was logged)
    assert ends["tree"]["finish"] == "FINISH_REASON_LENGTH" and ends["tree"]["code"] is None
    # Latencies: each admission's wait (both were admitted twice here), each first token, each end.
    assert value("ddtree_request_queue_seconds_count") == 4
    assert value("ddtree_time_to_first_token_seconds_count") == 2
    assert value("ddtree_request_duration_seconds_count", {"status": "length"}) == 2
    for end in ends.values():
        assert end["log_level"] == "info" and 0 <= end["queue_ms"] <= end["ttft_ms"] <= end["seconds"] * 1e3
    assert ends["tree"]["tree_steps"] == 3 and ends["ar"]["tree_steps"] == 0
    assert value("ddtree_kv_tokens_reserved", {"verifier": "v1"}) == 0
    router.lanes.clear()                    # no replica is in front of v1 any more: its series go
    router._prune_budgets()
    assert value("ddtree_kv_tokens_capacity", {"verifier": "v1"}) is None


def test_an_ended_requests_kv_is_admitted_against_elsewhere_only_once_its_release_is_answered() -> None:
    """Two replicas in front of one verifier share its KV. A request that ended still holds its
    pages at the verifier until the step carrying its release is answered: the other replica may
    not admit against them before then (its prefill could reach the verifier first and find no
    pages: RESOURCE_EXHAUSTED for a request admission had taken). The replica that releases may,
    since its next step releases before it prefills."""

    class GatedDraft(SlowDraft):
        """Holds any step that releases until ``gate`` is set."""

        def __init__(self) -> None:
            super().__init__(delay=0.0)
            self.gate = asyncio.Event()

        async def step(self, req, timeout):
            if req.release:
                await self.gate.wait()
            return await super().step(req, timeout)

    async def scenario() -> dict[str, object]:
        budget = KvBudget(capacity=1000)
        limits = Limits(64, 4096, 16, (0,), 1000)
        a, b = (StepLoop(SchedulerSettings(), name, GatedDraft(), limits, budget, Metrics("scheduler-test"))
                for name in ("a", "b"))
        first = request("first", 10, kv=600)
        a.waiting.append(first)
        a._schedule()
        a._finish(first)                               # ended; its release goes with a's next step
        out: dict[str, object] = {"reserved_after_end": budget.reserved}
        mine = request("mine", 10, kv=600)            # arrived first: "other" may not go ahead of it
        b.waiting.append(request("other", 10, kv=600))
        out["b_admits_before_release"] = admitted(b)
        a.waiting.append(mine)
        out["a_admits_with_its_release"] = admitted(a)  # this very step releases "first" first
        a.running.clear()
        a.waiting.clear()
        budget.reserved -= mine.kv_tokens
        a.start()                                      # the release-only step, held by the draft
        await asyncio.sleep(0.05)
        out["b_admits_while_release_in_flight"] = admitted(b)
        a.draft.gate.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not a.pending_releases:
                break
        out["b_admits_after_release"] = admitted(b)
        out["reserved_at_end"] = budget.reserved
        await a.stop()
        return out

    assert asyncio.run(scenario()) == {
        "reserved_after_end": 600, "b_admits_before_release": [], "a_admits_with_its_release": ["mine"],
        "b_admits_while_release_in_flight": [], "b_admits_after_release": ["other"], "reserved_at_end": 600}


def test_a_request_queued_on_a_replica_being_probed_can_still_be_aborted() -> None:
    """A replica marked down keeps the queued work no other replica can hold while the router
    probes it; a client that leaves meanwhile must find its request there (before, the probe held
    it aside, the abort missed it, and it was decoded to max_tokens for nobody)."""
    from services.scheduler.router import Router

    class SlowStub:
        async def GetModelInfo(self, request, wait_for_ready=True, timeout=None, metadata=()):
            await asyncio.sleep(0.2)   # the replica is coming back: the probe waits for it
            return common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        draft = SlowDraft(delay=0.01)
        draft.stub = SlowStub()
        lane = StepLoop(SchedulerSettings(), "d0", draft, Limits(64, 4096, 16, (0,), 10_000),
                        router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000)),
                        router.metrics)
        router.lanes.append(lane)
        lane.start()
        lane.healthy = False
        queued = request("q", 10)
        queued.max_tokens = 200
        lane.waiting.append(queued)
        recover = asyncio.create_task(router._recover(lane))
        await asyncio.sleep(0.05)                      # the probe is in flight
        found = router.abort("q", only=queued)         # the client went away
        await recover
        await asyncio.sleep(0.1)
        await router.stop()
        return found, queued, lane.healthy, draft.seen

    found, queued, healthy, seen = asyncio.run(scenario())
    from ddtree.v1 import scheduler_pb2

    assert found and queued.finish == scheduler_pb2.FINISH_REASON_ABORTED and not queued.out_ids
    assert healthy and not seen                        # back up, and nothing was decoded for nobody


def test_a_second_abort_of_a_request_still_finishing_its_step_finds_nothing() -> None:
    """It answered True again (the aborted request is held until its step returns); the README
    says False where no such request runs."""
    lane = loop()
    lane.waiting.append(request("x", 10))
    lane._schedule()
    assert lane.abort("x") is True and lane.abort("x") is False and lane.abort("nope") is False


def test_an_abort_reaches_a_reused_id_on_another_replica_before_its_aborted_predecessor() -> None:
    """Abort "x", reuse the id at once (placed on the least-loaded replica), abort again: the
    second abort must end the new request, not answer for the predecessor that another replica
    still holds, aborted, until its step in flight returns."""
    from ddtree.v1 import scheduler_pb2
    from services.scheduler.router import Router

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        limits, budget = Limits(64, 4096, 16, (0,), 10_000), KvBudget(10_000)
        a = StepLoop(SchedulerSettings(), "A", SlowDraft(delay=0.3), limits, budget, router.metrics)
        b = StepLoop(SchedulerSettings(), "B", SlowDraft(delay=0.01), limits, budget, router.metrics)
        router.lanes += [a, b]
        for i in range(3):                       # A is the busier replica
            a.waiting.append(request(f"busy{i}", 10))
            a.waiting[-1].max_tokens = 1000
        first = request("x", 10)
        first.max_tokens = 1000
        a.waiting.append(first)
        for lane in router.lanes:
            lane.start()
        for _ in range(300):
            if first.started:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)                # A's next step is in flight
        assert router.abort("x")
        again = request("x", 10)
        again.max_tokens = 1000
        router.submit(again)
        for _ in range(400):
            if again.started:
                break
            await asyncio.sleep(0.005)
        held = first in a.running.values()
        found = router.abort("x")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if again.done:
                break
        await router.stop()
        return again.draft, held, found, again

    lane, held, found, again = asyncio.run(scenario())
    assert lane == "B" and held and found
    assert again.finish == scheduler_pb2.FINISH_REASON_ABORTED and len(again.out_ids) < 100


@pytest.mark.parametrize("code, seen, suffix", [
    (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, " (NOT_FOUND there)"),
    (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE, " (FAILED_PRECONDITION there)"),
    (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED, "")])
def test_a_downstream_error_names_the_clients_request_id(code, seen, suffix) -> None:
    """The draft and verifier know a request by its wire id; the client, by its own. A code that
    tells of their state, not of the request (a replica that lost it), reached the client as it was,
    and a client does not retry NOT_FOUND: it is UNAVAILABLE, naming the code."""
    from ddtree.v1 import draft_pb2

    class Refusing(SlowDraft):
        async def step(self, req, timeout):
            return draft_pb2.StepResponse(results=[draft_pb2.StepResult(
                request_id=i.request_id, error_code=code.value[0], error_message=f"request {i.request_id} was lost")
                for i in req.items])

    req = asyncio.run(run_one(Refusing(), "mine"))
    assert req.error is not None and req.error.message == "request mine was lost" + suffix and req.error.code == seen
    assert req.wire_id.startswith("mine#")


def _two_lanes(capacity: int = 1000, **settings) -> tuple[StepLoop, StepLoop, KvBudget]:
    """Two replicas in front of one verifier group (no drafts: `_schedule` is called by hand)."""
    budget = KvBudget(capacity=capacity)
    limits = Limits(64, 4096, 16, (0,), capacity)
    a, b = (StepLoop(SchedulerSettings(**settings), name, None, limits, budget, Metrics("scheduler-test"))
            for name in ("a", "b"))
    return a, b, budget


def test_the_replicas_of_a_group_admit_first_come_first_served() -> None:
    """A large request queued on one replica waited for ever while the other replica admitted
    every small request that arrived later into the pages freed (and the router, seeing it "admit
    now", kept sending them there): now a lane admits only where the group's older queue heads
    still fit beside its request, and a lane that admits wakes the others."""
    a, b, budget = _two_lanes()
    running = request("running", 10, kv=600)
    a.waiting.append(running)
    assert admitted(a) == ["running"]
    big = request("big", 10, kv=700)
    b.waiting.append(big)
    assert admitted(b) == []                       # 600 + 700 > 1000
    small = request("small", 10, kv=300)           # arrived after big
    assert not a.admits_now(small)
    a.waiting.append(small)
    assert admitted(a) == []                       # it fits alone, not beside big: big goes first
    a.running.clear()
    budget.release(600)
    assert b._wake.is_set() and a._wake.is_set()
    a._wake.clear()
    assert admitted(b) == ["big"] and a._wake.is_set()   # b's admission wakes a
    assert admitted(a) == ["small"] and budget.reserved == 1000
    # A lane that is down holds nobody back (its queue moves elsewhere).
    c, d, _ = _two_lanes()
    c.waiting.append(request("held", 10, kv=900))
    c.healthy = False
    assert d.admits_now(request("new", 10, kv=500))


def test_a_long_prompts_pieces_leave_a_request_that_can_start_what_it_needs_up_to_half() -> None:
    """A prompt in pieces took the whole step's prompt budget, so nothing was admitted until its
    last piece (30 steps at 3000 tokens, 100 a step) and the router still placed new requests
    there as starting "now"."""
    step = loop(max_prefill_tokens=100)
    step.waiting.append(request("long", 3000, kv=4000))
    assert pieces(step)[0] == {"long": (100, True)}
    assert pieces(step)[0] == {"long": (100, True)}          # nothing waits: the whole step
    short = request("short", 10)
    assert step.admits_now(short)
    step.waiting.append(short)
    assert pieces(step)[0] == {"long": (90, True), "short": (10, False)}   # the short one's 10, not half
    step.waiting.append(request("medium", 80))
    assert pieces(step)[0] == {"long": (50, True), "medium": (50, True)}   # at most half
    step.waiting.append(request("blocked", 10, kv=10_000))   # cannot start: the long prompt keeps the step
    assert pieces(step)[0] == {"long": (100, True)}


def test_aborting_a_queued_head_wakes_its_lane_and_the_group() -> None:
    """The requests behind an aborted queue head that fit now slept until some other request of
    the group ended (minutes, at a large max_tokens)."""
    a, b, budget = _two_lanes()
    a.waiting.append(request("running", 10, kv=600))
    admitted(a)
    big, after = request("big", 10, kv=700), request("after", 10, kv=100)
    a.waiting += [big, after]
    assert admitted(a) == []
    a._wake.clear()
    b._wake.clear()
    assert a.abort("big")
    assert a._wake.is_set() and b._wake.is_set() and big.finish == scheduler_pb2.FINISH_REASON_ABORTED
    assert admitted(a) == ["after"]


def test_an_abort_ends_the_stream_at_once_whatever_the_step_in_flight_does() -> None:
    """Abort said found=True, and the stream then took the step in flight's tokens and could end
    LENGTH, or UNAVAILABLE when that step failed, after up to step_timeout_s: the proto says it
    ends ABORTED."""
    from ddtree.v1 import scheduler_pb2 as spb

    class FailsSecond(SlowDraft):
        def __init__(self) -> None:
            super().__init__(delay=0.1)
            self.steps = 0

        async def step(self, req, timeout):
            self.steps += 1
            if self.steps == 2:
                await asyncio.sleep(0.1)
                raise StepFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "slow step")
            return await super().step(req, timeout)

    async def case(draft, max_tokens: int) -> tuple[bool, int, int, int, float]:
        servicer, router, lane = scheduler(draft)
        stream = servicer.Generate(generate(max_tokens, "x"), NoDeadline())
        first = await stream.__anext__()
        await asyncio.sleep(0.02)                          # the next step is in flight
        found = (await servicer.Abort(spb.AbortRequest(request_id="x"), None)).found
        t0 = time.monotonic()
        last = await stream.__anext__()
        waited = time.monotonic() - t0
        await router.stop()
        return found, len(first.token_ids), last.finish_reason, len(last.token_ids), waited

    for draft, max_tokens in ((SlowDraft(delay=0.1), 2), (SlowDraft(delay=0.1), 50), (FailsSecond(), 50)):
        found, first, finish, after, waited = asyncio.run(case(draft, max_tokens))
        assert found and first == 1 and finish == spb.FINISH_REASON_ABORTED and after == 0 and waited < 0.05


def test_a_full_queue_does_not_refuse_a_request_a_replica_would_start_at_once() -> None:
    """max_queue counts every replica's queue: requests only a large group holds filled it, and a
    short one an idle small group would have started at once was refused RESOURCE_EXHAUSTED."""
    from services.scheduler.router import Router

    settings = SchedulerSettings(tokenizer_path="", max_queue=4)
    router = Router(settings, Metrics("scheduler-test"))
    big = StepLoop(settings, "big", None, Limits(64, 131072, 16, (0,), 100_000), KvBudget(100_000), router.metrics)
    small = StepLoop(settings, "small", None, Limits(64, 131072, 16, (0,), 10_000), KvBudget(10_000), router.metrics)
    router.lanes += [big, small]
    big.waiting.append(request("r", 4, kv=90_000))
    admitted(big)
    for i in range(4):
        router.submit(request(f"long{i}", 4, kv=50_000))
    router.submit(short := request("short", 4, kv=100))
    assert short.draft == "small"
    small.waiting.append(request("blocker", 4, kv=10_000))   # now nothing would start at once
    with pytest.raises(ServiceError) as info:
        router.submit(request("later", 4, kv=100))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in info.value.message
    assert info.value.reason == "queue_full"
    # An id in use is said as that, not as a full queue or a cache too small: a retry cannot take it.
    for taken in ("long0", "short", "blocker"):
        for kv in (100, 200_000):
            with pytest.raises(ServiceError) as info:
                router.submit(request(taken, 4, kv=kv))
            assert info.value.code == grpc.StatusCode.ALREADY_EXISTS and not info.value.retryable, info.value.message


def test_a_lane_that_follows_its_verifier_elsewhere_wakes_both_groups() -> None:
    """A lane moved to a new budget (its verifier restarted) neither woke the old group's lanes
    held behind its older head nor itself, though its head fit the new budget."""
    a, b, old = _two_lanes()
    b.waiting.append(request("running", 10, kv=600))
    admitted(b)
    a.waiting.append(request("head", 10, kv=700))
    b.waiting.append(request("later", 10, kv=300))
    assert admitted(b) == [] and admitted(a) == []
    a._wake.clear()
    b._wake.clear()
    a.kv = KvBudget(capacity=1000)
    assert a._wake.is_set() and b._wake.is_set()
    assert admitted(b) == ["later"] and admitted(a) == ["head"]


def test_a_head_waiting_for_batch_room_holds_no_other_lane_back() -> None:
    """A queue head whose own lane's batch is full cannot use the KV: counting it left another
    lane idle with free KV until a request of the full lane ended."""
    a, b, _ = _two_lanes(max_batch=1)
    a.waiting.append(request("running", 10, kv=100))
    admitted(a)
    a.waiting.append(request("head", 10, kv=800))
    late = request("late", 10, kv=500)
    assert b.admits_now(late)
    b.waiting.append(late)
    assert admitted(b) == ["late"]


def test_two_prompts_in_pieces_never_send_an_empty_piece() -> None:
    """Once the step's prompt tokens are spent, a second prompt still arriving gets no item: an
    empty piece of a prefilling request is refused by the draft (FAILED_PRECONDITION), and its
    request failed."""
    step = loop(max_prefill_tokens=100, max_batch=8)
    step.waiting.extend([request("a", 1000, kv=1100), request("b", 1000, kv=1100)])
    sent = {"a": 0, "b": 0}
    for _ in range(25):
        for item in step._schedule():
            req = step.running[item.request_id]
            if req.prompt_sent < len(req.prompt_ids) or item.prompt_continues:
                assert item.prompt_token_ids, f"an empty piece for {client_id(item.request_id)}"
            sent[client_id(item.request_id)] += len(item.prompt_token_ids)
    assert sent == {"a": 1000, "b": 1000}


def test_ending_a_lane_fails_its_queued_and_running_requests_each_logged() -> None:
    """`end_all` (the scheduler stops with them unfinished): every request gets the error and is
    counted; an aborted one ends as it was."""
    lane = loop(max_batch=2)
    lane.waiting.extend([request("a", 10), request("b", 10), request("c", 10)])
    lane._schedule()                                     # a and b run, c waits
    running = list(lane.running.values())
    running[1].aborted = True
    running[1].end(scheduler_pb2.FINISH_REASON_ABORTED)
    queued = lane.waiting[0]
    count = lambda status: lane.metrics.requests.labels(status)._value.get()   # noqa: E731
    before = count("unavailable"), count("aborted")
    error = ServiceError(grpc.StatusCode.UNAVAILABLE, "stopped")
    assert lane.end_all(error) == 3
    assert not lane.running and not lane.waiting and lane.load == 0
    assert running[0].error is error and queued.error is error and running[1].error is None
    for req in (running[0], queued):
        events = []
        while (event := req.take()) is not None:
            events.append(event)
        assert events[-1] is error
    assert (count("unavailable") - before[0], count("aborted") - before[1]) == (2, 1)
    assert sum(tokens for _, tokens in lane._owed) == 200      # the running ones' KV, given back with their release


def test_the_router_aborts_only_the_request_object_named() -> None:
    """A late clean-up of a finished stream must not abort a newer request that reuses its id."""
    from services.scheduler.router import Router

    async def scenario() -> None:
        router = Router(SchedulerSettings(), Metrics("router-abort-test"))
        lane = loop()
        router.lanes.append(lane)
        old, new = request("x", 10), request("x", 10)
        lane.waiting.append(new)
        lane._schedule()
        assert not router.abort("x", only=old)
        assert not lane.find("x").aborted and not new.done
        assert router.abort("x", only=new) and new.done

    asyncio.run(scenario())


def test_prompt_pieces_send_the_client_nothing_until_the_first_token() -> None:
    """A piece of a long prompt comes back without tokens: no message to the client, and the
    first-token time is the first token's, not the first piece's."""
    pieces: list[tuple[float, object]] = []   # each continuing piece's send time, and what the client had then
    held: dict[str, ActiveRequest] = {}

    class Draft(SlowDraft):   # a piece that continues answers no token, as the draft does
        async def step(self, req, timeout):
            from ddtree.v1 import draft_pb2

            self.seen.extend(req.items)
            if any(i.prompt_continues for i in req.items):
                pieces.append((time.monotonic(), held["r"].take()))
            return draft_pb2.StepResponse(results=[draft_pb2.StepResult(
                request_id=i.request_id, token_ids=[] if i.prompt_continues else [5],
                acceptance_length=0 if i.prompt_token_ids else 1) for i in req.items])

    async def scenario() -> None:
        req = held["r"] = request("r", 350, kv=400)
        req.max_tokens = 2
        lane = started(Draft(delay=0.0), req, max_prefill_tokens=100)
        await until(lambda: req.done)
        await lane.stop()
        message = req.take()
        assert sum(1 for i in lane.draft.seen if i.prompt_continues) == 3   # 350 tokens in pieces of 100
        assert [sent for _, sent in pieces] == [None, None, None]   # nothing for the client meanwhile
        assert len(message.token_ids) == 2 and message.finish_reason and req.take() is None
        assert req.first_token_at is not None and req.first_token_at > max(t for t, _ in pieces) and req.done

    asyncio.run(scenario())


def test_a_down_replicas_queue_moves_only_to_replicas_that_can_hold_it() -> None:
    """A queued request moved to a replica whose cache can never hold it sat at the head of that
    queue for good, and held back every request behind it."""
    from services.scheduler.router import Router

    big_lane, small_lane = loop(), loop()
    small_lane.kv = KvBudget(capacity=500)
    big, small = request("big", 10, kv=5000), request("small", 10, kv=100)
    big_lane.waiting.extend([big, small])
    big_lane.healthy = False
    Router._move_queued(big_lane, [small_lane])
    assert list(big_lane.waiting) == [big] and list(small_lane.waiting) == [small]


def test_a_burst_the_next_step_starts_is_not_counted_against_max_queue() -> None:
    """A burst arrives between two steps and all of it queues: with max_queue 2 and a batch of 64,
    7 of 10 requests to an idle replica were refused "queue full" though one step started them
    all. What waits is what the next step leaves queued, and the step's own room is what
    `_schedule` admits: the batch, the step's prompt tokens, the KV."""
    from services.scheduler.router import Router

    def router_with(max_batch: int, capacity: int = 100_000, prefill: int = 8192) -> tuple[Router, StepLoop]:
        settings = SchedulerSettings(tokenizer_path="", max_queue=2, max_batch=max_batch, max_prefill_tokens=prefill)
        router = Router(settings, Metrics("scheduler-burst-test"))
        lane = StepLoop(settings, "idle", None, Limits(64, 4096, 16, (0,), capacity), KvBudget(capacity), router.metrics)
        router.lanes.append(lane)
        return router, lane

    router, lane = router_with(max_batch=64)
    for i in range(10):
        router.submit(request(f"b{i}", 4))
    assert lane.waiting_past_next_step == 0 and len(admitted(lane)) == 10   # one step starts them all
    router, lane = router_with(max_batch=4)   # 4 start with the next step, 2 wait, the 7th is refused
    for i in range(6):
        router.submit(request(f"b{i}", 4))
    assert lane.waiting_past_next_step == 2
    with pytest.raises(ServiceError, match=r"queue full \(2 requests waiting\)"):
        router.submit(request("b6", 4))
    lane.healthy = False   # down: all its queue waits (for another replica), and none starts there
    assert lane.waiting_past_next_step == 6 and not lane.admits_now(request("b7", 4))
    lane.healthy = True
    assert len(admitted(lane)) == 4 and len(lane.waiting) == 2
    router, lane = router_with(max_batch=64, capacity=1_000)   # the KV holds 3 of them: the rest wait
    for i in range(5):
        router.submit(request(f"k{i}", 4, kv=300))
    with pytest.raises(ServiceError, match="queue full"):
        router.submit(request("k5", 4, kv=300))
    assert len(admitted(lane)) == 3
    router, lane = router_with(max_batch=64, prefill=100)   # the step's prompt tokens start 2 of them
    for i in range(4):
        router.submit(request(f"p{i}", 60))
    with pytest.raises(ServiceError, match="queue full"):
        router.submit(request("p4", 60))
    assert len(admitted(lane)) == 2


def test_replicas_sharing_a_verifiers_kv_count_their_whole_queues_against_max_queue() -> None:
    """Each of four replicas of one verifier group, simulating its next step alone, counted the
    group's free KV as its own: a burst of 40 left 19 waiting past a max_queue of 1. Where
    replicas share the KV, a request starts at once only into an empty queue, and every queued
    one counts."""
    from services.scheduler.router import Router

    settings = SchedulerSettings(tokenizer_path="", max_queue=1, max_batch=8)
    router = Router(settings, Metrics("scheduler-shared-test"))
    kv = KvBudget(1000)
    lanes = [StepLoop(settings, f"l{j}", None, Limits(64, 4096, 16, (0,), 1000), kv, router.metrics) for j in range(4)]
    router.lanes += lanes
    accepted = 0
    for i in range(40):
        with contextlib.suppress(ServiceError):
            router.submit(request(f"r{i}", 4, kv=100))
            accepted += 1
    assert accepted == 4 and sum(lane.waiting_past_next_step for lane in lanes) == 4   # one into each empty queue
    assert sum(len(admitted(lane)) for lane in lanes) == 4 and not any(lane.waiting for lane in lanes)


def test_what_the_queue_cap_counts_as_starting_is_what_the_next_step_starts() -> None:
    """`waiting_past_next_step` simulates `_schedule`'s admissions (batch, prompt tokens beside
    running prompts' pieces, KV with what the step releases first); on random lanes it must agree
    with the step itself, and
    `admits_now` with a request queued last."""
    import random
    rng = random.Random(7)
    for case in range(300):
        settings = SchedulerSettings(tokenizer_path="", max_batch=rng.randint(1, 8),
                                     max_prefill_tokens=rng.choice([16, 40, 100, 400]))
        capacity = rng.choice([500, 2_000, 100_000])
        lane = StepLoop(settings, "l", None, Limits(64, 4096, 16, (0,), capacity), KvBudget(capacity),
                        Metrics("scheduler-test"))
        for i in range(rng.randint(0, settings.max_batch)):   # running, some with prompt pieces still to send
            lane.waiting.append(request(f"run{i}", rng.randint(1, 300), kv=rng.randint(50, 400)))
            lane._schedule()
        lane.waiting.clear()
        for req in [r for r in lane.running.values() if rng.random() < 0.3]:   # ended: the next step frees their KV first
            lane._finish(req)
        queued = [request(f"q{i}", rng.randint(1, 120), kv=rng.randint(50, 600)) for i in range(rng.randint(0, 10))]
        lane.waiting.extend(queued[:-1])
        if queued:   # it starts at once where it and everything before it start
            starts = lane.admits_now(queued[-1])
            lane.waiting.append(queued[-1])
            assert starts == (lane.waiting_past_next_step == 0), case
        before, past = len(lane.waiting), lane.waiting_past_next_step
        lane._schedule()
        assert len(lane.waiting) == past, (case, before, past, len(lane.waiting))


def test_the_kv_and_queue_bounds_are_exact() -> None:
    """A request needing exactly the cache fits it; the queue takes max_queue waiting requests
    and refuses the next."""
    from services.scheduler.router import Router

    lane = loop()
    assert lane.holds(request("whole", 4, kv=10_000)) and not lane.holds(request("over", 4, kv=10_001))
    settings = SchedulerSettings(tokenizer_path="", max_queue=2)
    router = Router(settings, Metrics("scheduler-queue-test"))
    busy = StepLoop(settings, "busy", None, Limits(64, 4096, 16, (0,), 1_000), KvBudget(1_000), router.metrics)
    router.lanes.append(busy)
    busy.waiting.append(request("holds-it-all", 4, kv=1_000))
    admitted(busy)                                   # running: nothing else starts at once
    router.submit(request("q1", 4, kv=600))
    assert len(busy.waiting) == 1
    router.submit(request("q2", 4, kv=600))
    with pytest.raises(ServiceError, match="queue full"):
        router.submit(request("q3", 4, kv=600))


def test_prompts_a_step_that_never_reached_its_replica_began_are_refused_as_if_queued() -> None:
    """A replica that died before its lane marked it down: the step's new stream found no
    connection, so the prompts it began reached no replica, and a wait_for_ready client may send
    them again (the scheduler says `ddtree-refused` where `prompt_sent` is 0); a request that ran
    there already may have crashed it, and is not."""
    class DiesAfterOneStep(SlowDraft):
        async def step(self, req, timeout):
            if any(item.prompt_offset == 0 and item.prompt_token_ids and item.request_id.startswith("new")
                   for item in req.items):
                raise StepFailed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: ...",
                                 delivered=self.delivered)
            return await super().step(req, timeout)

    async def scenario(delivered: bool) -> tuple[ActiveRequest, ActiveRequest]:
        draft = DiesAfterOneStep(delay=0.01)
        draft.delivered = delivered
        old = request("old", 4)
        old.max_tokens = 1000
        lane = started(draft, old)
        await until(lambda: len(old.out_ids) > 1)
        new = request("new", 4)
        lane.submit(new)
        await until(lambda: new.done and old.done)
        await lane.stop()
        return old, new

    for delivered in (False, True):
        old, new = asyncio.run(scenario(delivered))
        assert new.error is not None and new.error.code == grpc.StatusCode.UNAVAILABLE
        assert old.error is not None and old.prompt_sent == 4
        assert new.prompt_sent == (4 if delivered else 0), delivered


def test_an_unreached_step_whose_requests_were_ended_meanwhile_leaves_the_loop_running() -> None:
    """`end_all` (a stop, a replica marked down) may end the step's requests while the step is in
    flight; the step then failing unreached must not touch them: the loop lives on, and each
    request keeps the error it ended with."""
    class Unreached:
        def __init__(self) -> None:
            self.entered, self.go = asyncio.Event(), asyncio.Event()

        async def step(self, req, timeout):
            self.entered.set()
            await self.go.wait()
            raise StepFailed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", delivered=False)

        def close(self) -> None:
            pass

    async def scenario() -> tuple[ActiveRequest, BaseException | None]:
        draft, new = Unreached(), request("new", 4)
        lane = started(draft, new)
        await asyncio.wait_for(draft.entered.wait(), 5)
        lane.end_all(ServiceError(grpc.StatusCode.UNAVAILABLE, "stopping"))
        draft.go.set()
        await until(lambda: not lane.healthy)
        crashed = lane._task.exception() if lane._task.done() and not lane._task.cancelled() else None
        await lane.stop()
        return new, crashed

    new, crashed = asyncio.run(scenario())
    assert crashed is None, repr(crashed)
    assert new.error is not None and new.error.message == "stopping"
