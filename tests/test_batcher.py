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
