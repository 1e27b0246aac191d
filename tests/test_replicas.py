"""Two draft replicas in front of one verifier: spreading, a replica dying mid-stream, rejoining."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest

from services.common.launcher import Stack, StackSpec
from services.scheduler.client import AsyncClient, Client, ClientError
from tests.stack_fixtures import PROMPTS, build_checkpoint


def test_replica_death_ends_its_requests_and_spares_the_rest(tmp_path):
    ckpt = build_checkpoint(tmp_path)
    spec = StackSpec(model_path=str(ckpt), scheduler_port=0, draft_replicas=2)
    with Stack(spec) as stack:
        with Client(stack.scheduler_address) as c:
            expected = {p: c.generate(p, max_tokens=60, ignore_eos=True).token_ids for p in PROMPTS[:8]}

        async def scenario():
            async with AsyncClient(stack.scheduler_address) as client:
                started = asyncio.Event()
                seen = [0]

                async def one(p):
                    toks = []
                    async for chunk in client.stream(p, max_tokens=60, ignore_eos=True):
                        toks += chunk.token_ids
                        seen[0] += 1
                        if seen[0] >= 16:
                            started.set()
                    return toks

                tasks = [asyncio.create_task(one(p)) for p in PROMPTS[:8]]
                await started.wait()
                stack.process("draft-1").kill()
                killed = time.monotonic()
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, time.monotonic() - killed

        results, took = asyncio.run(scenario())
        failed = [r for r in results if isinstance(r, ClientError)]
        ok = [(p, r) for p, r in zip(PROMPTS[:8], results) if not isinstance(r, BaseException)]
        assert failed and ok, "\n".join(repr(r)[-200:] for r in results)   # spread over both replicas
        assert all(e.code == grpc.StatusCode.UNAVAILABLE for e in failed)
        assert all(r == expected[p] for p, r in ok)         # the survivors were not disturbed
        assert took < 30
        with Client(stack.scheduler_address) as c:          # new requests go to the live replica
            for p in PROMPTS[:4]:
                assert c.generate(p, max_tokens=60, ignore_eos=True).token_ids == expected[p]
        stack.restart("draft-1")                            # a restarted replica rejoins

        async def burst():
            async with AsyncClient(stack.scheduler_address) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=60, ignore_eos=True)
                                              for p in PROMPTS[:8]))

        time.sleep(1.5)
        outs = asyncio.run(burst())
        assert [o.token_ids for o in outs] == [expected[p] for p in PROMPTS[:8]]
        # Prove draft-1 really rejoined: with draft-0 gone, requests are served by draft-1 alone.
        stack.process("draft-0").kill()
        stack.process("draft-0").wait()
        with Client(stack.scheduler_address) as c:
            outcomes = []
            for p in PROMPTS[:3]:
                try:
                    outcomes.append(c.generate(p, max_tokens=20, ignore_eos=True).token_ids == expected[p][:20])
                except ClientError as exc:   # at most the first one can land on draft-0 before it is marked down
                    assert exc.code == grpc.StatusCode.UNAVAILABLE
                    outcomes.append(None)
        assert outcomes[1:] == [True, True], outcomes


class _Proc:
    """A service's process as supervision sees it: running (code None) or exited with ``code``."""

    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_supervise_retries_a_restart_that_dies_and_stops_a_crash_loop() -> None:
    """`ddtree up`'s supervision without processes: a restart that fails during start-up (the
    service died before it was healthy) is one more exit to retry, not the end of the stack; more
    than `max_restarts` exits in the window is."""
    from services.common.launcher import _Service

    stack = Stack(StackSpec(model_path="unused"))
    svc = _Service("draft", "draft", "127.0.0.1:1", {}, _Proc(-9))
    stack.services = [svc]
    attempts, reports = [], []

    def restart(name, should_stop=None):
        attempts.append(name)
        if len(attempts) == 1:
            svc.proc = _Proc(-9)   # dies again before it is healthy
            raise RuntimeError("draft exited with code -9 during start-up (see its output)")
        svc.proc = _Proc(None)     # up

    stack.restart = restart
    stack.supervise(lambda: len(attempts) == 2, poll_s=0.0, report=lambda event, msg, **fields: reports.append((event, msg, fields)))
    assert attempts == ["draft", "draft"] and svc.proc.poll() is None
    assert [(event, fields) for event, _, fields in reports] == [
        ("service_restarting", {"target": "draft", "code": -9}), ("service_restart_failed", {"target": "draft"}),
        ("service_restarting", {"target": "draft", "code": -9})]
    assert reports[1][1].startswith("draft restart failed: draft exited with code -9")

    stack.restart = lambda name, should_stop=None: setattr(svc, "proc", _Proc(1))   # dies at once, every time
    svc.proc = _Proc(1)
    rounds = iter(range(50))   # bounded: a regression fails here, not at the suite's timeout
    with pytest.raises(RuntimeError, match="draft exited 4 times"):
        stack.supervise(lambda: next(rounds) == 49, poll_s=0.0, max_restarts=3)

    def slow_failure(name, should_stop=None):   # fails each start-up after its loading, past any window
        svc.proc = _Proc(2)
        raise RuntimeError("draft exited with code 2 during start-up (see its output)")
    stack.restart = slow_failure
    rounds = iter(range(50))
    with pytest.raises(RuntimeError, match=r"draft failed its start-up 4 times in a row \(draft exited with code 2"):
        stack.supervise(lambda: next(rounds) == 49, poll_s=0.0, max_restarts=3, window_s=0.0)

    left = ["fail"] * 3 + ["up"] + ["fail"] * 3 + ["up"]

    def fails_then_comes_up(name, should_stop=None):   # counted are failures in a row: one that came up resets it
        svc.proc = _Proc(2)   # (one that came up exits again at once: seen on the next round)
        if left.pop(0) == "fail":
            raise RuntimeError("draft exited with code 2 during start-up (see its output)")
    stack.restart = fails_then_comes_up
    svc.proc = _Proc(1)
    stack.supervise(lambda: not left, poll_s=0.0, max_restarts=3, window_s=0.0)   # 6 failures, never 4 in a row

    hung = []

    def hangs(name, should_stop=None):   # still starting when its time ran out: it was left running, never retried
        svc.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        hung.append(svc.proc)
        raise RuntimeError("draft did not become healthy within 1 s")
    stack.restart = hangs
    svc.proc = _Proc(1)
    t0 = time.monotonic()
    stack.supervise(lambda: len(hung) == 2, poll_s=0.0)
    assert hung[0].poll() is not None   # ended, so the next round started it again
    assert time.monotonic() - t0 < 30   # ended by the supervisor, not by its own 60 s
    hung[1].kill()
    hung[1].wait()


