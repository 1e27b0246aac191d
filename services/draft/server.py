"""The draft service's gRPC face: `StepStream` for the scheduler's steps, `GetModelInfo` for clients' limits."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch

from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from kernels.pdl import switch_from_env
from services.common import step_socket
from services.common.auth import internal_interceptors, internal_token
from services.common.checkpoint import CheckpointError, shared_weights_digest
from services.common.devices import pin_device
from services.common.grpc_server import (IdleStreams, ServiceError, check_port_free, host_port, listen, new_server,
                                         report_health, serve_until_signal, warn_if_reachable)
from services.common.logging import configure_logging, get_logger
from services.common.metrics import Metrics, serve_metrics
from services.common.settings import DraftSettings, SettingsError
from services.common.tokenizer_files import model_tokenizer_digest
from services.draft.config import least_context
from services.draft.engine import DraftEngine
from services.draft.proposer import Proposer, load_proposer
from services.draft.verifier_client import VerifierClient

__all__ = ["DraftServicer", "serve"]

log = get_logger("draft")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SOCKET_KEY_LIFE_S = 30.0   # an OpenStepSocket key not used by then is void
MAX_SOCKET_KEYS = 1024     # keys outstanding at once; past it the oldest go


class DraftServicer(step_socket.ServesStepSocket, draft_pb2_grpc.DraftServicer):
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self._idle = IdleStreams()   # step streams waiting for their next step
        self._streams = itertools.count(1)      # each step stream's number: the owner of what it admits
        self.server_id = f"draft-{secrets.token_hex(6)}"   # names its step socket
        self._socket_keys: dict[bytes, float] = {}   # keys offered and not yet used -> when they expire

    async def start_step_socket(self, enabled: bool = True, folder: str = "") -> str:
        """Offers schedulers of this host a step socket (`draft.step_socket`; an abstract name on
        Linux, or a socket file in ``folder``, `draft.step_socket_dir`); returns its name."""
        return await self._open_step_socket(enabled, self.server_id, self._socket_owner, self._owned_steps,
                                            draft_pb2.StepRequest, SOCKET_KEY_LIFE_S, folder)

    async def OpenStepSocket(self, request: draft_pb2.OpenStepSocketRequest,
                             context: grpc.aio.ServicerContext) -> draft_pb2.StepSocketOffer:
        if not self.step_socket:
            return draft_pb2.StepSocketOffer()
        now = time.monotonic()
        self._socket_keys = {k: t for k, t in self._socket_keys.items() if t > now}
        while len(self._socket_keys) >= MAX_SOCKET_KEYS:   # a caller asking without connecting: its oldest go
            self._socket_keys.pop(next(iter(self._socket_keys)))
        key = secrets.token_bytes(step_socket.KEY_BYTES)
        self._socket_keys[key] = now + SOCKET_KEY_LIFE_S
        return draft_pb2.StepSocketOffer(name=self.step_socket, key=key)

    def _socket_owner(self, key: bytes | None) -> int:
        """A new stream's owner number for a key this draft offered (each key opens one stream)."""
        held = next((k for k in self._socket_keys if step_socket.same_key(k, key)), None)
        if held is None or self._socket_keys.pop(held) < time.monotonic():
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "no step socket key of this draft (used, expired, or never given); "
                               "call OpenStepSocket first")
        return next(self._streams)

    async def StepStream(self, request_iterator: AsyncIterator[draft_pb2.StepRequest],
                         context: grpc.aio.ServicerContext) -> AsyncIterator[draft_pb2.StepResponse]:
        try:
            async with contextlib.aclosing(self._owned_steps(next(self._streams), request_iterator)) as steps:
                async for response in steps:
                    yield response
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)

    async def _owned_steps(self, owner: int, request_iterator: AsyncIterator[draft_pb2.StepRequest]
                           ) -> AsyncIterator[draft_pb2.StepResponse]:
        """One step stream, from gRPC or the step socket; a ServiceError out of it ends the stream."""
        try:
            requests = request_iterator.__aiter__()
            while (request := await self._idle.next(requests)) is not None:   # None: ended, or stopping
                step = asyncio.ensure_future(self.engine.step(request, owner))
                try:
                    # Shielded: if the scheduler gives up on the stream, the step still runs to its end
                    # (holding the engine's lock), so the next step never starts beside a half-done one.
                    yield await asyncio.shield(step)
                except asyncio.CancelledError:   # its end is heard by no one: said here, not by asyncio's
                    step.add_done_callback(_said_after_stream_end)   # "exception was never retrieved" traceback
                    raise
                finally:
                    # The answer has gone out (or the stream ended under it): the next step needs this
                    # work first, and the commit reads features that the verifier's ring holds for us
                    # only while our stream to it lasts.
                    self.engine.run_ahead()
        finally:
            # The stream ended: what it admitted goes (shielded as a step is, so a cancelled
            # stream still frees it, after the step in flight and its work ahead).
            await asyncio.shield(self.engine.end_stream(owner))

    def end_idle_streams(self) -> None:
        """At shutdown: ends every step stream between two steps, and every other one after the
        step in flight, so the grace period waits for steps in flight only, not for the schedulers'
        open streams (a lane whose stream ended finds this replica down at its next step). The step
        socket takes no new stream from here on either."""
        self._idle.end()
        self._stop_step_socket()

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        try:
            await self.engine.ensure_connected()   # a replica without its verifier is down
            return self.engine.model_info()
        except ServiceError as exc:
            await context.abort(exc.code, exc.message)


