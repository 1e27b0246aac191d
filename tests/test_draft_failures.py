"""A draft replica when what is around it fails: its verifier restarts between steps, freezes, or
dies for good beside another group's; its scheduler goes away; a step names a request twice.

Real services in one process over real sockets (CPU): the verifier's servicer and engine on a tiny
random target, the draft's servicer and engine with a random drafter, and the scheduler's own
step link (and router, where placement matters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from structlog.testing import capture_logs

from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc, scheduler_pb2, verifier_pb2, verifier_pb2_grpc
from services.common.grpc_server import ServiceError
from services.common.make_checkpoint import make_random_checkpoint
from services.common.metrics import Metrics
from services.common.settings import DraftSettings, SchedulerSettings, SettingsError, VerifierSettings
from services.common.transport import InlineWriter
from services.draft import server as draft_server
from services.draft.engine import DraftEngine
from services.draft.proposer import load_proposer
from services.draft.server import DraftServicer, _reconnect_when_lost, enable_propose_graphs
from services.draft.verifier_client import VerifierClient
from services.scheduler.draft_link import DraftLink, StepFailed
from services.scheduler.request import ActiveRequest
from services.scheduler.router import Router
from services.verifier.parallel import TensorParallel
from services.verifier.ranks import EngineGroup
from services.verifier.server import VerifierServicer, build_engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Iterator[Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # this module's in-process services, as each service process runs
    yield make_random_checkpoint(tmp_path_factory.mktemp("draft-failures") / "ckpt", vocab_size=512, seed=0)
    torch.set_num_threads(threads)   # later modules' timings must not depend on the order


class Verifier:
    """A verifier service in this process; ``hang`` makes it take the next verify message and
    never answer it (a frozen process whose socket stays open)."""

    def __init__(self, ckpt: Path, port: int = 0, kv_capacity_tokens: int = 4096) -> None:
        self.ckpt, self.port, self.kv = ckpt, port, kv_capacity_tokens
        self.hang = False

    async def start(self) -> Verifier:
        settings = VerifierSettings(model_path=str(self.ckpt), kv_capacity_tokens=self.kv, max_context=1024,
                                    ring_slot_bytes=1 << 20, ring_slots=4, port=self.port)
        engine = build_engine(settings, TensorParallel(0, 1))
        self.servicer = VerifierServicer(EngineGroup(engine, TensorParallel(0, 1)), settings, Metrics("verifier"))
        outer = self

        class Servicer(verifier_pb2_grpc.VerifierServicer):
            Handshake = self.servicer.Handshake

            async def VerifyStream(self, request_iterator, context):
                async for resp in outer.servicer.VerifyStream(outer._maybe_hang(request_iterator), context):
                    yield resp

        self.server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def _maybe_hang(self, requests: AsyncIterator) -> AsyncIterator:
        async for req in requests:
            if self.hang:
                self.hang = False
                await asyncio.Event().wait()
            yield req

    @property
    def engine(self):
        return self.servicer.engine

    async def stop(self) -> None:
        await self.server.stop(0)


class Draft:
    def __init__(self, ckpt: Path, verifier_port: int, step_timeout_s: float = 60.0) -> None:
        proposer = load_proposer(str(ckpt / "drafter"), str(ckpt), torch.float32, "cpu")
        self.client = VerifierClient(f"127.0.0.1:{verifier_port}", "shm", 4, 1 << 20, device="cpu",
                                     step_timeout_s=step_timeout_s)
        self.engine = DraftEngine(proposer, self.client)

    async def start(self) -> Draft:
        await self.engine.connect(wait_s=5)
        self.server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServicer_to_server(DraftServicer(self.engine), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        return self

    def link(self) -> tuple[DraftLink, grpc.aio.Channel]:
        channel = grpc.aio.insecure_channel(self.address)
        return DraftLink(draft_pb2_grpc.DraftStub(channel)), channel

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.engine.close()   # as the service stops: after the stream clean-up in progress


def admit(rid: str, max_new: int = 64) -> draft_pb2.StepItem:
    return draft_pb2.StepItem(request_id=rid, prompt_token_ids=[5, 6, 7, 8, 9, 10], budget=4, max_new_tokens=max_new,
                              mode=common_pb2.MODE_DDTREE)


def decode(rid: str) -> draft_pb2.StepItem:
    return draft_pb2.StepItem(request_id=rid, budget=4)


async def step(link: DraftLink, items, release=(), timeout: float = 30.0) -> list[tuple[str, str]] | str:
    """Each item's outcome by code name, or the step's failure."""
    try:
        resp = await link.step(draft_pb2.StepRequest(items=items, release=list(release)), timeout)
    except StepFailed as exc:
        return f"StepFailed({exc.code.name})"
    names = {c.value[0]: c.name for c in grpc.StatusCode}
    return [(r.request_id, names[r.error_code]) for r in resp.results]


@contextlib.asynccontextmanager
async def replica(ckpt: Path, kv_capacity_tokens: int = 4096, step_timeout_s: float = 60.0):
    """A verifier, a draft in front of it and a scheduler's link to the draft, all stopped at the
    end; a test that replaces one (a restart, a new scheduler) sets it on the returned namespace."""
    verifier = await Verifier(ckpt, kv_capacity_tokens=kv_capacity_tokens).start()
    draft = await Draft(ckpt, verifier.port, step_timeout_s=step_timeout_s).start()
    link, channel = draft.link()
    r = SimpleNamespace(verifier=verifier, draft=draft, link=link, channel=channel)
    try:
        yield r
    finally:
        r.link.close()
        await r.channel.close()
        await r.draft.stop()
        await r.verifier.stop()


def test_a_verifier_restarted_between_steps_is_hand_shaken_again(ckpt):
    """Its old stream ended while the draft was idle: the next step hand-shakes again (it wrote to
    the finished stream and failed UNKNOWN, then and on every step after, until a restart), and a
    request lost with the old verifier is reported UNAVAILABLE, not unknown."""
    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("a")]) == [("a", "OK")]
            await r.verifier.stop()
            await asyncio.sleep(0.3)
            r.verifier = await Verifier(ckpt, port=r.verifier.port).start()   # back before the next step
            piece = draft_pb2.StepItem(request_id="a", prompt_token_ids=[11, 12], prompt_offset=6, budget=4)
            return [await step(r.link, [decode("a"), admit("b")]), await step(r.link, [piece]),
                    await step(r.link, [decode("b")], release=["a"])], r.draft.client
    with capture_logs() as logs:
        steps, client = asyncio.run(run())
    assert steps == [[("a", "UNAVAILABLE"), ("b", "OK")], [("a", "UNAVAILABLE")], [("b", "OK")]]
    # The reconnect a step made is logged (only the replica's own watch logged one), naming the verifier.
    again = [e for e in logs if e["event"] == "verifier_reconnected"]
    assert len(again) == 1 and again[0]["verifier"] == client.address and again[0]["transport"] == "shm"
    assert again[0]["verifier_id"]


def test_a_frozen_verifier_costs_one_step_not_the_replica(ckpt):
    """A verifier that takes a step and never answers (alive, socket open) held the draft's lock
    for ever: every later step timed out. Past `verifier_step_timeout_s` the step fails, the
    replica counts as down, and it serves again once the verifier answers."""
    async def run():
        async with replica(ckpt, step_timeout_s=1.0) as r:
            assert await step(r.link, [admit("a")]) == [("a", "OK")]
            r.verifier.hang = True
            frozen = await step(r.link, [decode("a")], timeout=10)
            # The timed-out stream is dropped: kept, the next step could read the late answer to this one.
            dropped = not r.draft.client.connected
            after = await step(r.link, [admit("b")], timeout=10)
            return frozen, dropped, after, r.draft.engine._lock.locked()
    with capture_logs() as logs:
        frozen, dropped, after, locked = asyncio.run(run())
    assert frozen == "StepFailed(UNAVAILABLE)" and dropped and after == [("b", "OK")] and not locked
    lost = [e for e in logs if e["event"] == "verifier_stream_lost"]
    assert len(lost) == 1 and lost[0]["log_level"] == "warning" and lost[0]["verifier"].startswith("127.0.0.1:")
    assert lost[0]["error"] == "the verifier answered no step within 1 s"
    assert [e["event"] for e in logs if e["event"].startswith("verifier_")] == ["verifier_stream_lost",
                                                                                "verifier_reconnected"]


def test_a_scheduler_that_goes_away_leaves_no_request_behind(ckpt):
    """Its step stream ended (a restart): the requests it admitted kept their drafter contexts and
    KV pages until the draft or the verifier restarted, and their ids stayed taken."""
    async def run():
        async with replica(ckpt, kv_capacity_tokens=2048) as r:
            assert await step(r.link, [admit("a", max_new=900), admit("b", max_new=900)]) == [("a", "OK"), ("b", "OK")]
            assert r.verifier.engine.active_requests == 2
            assert r.draft.engine.metrics.running.collect()[0].samples[0].value == 2
            r.link.close()
            await r.channel.close()
            for _ in range(100):
                if r.verifier.engine.active_requests == 0:
                    break
                await asyncio.sleep(0.02)
            freed = r.verifier.engine.active_requests == 0 and not r.draft.engine._requests
            gauge = r.draft.engine.metrics.running.collect()[0].samples[0].value   # it kept 2 until a step
            freed = freed and gauge == 0
            r.link, r.channel = r.draft.link()   # the next scheduler: nothing reserved, ids free
            return freed, await step(r.link, [admit("c", max_new=900), admit("a", max_new=900)])
    freed, next_scheduler = asyncio.run(run())
    assert freed and next_scheduler == [("c", "OK"), ("a", "OK")]


def test_a_request_named_twice_in_a_step_fails_alone(ckpt):
    """Its two items would step it twice from one state; the other requests go on (its dropped
    prefill's commit failed the next step of every request, KeyError)."""
    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("b")]) == [("b", "OK")]
            twice = await step(r.link, [decode("b"), admit("a"), decode("a")])
            return twice, await step(r.link, [decode("b")], release=["a"])
    twice, after = asyncio.run(run())
    assert twice == [("b", "OK"), ("a", "INVALID_ARGUMENT"), ("a", "INVALID_ARGUMENT")] and after == [("b", "OK")]