def test_a_draft_replica_in_a_crash_loop_is_left_down_while_another_serves() -> None:
    """One replica's fault (its GPU, a bad host) stopped the healthy replicas and the rest of the
    stack with it. It is left down, said once, and supervision goes on for the others; the last
    replica's crash loop, or the verifier's, still stops the stack."""
    from services.common.launcher import _Service

    stack = Stack(StackSpec(model_path="unused"))
    bad = _Service("draft-1", "draft", "127.0.0.1:2", {}, _Proc(1))
    good = _Service("draft-0", "draft", "127.0.0.1:1", {}, _Proc(None))
    verifier = _Service("verifier", "verifier", "127.0.0.1:3", {}, _Proc(None))
    stack.services = [verifier, good, bad]
    attempts, reports = [], []

    def restart(name, should_stop=None):
        attempts.append(name)
        next(s for s in stack.services if s.name == name).proc = _Proc(1)   # dies at once, every time

    stack.restart = restart
    rounds = iter(range(20))
    stack.supervise(lambda: next(rounds) == 19, poll_s=0.0, max_restarts=3,
                    report=lambda event, msg, **fields: reports.append((event, msg, fields)))
    assert attempts == ["draft-1"] * 3   # then left down, not stopping the stack
    assert [event for event, _, _ in reports] == ["service_restarting"] * 3 + ["service_given_up"]
    assert reports[-1][1] == ("draft-1 exited 4 times in 60 s (last code 1); leaving it down until the stack "
                              "starts again (its other replicas go on: draft-0)")
    assert reports[-1][2] == {"target": "draft-1"}

    good.proc = _Proc(1)   # the last replica in a loop: the stack stops, as before
    attempts.clear()
    rounds = iter(range(20))
    with pytest.raises(RuntimeError, match="draft-0 exited 4 times in 60 s"):
        stack.supervise(lambda: next(rounds) == 19, poll_s=0.0, max_restarts=3)
    assert set(attempts) == {"draft-0", "draft-1"}   # a new supervision tries the other again

    def fails_start_up(name, should_stop=None):   # a replica that never comes up: its start-ups count
        next(s for s in stack.services if s.name == name).proc = _Proc(2)
        raise RuntimeError(f"{name} exited with code 2 during start-up (see its output)")
    stack.restart = fails_start_up
    good.proc, bad.proc = _Proc(None), _Proc(1)
    reports.clear()
    rounds = iter(range(20))
    stack.supervise(lambda: next(rounds) == 19, poll_s=0.0, max_restarts=3, window_s=0.0,
                    report=lambda event, msg, **fields: reports.append((event, msg, fields)))
    assert reports[-1][0] == "service_given_up" and "draft-1 failed its start-up 4 times in a row" in reports[-1][1]

    hung = []

    def hangs(name, should_stop=None):   # a replica given up while still starting is not left running
        svc = next(s for s in stack.services if s.name == name)
        svc.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        hung.append(svc.proc)
        raise RuntimeError(f"{name} did not become healthy within 1 s")
    stack.restart = hangs
    good.proc, bad.proc = _Proc(None), _Proc(1)
    reports.clear()
    rounds = iter(range(20))
    try:
        stack.supervise(lambda: next(rounds) == 19, poll_s=0.0, max_restarts=3, window_s=0.0,
                        report=lambda event, msg, **fields: reports.append((event, msg, fields)))
        assert reports[-1][0] == "service_given_up" and len(hung) == 4
        assert [p.poll() is not None for p in hung] == [True] * 4   # none left holding its GPU and port
    finally:
        for p in hung:
            p.kill()
            p.wait()

    # The verifier's loop, or the scheduler's, stops the stack, replicas or not.
    scheduler = _Service("scheduler", "scheduler", "127.0.0.1:4", {}, _Proc(None))
    stack.services.append(scheduler)
    stack.restart = restart
    for looping in (verifier, scheduler):
        verifier.proc, scheduler.proc, good.proc, bad.proc = _Proc(None), _Proc(None), _Proc(None), _Proc(None)
        looping.proc = _Proc(1)
        rounds = iter(range(20))
        with pytest.raises(RuntimeError, match=f"{looping.name} exited 4 times"):
            stack.supervise(lambda: next(rounds) == 19, poll_s=0.0, max_restarts=3)


