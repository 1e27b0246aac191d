"""The scheduler's step loop and router: rules a mutation run found unpinned (batcher.py,
router.py, speculation.py); each test says which change it catches."""

from __future__ import annotations

import asyncio

import grpc
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, draft_pb2, scheduler_pb2
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler.batcher import KvBudget, StepLoop
from services.scheduler.request import ActiveRequest, Limits
from tests.test_batcher import _two_lanes, admitted, client_id, request, until


# Catches (KvBudget.share) `if lane not in self._lanes:` dropped (a lane appended
# again each time it is given the same budget, as `Router._recover` does on every rejoin).
def test_a_lane_given_its_own_budget_again_counts_once_among_the_groups_heads() -> None:
    """A replica that rejoins its unchanged verifier group is handed the same budget again: its
    queue head must still count once in the other lanes' first-come-first-served check (counted
    twice, the other lane refused a request that fits beside it)."""
    a, b, budget = _two_lanes(capacity=1000)
    a.waiting.append(request("older", 10, kv=400))
    for _ in range(2):                  # rejoined twice behind the same verifier
        a.kv = budget
    late = request("late", 10, kv=400)  # 400 + 400 <= 1000
    assert b.admits_now(late)
    b.waiting.append(late)
    assert admitted(b) == ["late"]
    assert budget.lanes == [a, b]


# Catches (StepLoop._shares_kv) `and other.healthy` dropped (a replica that is
# down counted as sharing the group's KV).
def test_a_replica_whose_group_partner_is_down_admits_as_one_alone() -> None:
    """Where the other replica of a verifier group is down, the live one is alone on the KV: a
    burst queued on it that its next step starts is not "waiting" for the queue cap, and a request
    behind a queued one still starts at once (counted as shared, a full max_queue refused
    requests the next step would have started)."""
    a, b, _ = _two_lanes(capacity=10_000)
    b.healthy = False
    a.waiting.append(request("queued", 10))
    assert a.waiting_past_next_step == 0
    assert a.admits_now(request("next", 10))


# Catches (StepLoop.abort, queued branch) `log_end(self.metrics, req)` dropped.
def test_aborting_a_queued_request_counts_and_logs_its_end() -> None:
    a, _, _ = _two_lanes()
    count = lambda status: a.metrics.registry.get_sample_value("ddtree_requests_total", {"status": status}) or 0  # noqa: E731
    before = count("aborted")
    queued = request("q", 10)
    a.waiting.append(queued)
    with capture_logs() as logs:
        assert a.abort("q")
    assert count("aborted") == before + 1
    assert [e["status"] for e in logs if e["event"] == "request_end"] == ["aborted"]
    assert queued.finish == scheduler_pb2.FINISH_REASON_ABORTED


# Catches (StepLoop.find) the non-aborted request with the id no longer preferred
# (`return found[0] if found else None`).
def test_an_id_reused_on_the_same_lane_while_its_aborted_predecessor_finishes_its_step_is_live() -> None:
    """Abort "x" while its step is in flight and reuse the id at once on the same replica: until
    the loop retires the old one both run there. The new one is the live one: it holds the id
    (a third "x" is refused) and an abort of "x" ends it (before, the aborted one answered for it:
    the abort found nothing)."""
    a, _, _ = _two_lanes(capacity=10_000)
    old, new = request("x", 10), request("x", 10)
    a.waiting.append(old)
    a._schedule()
    assert a.abort("x") and old.aborted          # its step still in flight: it stays in `running`
    a.waiting.append(new)
    a._schedule()
    assert len(a.running) == 2
    assert a.find("x") is new and a.has_live("x")
    assert a.abort("x") and new.finish == scheduler_pb2.FINISH_REASON_ABORTED


class TreeDraft:
    """Answers each step: a prompt piece one token; a decode item with a tree (budget > 0) the
    request's ``accepts`` tokens (by client id, default 3); an item without one (speculation
    paused) a single token. Records every step."""

    def __init__(self, accepts: dict[str, int] | None = None, delay: float = 0.0) -> None:
        self.accepts = accepts or {}
        self.delay = delay
        self.calls: list[draft_pb2.StepRequest] = []

    async def step(self, req, timeout):
        self.calls.append(req)
        if self.delay:
            await asyncio.sleep(self.delay)
        out = []
        for i in req.items:
            if i.prompt_token_ids:
                out.append(draft_pb2.StepResult(request_id=i.request_id, token_ids=[5]))
            else:
                n = self.accepts.get(client_id(i.request_id), 3) if i.budget else 1
                out.append(draft_pb2.StepResult(request_id=i.request_id, token_ids=[5] * n, acceptance_length=n))
        return draft_pb2.StepResponse(results=out)

    def close(self) -> None:
        pass


def _lane(draft, metrics: Metrics, **settings) -> StepLoop:
    limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_ids=(0,), kv_capacity_tokens=10_000)
    return StepLoop(SchedulerSettings(**settings), "draft", draft, limits, KvBudget(capacity=10_000), metrics)