def test_a_running_request_named_twice_is_refused_not_dropped(ckpt):
    """Both items fail; the request itself was dropped here while its KV stayed held at the
    verifier, and its next decode found nothing (NOT_FOUND) though the verifier still had it."""
    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("a")]) == [("a", "OK")]
            twice = await step(r.link, [decode("a"), decode("a")])
            return twice, await step(r.link, [decode("a")]), r.verifier.engine.active_requests
    twice, after, held = asyncio.run(run())
    assert twice == [("a", "INVALID_ARGUMENT")] * 2 and after == [("a", "OK")] and held == 1


def test_an_item_out_of_range_fails_alone_with_invalid_argument(ckpt):
    """A max_new_tokens whose reservation overflows the verifier's int32 raised out of the step
    (the stream ended UNKNOWN and every request of it went); an unknown mode was served as DDTree;
    a negative prompt offset skipped the piece's continuity check."""
    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("a")]) == [("a", "OK")]
            huge, zero = admit("huge", max_new=2**31 - 5), admit("zero", max_new=0)
            mode = admit("mode")
            mode.mode = 7
            negative = draft_pb2.StepItem(request_id="a", prompt_token_ids=[11], prompt_offset=-1, budget=4)
            bad = await step(r.link, [decode("a"), huge, zero, mode])
            return bad, await step(r.link, [negative]), await step(r.link, [decode("a")]), sorted(r.draft.engine._requests)
    bad, negative, after, held = asyncio.run(run())
    assert bad == [("a", "OK"), ("huge", "INVALID_ARGUMENT"), ("zero", "INVALID_ARGUMENT"), ("mode", "INVALID_ARGUMENT")]
    assert negative == [("a", "INVALID_ARGUMENT")] and after == [("a", "OK")] and held == ["a"]