async def _reconnect_when_lost(engine: DraftEngine, interval_s: float = 1.0) -> None:
    """Hand-shakes again soon after the verifier's stream was lost, whether or not a step or a
    scheduler's probe comes: the replica's health says NOT_SERVING until then."""
    said = None   # the failure warned of last: said once until it changes or a reconnect works (not a line a second)
    while True:
        await asyncio.sleep(interval_s)
        if engine.verifier.connected:   # (a step or the scheduler's probe may have reconnected it)
            said = None
        else:
            try:
                await engine.ensure_connected()   # (the client logs `verifier_reconnected`)
                said = None
            except ServiceError as exc:   # a verifier still down is expected; one refusing our token is not
                kind = exc.code.name
                warn = exc.code == grpc.StatusCode.UNAUTHENTICATED and said != kind
                (log.warning if warn else log.debug)("verifier_reconnect_failed", code=kind, error=exc.message)
                said = kind if exc.code == grpc.StatusCode.UNAUTHENTICATED else said
            except Exception as exc:  # noqa: BLE001 - e.g. a ring that cannot be made now: the next round tries again
                kind = type(exc).__name__
                (log.warning if said != kind else log.debug)("verifier_reconnect_failed", error=repr(exc))
                said = kind


def _said_after_stream_end(step: asyncio.Future) -> None:
    """How a step whose stream ended under it (the scheduler gave up) ended, as a log event."""
    if not step.cancelled() and (exc := step.exception()) is not None:
        log.warning("step_failed_after_stream_ended", error=str(exc) or type(exc).__name__)


def _target_digest(path: str) -> str:
    """`shared_weights_digest` of the target the drafter read, "" where there is none to read."""
    try:
        return shared_weights_digest(Path(path))
    except (CheckpointError, OSError):
        return ""


def _tokenizer_digest(path: str) -> str:
    """`model_tokenizer_digest` of the target's directory; "" (nothing for the scheduler to compare)
    where its tokenizer does not load: the draft does not tokenize, and a scheduler that reads it
    names the fault itself."""
    try:
        return model_tokenizer_digest(path, "draft.target_path")
    except SettingsError as exc:
        log.warning("target_tokenizer_unread", error=str(exc))
        return ""


def enable_propose_graphs(proposer: Proposer, settings: DraftSettings, device: torch.device) -> None:
    """The context pool and its graphs. A pool too large for the GPU is the settings' fault, said
    as such: a bare OutOfMemoryError traceback left an operator (who raised `graph_context` for
    long prompts: 131072 tokens take 24 GiB on the demo drafter) to guess which setting."""
    try:
        pool = proposer.enable_graphs(settings.graph_rows, settings.graph_context)
    except torch.OutOfMemoryError as exc:
        raise SettingsError(f"draft.graph_rows, draft.graph_context: a context pool of {settings.graph_rows} contexts x "
                            f"{settings.graph_context} tokens does not fit on {device} beside the drafter; lower "
                            f"either (requests past them propose eagerly) or set draft.cuda_graphs = false "
                            f"({'. '.join(str(exc).splitlines()[0].split('. ')[:2])[:160]})") from None
    log.info("propose_graphs_on", rows=settings.graph_rows, context=settings.graph_context,
             pool_mb=round(pool / 2**20, 1))


