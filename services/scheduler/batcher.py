"""Continuous batching on one draft replica: each step takes all running requests plus admissions.

The loop is the spine of the stack (README, "The pieces"): schedule -> a step on the lane's stream to its
draft (`DraftLink`; the draft drafts, verifies and commits) -> hand each request its tokens ->
release what finished. Admission is by KV reservation so the verifier never runs out of pages
mid-request. A replica that fails ends its requests with UNAVAILABLE and is marked down; the
router sends new work elsewhere until it is back.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ddtree.v1 import common_pb2, draft_pb2, scheduler_pb2
from services.common.grpc_server import ServiceError
from services.common.logging import get_logger
from services.common.metrics import Metrics
from services.common.settings import SchedulerSettings
from services.scheduler.draft_link import DraftLink, StepFailed
from services.scheduler.request import ActiveRequest, Limits, step_prompt_tokens
from services.scheduler.speculation import SpeculationGate

__all__ = ["StepLoop", "KvBudget", "log_end", "rejoin_hold_s"]

log = get_logger("scheduler")

_FINISH_NAMES = {v: k for k, v in scheduler_pb2.FinishReason.items()}

# A replica whose steps keep failing while its probe answers (a broken verifier behind a live
# draft) would rejoin each probe round and take the next requests (least loaded: its own failed at
# once): from its second failed step in a row it stays down this long, doubling, up to the most.
REJOIN_HOLD_S = 1.0
REJOIN_HOLD_MAX_S = 30.0
FAILURES_FORGOTTEN_S = 120.0   # a failed step this long after the one before starts a new run

_RUN = secrets.token_hex(3)         # this scheduler process's, so a restarted one never reuses a wire id
_ADMISSIONS = itertools.count()


def rejoin_hold_s(failed_steps: int) -> float:
    """How long a replica stays down after ``failed_steps`` failed steps in a row: none after one
    (a slow step, a verifier restart: the next probe brings it back), then ``REJOIN_HOLD_S``,
    doubling, at most ``REJOIN_HOLD_MAX_S``."""
    if failed_steps <= 1:
        return 0.0
    return min(REJOIN_HOLD_MAX_S, REJOIN_HOLD_S * 2.0 ** min(failed_steps - 2, 32))


def wire_id(request_id: str) -> str:
    """The id an admitted request goes by downstream: its request_id plus this admission's number.
    A client may reuse a request_id as soon as its request ended, while the draft and verifier
    still hold the old one until its release arrives (after a failed step, until the old stream's
    clean-up): under the bare id the new request met the old one there (ALREADY_EXISTS)."""
    return f"{request_id}#{_RUN}.{next(_ADMISSIONS)}"


@dataclass
class KvBudget:
    """The KV tokens of one verifier group; draft replicas in front of the same group share it."""

    capacity: int
    reserved: int = 0
    verifier_id: str = ""   # the group's, as its replicas report it ("" where unknown)
    _lanes: list[StepLoop] = field(default_factory=list)   # the lanes that share it (or did: see `lanes`)

    def share(self, lane: StepLoop) -> None:
        if lane not in self._lanes:
            self._lanes.append(lane)

    @property
    def lanes(self) -> list[StepLoop]:
        """The lanes admitting against this budget now (a lane that rejoined another group left it)."""
        return [lane for lane in self._lanes if lane.kv is self]

    def wake(self) -> None:
        """Every sharing lane re-checks its queue: KV came back, or a queue head that others wait
        behind was admitted or left (woken alone, a lane slept on with requests that fit now)."""
        for lane in self.lanes:
            lane.wake()

    def release(self, tokens: int) -> None:
        """A finished request's KV back; every lane that shares it woken."""
        self.reserved -= tokens
        self.wake()

    def heads_ahead(self, lane: StepLoop, req: ActiveRequest | None = None) -> int:
        """KV tokens of the queue heads on the other healthy lanes sharing this budget that arrived
        before ``req`` (all of them when ``req`` is None: a request not queued yet is the newest).
        Admission is first come, first served across the lanes of a group: a lane admits only where
        those heads still fit beside its own. Lane by lane, a large request at one queue's head
        waited for ever while the other lanes kept admitting small ones into every page freed.
        Heads of lanes whose batch is full are not counted: they cannot use the KV now, and their
        lane counts them again as soon as it has room."""
        return sum(other.waiting[0].kv_tokens for other in self.lanes
                   if other is not lane and other.healthy and other.waiting
                   and len(other.running) < other.settings.max_batch
                   and (req is None or other.waiting[0].created < req.created))