def test_the_verifier_answers_a_prefill_named_twice_in_its_place() -> None:
    """A draft that sends a request's prefill twice in a step, the first with sampling the
    verifier refuses, gets each item's own result in its place: the refusal for the first, the
    engine's outcome for the second, and the next item's for the next (the refusal was keyed by
    request id, so both copies got it and every later item got its neighbour's outcome)."""
    from services.verifier.engine import ItemOutcome
    from services.verifier.server import _in_order
    prefills = [verifier_pb2.PrefillItem(request_id=r) for r in ("x", "x", "y")]
    refused = verifier_pb2.ItemResult(request_id="x", error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                      error_message="sampling: temperature must be ...")
    done = [ItemOutcome("x", [11], committed=4), ItemOutcome("y", [12], committed=2)]
    got = _in_order(prefills, {0: refused}, done)
    assert [(r.request_id, r.error_code, list(r.token_ids)) for r in got] == [
        ("x", grpc.StatusCode.INVALID_ARGUMENT.value[0], []), ("x", 0, [11]), ("y", 0, [12])]


def _request(name: str, max_tokens: int = 6, kv_tokens: int = 64) -> ActiveRequest:
    return ActiveRequest(name, [5, 6, 7, 8], common_pb2.SamplingParams(), max_tokens, 4, common_pb2.MODE_DDTREE,
                         (), frozenset(), frozenset(), None, kv_tokens=kv_tokens)