# Catches (StepLoop.run) `if req is None or req.aborted:` -> `if req is None:` (the
# step in flight's tokens taken by a request aborted meanwhile). Also catches
# `self.metrics.tokens.inc(len(req.out_ids) - before)` dropped (the generated-tokens counter).
def test_a_request_aborted_while_its_step_is_in_flight_takes_none_of_that_steps_tokens() -> None:
    """Its stream ended ABORTED at the abort: the tokens of the step then in flight were never
    streamed, so neither its usage (logged with its end) nor the generated-tokens counter has them."""
    metrics = Metrics("scheduler-test")

    async def scenario() -> tuple[ActiveRequest, list[dict]]:
        lane = _lane(TreeDraft(delay=0.1), metrics, spec_min_acceptance=0)
        req = request("x", 4)
        req.max_tokens = 50
        lane.submit(req)
        with capture_logs() as logs:
            lane.start()
            await until(lambda: len(req.out_ids) == 1)      # the prefill's token; the next step is in flight
            await asyncio.sleep(0.02)
            assert lane.abort("x")
            await until(lambda: not lane.running)
            await asyncio.sleep(0.15)
            await lane.stop()
        return req, logs

    req, logs = asyncio.run(scenario())
    assert req.finish == scheduler_pb2.FINISH_REASON_ABORTED and req.out_ids == [5]
    assert metrics.registry.get_sample_value("ddtree_generated_tokens_total") == 1
    ends = [e for e in logs if e["event"] == "request_end"]
    assert len(ends) == 1 and ends[0]["status"] == "aborted" and ends[0]["completion_tokens"] == 1


# Catches (StepLoop.run) `if tree_step and res.request_id in trees:` -> `if tree_step:`
# (the paused steps of a DDTree request, budget 0, observed as acceptance 1).
def test_the_acceptance_histogram_leaves_out_a_ddtree_requests_paused_steps() -> None:
    metrics = Metrics("scheduler-test")

    async def scenario() -> ActiveRequest:
        lane = _lane(TreeDraft(accepts={"a": 3}), metrics, spec_min_acceptance=4.0, spec_backoff_steps=4)
        req = request("a", 4)
        req.max_tokens = 60
        lane.submit(req)
        lane.start()
        await until(lambda: req.done)
        await lane.stop()
        return req

    req = asyncio.run(scenario())
    usage = req.usage()
    assert req.done and 0 < usage.tree_steps < usage.steps        # some steps were paused
    value = metrics.registry.get_sample_value
    assert value("ddtree_acceptance_length_count") == usage.tree_steps
    assert value("ddtree_acceptance_length_sum") == 3 * usage.tree_steps


# Catches (StepLoop.run) the gate fed `max(drafted)` instead of the step's mean
# acceptance over its DDTree requests.
def test_the_speculation_gate_weighs_a_steps_mean_acceptance_over_its_requests() -> None:
    """A batch where one request accepts 3 tokens a tree step and another 1 averages 2, under a
    bar of 2.5: the batch pauses speculation while both run (on the best request alone it never would)."""
    metrics = Metrics("scheduler-test")

    async def scenario() -> tuple[int, float | None, list[int]]:
        draft = TreeDraft(accepts={"hi": 3, "lo": 1})
        lane = _lane(draft, metrics, spec_min_acceptance=2.5, spec_backoff_steps=2)
        hi, lo = request("hi", 4), request("lo", 4)
        hi.max_tokens, lo.max_tokens = 1000, 12
        lane.submit(hi)
        lane.submit(lo)
        lane.start()
        await until(lambda: lo.done)
        seen = (lane.gate.fallbacks,
                metrics.registry.get_sample_value("ddtree_speculation_pauses_total", {"draft": "draft"}),
                [i.budget for c in draft.calls for i in c.items
                 if not i.prompt_token_ids and client_id(i.request_id) == "lo"])
        await lane.stop()
        return seen

    fallbacks, pauses, lo_budgets = asyncio.run(scenario())
    assert fallbacks >= 1 and pauses == fallbacks
    assert 0 in lo_budgets and lo_budgets[:4] == [8, 8, 8, 8]   # a window of 4 tree steps, then paused


class _Stub:
    """A replica's model info as the router probes it."""

    def __init__(self, verifier_id: str, capacity: int) -> None:
        self.verifier_id, self.capacity = verifier_id, capacity

    async def GetModelInfo(self, request, wait_for_ready=True, timeout=None, metadata=()):
        return common_pb2.ModelInfo(verifier_id=self.verifier_id, kv_capacity_tokens=self.capacity)


class _ProbedDraft:
    def __init__(self, verifier_id: str, capacity: int) -> None:
        self.stub = _Stub(verifier_id, capacity)

    def close(self) -> None:
        pass


# Catches (Router._recover) `self._refuse_unfitting(lane, [])` dropped.
def test_a_lone_replica_rejoining_a_smaller_verifier_group_refuses_what_its_queue_no_longer_holds() -> None:
    """A lone replica is marked down (its verifier restarting) with requests queued; it rejoins in
    front of the restarted verifier, now with a smaller cache. A queued request the new cache cannot
    hold fails OUT_OF_RANGE as `submit` would refuse it (left queued, it sat at the head for good,
    and every request behind it too); the one behind it starts."""
    from services.scheduler.router import Router

    async def scenario():
        router = Router(SchedulerSettings(tokenizer_path=""), Metrics("scheduler-test"))
        old = router._budget(common_pb2.ModelInfo(verifier_id="v1", kv_capacity_tokens=10_000))
        lane = StepLoop(SchedulerSettings(), "d0", _ProbedDraft("v2", 5000), Limits(64, 4096, 16, (0,), 10_000),
                        old, router.metrics)
        router.lanes.append(lane)
        lane.healthy = False
        big, after = request("big", 10, kv=6000), request("after", 10, kv=100)
        lane.waiting += [big, after]
        await router._recover(lane)
        started = admitted(lane)
        await router.stop()
        return lane, big, started

    lane, big, started = asyncio.run(scenario())
    assert lane.healthy and lane.kv.capacity == 5000 and lane.kv.verifier_id == "v2"
    assert big.error is not None and big.error.code == grpc.StatusCode.OUT_OF_RANGE
    assert started == ["after"] and not lane.waiting