class StepLoop:
    """One draft replica's batch: its running requests, its queue, its step loop."""

    def __init__(self, settings: SchedulerSettings, address: str, draft: DraftLink, limits: Limits,
                 kv: KvBudget, metrics: Metrics) -> None:
        self.settings = settings
        self.address = address
        self.draft = draft
        self.limits = limits
        self.metrics = metrics
        self.on_health_change: Callable[[], None] | None = None   # told when `healthy` flips
        self._healthy = True
        self.failed_steps = 0       # failed steps since the last answered one (`rejoin_hold_s`)
        self.rejoin_after = 0.0     # monotonic time before which the router does not bring it back
        self._failed_at = 0.0
        self.waiting: deque[ActiveRequest] = deque()
        self.running: dict[str, ActiveRequest] = {}   # by wire id
        self._release: list[str] = []     # wire ids of ended requests, released with the next step
        self._releasing: list[str] = []   # the releases of the step in flight
        # The KV of those: still held at the verifier until the step that releases them is answered,
        # so no lane sharing the budget may admit against it before then (its prefill could reach the
        # verifier first and find no pages). This lane may: its next step releases, then prefills.
        self._owed: list[tuple[KvBudget, int]] = []
        self._wake = asyncio.Event()
        self.kv = kv
        self._task: asyncio.Task | None = None
        self.gate = SpeculationGate(settings.spec_min_acceptance, backoff=settings.spec_backoff_steps)
        self._speculating = True

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv(self) -> KvBudget:
        """The KV of the verifier group this replica is in front of (set again when it rejoins)."""
        return self._kv

    @kv.setter
    def kv(self, budget: KvBudget) -> None:
        old = getattr(self, "_kv", None)
        self._kv = budget
        budget.share(self)
        if old is not None and old is not budget:   # its head no longer holds the old group's lanes back,
            old.wake()                              # and may fit the new group now
            self.wake()

    def wake(self) -> None:
        self._wake.set()

    def holds(self, req: ActiveRequest) -> bool:
        """Whether this replica's verifier group can hold the request's KV at all (groups may differ)."""
        return req.kv_tokens <= self.kv.capacity

    def admits_now(self, req: ActiveRequest) -> bool:
        """Whether the request would start with this replica's next step: where the replica is
        alone on its verifier group's KV, behind the requests queued here (a burst arrives between
        two steps: it all queues, and one step starts it); where replicas share the KV, only into
        an empty queue, as each replica's queue would spend the same free KV (a burst over four of
        them left 19 waiting past a max_queue of 1). Called for each request placed: O(1) where
        the batch is full."""
        if not self.healthy or len(self.running) + len(self.waiting) >= self.settings.max_batch:
            return False
        if self.waiting and self._shares_kv():
            return False
        return self._left_queued([*self.waiting, req], self.kv.heads_ahead(self, req)) == 0

    @property
    def waiting_past_next_step(self) -> int:
        """Queued requests the next step would not start: those that wait (`max_queue`). All of a
        replica's that is down, or that shares its verifier group's KV with another (see
        `admits_now`)."""
        if not self.healthy or self._shares_kv():
            return len(self.waiting)
        return self._left_queued(list(self.waiting))

    def _left_queued(self, queue: list[ActiveRequest], older_heads: int = 0) -> int:
        """How many of ``queue`` the next step would leave queued, as `_schedule` admits: in order,
        while the batch, the step's prompt tokens and the KV (less what the step releases first,
        beside ``older_heads``' tokens of other queues) last."""
        slots = self.settings.max_batch - len(self.running)
        left, taken = self._prefill_left(queue[0]) if queue else 0, older_heads - self._freed_next()
        for n, r in enumerate(queue):
            if n >= slots or left <= 0 or self.kv.reserved + taken + r.kv_tokens > self.kv.capacity:
                return len(queue) - n
            left -= len(r.prompt_ids)
            taken += r.kv_tokens
        return 0

    def _freed_next(self) -> int:
        """KV tokens of ended requests the next step releases first (in this lane's group)."""
        return sum(tokens for budget, tokens in self._owed if budget is self.kv)

    def _shares_kv(self) -> bool:
        """Whether another replica that is up admits against this one's verifier group."""
        return any(other is not self and other.healthy for other in self.kv.lanes)

    @property
    def pending_releases(self) -> list[str]:
        """Wire ids of ended requests whose release is on its way down this lane: in the step in flight
        (a request's last event reaches its client while the next step, which releases it, runs),
        or with the next one."""
        return self._releasing + self._release

    # ---- called by the router -----------------------------------------------------------------
    def submit(self, req: ActiveRequest) -> None:
        req.draft = self.address
        self.waiting.append(req)
        self._wake.set()

    def abort(self, request_id: str, only: ActiveRequest | None = None) -> bool:
        """Ends the request with this id; with ``only``, just that request object (a stream that
        went away must not end a newer request that reuses its id)."""
        for req in self.waiting:
            if req.request_id == request_id and (only is None or req is only):
                self.unqueue(req)
                req.end(scheduler_pb2.FINISH_REASON_ABORTED)
                log_end(self.metrics, req)
                return True
        req = self.find(request_id)
        if req is None or req.aborted or (only is not None and req is not only):
            return False   # (an aborted one still finishing its step runs no more: a second abort finds nothing)
        # Its stream ends now, ABORTED, as the proto says: the step in flight (up to
        # step_timeout_s) neither adds its tokens nor ends it another way; the loop retires it and
        # sends the release with its next step.
        req.aborted = True
        req.end(scheduler_pb2.FINISH_REASON_ABORTED)
        self._wake.set()
        return True

    def unqueue(self, req: ActiveRequest) -> None:
        """Takes a queued request off this lane; the lanes of its group look at their queues again
        (the requests behind it, and other lanes' that waited for it as the older head, may start)."""
        self.waiting.remove(req)
        self.kv.wake()

    def has_live(self, request_id: str) -> bool:
        """Whether a request with this client id runs here (not being aborted) or waits here."""
        found = self.find(request_id)
        return (found is not None and not found.aborted) or any(w.request_id == request_id for w in self.waiting)

    def find(self, request_id: str) -> ActiveRequest | None:
        """The running request with this client id that is not being aborted, else any with it."""
        found = [r for r in self.running.values() if r.request_id == request_id]
        return next((r for r in found if not r.aborted), found[0] if found else None)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        """Ends the loop, a step in flight too. What its releases owed the KV budget goes back: the
        replica is gone (forgotten) or the scheduler stops, and the verifier frees those pages as
        the replica's stream ends (kept in the cancelled step, a forgotten replica's share stayed
        reserved for good, shrinking its group's budget)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5.0)
        for budget, tokens in self._owed:
            budget.release(tokens)
        self._owed = []
        self.draft.close()

    # ---- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        answered: float | None = None   # when the last step's answer came, while no wait followed it
        while True:
            self._retire_aborted()
            items = self._schedule() if self.healthy else []
            if not items and not (self._release and self.healthy):
                self._wake.clear()
                answered = None
                await self._wake.wait()
                continue
            release, self._release = self._release, []
            owed, self._owed = self._owed, []
            sent = time.perf_counter()
            if answered is not None and items:   # this loop's own time between two steps
                self.metrics.step_ms.labels("scheduler").observe((sent - answered) * 1e3)
            self._releasing = release
            try:
                resp = await self.draft.step(draft_pb2.StepRequest(items=items, release=release),
                                             timeout=self.settings.step_timeout_s)
            except StepFailed as exc:
                self._release = release + self._release   # not delivered: they go with the next step
                self._owed = owed + self._owed
                if not exc.delivered:   # the prompts it began reached no replica: refused, as if queued
                    for item in items:
                        if item.prompt_offset == 0 and item.prompt_token_ids and item.request_id in self.running:
                            self.running[item.request_id].prompt_sent = 0
                self._fail_replica(exc)
                answered = None
                continue
            except asyncio.CancelledError:   # `stop`: what this step owed goes back there
                self._owed = owed + self._owed
                raise
            finally:
                self._releasing = []
            for budget, tokens in owed:   # freed at the verifier now: any lane sharing it may admit
                budget.release(tokens)
            if items:   # (a release-only step is answered by a verifier whose forwards fail)
                self.failed_steps = 0
            answered = time.perf_counter()
            if resp.decoded:   # as the draft times it: not releases alone, nor items it refused
                self.metrics.step_ms.labels("step_rpc").observe((answered - sent) * 1e3)
                self.metrics.step_ms.labels("draft").observe(resp.draft_ms)
                self.metrics.step_ms.labels("verify").observe(resp.verify_ms)
            trees = {i.request_id for i in items if i.budget > 0}   # sent with a tree this step
            drafted: list[int] = []   # accepted tokens of this step's DDTree requests
            for res in resp.results:
                req = self.running.get(res.request_id)
                if req is None or req.aborted:   # an aborted one's stream has ended
                    continue
                if res.error_code:   # the draft and verifier name it by its wire id; the client knows its own
                    message = res.error_message.replace(req.wire_id, req.request_id)
                    self._finish(req, error=client_error(grpc.StatusCode(_code(res.error_code)), message))
                    continue
                req.started = True
                if not res.token_ids:   # a piece of a long prompt went in; the first token comes with the last
                    continue
                before = len(req.out_ids)
                # (An autoregressive request's items may carry a budget, which the draft ignores.)
                req.add_tokens(list(res.token_ids), res.acceptance_length,
                               tree=res.request_id in trees and req.mode != common_pb2.MODE_AUTOREGRESSIVE)
                tree_step = res.acceptance_length and req.mode != common_pb2.MODE_AUTOREGRESSIVE
                if tree_step:
                    drafted.append(res.acceptance_length)
                self.metrics.tokens.inc(len(req.out_ids) - before)
                if not before and req.first_token_at is not None:
                    self.metrics.ttft_seconds.observe(req.first_token_at - req.created)
                if tree_step and res.request_id in trees:   # as verified (not autoregressive or paused steps)
                    self.metrics.acceptance.observe(res.acceptance_length)
                if req.done:
                    self._finish(req)
            if drafted and self.gate.observe(self._speculating, sum(drafted) / len(drafted)):
                self.metrics.speculation_pauses.labels(self.address).inc()
                log.info("speculation_paused", draft=self.address, steps=self.gate.pause_left,
                         mean_acceptance=round(self.gate.window_mean, 2),   # the window's, that decided
                         min_acceptance=self.settings.spec_min_acceptance)

    def _fail_replica(self, exc: StepFailed) -> None:
        """The draft replica failed a step: its running requests are lost; mark it down (its
        probe brings it back once it answers: a replica that failed every step at once, left up,
        took the next one at once, thousands a second)."""
        self.healthy = False
        now = time.monotonic()
        self.failed_steps = 1 if now - self._failed_at > FAILURES_FORGOTTEN_S else self.failed_steps + 1
        self._failed_at = now
        hold = rejoin_hold_s(self.failed_steps)
        self.rejoin_after = now + hold
        # Whatever ended the stream (a refused internal token, a verifier that would not hand-shake
        # again, a bug there), it is no fault of the clients' requests: UNAVAILABLE, which they retry.
        said = "" if exc.code == grpc.StatusCode.UNAVAILABLE else f" ({exc.code.name})"
        err = ServiceError(grpc.StatusCode.UNAVAILABLE, f"draft replica {self.address} failed{said}: {exc.details}")
        log.warning("draft_replica_failed", address=self.address, code=exc.code.name, details=exc.details,
                    running=len(self.running), failed_steps=self.failed_steps, held_down_s=hold)
        for req in list(self.running.values()):
            self._finish(req, error=err)
        # The failed requests are released with the next step that reaches the replica (the draft
        # frees what a step stream admitted when that stream ends, too): a replica that kept
        # running still holds their drafter contexts, pool rows and KV pages until then; a
        # restarted one ignores ids it does not know. Their KV is given back to admission now: a
        # replica that never answers again must not hold its group's budget for good (a prefill
        # elsewhere may meet pages not yet freed, and fails alone, RESOURCE_EXHAUSTED).
        owed, self._owed = self._owed, []
        for budget, tokens in owed:
            budget.release(tokens)

    def end_all(self, error: ServiceError) -> int:
        """Fails every queued and running request with ``error`` (the scheduler stops with them
        unfinished): each is logged and counted as every request that ends, and its client gets
        the error, not gRPC's cancellation. An aborted one ends as it was. Returns how many."""
        queued = list(self.waiting)
        self.waiting.clear()
        for req in queued:
            self.fail_unstarted(req, error)
        running = list(self.running.values())
        for req in running:
            self._finish(req, error=None if req.aborted else error)
        return len(queued) + len(running)

    def fail_unstarted(self, req: ActiveRequest, error: ServiceError) -> None:
        """Fails a request that never reached a step (taken off a down replica, nowhere to go):
        counted and logged as every request that ends."""
        req.fail(error)
        log_end(self.metrics, req)

    def take_waiting(self) -> list[ActiveRequest]:
        """Hands queued (never started) requests back to the router to place on another replica."""
        out = list(self.waiting)
        self.waiting.clear()
        self.kv.wake()
        return out

    @property
    def healthy(self) -> bool:
        """Whether the router steps this replica (down after a failed step until its probe answers);
        setting it tells `on_health_change` of a flip."""
        return self._healthy

    @healthy.setter
    def healthy(self, up: bool) -> None:
        changed, self._healthy = up != self._healthy, up
        if changed and self.on_health_change is not None:
            self.on_health_change()

    def mark_healthy(self) -> None:
        self.healthy = True
        self._wake.set()

    def _schedule(self) -> list[draft_pb2.StepItem]:
        """All running requests, then admissions in arrival order while batch, KV and the step's
        prefill budget allow. Prompt tokens a step stay within ``max_prefill_tokens``: a prompt
        longer than what is left goes in pieces over the next steps, so one step's prefill time
        stays bounded and running requests keep decoding between the pieces (a 2000-token prompt
        used to stop every stream for the whole prefill). Those pieces leave a queued request that
        could start what it needs of the step, up to half (`_pieces_most`)."""
        # One decision for the whole batch (see speculation.py). A pause counts the steps that decode:
        # steps of prompt pieces only (a long prefill) would spend it drafting nothing. An empty
        # batch forgets it: the requests it was decided on have all ended.
        if not self.running:
            self.gate.forget()
        if any(r.prompt_sent >= len(r.prompt_ids) for r in self.running.values()):
            self._speculating = self.gate.speculate()
        else:
            self._speculating = self.gate.pause_left == 0
        freed = self._freed_next()
        left = step_prompt_tokens(self.settings, self.limits)
        head = self.waiting[0] if self.waiting and len(self.running) < self.settings.max_batch \
            and self._fits(self.waiting[0], freed) else None
        pieces = self._pieces_most(left, head)
        items = []
        for r in self.running.values():
            if r.prompt_sent < len(r.prompt_ids):   # its prompt's next piece, while the budget lasts
                if pieces > 0:
                    items.append(self._piece(r, pieces, self._budget(r)))
                    pieces -= len(items[-1].prompt_token_ids)
                    left -= len(items[-1].prompt_token_ids)
                continue
            items.append(draft_pb2.StepItem(request_id=r.wire_id, budget=self._budget(r)))
        admitted = False
        while self.waiting and left > 0 and len(items) < self.settings.max_batch and self._fits(self.waiting[0], freed):
            req = self.waiting.popleft()
            req.wire_id = wire_id(req.request_id)
            req.admitted_at = time.monotonic()
            self.metrics.queue_seconds.observe(req.admitted_at - req.created)
            self.running[req.wire_id] = req
            self.kv.reserved += req.kv_tokens
            req.kv_budget = self.kv
            items.append(self._piece(req, left, self._budget(req)))
            left -= len(items[-1].prompt_token_ids)
            admitted = True
        if admitted:   # lanes that waited behind this lane's head as the older one
            self.kv.wake()
        return items

    def _fits(self, req: ActiveRequest, freed: int = 0) -> bool:
        """Whether the group's KV holds the request now (``freed``: what this lane's next step
        releases first), beside the older heads of the group's other queues."""
        return self.kv.reserved - freed + req.kv_tokens + self.kv.heads_ahead(self, req) <= self.kv.capacity

    @staticmethod
    def _pieces_most(total: int, head: ActiveRequest | None) -> int:
        """What running prompts' next pieces may take of a step's ``total`` prompt tokens: all but
        what ``head``, a queued request that could start with the step, needs of it, up to half;
        all of it where none can. (They took it all: a 3000-token prompt at 100 a step held every
        admission for 30 steps.)"""
        return total if head is None else total - min(total // 2, len(head.prompt_ids))

    def _prefill_left(self, req: ActiveRequest) -> int:
        """The next step's prompt tokens left to ``req`` queued now, once running prompts take their pieces."""
        total = step_prompt_tokens(self.settings, self.limits)
        backlog = sum(len(r.prompt_ids) - r.prompt_sent for r in self.running.values())
        return total - min(backlog, self._pieces_most(total, req))

    def _budget(self, req: ActiveRequest) -> int:
        """The request's tree budget this step: 0 while the gate pauses speculation. A request's
        output does not depend on its trees, sampled ones' included (their draws are keyed by
        token index: `services/verifier/sampling.py`), so every request of the batch pauses.
        Prompt pieces carry it too: the draft drafts a request's next tree at the budget of its
        last item, before the next step says which budget that step wants."""
        return req.budget if self._speculating else 0

    @staticmethod
    def _piece(req: ActiveRequest, tokens: int, tree_budget: int) -> draft_pb2.StepItem:
        """The next at most ``tokens`` tokens of the prompt. The first piece carries the request's
        parameters and reserves the KV of the whole request (the later pieces are counted in
        ``max_new_tokens``, which the draft adds to the piece's length)."""
        start = req.prompt_sent
        piece = req.prompt_ids[start:start + tokens]
        req.prompt_sent += len(piece)
        item = draft_pb2.StepItem(request_id=req.wire_id, prompt_token_ids=piece, budget=tree_budget,
                                  prompt_continues=req.prompt_sent < len(req.prompt_ids), prompt_offset=start)
        if start == 0:
            item.sampling.CopyFrom(req.sampling)
            item.mode = req.mode
            item.max_new_tokens = req.max_tokens + len(req.prompt_ids) - len(piece)
        return item

    def _retire_aborted(self) -> None:
        for req in [r for r in self.running.values() if r.aborted]:
            req.end(scheduler_pb2.FINISH_REASON_ABORTED)
            self._finish(req)

    def _finish(self, req: ActiveRequest, error: ServiceError | None = None) -> None:
        if error is not None:
            req.fail(error)
        if self.running.pop(req.wire_id, None) is not None:
            # Owed to the budget it was admitted against (the lane may have moved to another group since).
            self._owed.append((req.kv_budget or self.kv, req.kv_tokens))
            self._release.append(req.wire_id)
        self._wake.set()
        log_end(self.metrics, req)


def end_status(req: ActiveRequest) -> str:
    """How a request ended, in one word: its finish reason (stop, length, aborted), or the code it
    failed with (unavailable, deadline_exceeded, ...)."""
    if req.error is not None:
        return req.error.code.name.lower()
    return _FINISH_NAMES.get(req.finish, "ERROR").removeprefix("FINISH_REASON_").lower()


# Failures of a request's own making: its deadline, input only the verifier could check.
_CLIENTS_OWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.OUT_OF_RANGE})