async def _settled(req: ActiveRequest) -> str:
    for _ in range(400):
        if req.error is not None or req.finish != scheduler_pb2.FINISH_REASON_UNSPECIFIED:
            return req.error.code.name if req.error is not None else "OK"
        await asyncio.sleep(0.025)
    return "still running"


def test_a_dead_verifier_group_takes_no_new_requests(ckpt):
    """Two verifier groups, one draft each; A's verifier dies under a running request. That draft
    answered every step request by request, so its lane stayed up, was the least loaded, and
    took (and failed) every new request while group B idled."""
    async def run():
        verifier_a, verifier_b = await Verifier(ckpt).start(), await Verifier(ckpt).start()
        draft_a, draft_b = await Draft(ckpt, verifier_a.port).start(), await Draft(ckpt, verifier_b.port).start()
        router = Router(SchedulerSettings(tokenizer_path="", draft_addresses=(draft_a.address, draft_b.address)),
                        Metrics("scheduler"))
        await router.start(timeout_s=10)
        try:
            running = _request("running", max_tokens=900, kv_tokens=1024)
            router.lanes[0].submit(running)
            await asyncio.sleep(0.3)
            await verifier_a.stop()
            lost = await _settled(running)
            outcomes = []
            for i in range(4):
                req = _request(f"new{i}")
                router.submit(req)
                outcomes.append(await _settled(req))
            return lost, outcomes, [lane.healthy for lane in router.lanes]
        finally:
            await router.stop()
            await draft_a.stop()
            await draft_b.stop()
            await verifier_b.stop()
    lost, outcomes, healthy = asyncio.run(run())
    assert lost == "UNAVAILABLE" and outcomes == ["OK"] * 4 and healthy == [False, True]


