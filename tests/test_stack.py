"""End to end through the real three-process stack (scheduler, draft, verifier) over gRPC, on the CPU.

The drafter here is the oracle test drafter: it plants the target's own greedy continuation among
noise at a random rank per depth, so accepted paths of many lengths and rejections at every depth
occur, and greedy DDTree must still reproduce greedy autoregressive decoding token for token.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launcher import Stack, StackSpec, free_port
from services.scheduler.client import AsyncClient, Client, ClientError
from tests.stack_fixtures import GREEDY_TOKENS, PROMPTS, build_checkpoint, greedy_references, write_oracle

BUDGETS = [1, 4, 8, 16, 32]
# Filled by the stack fixture just before it starts: ports picked when the module is collected
# were taken by then (a CI run lost one to another test's ephemeral port minutes later).
METRICS_PORTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("stack"))


@pytest.fixture(scope="module")
def refs(ckpt):
    return greedy_references(ckpt, PROMPTS, GREEDY_TOKENS)


@pytest.fixture(scope="module")
def stack(ckpt, refs, tmp_path_factory):
    drafter = write_oracle(tmp_path_factory.mktemp("oracle") / "oracle.json", ckpt, refs)
    METRICS_PORTS.update({name: free_port() for name in ("scheduler", "draft", "verifier")})
    spec = StackSpec(model_path=str(ckpt), drafter_path=drafter, scheduler_port=0,
                     extra_env={"DDTREE_VERIFIER_MAX_CONTEXT": "256", "DDTREE_SCHEDULER_MAX_QUEUE": "64",
                                **{f"DDTREE_{s.upper()}_METRICS_PORT": str(METRICS_PORTS[s]) for s in METRICS_PORTS}})
    with Stack(spec) as s:
        METRICS_PORTS.update({name: int(s.metrics_address(name).rsplit(":", 1)[1]) for name in METRICS_PORTS})
        yield s


async def _run_all(address: str, prompts: list, **kwargs) -> list:
    async with AsyncClient(address) as client:
        return await asyncio.gather(*(client.generate(p, **kwargs) for p in prompts))


def test_stack_uses_shared_memory_transport(stack, ckpt):
    from services.common.tokenizer_files import load_tokenizer, vocab_digest

    with Client(stack.scheduler_address) as c:
        info = c.model_info()
    assert info.transport == "shm"
    assert info.block_size == 16 and info.max_context == 256
    assert list(info.eos_token_ids) == [info.eos_token_id] == [0]   # the demo's "<|eos|>", verifier to client
    # the draft's target tokenizer, which the scheduler checked its own against at its start
    assert info.tokenizer_digest == vocab_digest(load_tokenizer(str(ckpt)))


def test_greedy_ddtree_equals_autoregressive_every_budget(stack, refs):
    """20 prompts x budgets {1,4,8,16,32}: identical tokens to AR and to the float64 reference."""
    prompts = [refs[p][0] for p in PROMPTS]
    ar = asyncio.run(_run_all(stack.scheduler_address, prompts, max_tokens=GREEDY_TOKENS,
                              mode="autoregressive", ignore_eos=True))
    ar_tokens = [o.token_ids for o in ar]
    assert ar_tokens == [refs[p][1] for p in PROMPTS]
    assert all(a == 1 for o in ar for a in o.acceptance_lengths)
    lengths: Counter = Counter()
    for budget in BUDGETS:
        dd = asyncio.run(_run_all(stack.scheduler_address, prompts, max_tokens=GREEDY_TOKENS, budget=budget,
                                  mode="ddtree", ignore_eos=True))
        for p, o, a in zip(PROMPTS, dd, ar_tokens):
            assert o.token_ids == a, f"budget {budget}, prompt {p!r}"
            assert o.finish_reason == "length"
        per_budget = Counter(x for o in dd for x in o.acceptance_lengths)
        lengths.update(per_budget)
        if budget >= 8:
            assert max(per_budget) >= 4, f"budget {budget} never accepted a deep path: {per_budget}"
    # Rejections at every depth and long accepted paths both happened.
    assert lengths[1] > 0
    assert all(lengths[k] > 0 for k in range(1, 7)), lengths
    assert max(lengths) >= 8, lengths


def test_concurrent_streams_get_their_own_tokens(stack, refs):
    """32 concurrent streaming requests of different lengths equal their single-request outputs."""
    prompts = [refs[PROMPTS[i % len(PROMPTS)]][0] for i in range(32)]
    lengths = [4 + (7 * i) % 21 for i in range(32)]
    with Client(stack.scheduler_address) as c:
        alone = [c.generate(p, max_tokens=n, budget=8, ignore_eos=True).token_ids for p, n in zip(prompts, lengths)]

    async def together():
        async with AsyncClient(stack.scheduler_address) as client:
            async def one(p, n):
                toks = []
                async for chunk in client.stream(p, max_tokens=n, budget=8, ignore_eos=True):
                    toks += chunk.token_ids
                return toks
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    streamed = asyncio.run(together())
    assert streamed == alone
    assert [len(t) for t in streamed] == lengths


def test_sampling_with_seed_is_reproducible(stack):
    kwargs = dict(max_tokens=20, temperature=1.0, top_p=0.95, budget=16, ignore_eos=True)
    with Client(stack.scheduler_address) as c:
        a = c.generate(PROMPTS[0], seed=1234, **kwargs)
        b = c.generate(PROMPTS[0], seed=1234, **kwargs)
        others = {tuple(c.generate(PROMPTS[0], seed=s, **kwargs).token_ids) for s in range(5)}
        # The draws are keyed by token index, not by the trees: any budget, or no speculation, the same text
        budgets = [c.generate(PROMPTS[0], seed=1234, **dict(kwargs, budget=b)).token_ids for b in (1, 64)]
        auto = c.generate(PROMPTS[0], seed=1234, mode="autoregressive", **kwargs)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    assert budgets == [a.token_ids] * 2 and auto.token_ids == a.token_ids
    assert len(others) > 1  # the seed does change the draw


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 2, 100000]), "token_ids[2]"),
    (dict(prompt=list(range(5, 300))), "max context"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(budget=129), "budget"),
    (dict(budget=-1), "budget"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("inf")), "temperature"),   # once failed every request of the verify step
    (dict(temperature=1e-40), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(stop_token_ids=[99999]), "stop_token_ids"),
    # past the request size limit (4 MiB) but under gRPC's own (twice that): refused by name, where
    # gRPC answered RESOURCE_EXHAUSTED "Received message larger than max"
    (dict(prompt=[1 << 27] * (1100 << 10)), "scheduler.max_request_bytes"),  # 4-byte varints: 4.5 MB
]


def test_bad_input_gets_clear_status_and_others_keep_running(stack, refs):
    prompt, expected = refs[PROMPTS[3]]

    async def scenario():
        async with AsyncClient(stack.scheduler_address) as client:
            long_run = asyncio.create_task(client.generate(prompt, max_tokens=GREEDY_TOKENS, budget=4,
                                                           ignore_eos=True))
            errors = []
            for overrides, field in BAD_REQUESTS:
                kwargs = dict(prompt="def f():", max_tokens=8)
                kwargs.update(overrides)
                p = kwargs.pop("prompt")
                with pytest.raises(ClientError) as info:
                    await client.generate(p, **kwargs)
                errors.append((info.value, field))
            return await long_run, errors

    done, errors = asyncio.run(scenario())
    for err, field in errors:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT, (field, err)
        assert field in err.message, (field, err.message)
    assert done.token_ids == expected


async def _reuse(client: AsyncClient, prompt, request_id: str):
    """A call with ``request_id`` as soon as the server has the closed stream's cancellation, which
    reaches it asynchronously (a few tries at most; up to 3 s on a loaded machine)."""
    for _ in range(300):
        try:
            return await client.generate(prompt, max_tokens=3, request_id=request_id, ignore_eos=True)
        except ClientError as exc:
            assert exc.code == grpc.StatusCode.ALREADY_EXISTS
            await asyncio.sleep(0.01)


def test_a_stream_closed_early_or_aborted_frees_its_id_at_once(stack, refs):
    """`break` (+ `aclose()`) cancels the call, and abort ends the request; either way its id may be
    used again at once (before, the request ran to max_tokens and a reuse got ALREADY_EXISTS;
    later, until the next step had retired it): right after ``abort`` returns, and as soon as a
    closed stream's cancellation arrives. The new request's output is its own."""
    prompt = refs[PROMPTS[2]][0]
    kwargs = dict(max_tokens=400, mode="autoregressive", ignore_eos=True)

    async def scenario():
        async with AsyncClient(stack.scheduler_address) as client:
            chunks = client.stream(prompt, request_id="closed-early", **kwargs)
            async for _ in chunks:
                break
            await chunks.aclose()
            first = await _reuse(client, prompt, "closed-early")
            got = []
            async for chunk in client.stream(prompt, request_id="aborted", **kwargs):
                got.append(chunk)
                if len(got) == 2:
                    assert await client.abort("aborted")
                    second = await client.generate(prompt, max_tokens=3, request_id="aborted", ignore_eos=True)
            return first, second, got

    first, second, got = asyncio.run(scenario())
    assert got[-1].finish_reason == "aborted"
    want = refs[PROMPTS[2]][1][:3]
    assert first.token_ids == second.token_ids == want
    with Client(stack.scheduler_address) as c:
        for chunk in c.stream(prompt, request_id="sync-closed", **kwargs):
            break

    async def sync_closed_reused():
        async with AsyncClient(stack.scheduler_address) as client:
            return await _reuse(client, prompt, "sync-closed")
    assert asyncio.run(sync_closed_reused()).token_ids == want


def test_abort_and_deadline_end_requests_and_free_them(stack, refs):
    prompt = refs[PROMPTS[1]][0]

    async def scenario():
        async with AsyncClient(stack.scheduler_address) as client:
            got = []

            async def consume():
                async for chunk in client.stream(prompt, max_tokens=200, request_id="to-abort", mode="autoregressive",
                                                 ignore_eos=True):
                    got.append(chunk)
                    if len(got) == 2:
                        assert await client.abort("to-abort")
            await consume()
            with pytest.raises(ClientError) as info:
                await client.generate(prompt, max_tokens=200, mode="autoregressive", ignore_eos=True,
                                      timeout_s=0.05)
            return got, info.value

    got, deadline_error = asyncio.run(scenario())
    assert got[-1].finish_reason == "aborted"
    assert deadline_error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(stack.scheduler_address) as c:   # still serving, with the same answer as before
        assert c.generate(prompt, max_tokens=GREEDY_TOKENS, ignore_eos=True).token_ids == refs[PROMPTS[1]][1]
        assert not c.abort("no-such-request")


def test_health_reflection_and_cli_json(stack):
    with grpc.insecure_channel(stack.scheduler_address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="ddtree.v1.Scheduler"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"ddtree.v1.Scheduler", "grpc.health.v1.Health"} <= names
    out = subprocess.run([sys.executable, "-m", "services.cli", "generate", "--address", stack.scheduler_address,
                          "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--budget", "8", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) <= 12 and result["finish_reason"] in ("length", "stop")
    assert result["acceptance_lengths"] and sum(result["acceptance_lengths"]) == len(result["token_ids"]) - 1
    usage = result["usage"]
    assert usage["completion_tokens"] == len(result["token_ids"]) and usage["prompt_tokens"] > 0
    assert usage["steps"] == len(result["acceptance_lengths"])
    with Client(stack.scheduler_address) as c:   # the SDK carries the server's usage
        out = c.generate("def fibonacci(n):", max_tokens=12, budget=8)
        assert out.prompt_tokens == usage["prompt_tokens"] and out.usage.completion_tokens == len(out.token_ids)


def test_every_service_exports_prometheus_metrics(stack):
    """Read as differences over one request: the module's earlier tests already moved every counter."""
    import urllib.request

    def pages() -> dict[str, str]:
        return {name: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                for name, port in METRICS_PORTS.items()}

    def settled() -> dict[str, str]:
        # A release-only step may still be in flight after a request ended: read the pages again
        # until the scheduler and the draft counted the same steps.
        deadline = time.monotonic() + 10
        now = pages()
        while _value(now["scheduler"], 'ddtree_step_ms_count{stage="step_rpc"}') != \
                _value(now["draft"], 'ddtree_step_ms_count{stage="step"}') and time.monotonic() < deadline:
            time.sleep(0.1)
            now = pages()
        return now

    with Client(stack.scheduler_address) as c:   # every stage has a sample before the first read
        c.generate(PROMPTS[0], max_tokens=4, budget=8, ignore_eos=True)
    before = settled()
    with Client(stack.scheduler_address) as c:
        c.generate(PROMPTS[0], max_tokens=8, budget=8, ignore_eos=True)
    after = settled()

    def delta(service: str, name: str) -> float:
        return _value(after[service], name) - _value(before[service], name)

    assert delta("scheduler", "ddtree_generated_tokens_total") == 8
    assert delta("scheduler", 'ddtree_requests_total{status="length"}') == 1
    assert delta("scheduler", "ddtree_acceptance_length_count") >= 1
    assert "ddtree_queue_depth" in after["scheduler"]
    for stage in ("draft", "verify", "transport", "verifier_rpc", "context_commit", "draft_ahead", "step", "ahead_wait"):
        assert delta("draft", f'ddtree_step_ms_count{{stage="{stage}"}}') >= 1, stage
    for stage in ("commit", "stream_step", "features"):
        assert delta("verifier", f'ddtree_step_ms_count{{stage="{stage}"}}') >= 1, stage
    assert delta("scheduler", 'ddtree_step_ms_count{stage="scheduler"}') >= 1
    # Each caller's time holds its callee's: the hops are the differences.
    assert delta("scheduler", 'ddtree_step_ms_count{stage="step_rpc"}') == \
        delta("draft", 'ddtree_step_ms_count{stage="step"}') >= 1
    assert delta("scheduler", 'ddtree_step_ms_sum{stage="step_rpc"}') >= \
        delta("draft", 'ddtree_step_ms_sum{stage="step"}') + delta("draft", 'ddtree_step_ms_sum{stage="ahead_wait"}')
    assert delta("draft", 'ddtree_step_ms_sum{stage="step"}') >= \
        delta("draft", 'ddtree_step_ms_sum{stage="verifier_rpc"}') >= \
        delta("verifier", 'ddtree_step_ms_sum{stage="stream_step"}')
    # Every tree step after the first of a request finds its tree drafted ahead.
    tree_steps = delta("scheduler", "ddtree_acceptance_length_count")
    assert delta("draft", 'ddtree_draft_trees_total{drafted="ahead"}') >= tree_steps - 1 >= 1
    assert delta("draft", 'ddtree_draft_trees_total{drafted="ahead"}') + \
        delta("draft", 'ddtree_draft_trees_total{drafted="step"}') == tree_steps
    assert _value(after["verifier"], "ddtree_kv_pages_free") > 0


def _value(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics page")