async def serve(settings: DraftSettings) -> None:
    configure_logging("draft", settings.json_logs)
    # Ports first: one that cannot be had fails start-up now, not after the weights load and the verifier answers.
    check_port_free(settings.host, settings.port, "draft.port")
    try:
        switch_from_env()   # DDTREE_PDL: its kernels' launches
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    token = internal_token()   # asked of the scheduler's calls, presented to the verifier
    metrics = Metrics("draft")
    metrics_port = serve_metrics(metrics, settings.host, settings.metrics_port)
    torch.set_num_threads(settings.cpu_threads)
    device = pin_device(settings.device, "draft.device")   # Triton launches and the shared ring follow the current device
    metrics.track_gpu_memory(device)   # the drafter, its context pool, a cuda_ipc ring
    proposer = load_proposer(settings.drafter_path, settings.target_path, _DTYPES[settings.dtype], str(device))
    log.info("drafter_loaded", path=settings.drafter_path, block_size=proposer.block_size,
             target_layer_ids=list(proposer.target_layer_ids))
    client = VerifierClient(settings.verifier_address, settings.transport, settings.ring_slots,
                            settings.ring_slot_bytes, device=str(device), step_timeout_s=settings.verifier_step_timeout_s,
                            internal_token=token, target_digest=_target_digest(settings.target_path),
                            on_inline_fallback=metrics.ring_inline_fallbacks.labels("slot_too_small").inc)
    if device.type == "cuda" and settings.cuda_graphs:
        enable_propose_graphs(proposer, settings, device)
    engine = DraftEngine(proposer, client, metrics)
    engine.tokenizer_digest = _tokenizer_digest(settings.target_path)
    t0 = time.perf_counter()
    engine.warm_up(settings.warmup_budgets, str(device))
    log.info("draft_warm", budgets=list(settings.warmup_budgets), seconds=round(time.perf_counter() - t0, 2))
    log.info("verifier_connecting", verifier=settings.verifier_address, wait_s=settings.verifier_wait_s)
    try:   # fail fast on an incompatible verifier (FAILED_PRECONDITION names the field)
        await engine.connect(wait_s=settings.verifier_wait_s)
    except ServiceError as exc:
        waited = (f"nothing answered within {settings.verifier_wait_s:g} s (draft.verifier_wait_s)"
                  if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED else exc.message)
        raise ServiceError(exc.code, f"draft.verifier_address {settings.verifier_address}: {waited}") from None
    if engine.max_context < least_context(proposer.block_size):
        # A prompt of one token and one tree of a block must fit: the stack served, and refused
        # every request with "-1 prompt tokens at most".
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"the verifier's max context ({engine.max_context}: verifier.max_context, or the target's "
                           f"max_position_embeddings) holds no prompt beside one tree of this drafter's block_size "
                           f"{proposer.block_size}: it must be at least {least_context(proposer.block_size)}")
    log.info("verifier_connected", verifier=settings.verifier_address, verifier_id=client.handshake.verifier_id,
             transport=client.handshake.transport, device=str(device), max_context=engine.max_context)
    server, health = new_server([draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name], internal_interceptors(token))
    servicer = DraftServicer(engine)
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    port = listen(server, host_port(settings.host, settings.port), "draft.port")
    warn_if_reachable(settings.host, "draft.host", bool(token))
    await server.start()
    await servicer.start_step_socket(settings.step_socket, settings.step_socket_dir)
    log.info("serving", address=host_port(settings.host, port), verifier=settings.verifier_address, metrics_port=metrics_port,
             step_socket=step_socket.log_name(servicer.step_socket), verifier_lane=client.lane)
    tasks = [asyncio.ensure_future(report_health(health, [draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name],
                                                 lambda: client.connected, "no verifier stream",
                                                 wake=client.stream_changed)),
             asyncio.ensure_future(_reconnect_when_lost(engine))]
    try:
        await serve_until_signal(server, health, on_stop=servicer.end_idle_streams)
    finally:
        await servicer.close_step_socket(grace_s=5.0)   # gRPC's stop gave its own streams as long
        for task in tasks:
            task.cancel()
        await engine.close()