def log_end(metrics: Metrics, req: ActiveRequest) -> None:
    """A request's end, counted by how it ended and logged with its usage and the same `status`
    word (logs and metrics join on it)."""
    status = end_status(req)
    metrics.requests.labels(status).inc()
    usage = req.usage()
    now = time.monotonic()
    metrics.request_seconds.labels(status).observe(now - req.created)
    # A failure the server saw (a replica lost, a fault downstream, the scheduler's stop) at
    # warning, so a filter on warnings finds it; not one of the client's own doing.
    failed = req.error is not None and req.error.code not in _CLIENTS_OWN
    say = log.warning if failed else log.info
    say("request_end", status=status, request_id=req.request_id, wire_id=req.wire_id or None, draft=req.draft,
        mode=common_pb2.Mode.Name(req.mode).removeprefix("MODE_").lower(),
        finish=_FINISH_NAMES.get(req.finish, "") if req.error is None else "ERROR",
        # an Abort call, or a client that closed its stream or went away: both count as aborted
        aborted_by=("client_left" if req.left else "abort_call") if status == "aborted" else None,
        code=req.error.code.name if req.error is not None else None,
        error=req.error.message if req.error is not None else None,
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, steps=usage.steps,
        tree_steps=usage.tree_steps, mean_acceptance=round(usage.mean_acceptance, 3),
        budget=req.budget if req.mode == common_pb2.MODE_DDTREE else None,   # no tree: no budget
        queue_ms=round((req.admitted_at - req.created) * 1e3, 2) if req.admitted_at else None,
        ttft_ms=round((req.first_token_at - req.created) * 1e3, 2) if req.first_token_at else None,
        seconds=round(now - req.created, 4))


# What a draft or verifier may say of one request that tells of their own state, not of the
# request the scheduler checked and sent (a replica that lost it or its stream, one whose token or
# handshake was refused): the client sees UNAVAILABLE, which it retries, with the code named.
_SERVER_STATE = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED,
                           grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN})


def client_error(code: grpc.StatusCode, message: str) -> ServiceError:
    """A request's failure downstream as its client should see it (`_SERVER_STATE`); bad input the
    scheduler could not check (INVALID_ARGUMENT, OUT_OF_RANGE), a full cache (RESOURCE_EXHAUSTED)
    and a fault there (INTERNAL) keep their codes."""
    if code in _SERVER_STATE:
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"{message} ({code.name} there)")
    return ServiceError(code, message)


def _code(value: int) -> tuple:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code.value
    return grpc.StatusCode.UNKNOWN.value
