"""The public API: `Generate` (server-streaming), `Abort`, `GetModelInfo`.

Every handler validates before anything is queued, so bad input gets INVALID_ARGUMENT naming the
field and nothing else running is touched. A client that disconnects or whose deadline passes
aborts its request, which frees its batch slot and KV at the next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from tokenizers import Tokenizer

from ddtree.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.auth import BearerTokenInterceptor, internal_token, server_credentials
from services.common.grpc_server import (MAX_MESSAGE_BYTES, ServiceError, check_port_free, host_port, is_loopback, listen,
                                         new_server, report_health, serve_until_signal)
from services.common.logging import OncePer, configure_logging, get_logger
from services.common.metrics import Metrics, serve_metrics
from services.common.settings import MAX_BUDGET, SchedulerSettings, SettingsError
from services.common.tokenizer_files import load_tokenizer, vocab_digest
from services.scheduler.batcher import log_end
from services.scheduler.client import REFUSED_METADATA, RETRYABLE_METADATA
from services.scheduler.request import (ActiveRequest, check_fields, check_request_id, check_text_size,
                                        max_token_bytes, step_prompt_tokens, validate)
from services.scheduler.router import STOPPING, Router
from services.scheduler.tokenizing import PromptEncoder

__all__ = ["SchedulerServicer", "serve"]

log = get_logger("scheduler")
GENERATE_METHOD = f"/{scheduler_pb2.DESCRIPTOR.services_by_name['Scheduler'].full_name}/Generate"


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, settings: SchedulerSettings, router: Router, info: common_pb2.ModelInfo,
                 tokenizer: Tokenizer | None, encoder: PromptEncoder | None = None) -> None:
        self.settings = settings
        self.router = router
        self.info = info
        self.tokenizer = tokenizer
        self.token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0
        self.encoder = encoder or (PromptEncoder(tokenizer) if tokenizer is not None else None)
        # Ids of requests whose text is being tokenized, not yet in the router: each one's abort.
        self._encoding: dict[str, asyncio.Event] = {}
        self._unauthenticated = OncePer()
        self._busy_refusals: dict[str, OncePer] = {}   # by kind: see `refused`
        self.stopping = False   # the server stops: it takes no new request
        self.encoding = 0       # requests whose text is being tokenized (the drain waits for them too)

    async def Generate(self, request: scheduler_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.GenerateResponse]:
        received = time.monotonic()   # a request's times count from here, its text's tokenizing included
        try:
            if self.stopping:
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, STOPPING, "stopping")
            text_ids = None
            size = request.ByteSize()
            if size > self.settings.max_request_bytes:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"request is {size} bytes; scheduler.max_request_bytes allows "
                                   f"{self.settings.max_request_bytes}", "request_too_large")
            aborted = False
            if request.WhichOneof("prompt") == "text" and request.text and self.encoder is not None:
                check_fields(request, self.settings, self.router.limits, self.tokenizer)
                check_text_size(request.text, self.router.limits, self.token_bytes)
                try:
                    text_ids, aborted = await self._encode(request)
                except asyncio.CancelledError:   # its client left (or the stop's grace ended) meanwhile
                    self._gone_while_tokenized(request, received, context)
                    raise
            elif request.request_id in self._encoding:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id} is already in use",
                                   "id_in_use")
            if aborted or (text_ids is not None and self.router.stop_error is not None):
                # Aborted while its text was tokenized, or tokenized after the stop's grace ended: it
                # ends as an abort of a running one does (`Abort` said it found it), or as the stop
                # ended the queued ones (not refused as new).
                req = self._unqueued(request, received, text_ids)
                if aborted:
                    req.end(scheduler_pb2.FINISH_REASON_ABORTED)
                else:
                    req.fail(self.router.stop_error)
                log_end(self.router.metrics, req)
            else:
                req = validate(request, self.settings, self.router.limits, self.tokenizer, text_ids)
                req.created = received
                self.router.submit(req)
        except ServiceError as exc:
            self.refused(exc.code, exc.message, request.request_id, context.peer(), exc.reason, exc.retryable)
            await _abort(context, exc, refused=True)
        ended = False
        try:
            while True:
                event = await req.next_event()
                if isinstance(event, ServiceError):
                    ended = True
                    await _abort(context, event, refused=req.prompt_sent == 0)   # never sent to a replica
                yield event
                if event.finish_reason != scheduler_pb2.FINISH_REASON_UNSPECIFIED:
                    ended = True
                    return
        finally:
            if not ended:
                # Client went away or its deadline passed: free the request's slot and KV (this
                # request's: after an abort, its id may already belong to a newer one). Not only on
                # a cancellation here: one that lands while gRPC sends the last event closes this
                # stream at its yield instead (GeneratorExit), about one client in four that left.
                if self.stopping and self.router.closed:   # cut by the server's stop after its drain (the
                    # client saw UNAVAILABLE): counted so; one that left during the drain aborted
                    req.fail(ServiceError(grpc.StatusCode.UNAVAILABLE, "the scheduler stopped"))
                elif _deadline_passed(context):   # not the client's choice to leave: counted apart from aborts
                    req.fail(ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed"))
                else:
                    req.left = True
                self.router.abort(req.request_id, only=req)

    def _gone_while_tokenized(self, request: scheduler_pb2.GenerateRequest, received: float,
                              context: grpc.aio.ServicerContext) -> None:
        """Counts and logs a request whose call ended while its text was tokenized, by why, as one
        that ends in the queue is (`requests_total` promises every request admitted, these too)."""
        try:   # its fields were checked before the tokenizing; the prompt is not known
            req = self._unqueued(request, received, [])
        except ServiceError:
            return
        if self.stopping and self.router.closed:   # gRPC's end of the stop's grace cancelled it
            req.fail(self.router.stop_error or ServiceError(grpc.StatusCode.UNAVAILABLE, "the scheduler stopped"))
        elif _deadline_passed(context):
            req.fail(ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed"))
        else:
            req.left = True
            req.end(scheduler_pb2.FINISH_REASON_ABORTED)
        log_end(self.router.metrics, req)

    def _unqueued(self, request: scheduler_pb2.GenerateRequest, received: float, prompt_ids: list[int]) -> ActiveRequest:
        """A text request that ends before it reaches the router, to be ended and logged as one
        that ends in the queue: checked on its first token alone, whatever its prompt."""
        req = validate(request, self.settings, self.router.limits, self.tokenizer, prompt_ids[:1] or [0])
        req.prompt_ids, req.created = prompt_ids, received
        return req

    async def _encode(self, request: scheduler_pb2.GenerateRequest) -> tuple[list[int], bool]:
        """The text's tokens, and whether ``Abort`` named the request meanwhile: a long text takes
        seconds in the encoder's worker process before the request reaches the router, and an
        abort then found nothing (the request ran to max_tokens, holding a slot and its KV)."""
        rid = request.request_id
        if rid and (rid in self._encoding or any(lane.has_live(rid) for lane in self.router.lanes)):
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid} is already in use", "id_in_use")
        aborted = asyncio.Event()
        if rid:
            self._encoding[rid] = aborted
        self.encoding += 1
        try:   # in the encoder's worker process where long: the other streams go on meanwhile
            ids = await self.encoder.encode(request.text)
        except ServiceError:   # too many long texts waiting already
            raise
        except Exception as exc:  # noqa: BLE001 - the tokenizer's own error type
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt text cannot be tokenized: {exc}") from None
        finally:
            self.encoding -= 1
            if self._encoding.get(rid) is aborted:
                del self._encoding[rid]
        return ids, aborted.is_set()

    def refused(self, code: grpc.StatusCode, message: str, request_id: str = "", peer: str | None = None,
                reason: str = "", busy: bool = False) -> None:
        """Counts a request refused before it ran by code and ``reason`` (the code where one cause
        has it alone), and logs it with its id (as far as it is not itself the fault: cut at 200
        characters) and the client's address, to match a user's report to its line.

        ``busy``: refused for the server's state (a full queue, no replica up, a stop: retryable),
        which clients retrying in a loop repeat hundreds of times a second, the same line each time
        (a full queue logged 168 KB/s): logged at most once each BUSY_LOG_EVERY_S per kind, with
        the count since the last line (`calls`, this one included); the metric counts every one."""
        kind = reason or code.name.lower()
        self.router.metrics.refused.labels(code.name.lower(), kind).inc()
        calls = self._busy_refusals.setdefault(kind, OncePer(BUSY_LOG_EVERY_S)).due() if busy else 1
        if calls is not None:
            log.info("request_refused", code=code.name, kind=kind, reason=message[:200],
                     request_id=request_id[:200] or None, peer=peer, calls=calls)

    def unauthenticated(self) -> None:
        """A call refused for its bearer token (by the interceptor, before any handler): counted
        each time, logged at most once a minute with the count since (a token-guessing run left
        no trace; a line each would flood the log)."""
        self.router.metrics.refused.labels("unauthenticated", "unauthenticated").inc()
        calls = self._unauthenticated.due()
        if calls is not None:
            log.warning("request_refused", code="UNAUTHENTICATED", reason="missing or wrong bearer token", calls=calls)

    def unparsed(self, method: str, message: str) -> None:
        """A call that did not parse (`new_server`'s `on_unparsed`): for Generate, a refusal like
        the others (an Abort or a health check is no request)."""
        if method == GENERATE_METHOD:
            self.refused(grpc.StatusCode.INVALID_ARGUMENT, message, reason="unparsed")

    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        try:   # an id no request can have is the caller's mistake, not "not found"
            check_request_id(request.request_id, required=True)
        except ServiceError as exc:
            await _abort(context, exc, refused=False)
        # One being tokenized gives its id up at once (as an aborted running one does): it ends
        # aborted once tokenized, and the id may be used again meanwhile.
        tokenizing = self._encoding.pop(request.request_id, None)
        if tokenizing is not None:
            tokenizing.set()
            return scheduler_pb2.AbortResponse(found=True)
        return scheduler_pb2.AbortResponse(found=self.router.abort(request.request_id))

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.router.served_info())
        info.default_budget, info.max_budget = self.info.default_budget, self.info.max_budget
        return info


async def _abort(context: grpc.aio.ServicerContext, exc: ServiceError, refused: bool) -> None:
    """Ends the call with ``exc``'s status, telling the client whether to retry (`ClientError.retryable`)
    and whether the request never ran on a replica (``refused``: refused at admission, failed in
    the queue, or its first step reached no replica), which a wait_for_ready stream sends again by itself."""
    await context.abort(exc.code, exc.message,
                        trailing_metadata=((RETRYABLE_METADATA, "true" if exc.retryable else "false"),
                                           (REFUSED_METADATA, "true" if refused else "false")))


DEADLINE_SLACK_S = 0.1   # see _deadline_passed
BUSY_LOG_EVERY_S = 10.0  # see SchedulerServicer.refused


def _deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call ended at its deadline. The server's deadline runs from the call's arrival,
    so over a network the client's own cancel at its deadline can land a little before it."""
    left = context.time_remaining()
    return left is not None and left < DEADLINE_SLACK_S


async def serve(settings: SchedulerSettings) -> None:
    configure_logging("scheduler", settings.json_logs)
    metrics = Metrics("scheduler")
    # Port, TLS files and the tokenizer first: a bad one fails start-up now, not after the drafts answer.
    check_port_free(settings.host, settings.port, "scheduler.port")
    credentials = server_credentials(settings.tls_cert, settings.tls_key) if settings.tls_cert else None
    metrics_port = serve_metrics(metrics, settings.host, settings.metrics_port)
    drafts_token = internal_token()
    tokenizer = load_tokenizer(settings.tokenizer_path)
    encoder = PromptEncoder(tokenizer, apart=True) if tokenizer is not None else None
    router = Router(settings, metrics, drafts_token)
    router.tokenizer_digest = vocab_digest(tokenizer) if tokenizer is not None else ""
    info = await router.start(settings.draft_wait_s)
    prompt_tokens = step_prompt_tokens(settings, router.limits)
    if prompt_tokens == 0:
        await router.stop()
        raise SettingsError(f"scheduler.max_batch: {settings.max_batch} requests a step can commit "
                            f"{settings.max_batch * router.limits.block_size} tokens, whose features "
                            f"({router.limits.feature_bytes_per_token} bytes a token) would not fit gRPC's "
                            f"{MAX_MESSAGE_BYTES >> 30} GiB message; lower it")
    if prompt_tokens < settings.max_prefill_tokens:
        log.warning("max_prefill_tokens_capped", setting=settings.max_prefill_tokens, tokens=prompt_tokens,
                    reason=f"a step's features ({router.limits.feature_bytes_per_token} bytes a token) must fit "
                           f"gRPC's {MAX_MESSAGE_BYTES >> 30} GiB message")
    words = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer is not None else 0
    if words > info.vocab_size:   # else every text prompt failed "token id outside the vocabulary", unasked
        await router.stop()
        raise SettingsError(f"scheduler.tokenizer_path: {settings.tokenizer_path} holds {words} tokens, more than "
                            f"the model's vocabulary of {info.vocab_size} (another model's tokenizer?)")
    if router.tokenizer_digest and info.tokenizer_digest and info.tokenizer_digest != router.tokenizer_digest:
        await router.stop()   # else every text prompt became another model's tokens, without a word
        raise SettingsError(f"scheduler.tokenizer_path: {settings.tokenizer_path} is not the tokenizer of the model "
                            "the drafts serve (the one in their draft.target_path has another vocabulary); point it "
                            "at that model's directory")
    info.default_budget = settings.default_budget
    info.max_budget = MAX_BUDGET
    log.info("model_info", vocab_size=info.vocab_size, max_context=info.max_context, block_size=info.block_size,
             kv_capacity_tokens=info.kv_capacity_tokens, transport=info.transport,
             tokenizer=settings.tokenizer_path if tokenizer else None, metrics_port=metrics_port)
    # Up to twice the limit a request reaches Generate, which refuses it by the setting's name.
    servicer = SchedulerServicer(settings, router, info, tokenizer, encoder)
    interceptors = [BearerTokenInterceptor(settings.auth_token, on_refused=servicer.unauthenticated)] \
        if settings.auth_token else []
    server, health = new_server([scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name], interceptors,
                                max_receive_bytes=min(2 * settings.max_request_bytes, 2**31 - 1),
                                on_unparsed=servicer.unparsed)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = listen(server, host_port(settings.host, settings.port), "scheduler.port", credentials)
    await server.start()
    log.info("serving", address=host_port(settings.host, port), tls=bool(settings.tls_cert),
             auth=bool(settings.auth_token))
    if settings.auth_token and not settings.tls_cert and not is_loopback(settings.host):
        log.warning("token_in_clear", address=host_port(settings.host, port),
                    advice="the bearer token crosses the network readable; set scheduler.tls_cert / tls_key "
                           "or put a TLS-terminating proxy in front")
    watch = asyncio.ensure_future(report_health(health, [scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name],
                                                lambda: any(lane.healthy for lane in router.lanes),
                                                "no draft replica is up", wake=router.health_changed))
    try:
        await serve_until_signal(server, health, on_stop=lambda: setattr(servicer, "stopping", True),
                                 drain=lambda now: router.drain(settings.stop_grace_s, now,
                                                                arriving=lambda: servicer.encoding))
    finally:
        watch.cancel()
        await router.stop()
        if encoder is not None:
            encoder.close()
