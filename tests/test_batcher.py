"""The scheduler's admission (StepLoop._schedule): batch, KV and per-step prefill limits."""

from __future__ import annotations

import asyncio

from ddtree.v1 import common_pb2
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler.batcher import KvBudget, StepLoop
from services.scheduler.request import ActiveRequest, Limits


def request(rid: str, prompt_len: int, kv: int = 100) -> ActiveRequest:
    return ActiveRequest(request_id=rid, prompt_ids=list(range(2, 2 + prompt_len)),
                         sampling=common_pb2.SamplingParams(), max_tokens=8, budget=8,
                         mode=common_pb2.MODE_DDTREE, stop=(), stop_ids=frozenset(), eos_id=None,
                         tokenizer=None, kv_tokens=kv)


def loop(**settings) -> StepLoop:
    limits = Limits(vocab_size=64, max_context=4096, block_size=16, eos_token_id=0, kv_capacity_tokens=10_000)
    return StepLoop(SchedulerSettings(**settings), "draft", None, limits, KvBudget(capacity=10_000),
                    Metrics("scheduler-test"))


def admitted(step: StepLoop) -> list[str]:
    return [i.request_id for i in step._schedule() if i.prompt_token_ids]


def test_prefill_tokens_per_step_are_bounded_and_the_rest_waits() -> None:
    async def scenario() -> None:
        step = loop(max_prefill_tokens=1000, max_batch=64)
        step.waiting.extend([request("a", 600), request("b", 300), request("c", 200), request("d", 50)])
        assert admitted(step) == ["a", "b"]               # 900; c would make 1100
        assert admitted(step) == ["c", "d"]               # the next step takes the rest
        step.waiting.append(request("long", 5000))
        assert admitted(step) == ["long"]                 # longer than the budget: goes alone
        assert step.kv.reserved == 500

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

    def step(acceptance: int) -> None:
        b = gate.budget(16)
        sent.append(b)
        gate.observe(b, acceptance if b else 1)   # an AR step accepts exactly 1

    for _ in range(2):
        step(1)                      # a window of rejected drafts ...
    for _ in range(3):
        step(5)                      # ... three AR steps, whatever the drafts would have done
    for _ in range(2):
        step(1)                      # the probe fails: the pause doubles
    for _ in range(6):
        step(1)
    for _ in range(4):
        step(4)                      # accepted again: stays speculative, and the pause resets
    step(1)                          # one bad step in a good window: no fallback (mean 2.5)
    assert sent == [16, 16, 0, 0, 0, 16, 16, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16]
    assert gate.fallbacks == 2 and gate._next_backoff == 3
    off = SpeculationGate(min_acceptance=0)
    for _ in range(10):
        off.observe(16, 1)
    assert off.budget(16) == 16 and off.fallbacks == 0


def test_step_loop_sends_budget_zero_while_a_request_backs_off() -> None:
    from services.scheduler.speculation import SpeculationGate

    async def scenario() -> None:
        step = loop(max_batch=8)
        req = request("a", 10)
        req.gate = SpeculationGate(min_acceptance=1.5, backoff=2, window=2)
        step.waiting.append(req)
        step._schedule()                                  # the prefill step
        budgets = []
        for _ in range(5):
            (item,) = step._schedule()
            budgets.append(item.budget)
            req.gate.observe(req.step_budget, 1)          # the verifier accepted only the bonus token
        assert budgets == [8, 8, 0, 0, 8]

    asyncio.run(scenario())
