"""The stack with the real DFlash drafter, the inline transport, and the ways it must fail cleanly.

Each test's stack is its own (nothing shared between tests); the ``starts`` fixture starts them side
by side as the module starts, so they come up while the first test runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench.common import read_metrics
from services.common.launcher import StackSpec, free_port
from services.common.make_checkpoint import make_random_checkpoint
from services.scheduler.client import AsyncClient, Client, ClientError
from tests.stack_fixtures import PROMPTS, StackStarts, build_checkpoint, greedy_references


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("failures"))


def _inline_spec(ckpt) -> StackSpec:
    return StackSpec(model_path=str(ckpt), scheduler_port=0, extra_env={"DDTREE_DRAFT_TRANSPORT": "inline"})


def _other_target_spec(ckpt, other) -> StackSpec:
    """The target at ``ckpt``, the drafter (and the draft service's target) of ``other``."""
    return StackSpec(model_path=str(ckpt), scheduler_port=0, drafter_path=str(other / "drafter"),
                     extra_env={"DDTREE_DRAFT_TARGET_PATH": str(other)})


def _queue_spec(ckpt) -> StackSpec:
    return StackSpec(model_path=str(ckpt), scheduler_port=0,
                     extra_env={"DDTREE_SCHEDULER_MAX_QUEUE": "1", "DDTREE_SCHEDULER_MAX_BATCH": "1"})


def _plain_spec(ckpt) -> StackSpec:
    return StackSpec(model_path=str(ckpt), scheduler_port=0)


def _pieces_spec(ckpt) -> StackSpec:
    """Five prompt tokens a step: every prompt here arrives in pieces over several steps."""
    return StackSpec(model_path=str(ckpt), scheduler_port=0, extra_env={"DDTREE_SCHEDULER_MAX_PREFILL_TOKENS": "5"})


def _logged_spec(ckpt) -> StackSpec:
    return StackSpec(model_path=str(ckpt), scheduler_port=0, log_path=str(ckpt.parent / "idle-stop.log"))


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A checkpoint of another target (hidden size 32): its drafter does not fit ``ckpt``."""
    return make_random_checkpoint(tmp_path_factory.mktemp("other") / "other", vocab_size=512, seed=3,
                                  target_overrides={"hidden_size": 32})


@pytest.fixture(scope="module")
def starts(request, ckpt, other_ckpt):
    """The stacks of the selected tests below, started side by side as the module starts (each test
    takes its own, unshared; see ``StackStarts``)."""
    starts = StackStarts(request, {
        "test_real_drafter_over_inline_transport_is_lossless": lambda: _inline_spec(ckpt),
        "test_drafter_for_another_target_is_refused_at_handshake": lambda: _other_target_spec(ckpt, other_ckpt),
        "test_queue_bound_rejects_with_resource_exhausted": lambda: _queue_spec(ckpt),
        "test_dead_verifier_is_reported_not_hung_on": lambda: _plain_spec(ckpt),
        "test_prompts_in_pieces_decode_as_whole_ones": lambda: _pieces_spec(ckpt),
        "test_an_idle_verifier_stops_at_once_and_its_draft_reports_it": lambda: _logged_spec(ckpt),
    })
    yield starts
    starts.close()


def _serve(service: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "serve", service], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def test_real_drafter_over_inline_transport_is_lossless(ckpt, starts):
    with starts.take("test_real_drafter_over_inline_transport_is_lossless", _inline_spec(ckpt)) as stack, \
            Client(stack.scheduler_address) as c:
        assert c.model_info().transport == "inline"
        for p in PROMPTS[:5]:
            ar = c.generate(p, max_tokens=16, mode="autoregressive", ignore_eos=True)
            for budget in (1, 16, 128):
                dd = c.generate(p, max_tokens=16, budget=budget, ignore_eos=True)
                assert dd.token_ids == ar.token_ids, (p, budget)
                assert sum(dd.acceptance_lengths) >= 15


def test_prompts_in_pieces_decode_as_whole_ones(ckpt, starts):
    """With five prompt tokens a step, prompts go in pieces while other requests decode between
    them (real drafter); every output is still the float64 reference's greedy continuation."""
    prompts = [p for p in PROMPTS if len(p) > 20][:6]
    refs = greedy_references(ckpt, prompts, 12)
    assert all(len(ids) > 10 for ids, _ in refs.values())   # three pieces or more each

    async def scenario():
        async with AsyncClient(stack.scheduler_address) as client:
            return await asyncio.gather(*[client.generate(p, max_tokens=12, budget=(4, 16, 0)[i % 3], ignore_eos=True,
                                                          mode="autoregressive" if i % 3 == 2 else "ddtree")
                                          for i, p in enumerate(prompts)])

    with starts.take("test_prompts_in_pieces_decode_as_whole_ones", _pieces_spec(ckpt)) as stack:
        outs = asyncio.run(scenario())
    for p, out in zip(prompts, outs):
        assert out.token_ids == refs[p][1], p


def test_malformed_checkpoint_directory_fails_start_with_a_clear_message(tmp_path, ckpt):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 96'))
    (broken / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    with ThreadPoolExecutor(2) as pool:   # two independent verifier start-ups, side by side
        no_config, bad_shapes = pool.map(lambda d: _serve("verifier", {"DDTREE_VERIFIER_MODEL_PATH": str(d),
                                                                       "DDTREE_VERIFIER_PORT": "0"}), (empty, broken))
    assert no_config.returncode == 2 and "config.json" in no_config.stderr, no_config.stderr
    assert bad_shapes.returncode == 2 and "model.safetensors" in bad_shapes.stderr, bad_shapes.stderr


def test_drafter_for_another_target_is_refused_at_handshake(ckpt, other_ckpt, starts):
    with pytest.raises(RuntimeError, match="draft exited with code 2"):
        with starts.take("test_drafter_for_another_target_is_refused_at_handshake", _other_target_spec(ckpt, other_ckpt)):
            pass


def test_queue_bound_rejects_with_resource_exhausted(ckpt, starts):

    async def burst(address):
        async with AsyncClient(address) as client:
            return await asyncio.gather(*(client.generate(PROMPTS[0], max_tokens=40, ignore_eos=True)
                                          for _ in range(6)), return_exceptions=True)

    with starts.take("test_queue_bound_rejects_with_resource_exhausted", _queue_spec(ckpt)) as stack:
        results = asyncio.run(burst(stack.scheduler_address))
    rejected = [r for r in results if isinstance(r, ClientError)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert rejected and all(r.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in r.message
                            for r in rejected)
    assert served and all(len(r.token_ids) == 40 for r in served)


def test_dead_verifier_is_reported_not_hung_on(ckpt, starts):
    with starts.take("test_dead_verifier_is_reported_not_hung_on", _plain_spec(ckpt)) as stack:
        async def scenario():
            async with AsyncClient(stack.scheduler_address) as client:
                got = []
                with pytest.raises(ClientError) as info:
                    async for chunk in client.stream(PROMPTS[2], max_tokens=4000 // 8, mode="autoregressive",
                                                     ignore_eos=True):
                        got.append(chunk)
                        if len(got) == 3:
                            stack.process("verifier").kill()
                            killed_at = time.monotonic()
                ended_in = time.monotonic() - killed_at
                t0 = time.monotonic()
                with pytest.raises(ClientError) as later:
                    await client.generate(PROMPTS[0], max_tokens=4)
                return info.value, ended_in, later.value, time.monotonic() - t0

        err, ended_in, later, later_s = asyncio.run(scenario())
        # `ddtree up`'s supervision starts it again on its address, and the stack serves again
        restarted, back = [], []
        launch = stack.restart

        def restart(name: str, should_stop=None) -> None:   # supervision ends once the restart is done
            launch(name, should_stop)
            back.append(name)
        stack.restart = restart
        stack.supervise(lambda: bool(back), poll_s=0.05, report=lambda event, msg, **fields: restarted.append(msg))
        del stack.restart
        with Client(stack.scheduler_address, timeout_s=60) as c:
            for _ in range(50):   # the draft re-opens its verify stream on the next step
                try:
                    out = c.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
                    break
                except ClientError as exc:
                    assert exc.code == grpc.StatusCode.UNAVAILABLE
                    time.sleep(0.2)
        # a service that keeps dying is not restarted forever

        def kill_verifier() -> bool:
            proc = stack.process("verifier")
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            return False

        with pytest.raises(RuntimeError, match="verifier exited 2 times"):
            stack.supervise(kill_verifier, poll_s=0.05, max_restarts=1)
    assert err.code == grpc.StatusCode.UNAVAILABLE and ended_in < 5.0
    assert later.code == grpc.StatusCode.UNAVAILABLE and later_s < 5.0
    assert restarted == ["verifier exited with code -9; restarting it"] and len(out.token_ids) == 4


def test_an_idle_verifier_stops_at_once_and_its_draft_reports_it(ckpt, starts):
    """A draft's open verify stream held a SIGTERMed verifier for the server's whole grace (5 s),
    and the draft said SERVING until the process was gone; the verifier also logged nothing of its
    stop. Now it ends its idle streams, says `stopping`, and the draft's health follows."""
    from grpc_health.v1 import health_pb2

    from services.healthcheck import check

    spec = _logged_spec(ckpt)
    with starts.take("test_an_idle_verifier_stops_at_once_and_its_draft_reports_it", spec) as stack:
        with Client(stack.scheduler_address, timeout_s=60) as c:
            assert len(c.generate(PROMPTS[0], max_tokens=4, ignore_eos=True).token_ids) == 4   # the stream is open
        draft = next(name for name, _ in stack.procs if name.startswith("draft"))
        assert check(stack.address(draft)) == health_pb2.HealthCheckResponse.SERVING
        verifier = stack.process("verifier")
        t0 = time.monotonic()
        verifier.terminate()
        verifier.wait(30)
        took = time.monotonic() - t0
        while check(stack.address(draft)) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - t0 < 10, "the draft still says SERVING 10 s after its verifier's stop"
            time.sleep(0.02)
    log = open(spec.log_path).read()
    assert took < 3.0, took
    assert any("stopping" in line and "service=verifier" in line and "signal=SIGTERM" in line
               for line in log.splitlines()), log[-2000:]


def test_a_picked_port_another_process_takes_before_its_service_binds_it_is_picked_again(ckpt, monkeypatch, capsys):
    """A stack's ports are picked together and bound seconds later; a test run's other stacks pick in
    the same range, and one took a scheduler's port between the two (the stack failed its start,
    "Address already in use"). The verifier and the scheduler lose theirs here: each is started
    again on a new port, and the drafts are given the verifier's new address. So does a metrics
    port picked with `free_port` and passed on as a setting (as tests and benchmarks do), read back
    with `metrics_address`."""
    import socket

    from services.common.launcher import Stack

    held: list[socket.socket] = []
    plan = Stack._plan

    def taken_after_planning(self):
        services = plan(self)
        for svc in (services[0], services[-1]):   # the verifier's and the scheduler's
            take(int(svc.address.rsplit(":", 1)[1]))
        return services

    def take(port: int) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen(1)
        held.append(s)

    def metrics_taken_while_the_verifier_loads(self, svc, should_stop=None):
        metrics = int(self.services[1].env["DDTREE_DRAFT_METRICS_PORT"])   # picked here (below)
        if svc.role == "verifier" and metrics not in {s.getsockname()[1] for s in held}:   # after the checks
            take(metrics)
        return launch(self, svc, should_stop)

    launch = Stack._launch
    monkeypatch.setattr(Stack, "_plan", taken_after_planning)
    monkeypatch.setattr(Stack, "_launch", metrics_taken_while_the_verifier_loads)
    spec = _plain_spec(ckpt)
    spec.extra_env["DDTREE_DRAFT_METRICS_PORT"] = str(free_port())
    try:
        with Stack(spec) as stack, Client(stack.scheduler_address) as c:
            lost = {s.getsockname()[1] for s in held}
            ports = {int(svc.address.rsplit(":", 1)[1]) for svc in stack.services}
            assert not lost & ports and len(ports) == len(stack.services)
            draft_metrics = stack.metrics_address("draft")
            assert int(draft_metrics.rsplit(":", 1)[1]) not in lost
            assert read_metrics(draft_metrics)   # its page answers where it moved
            assert all(svc.env["DDTREE_DRAFT_VERIFIER_ADDRESS"] == stack.services[0].address
                       for svc in stack.services if svc.role == "draft")
            assert stack.scheduler_address == stack.services[-1].address
            assert len(c.generate(PROMPTS[0], max_tokens=4, ignore_eos=True).token_ids) == 4
    finally:
        for s in held:
            s.close()
    err = capsys.readouterr().err
    assert "verifier's port" in err and "scheduler's port" in err and "taken by another process" in err
    assert "draft's metrics port" in err
