"""Continuous batching: every step takes all running requests plus whatever the queue can admit.

The loop is the spine of the stack (DESIGN.md §2): schedule -> Step on the draft (which drafts,
verifies and commits) -> hand each request its tokens -> release what finished. Admission is by KV
reservation so the verifier never runs out of pages mid-request; a full queue rejects at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc

from ddtree.v1 import draft_pb2, draft_pb2_grpc, scheduler_pb2
from services.common.grpc_server import ServiceError
from services.common.logging import get_logger
from services.common.settings import SchedulerSettings
from services.scheduler.request import ActiveRequest, Limits

__all__ = ["StepLoop"]

log = get_logger("scheduler")

_FINISH_NAMES = {v: k for k, v in scheduler_pb2.FinishReason.items()}


class StepLoop:
    def __init__(self, settings: SchedulerSettings, draft: draft_pb2_grpc.DraftStub, limits: Limits) -> None:
        self.settings = settings
        self.draft = draft
        self.limits = limits
        self.waiting: deque[ActiveRequest] = deque()
        self.running: dict[str, ActiveRequest] = {}
        self.kv_reserved = 0
        self._release: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- called by the servicer ---------------------------------------------------------------
    def submit(self, req: ActiveRequest) -> None:
        if req.kv_tokens > self.limits.kv_capacity_tokens:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"request needs {req.kv_tokens} KV tokens (prompt + max_tokens + one block); "
                               f"the cache holds {self.limits.kv_capacity_tokens}")
        if len(self.waiting) >= self.settings.max_queue:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue full ({self.settings.max_queue} requests waiting); retry later")
        if req.request_id in self.running or any(w.request_id == req.request_id for w in self.waiting):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {req.request_id} is already in use")
        self.waiting.append(req)
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.end(scheduler_pb2.FINISH_REASON_ABORTED)
                self._log_end(req)
                return True
        req = self.running.get(request_id)
        if req is None:
            return False
        req.aborted = True
        self._wake.set()
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- the loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self._retire_aborted()
            items = self._schedule()
            if not items and not self._release:
                self._wake.clear()
                await self._wake.wait()
                continue
            release, self._release = self._release, []
            try:
                resp = await self.draft.Step(draft_pb2.StepRequest(items=items, release=release))
            except grpc.aio.AioRpcError as exc:
                code = exc.code() if exc.code() != grpc.StatusCode.CANCELLED else grpc.StatusCode.UNAVAILABLE
                err = ServiceError(code, f"draft service failed: {exc.details()}")
                for item in items:
                    self._finish(self.running[item.request_id], error=err)
                continue
            for res in resp.results:
                req = self.running.get(res.request_id)
                if req is None:
                    continue
                if res.error_code:
                    self._finish(req, error=ServiceError(grpc.StatusCode(_code(res.error_code)), res.error_message))
                    continue
                req.started = True
                req.add_tokens(list(res.token_ids), res.acceptance_length)
                if req.done:
                    self._finish(req)

    def _schedule(self) -> list[draft_pb2.StepItem]:
        """All running requests, then admissions in arrival order while batch and KV allow."""
        items = [draft_pb2.StepItem(request_id=r.request_id, budget=r.budget) for r in self.running.values()]
        while self.waiting and len(items) < self.settings.max_batch and \
                self.kv_reserved + self.waiting[0].kv_tokens <= self.limits.kv_capacity_tokens:
            req = self.waiting.popleft()
            self.running[req.request_id] = req
            self.kv_reserved += req.kv_tokens
            items.append(draft_pb2.StepItem(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=req.sampling, mode=req.mode,
                budget=req.budget, max_new_tokens=req.max_tokens))
        return items

    def _retire_aborted(self) -> None:
        for req in [r for r in self.running.values() if r.aborted]:
            req.end(scheduler_pb2.FINISH_REASON_ABORTED)
            self._finish(req)

    def _finish(self, req: ActiveRequest, error: ServiceError | None = None) -> None:
        if error is not None:
            req.fail(error)
        self.running.pop(req.request_id, None)
        self.kv_reserved -= req.kv_tokens
        self._release.append(req.request_id)
        self._wake.set()
        self._log_end(req)

    def _log_end(self, req: ActiveRequest) -> None:
        usage = req.usage()
        now = time.monotonic()
        log.info("request_end", request_id=req.request_id,
                 finish=_FINISH_NAMES.get(req.finish, "") if req.error is None else "ERROR",
                 error=req.error.message if req.error is not None else None,
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, steps=usage.steps,
                 mean_acceptance=round(usage.mean_acceptance, 3), budget=req.budget,
                 ttft_ms=round((req.first_token_at - req.created) * 1e3, 2) if req.first_token_at else None,
                 seconds=round(now - req.created, 4))


def _code(value: int) -> tuple:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code.value
    return grpc.StatusCode.UNKNOWN.value