def test_an_old_streams_end_frees_only_what_it_admitted(ckpt):
    """A draft hand-shakes again under its id (its stream broke) and admits on the new stream
    before the verifier notices the old one end: that end freed the new stream's requests too (by
    draft id), and their next verify found nothing. What the old stream admitted goes at the new
    handshake."""
    layers = json.loads((ckpt / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    cfg = json.loads((ckpt / "config.json").read_text())
    hello = verifier_pb2.HandshakeRequest(draft_id="d1", feature_layer_ids=layers, hidden_size=cfg["hidden_size"],
                                          vocab_size=cfg["vocab_size"], transports=["inline"])

    def prefill(rid: str) -> verifier_pb2.VerifyRequest:
        return verifier_pb2.VerifyRequest(sequence=1, prefills=[
            verifier_pb2.PrefillItem(request_id=rid, token_ids=[5, 6, 7], reserve_tokens=64)])

    async def run():
        verifier = await Verifier(ckpt).start()
        address = f"127.0.0.1:{verifier.port}"
        old_channel, new_channel = grpc.aio.insecure_channel(address), grpc.aio.insecure_channel(address)
        try:
            await verifier_pb2_grpc.VerifierStub(old_channel).Handshake(hello)
            old = verifier_pb2_grpc.VerifierStub(old_channel).VerifyStream(metadata=(("draft-id", "d1"),))
            await old.write(prefill("a"))
            await old.read()
            await verifier_pb2_grpc.VerifierStub(new_channel).Handshake(hello)
            held_after_handshake = sorted(verifier.engine._requests)
            new = verifier_pb2_grpc.VerifierStub(new_channel).VerifyStream(metadata=(("draft-id", "d1"),))
            await new.write(prefill("b"))
            root = (await new.read()).prefills[0].token_ids[0]
            await old_channel.close()   # the old stream's end reaches the verifier now
            await asyncio.sleep(0.3)
            t = torch.tensor
            trees = {"tokens": t([root]), "parents": t([-1]), "depths": t([0]), "sizes": t([1])}
            await new.write(verifier_pb2.VerifyRequest(sequence=2, verify_ids=["b"], trees=InlineWriter().write(trees)))
            (item,) = (await new.read()).verifies
            return held_after_handshake, item.error_code, sorted(verifier.engine._requests)
        finally:
            await new_channel.close()
            await verifier.stop()
    held_after_handshake, code, held_at_end = asyncio.run(run())
    assert held_after_handshake == [] and code == 0 and held_at_end == ["b"]


def test_a_second_stream_on_one_handshake_is_refused_and_the_first_goes_on(ckpt):
    """Two streams of one handshake would interleave their steps on the same rings, and the end of
    either would drop the peer under the other: the second is refused, the first is untouched."""
    layers = json.loads((ckpt / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    cfg = json.loads((ckpt / "config.json").read_text())
    hello = verifier_pb2.HandshakeRequest(draft_id="d1", feature_layer_ids=layers, hidden_size=cfg["hidden_size"],
                                          vocab_size=cfg["vocab_size"], transports=["inline"])

    def prefill(rid: str, seq: int) -> verifier_pb2.VerifyRequest:
        return verifier_pb2.VerifyRequest(sequence=seq, prefills=[
            verifier_pb2.PrefillItem(request_id=rid, token_ids=[5, 6, 7], reserve_tokens=64)])

    async def run():
        verifier = await Verifier(ckpt).start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}")
        try:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            await stub.Handshake(hello)
            first = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            await first.write(prefill("a", 1))
            await first.read()
            second = stub.VerifyStream(metadata=(("draft-id", "d1"),))
            with pytest.raises(grpc.aio.AioRpcError) as refused:   # the refusal may end the call before the write
                await second.write(prefill("b", 1))
                await second.read()
            await asyncio.sleep(0.2)   # the refused stream's end must not have dropped the first's peer
            await first.write(prefill("c", 2))
            (item,) = (await first.read()).prefills
            return refused.value, item.error_code, sorted(verifier.engine._requests)
        finally:
            await channel.close()
            await verifier.stop()
    refused, code, held = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "already open" in refused.details()
    assert code == 0 and held == ["a", "c"]


def test_a_step_stream_that_ended_between_steps_fails_its_requests_as_unavailable(ckpt):
    """The draft frees what a step stream admitted when it ends (a dropped connection); the lane
    must hear so at its next step, not step on as if nothing happened and get NOT_FOUND."""
    async def run():
        async with replica(ckpt) as r:
            out = [await step(r.link, [admit("a")])]
            r.link._call.cancel()   # as a connection that dropped between steps
            await asyncio.sleep(0.2)
            out.append(await step(r.link, [decode("a")]))
            out.append(await step(r.link, [decode("a"), admit("b")]))   # a late reference to the lost request
            return out, r.verifier.engine.active_requests
    out, active = asyncio.run(run())
    assert out == [[("a", "OK")], "StepFailed(UNAVAILABLE)", [("a", "UNAVAILABLE"), ("b", "OK")]] and active == 1


def test_a_replica_comes_back_when_its_verifiers_handshake_outlasts_the_probe(ckpt):
    """A replica down for want of its verifier rejoins through its probe, which hand-shakes again.
    The probe gives up after 1 s; a handshake that takes longer (the verifier's engine busy with
    other replicas' steps) was cancelled with it, every time, and the replica stayed down."""
    async def run():
        verifier = await Verifier(ckpt).start()
        port = verifier.port
        draft = await Draft(ckpt, verifier.port).start()
        router = Router(SchedulerSettings(tokenizer_path="", draft_addresses=(draft.address,)), Metrics("scheduler"))
        await router.start(timeout_s=10)
        try:
            await verifier.stop()
            req = _request("r0")
            router.submit(req)
            lost, down = await _settled(req), not router.lanes[0].healthy
            verifier = await Verifier(ckpt, port=port).start()
            engine = verifier.servicer.engine
            set_layers = engine.set_feature_layers
            engine.set_feature_layers = lambda layers: (time.sleep(1.5), set_layers(layers))
            for _ in range(100):
                if router.lanes[0].healthy:
                    break
                await asyncio.sleep(0.1)
            return lost, down, router.lanes[0].healthy
        finally:
            await router.stop()
            await draft.stop()
            await verifier.stop()
    assert asyncio.run(run()) == ("UNAVAILABLE", True, True)


def test_a_draft_hand_shakes_again_by_itself_once_its_verifier_is_back(ckpt):
    """Between the loss and the next step or probe, the draft reports NOT_SERVING (its health
    follows `connected`); it reconnects on its own, so a replica no scheduler steps comes back too."""
    async def run():
        async with replica(ckpt) as r:
            first = r.draft.client.handshake.verifier_id
            changed = r.draft.client.stream_changed
            changed.clear()
            await r.verifier.stop()
            await asyncio.wait_for(changed.wait(), 2)   # the stream's end tells health at once
            lost = not r.draft.client.connected
            changed.clear()
            r.verifier = await Verifier(ckpt, port=r.verifier.port).start()
            task = asyncio.ensure_future(_reconnect_when_lost(r.draft.engine, interval_s=0.05))
            await asyncio.wait_for(changed.wait(), 5)   # and so does the new stream
            task.cancel()
            return lost, r.draft.client.connected, r.draft.client.handshake.verifier_id != first
    assert asyncio.run(run()) == (True, True, True)


def test_a_step_stream_cannot_step_or_end_another_streams_request(ckpt):
    """The draft checked no owner: a second step stream that knew a wire id could step (and read)
    or release a request another stream admitted."""
    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("a")]) == [("a", "OK")]
            other, channel = r.draft.link()
            try:
                stepped = await step(other, [decode("a")])
                await step(other, [], release=["a"])
                piece = draft_pb2.StepItem(request_id="a", prompt_token_ids=[11], prompt_offset=3, budget=4)
                pieced = await step(other, [piece])
            finally:
                await channel.close()
            return stepped, pieced, await step(r.link, [decode("a")]), sorted(r.draft.engine._requests)
    stepped, pieced, own, held = asyncio.run(run())
    assert stepped == [("a", "NOT_FOUND")] and pieced == [("a", "NOT_FOUND")]
    assert own == [("a", "OK")] and held == ["a"]   # its own stream steps it; nothing released it


def test_a_request_the_verifier_refused_is_released_there_not_only_forgotten_here(ckpt):
    """A prompt piece (or a tree) the verifier refused: the draft forgot the request, the verifier
    kept it and its KV pages; a scheduler that went away before its next step (which carries the
    release) left them held, and the id taken (ALREADY_EXISTS), until the draft's verifier stream
    ended. The next verifier call now frees it."""
    async def run():
        async with replica(ckpt) as r:
            engine = r.verifier.engine
            first = draft_pb2.StepItem(request_id="a", prompt_token_ids=[5, 6, 7], budget=4, max_new_tokens=64,
                                       mode=common_pb2.MODE_DDTREE, prompt_continues=True)
            assert await step(r.link, [first]) == [("a", "OK")]
            bad = draft_pb2.StepItem(request_id="a", prompt_token_ids=[99999], prompt_offset=3, budget=4)
            refused = await step(r.link, [bad])
            held = sorted(engine._requests)
            r.link.close()   # the scheduler goes away before a step of its could release "a"
            await r.channel.close()
            for _ in range(100):
                if not engine._requests:
                    break
                await asyncio.sleep(0.02)
            r.link, r.channel = r.draft.link()
            return refused, held, sorted(engine._requests), await step(r.link, [admit("a")])
    refused, held, after, again = asyncio.run(run())
    assert refused == [("a", "INVALID_ARGUMENT")] and held == ["a"]
    assert after == [] and again == [("a", "OK")]


def test_a_step_whose_items_are_all_refused_makes_no_verifier_call_and_no_timing(ckpt):
    """Each such step (unknown ids, repeated ids) made an empty round trip to the verifier and
    was timed in every ddtree_step_ms stage, which count decode steps."""
    async def run():
        async with replica(ckpt) as r:
            calls = []
            client = r.draft.engine.verifier
            forward = client.step
            client.step = lambda *args: (calls.append(args), forward(*args))[1]
            def count() -> float:   # decode steps timed in the "step" stage
                return sum(x.value for m in r.draft.engine.metrics.step_ms.collect() for x in m.samples
                           if x.name.endswith("_count") and x.labels.get("stage") == "step")
            before = count()
            refused = [await step(r.link, [decode("nobody")]) for _ in range(3)]
            return refused, len(calls), count() - before, await step(r.link, [admit("a")]), len(calls)
    refused, calls, timed, admitted, after = asyncio.run(run())
    assert refused == [[("nobody", "NOT_FOUND")]] * 3 and calls == 0 and timed == 0
    assert admitted == [("a", "OK")] and after == 1


def test_prompts_that_would_overflow_the_verifiers_reply_are_refused_alone(ckpt):
    """A step whose prompt features pass gRPC's message cap broke the verifier stream: the draft
    then failed every request of every stream it served. Its prompts past the cap are refused
    (RESOURCE_EXHAUSTED) before they are sent; the others of the step go on."""
    from services.common.grpc_server import MAX_MESSAGE_BYTES, REPLY_OVERHEAD_BYTES

    async def run():
        async with replica(ckpt) as r:
            assert await step(r.link, [admit("running")]) == [("running", "OK")]
            hs = r.draft.engine.verifier.handshake
            hs.feature_bytes_per_token = (MAX_MESSAGE_BYTES - REPLY_OVERHEAD_BYTES) // 100   # 100 rows a reply
            block = r.draft.engine.proposer.block_size

            def prompt(rid: str, n: int) -> draft_pb2.StepItem:
                return draft_pb2.StepItem(request_id=rid, prompt_token_ids=[5] * n, budget=4, max_new_tokens=8,
                                          mode=common_pb2.MODE_DDTREE)
            room = 100 - 3 * block   # three items, each committing up to a block
            first = await step(r.link, [decode("running"), prompt("fits", room), prompt("over", 1)])
            # A prompt refused for itself (its id runs already) is not sent: its tokens take no room.
            second = await step(r.link, [prompt("fits", room), prompt("later", room)])
            return first, second
    first, second = asyncio.run(run())
    assert first == [("running", "OK"), ("fits", "OK"), ("over", "RESOURCE_EXHAUSTED")]
    assert second == [("fits", "ALREADY_EXISTS"), ("later", "OK")]


def test_a_drafter_of_another_vocabulary_is_refused_at_its_handshake(ckpt):
    """The verifier is the one place a drafter's vocabulary is checked against its target's; one
    that hand-shook would draft tokens past the target's vocabulary."""
    layers = json.loads((ckpt / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    cfg = json.loads((ckpt / "config.json").read_text())

    async def run():
        verifier = await Verifier(ckpt).start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{verifier.port}")
        try:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            results = []
            for vocab in (cfg["vocab_size"] + 1, cfg["vocab_size"]):
                hello = verifier_pb2.HandshakeRequest(draft_id=f"v{vocab}", feature_layer_ids=layers,
                                                      hidden_size=cfg["hidden_size"], vocab_size=vocab,
                                                      transports=["inline"])
                try:
                    await stub.Handshake(hello)
                    results.append("OK")
                except grpc.aio.AioRpcError as exc:
                    results.append((exc.code(), exc.details()))
            return results
        finally:
            await channel.close()
            await verifier.stop()
    (code, details), ok = asyncio.run(run())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and f"vocab_size={cfg['vocab_size'] + 1}" in details
    assert ok == "OK"


def test_a_context_pool_too_large_for_the_gpu_fails_the_start_naming_its_settings(monkeypatch) -> None:
    """`draft.graph_context` raised for long prompts (131072 tokens: 24 GiB on the demo drafter)
    ended the draft's start in a bare OutOfMemoryError traceback (exit 1, "may work later")."""
    class Proposer:
        def __init__(self, fits: bool) -> None:
            self.fits, self.asked = fits, []

        def enable_graphs(self, rows: int, context: int) -> int:
            self.asked.append((rows, context))
            if not self.fits:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB. GPU 0 has a total "
                                             "capacity of 79.18 GiB of which 78.55 GiB is free. Including\nmore")
            return 2**20

    settings = DraftSettings(graph_rows=128, graph_context=131072)
    with pytest.raises(SettingsError, match=r"draft\.graph_rows, draft\.graph_context: a context pool of 128 contexts "
                                            r"x 131072 tokens does not fit on cuda:0 .*draft\.cuda_graphs = false "
                                            r"\(CUDA out of memory\. Tried to allocate 24\.00 GiB\)$"):
        enable_propose_graphs(Proposer(fits=False), settings, torch.device("cuda", 0))

    class Wordy(Proposer):   # an allocator's first sentence can be long: a line of the message, not a page
        def enable_graphs(self, rows: int, context: int) -> int:
            raise torch.OutOfMemoryError("CUDA out of memory" + " very" * 200 + ". Tried to allocate 24.00 GiB. More")

    with pytest.raises(SettingsError) as info:
        enable_propose_graphs(Wordy(fits=False), settings, torch.device("cuda", 0))
    assert str(info.value).endswith(f" ({('CUDA out of memory' + ' very' * 200)[:160]})")
    # The service's start takes that way: a GPU draft with graphs, its drafter and client stubbed.
    too_big = Proposer(fits=False)
    too_big.block_size, too_big.target_layer_ids = 16, (1, 3)
    monkeypatch.setattr(draft_server, "pin_device", lambda device, setting: torch.device("cuda", 0))
    monkeypatch.setattr(Metrics, "track_gpu_memory", lambda self, device: None)
    monkeypatch.setattr(draft_server, "load_proposer", lambda *args: too_big)
    monkeypatch.setattr(draft_server, "VerifierClient", lambda *args, **kwargs: None)
    with pytest.raises(SettingsError, match=r"^draft\.graph_rows, draft\.graph_context: a context pool of 128"):
        asyncio.run(draft_server.serve(dataclasses.replace(settings, device="cuda", port=0)))
    assert too_big.asked == [(128, 131072)]
    fits = Proposer(fits=True)
    with capture_logs() as logs:
        enable_propose_graphs(fits, settings, torch.device("cuda", 0))
    assert fits.asked == [(128, 131072)]
    assert [(e["event"], e["pool_mb"]) for e in logs] == [("propose_graphs_on", 1.0)]


def test_the_drafts_start_takes_its_settings_and_names_an_incompatible_verifier_as_a_settings_fault(monkeypatch):
    """`draft.cuda_graphs = false` (the way out the pool's out-of-memory error names) makes a GPU
    draft build no pool; `draft.dtype` and `draft.cpu_threads` reach the drafter and torch; a busy
    `draft.port` fails the start before the weights load; and a verifier refusing the pairing
    (FAILED_PRECONDITION) keeps its code, which the CLI turns into exit 2 (fix the settings), not 3
    (may work later). (GPU start-up with its drafter, client and engine stubbed.)"""
    class Proposer:
        block_size, target_layer_ids = 16, (1, 3)

        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []

        def enable_graphs(self, rows: int, context: int) -> int:
            self.asked.append((rows, context))
            return 2**20

    class Engine:   # warms up, then meets a verifier of another vocabulary
        def __init__(self, *args, **kwargs) -> None:
            pass

        def warm_up(self, budgets, device) -> None:
            pass

        async def connect(self, wait_s: float) -> None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "vocab_size=301 is not the drafter's 300")

    proposer, loaded = Proposer(), []
    monkeypatch.setattr(draft_server, "pin_device", lambda device, setting: torch.device("cuda", 0))
    monkeypatch.setattr(Metrics, "track_gpu_memory", lambda self, device: None)
    monkeypatch.setattr(draft_server, "load_proposer", lambda *args: loaded.append(args) or proposer)
    monkeypatch.setattr(draft_server, "VerifierClient", lambda *args, **kwargs: None)
    monkeypatch.setattr(draft_server, "DraftEngine", Engine)
    threads = torch.get_num_threads()
    try:
        for graphs, dtype in ((False, "bfloat16"), (True, "float16")):
            with pytest.raises(ServiceError) as refused:
                asyncio.run(draft_server.serve(DraftSettings(device="cuda", port=0, cuda_graphs=graphs, dtype=dtype,
                                                             cpu_threads=threads + 1, graph_rows=8, graph_context=256)))
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.message == ("draft.verifier_address 127.0.0.1:50053: "
                                             "vocab_size=301 is not the drafter's 300")
            assert torch.get_num_threads() == threads + 1
    finally:
        torch.set_num_threads(threads)
    assert [args[2] for args in loaded] == [torch.bfloat16, torch.float16]
    assert proposer.asked == [(8, 256)]   # a pool only where cuda_graphs is on
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(SettingsError, match="draft.port"):
            asyncio.run(draft_server.serve(DraftSettings(device="cuda", port=held.getsockname()[1])))
    assert len(loaded) == 2   # refused before the drafter loads