@pytest.mark.parametrize("replicas, scheduler_metrics, scheduler_port, named",
                         [(3, 2, 0, False), (3, 2, 1, False), (1, 0, 1, False), (3, 2, 0, True)])
def test_a_draft_replicas_metrics_port_is_moved_past_every_port_of_the_stack(replicas, scheduler_metrics,
                                                                             scheduler_port, named) -> None:
    """A replica whose metrics port another's takes moves to the next one no service of the stack
    uses: the move went past the other services' metrics ports only, onto the scheduler's own port
    (`ddtree up` then refused to start, naming `scheduler.port`) or a replica's gRPC port. The
    first replica keeps the configured port where no other metrics take it."""
    from pathlib import Path

    from services.common.launcher import free_port

    root = Path(__file__).resolve().parent.parent
    metrics = free_port()
    port = metrics + scheduler_port if scheduler_port else 0
    spec = StackSpec(model_path=str(root / "models" / "demo"), scheduler_port=port, draft_replicas=replicas,
                     draft_port=metrics + 3 if port else 0,
                     extra_env={"DDTREE_DRAFT_METRICS_PORT": str(metrics),
                                "DDTREE_SCHEDULER_METRICS_PORT": str(metrics + scheduler_metrics)},
                     # one replica's own port, given by name: kept, and not moved onto by another
                     service_env={"draft-1": {"DDTREE_DRAFT_METRICS_PORT": str(metrics + 1)}} if named else {})
    plan = Stack(spec)._plan()
    grpc_ports = [int(svc.address.rsplit(":", 1)[1]) for svc in plan]
    metrics_ports = [int(svc.env[f"DDTREE_{svc.role.upper()}_METRICS_PORT"]) for svc in plan
                     if f"DDTREE_{svc.role.upper()}_METRICS_PORT" in svc.env]
    drafts = [svc for svc in plan if svc.role == "draft"]
    assert (int(drafts[0].env["DDTREE_DRAFT_METRICS_PORT"]) == metrics) == (scheduler_metrics != 0)
    if named:
        assert int(drafts[1].env["DDTREE_DRAFT_METRICS_PORT"]) == metrics + 1
    assert len(metrics_ports) == replicas + 1 and len(set(grpc_ports + metrics_ports)) == len(grpc_ports + metrics_ports), \
        (grpc_ports, metrics_ports)
