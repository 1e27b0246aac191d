"""Spreads requests over draft replicas: least-loaded at admission, sticky for the request's life.

Replicas in front of the same verifier group share that group's KV budget. A replica that fails is
marked down (its running requests end with UNAVAILABLE, its queued ones move to a live replica) and
probed until it answers again, when it rejoins; one whose steps keep failing is held down longer
each time (`batcher.rejoin_hold_s`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import time
from collections.abc import Callable

import grpc

from ddtree.v1 import common_pb2, draft_pb2_grpc
from services.common.auth import token_metadata
from services.common.grpc_server import ServiceError, server_options
from services.common.logging import get_logger
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler.batcher import KvBudget, StepLoop
from services.scheduler.draft_link import DraftLink
from services.scheduler.request import ActiveRequest, Limits, step_prompt_tokens

__all__ = ["Router", "discover", "limits_from_info"]

log = get_logger("scheduler")
STOPPING = "the scheduler is stopping; send the request to another one"   # a request refused while it stops

PROBE_INTERVAL_S = 0.5
DISCOVERY_EVERY = 10   # probe rounds between DNS look-ups for new replicas
START_GRACE_S = 1.0    # at start-up, how long the other replicas may answer after the first


def discover(entries: tuple[str, ...] | list[str], failed: list[str] | None = None) -> list[str]:
    """Replica addresses from config: `host:port` as is; `dns:host:port` is every address the name
    resolves to (how `docker compose --scale draft=N` replicas are found). A name that does not
    resolve is left out, and appended to ``failed``."""
    out: list[str] = []
    for entry in entries:
        if not entry.startswith("dns:"):
            out.append(entry)
            continue
        host, _, port = entry[len("dns:"):].lstrip("/").rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):   # (an empty label, "draft..svc", fails IDNA encoding)
            if failed is not None:
                failed.append(entry)
            continue
        for ip in sorted({i[4][0] for i in infos}):
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))


async def resolve(entries: tuple[str, ...] | list[str], failed: list[str] | None = None) -> list[str]:
    """`discover` in a worker thread: a DNS look-up can wait seconds for a slow or missing
    server, and every stream the scheduler serves would stall with the event loop meanwhile."""
    return await asyncio.to_thread(discover, entries, failed)


def limits_from_info(info: common_pb2.ModelInfo) -> Limits:
    # A draft older than eos_token_ids sends only eos_token_id (-1: none).
    eos = tuple(info.eos_token_ids) or ((info.eos_token_id,) if info.eos_token_id >= 0 else ())
    return Limits(vocab_size=info.vocab_size, max_context=info.max_context, block_size=info.block_size,
                  eos_token_ids=eos, kv_capacity_tokens=info.kv_capacity_tokens,
                  kv_page_size=info.kv_page_size or 1, feature_bytes_per_token=info.feature_bytes_per_token)


def place(req: ActiveRequest, fits: list[StepLoop]) -> None:
    """Queues the request on the least-loaded of the replicas that hold it, among those that would
    start it at once where there are any: by load alone, a request went to a replica in front of a
    full verifier group (one long request on it, fewer requests than the other) and waited there,
    for as long as that request ran, while another group had room."""
    ready = [lane for lane in fits if lane.admits_now(req)]
    min(ready or fits, key=lambda lane: lane.load).submit(req)


class Router:
    def __init__(self, settings: SchedulerSettings, metrics: Metrics, internal_token: str = "") -> None:
        self.settings = settings
        self.metrics = metrics
        self._metadata = token_metadata(internal_token)   # what every call to a draft carries
        self.lanes: list[StepLoop] = []
        self.health_changed = asyncio.Event()   # set when a replica goes down or comes up (health reads it)
        self._channels: dict[str, grpc.aio.Channel] = {}   # by replica address
        self._budgets: dict[str, KvBudget] = {}
        self._unknown = itertools.count()   # budgets of replicas whose verifier is not known yet
        self.info: common_pb2.ModelInfo | None = None   # the first answer: the model this scheduler serves
        self._answers: dict[str, common_pb2.ModelInfo] = {}   # each replica's latest answer of that model
        self.tokenizer_digest = ""   # the scheduler's tokenizer's vocabulary (`vocab_digest`; "": none)
        self._watch: asyncio.Task | None = None
        self._follows: set[asyncio.Task] = set()   # `_recover`'s follows of a restarted verifier's group
        self._discovery: asyncio.Task | None = None
        self._other_models: set[str] = set()   # replicas logged as serving another model (`_other_model`)
        self._refused_token: set[str] = set()   # replicas logged as refusing our internal token
        self._too_wide: set[str] = set()   # replicas logged as replying more than a message holds
        self.closed = False   # the scheduler stopped with requests unfinished (`drain`): no new request
        self.stop_error: ServiceError | None = None   # what `drain` ended the unfinished ones with
        # Read when scraped (a gauge set on each change lagged by up to a probe round).
        metrics.queue_depth.set_function(lambda: self.waiting)
        metrics.running.set_function(lambda: sum(len(lane.running) for lane in list(self.lanes)))

    async def start(self, timeout_s: float = 120.0) -> common_pb2.ModelInfo:
        """Connects to every configured replica; needs one to answer within `timeout_s`. Serves
        from the first answer (and those within `START_GRACE_S` of it): waiting for every probe held
        the whole start-up for `timeout_s` behind one dead replica, which the watcher brings in
        once it answers."""
        addresses = await resolve(self.settings.draft_addresses)
        if not addresses:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "scheduler.draft_addresses: no address to try "
                               f"(no dns: name resolved): {list(self.settings.draft_addresses)}")
        stubs = [self._stub(a) for a in addresses]
        errors: list[str] = []
        probes = [asyncio.ensure_future(self._probe(s, timeout_s, a, errors)) for s, a in zip(stubs, addresses)]
        pending: set[asyncio.Future] = set(probes)
        while pending and not any(p.done() and p.result() is not None for p in probes):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=START_GRACE_S)
        for probe in pending:
            probe.cancel()
        infos = [p.result() if p.done() and not p.cancelled() else None for p in probes]
        live = [i for i in infos if i is not None]
        if not live:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"scheduler.draft_addresses: no draft replica answered: {'; '.join(errors)}")
        self.info = live[0]
        for address, stub, info in zip(addresses, stubs, infos):
            self._add_lane(address, stub, info)
        self._watch = asyncio.create_task(self._watch_replicas())
        log.info("replicas", up=[lane.address for lane in self.lanes if lane.healthy],
                 down=[lane.address for lane in self.lanes if not lane.healthy])
        return self.info

    def _stub(self, address: str) -> draft_pb2_grpc.DraftStub:
        # A replica that died and came back must be seen within a probe or two, not after gRPC's
        # default reconnect back-off (which grows towards two minutes).
        # (Not min_reconnect_backoff_ms: that bounds how long one connection attempt may take.)
        options = server_options() + [("grpc.initial_reconnect_backoff_ms", 200),
                                      ("grpc.max_reconnect_backoff_ms", 1000)]
        channel = grpc.aio.insecure_channel(address, options=options)
        self._channels[address] = channel
        return draft_pb2_grpc.DraftStub(channel)

    def _add_lane(self, address: str, stub: draft_pb2_grpc.DraftStub, info: common_pb2.ModelInfo | None) -> None:
        assert self.info is not None
        info = self._same_model(address, info)   # else down from the start
        lane = StepLoop(self.settings, address, DraftLink(stub, self._metadata), self._limits(info), self._budget(info),
                        self.metrics)
        lane.on_health_change = self.health_changed.set
        lane.healthy = info is not None
        lane.start()
        self.lanes.append(lane)
        self.metrics.replica_up.labels(address).set_function(lambda: float(lane.healthy))
        self.metrics.speculation_pauses.labels(address)   # at 0 from the start, for a rate to see

    def _budget(self, info: common_pb2.ModelInfo | None) -> KvBudget:
        known = info is not None and info.verifier_id
        key = info.verifier_id if known else f"unknown-{next(self._unknown)}"
        if key not in self._budgets:
            budget = self._budgets[key] = KvBudget(info.kv_capacity_tokens if info is not None else 0,
                                                   verifier_id=info.verifier_id if known else "")
            self.metrics.kv_reserved.labels(key).set_function(lambda: budget.reserved)
            self.metrics.kv_capacity.labels(key).set_function(lambda: budget.capacity)
        return self._budgets[key]

    def _prune_budgets(self) -> None:
        """Forgets the budgets of verifier groups no replica is in front of any more (a restarted
        verifier has a new id), with their gauges, once nothing is reserved against them."""
        used = {id(lane.kv) for lane in self.lanes}
        for key, budget in list(self._budgets.items()):
            if id(budget) not in used and budget.reserved == 0:
                del self._budgets[key]
                self.metrics.kv_reserved.remove(key)
                self.metrics.kv_capacity.remove(key)

    async def _probe(self, stub: draft_pb2_grpc.DraftStub, timeout_s: float, address: str = "",
                     errors: list[str] | None = None) -> common_pb2.ModelInfo | None:
        """The replica's model info, or None (its error appended to ``errors``, for the start-up message)."""
        try:
            info = await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), wait_for_ready=True,
                                           timeout=timeout_s, metadata=self._metadata)
            self._refused_token.discard(address)
            return info
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and address not in self._refused_token:
                self._refused_token.add(address)   # said once, not each probe round
                log.error("draft_replica_refused_token", address=address, details=exc.details())
            if errors is not None:
                why = f"nothing answered within {timeout_s:.0f} s" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED \
                    else f"{exc.code().name}: {exc.details()}"
                errors.append(f"{address}: {why}")
            return None
        except grpc.aio.UsageError:   # its channel closed under the probe: a replica forgotten meanwhile
            return None

    @property
    def limits(self) -> Limits:
        return self.lanes[0].limits

    @property
    def waiting(self) -> int:
        return sum(len(lane.waiting) for lane in list(self.lanes))

    def submit(self, req: ActiveRequest) -> None:
        if self.closed:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, STOPPING, "stopping")
        # An aborted request that has not left its step loop yet does not hold its id: the id may be
        # reused at once, anywhere (downstream, each admission has an id of its own: batcher.wire_id).
        # Checked before the retryable refusals: a full queue's RESOURCE_EXHAUSTED sent a client to
        # retry an id that no retry could take.
        if any(lane.has_live(req.request_id) for lane in self.lanes):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id} is already in use",
                               "id_in_use")
        live = [lane for lane in self.lanes if lane.healthy]
        if not live:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no draft replica is up; retry later", "no_replica")
        fits = [lane for lane in live if lane.holds(req)]
        if not fits:
            # OUT_OF_RANGE where no replica's cache, up or down, could ever hold it (a retry as it
            # is cannot succeed); RESOURCE_EXHAUSTED where one that is down now could.
            never = not any(lane.holds(req) for lane in self.lanes)
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE if never else grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request needs {req.kv_tokens} KV tokens (prompt + max_tokens + one block, "
                               f"in whole pages); the cache holds {max(lane.kv.capacity for lane in live)}"
                               + ("; lower max_tokens or shorten the prompt" if never else ""),
                               "kv_too_large" if never else "replica_down")
        # The queue's cap is for requests that wait: one a replica would start at once does not,
        # nor do those queued that the next step starts (counted only where the queues reach it).
        if self.waiting >= self.settings.max_queue \
                and sum(lane.waiting_past_next_step for lane in list(self.lanes)) >= self.settings.max_queue \
                and not any(lane.admits_now(req) for lane in fits):
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue full ({self.settings.max_queue} requests waiting); retry later", "queue_full")
        place(req, fits)

    def abort(self, request_id: str, only: ActiveRequest | None = None) -> bool:
        """Ends the request with this id (with ``only``, that request object alone). A live one is
        looked for first: an id aborted on one replica may already run again on another while the
        first still holds its aborted predecessor, which would otherwise answer for it."""
        if only is None:
            live = [lane for lane in self.lanes if lane.has_live(request_id)]
            return any(lane.abort(request_id) for lane in live or self.lanes)
        return any(lane.abort(request_id, only) for lane in self.lanes)

    async def _watch_replicas(self) -> None:
        """Moves queued work off replicas that went down, brings recovered ones back, finds new ones.
        A round that fails is logged and the next one runs: a watcher that died silently would
        leave every replica that went down out for good, and its queued requests waiting."""
        rounds = 0
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            rounds += 1
            try:
                await self._watch_round(rounds)
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.error("replica_watch_failed", error=repr(exc))

    async def _watch_round(self, rounds: int) -> None:
        self._prune_budgets()
        if rounds % DISCOVERY_EVERY == 0 and (self._discovery is None or self._discovery.done()):
            # Beside the probes, not before them: a DNS look-up or a slow replica's answer can
            # take seconds, and a down replica's queue should not wait for it.
            self._discovery = asyncio.create_task(self._discover())
        live = [lane for lane in self.lanes if lane.healthy]
        down = [x for x in self.lanes if not x.healthy]
        # Every down replica's queue moves first, then all are probed at once: one after another, a
        # silent address (a replica scaled away) took its whole probe timeout from each behind it.
        for lane in down:
            self._move_queued(lane, live)
        outcomes = await asyncio.gather(*(self._recover(lane) for lane in down), return_exceptions=True)
        for lane, outcome in zip(down, outcomes):   # one lane's trouble leaves the others' to run
            if isinstance(outcome, Exception):
                log.error("replica_recover_failed", address=lane.address, error=repr(outcome))

    async def _discover(self) -> None:
        try:
            known = {lane.address for lane in self.lanes}
            failed: list[str] = []
            resolved = await resolve(self.settings.draft_addresses, failed)
            for address in resolved:
                if address not in known:
                    stub = self._stub(address)
                    self._add_lane(address, stub, await self._probe(stub, 1.0, address))
                    log.info("draft_replica_discovered", address=address)
            if not failed:   # a name that did not resolve is a failed look-up, not its replicas gone
                await self._forget_gone(set(resolved))
            await self._follow_verifiers()
        except Exception as exc:  # noqa: BLE001 - the next discovery round tries again
            log.error("replica_discovery_failed", error=repr(exc))

    async def _forget_gone(self, resolved: set[str]) -> None:
        """Drops the replicas the `dns:` names no longer resolve to (every name resolved) that are
        down and hold no request (a replica scaled away, a container back under another address),
        with their channel and gauge: kept, each was probed every round for the life of the
        scheduler. One that resolves again is found again. The last replica stays (the limits are
        read from one)."""
        for lane in [x for x in self.lanes if x.address not in resolved]:
            if lane.healthy or lane.running or lane.waiting or len(self.lanes) == 1:
                continue
            self.lanes.remove(lane)
            self._answers.pop(lane.address, None)
            await lane.stop()
            channel = self._channels.pop(lane.address, None)
            if channel is not None:
                await channel.close()
            self.metrics.replica_up.remove(lane.address)
            self.metrics.speculation_pauses.remove(lane.address)
            for said in (self._other_models, self._refused_token, self._too_wide):
                said.discard(lane.address)
            log.info("draft_replica_forgotten", address=lane.address, reason="its name no longer resolves to it")

    async def _follow_verifiers(self, lanes: list[StepLoop] | None = None) -> None:
        """A verifier that restarted has a new id, and the replicas in front of it reconnect on
        their own, staying up: each lane's KV budget follows its replica's verifier, so one group
        is never admitted against two budgets (the lanes that rejoined would have the new one).
        An idle replica that does not answer is marked down here (a busy one's step fails).
        ``lanes``: only these (default: every live one). Probed at once: one after another, each
        silent replica held the rest for its probe's timeout."""
        chosen = [x for x in (self.lanes if lanes is None else lanes) if x.healthy]
        outcomes = await asyncio.gather(*(self._follow_verifier(lane) for lane in chosen), return_exceptions=True)
        for lane, outcome in zip(chosen, outcomes):   # one lane's trouble leaves the others' to run
            if isinstance(outcome, Exception):
                log.error("replica_follow_failed", address=lane.address, error=repr(outcome))

    async def _follow_verifier(self, lane: StepLoop) -> None:
        """`_follow_verifiers` for one live lane."""
        # Another model's answer is no answer (a busy one's next step fails: its verifier restarted).
        info = self._same_model(lane.address, await self._probe(lane.draft.stub, 1.0, lane.address))
        if lane not in self.lanes or not lane.healthy:   # forgotten, or failed, during the probe
            return
        if info is None and not lane.running:
            # An idle replica that died (or lost its verifier) has no step to fail: without
            # this the scheduler said SERVING until a client's request failed there.
            lane.healthy = False
            why = ("serves another model" if lane.address in self._other_models else
                   "refuses the internal token" if lane.address in self._refused_token else
                   "replies larger than a message" if lane.address in self._too_wide else "no answer to a probe")
            log.warning("draft_replica_down", address=lane.address, reason=why)
        if info is not None:
            self._follow_width(lane, info)
        if info is not None and info.verifier_id and info.verifier_id != lane.kv.verifier_id:
            lane.kv = self._budget(info)
            log.info("draft_replica_verifier_changed", address=lane.address, verifier_id=info.verifier_id)
            # A group that came back smaller: what its queue holds that no longer fits would
            # wait at the head of the queue for good, and every request behind it too.
            self._refuse_unfitting(lane)

    def _same_model(self, address: str, info: common_pb2.ModelInfo | None) -> common_pb2.ModelInfo | None:
        """``info``, or None where it is another model's (`_other_model`) or its verifier's replies
        could not carry a step of ``max_batch`` requests: taken as no answer."""
        if info is None or self._other_model(address, info):
            return None
        if step_prompt_tokens(self.settings, limits_from_info(info)) == 0:
            if address not in self._too_wide:
                self._too_wide.add(address)
                log.error("draft_replica_replies_too_large", address=address,
                          feature_bytes_per_token=info.feature_bytes_per_token,
                          action="kept down; lower scheduler.max_batch")
            return None
        self._too_wide.discard(address)
        self._answers[address] = info
        return info

    def served_info(self) -> common_pb2.ModelInfo:
        """What `GetModelInfo` tells: the latest answer of the first replica that is up (else the
        first answer at the start). The start's answer alone was told for good: after a verifier
        restarted, its `verifier_id`, and whatever the new group runs with (`kv_capacity_tokens`,
        `device`, `transport`), were the old group's."""
        assert self.info is not None
        return next((self._answers[lane.address] for lane in self.lanes
                     if lane.healthy and lane.address in self._answers), self.info)

    def _limits(self, info: common_pb2.ModelInfo | None) -> Limits:
        """A new lane's limits: the first model's, with this replica's own feature width (its
        verifier's dtype and feature layers size its replies, which the step's prompt tokens must fit)."""
        assert self.info is not None
        limits = limits_from_info(self.info)
        return limits if info is None else dataclasses.replace(limits, feature_bytes_per_token=info.feature_bytes_per_token)

    @staticmethod
    def _follow_width(lane: StepLoop, info: common_pb2.ModelInfo) -> None:
        """A replica's verifier may come back in another dtype or with other feature layers."""
        lane.limits = dataclasses.replace(lane.limits, feature_bytes_per_token=info.feature_bytes_per_token)

    def _other_model(self, address: str, info: common_pb2.ModelInfo) -> bool:
        """Whether the replica now serves another model than the one this scheduler started with
        (a verifier restarted on another checkpoint, or with another context or page size): its
        tokenizer, vocabulary, end-of-sequence ids and the limits it checks requests against (the
        longest context, the page its KV reservations round to) are that first model's, so the
        replica stays down, said once, until a restart. So does a replica whose target's tokenizer
        is not the scheduler's (its prompts would be another model's tokens)."""
        if self.info is None:
            return False
        fields = ("model_type", "vocab_size", "block_size", "max_context", "kv_page_size")
        diff = [f"{f} {getattr(self.info, f)!r} -> {getattr(info, f)!r}" for f in fields
                if getattr(self.info, f) != getattr(info, f)]
        if list(self.info.eos_token_ids) != list(info.eos_token_ids):
            diff.append(f"eos_token_ids {list(self.info.eos_token_ids)} -> {list(info.eos_token_ids)}")
        if self.tokenizer_digest and info.tokenizer_digest and info.tokenizer_digest != self.tokenizer_digest:
            diff.append("tokenizer: its draft.target_path holds another vocabulary than scheduler.tokenizer_path")
        if diff and address not in self._other_models:
            self._other_models.add(address)
            log.error("draft_replica_serves_another_model", address=address, changes=diff,
                      action="kept down; restart the scheduler to serve that model")
        return bool(diff)

    def _refuse_unfitting(self, lane: StepLoop, others: list[StepLoop] | None = None) -> None:
        """The lane's queued requests its KV cannot hold go to another replica that can (of
        ``others``, default every other live one), or fail as `submit` would refuse them now:
        OUT_OF_RANGE where no replica, up or down, holds them (a retry cannot succeed), else
        RESOURCE_EXHAUSTED."""
        others = [x for x in self.lanes if x.healthy and x is not lane] if others is None else others
        for req in [r for r in lane.waiting if not lane.holds(r)]:
            lane.unqueue(req)
            fits = [x for x in others if x.holds(req)]
            if fits:
                place(req, fits)
                continue
            never = not any(x.holds(req) for x in self.lanes)
            lane.fail_unstarted(req, ServiceError(
                grpc.StatusCode.OUT_OF_RANGE if never else grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request needs {req.kv_tokens} KV tokens; the cache holds {lane.kv.capacity}"
                + ("; lower max_tokens or shorten the prompt" if never else "")))

    @staticmethod
    def _move_queued(lane: StepLoop, live: list[StepLoop]) -> None:
        """A down lane's queued requests go to live lanes that hold them (`place`)."""
        for req in list(lane.waiting):
            fits = [x for x in live if x.holds(req)]
            if fits:
                lane.unqueue(req)
                place(req, fits)

    async def _recover(self, lane: StepLoop) -> None:
        """A down replica, its queued work moved to others where it fits (`_move_queued`, first):
        a probe; an answer brings it back, with the work no other replica could take (a single
        replica marked down by one slow step keeps its queue), and no answer fails that work. That
        work stays in the lane's queue during the probe, where an abort finds it (nothing steps a
        lane that is down)."""
        hold = lane.rejoin_after - time.monotonic()
        if hold > 0:   # its steps keep failing (`rejoin_hold_s`): not probed, its queue not kept
            for req in lane.take_waiting():
                lane.fail_unstarted(req, ServiceError(grpc.StatusCode.UNAVAILABLE, (
                    f"draft replica {lane.address} failed {lane.failed_steps} steps in a row (tried again in "
                    f"{hold:.0f} s) and no other replica that can hold the request is up")))
            return
        info = self._same_model(lane.address, await self._probe(lane.draft.stub, 1.0, lane.address))   # another model: down
        if lane not in self.lanes:   # forgotten during the probe (`_forget_gone`)
            return
        if info is None:
            for req in lane.take_waiting():
                lane.fail_unstarted(req, ServiceError(grpc.StatusCode.UNAVAILABLE, "no draft replica that can hold it is up"))
            return
        before, lane.kv = lane.kv, self._budget(info)
        self._follow_width(lane, info)
        self._refuse_unfitting(lane, [])   # what another replica could take has gone there already
        lane.mark_healthy()
        log.info("draft_replica_rejoined", address=lane.address)
        if before.verifier_id and before is not lane.kv:
            # Its verifier restarted: the live replicas still on the old group's budget are asked
            # now, not at the next discovery round (up to DISCOVERY_EVERY rounds on), while until
            # then the new group was admitted against both budgets, twice its cache. Beside the
            # watch round, not in it: a silent replica would hold every other recovery for its probe.
            task = asyncio.create_task(self._follow_verifiers([x for x in self.lanes if x.kv is before]))
            self._follows.add(task)
            task.add_done_callback(self._follows.discard)

    async def drain(self, timeout_s: float, now: asyncio.Event | None = None,
                    arriving: Callable[[], int] = lambda: 0) -> int:
        """The scheduler stops (it refuses new requests itself): the queued and running requests,
        and the ``arriving`` ones on their way in (texts being tokenized), go on for up to
        ``timeout_s`` or until ``now`` is set (a second signal; the launcher gone); then whatever
        is left fails UNAVAILABLE, logged and counted, its client told why (gRPC's end of the
        grace period said only "Cancelling all calls", and nothing was logged). A text still being
        tokenized then fails with the same error (`stop_error`) when its tokens come. Returns how
        many were cut, those texts included."""
        t0 = time.monotonic()
        while (any(lane.load for lane in self.lanes) or arriving()) and time.monotonic() - t0 < timeout_s:
            if now is not None and now.is_set():
                break
            await asyncio.sleep(0.05)
        self.closed = True
        waited = time.monotonic() - t0
        if now is not None and now.is_set() and waited < timeout_s:   # the grace it did not give, not said as given
            why = f"told to stop without waiting longer after {waited:.1f} s of its {timeout_s:g} s grace: a second " \
                  f"signal, or its launcher is gone"
        else:
            why = f"it waits up to {timeout_s:g} s for running requests when it stops"
        error = ServiceError(grpc.StatusCode.UNAVAILABLE,
                             f"the scheduler stopped before this request finished ({why}); retry it")
        self.stop_error = error
        left = sum(lane.end_all(error) for lane in self.lanes) + arriving()
        if left:
            log.warning("requests_cut_by_stop", requests=left, waited_s=round(waited, 2))
        return left

    async def stop(self) -> None:
        for task in (self._watch, self._discovery, *self._follows):
            if task is not None:
                task.cancel()
        for lane in self.lanes:
            await lane.stop()
        for channel in self._channels.values():
            await channel.close()
