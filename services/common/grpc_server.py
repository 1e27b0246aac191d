"""What every server of the stack shares: health, reflection, graceful stop, status helpers."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.call_errors import CallErrorInterceptor
from services.common.health import OVERALL, HealthServicer
from services.common.logging import get_logger
from services.common.settings import SettingsError, cannot_listen

T = TypeVar("T")
__all__ = ["ServiceError", "IdleStreams", "is_loopback", "new_server", "check_port_free", "listen", "serve_until_signal",
           "report_health", "HEALTH_SERVICE_NAME", "PARENT_PID_ENV"]

HEALTH_SERVICE_NAME = OVERALL
# Set by `ddtree up` to its own pid: a service whose parent is no longer that process stops (below).
PARENT_PID_ENV = "DDTREE_PARENT_PID"

# Inline tensor bundles (a payload larger than a ring slot, or no shared memory) can be large: a
# step that prefills 8192 prompt tokens of K2 carries ~350 MB of bf16 features (3 feature layers).
MAX_MESSAGE_BYTES = 1 << 30
# Room a verifier reply needs beside its features (tokens and results of every item): far less than this.
REPLY_OVERHEAD_BYTES = 16 << 20


def reply_feature_rows(feature_bytes_per_token: int) -> int | None:
    """The committed tokens whose features one verifier reply can carry in its message (a long
    prefill's exceed a ring slot and go there); None where the width is not known."""
    if feature_bytes_per_token <= 0:
        return None
    return (MAX_MESSAGE_BYTES - REPLY_OVERHEAD_BYTES) // feature_bytes_per_token

# How often each end of a connection pings the other, and how long it waits for the ack.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


class ServiceError(Exception):
    """An error meant for the caller: carries the gRPC status code and a message naming the cause;
    ``reason``, a word telling apart causes that share a code (a refusal's metric label).

    ``retryable``: whether the same request may succeed later as it is, because the server's state
    (a replica down, a full queue or cache, a stop), not the request, failed it. The scheduler
    sends it to the client (`ClientError.retryable`): both kinds share UNAVAILABLE and
    RESOURCE_EXHAUSTED with failures a retry cannot mend (a message over gRPC's size limit, a
    prompt that killed the tokenizer), and a client retrying on the code alone retried those."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", retryable: bool | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.retryable = code in _RETRYABLE_CODES if retryable is None else retryable


_RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """The stack's servers' options, and its channels' between services (the scheduler's to its
    drafts, a draft's to its verifier)."""
    # SO_REUSEPORT off: with gRPC's default a second server binds a port already in use without an
    # error, and the two then share the calls (a scheduler started on a verifier's port answered
    # one call in six with UNIMPLEMENTED).
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.so_reuseport", 0), *keepalive_options()]


def keepalive_options() -> list[tuple[str, int]]:
    """Pings both ways on every connection, so that a peer whose host vanished without closing it
    (a crash, a cut network: no FIN) is found within ``KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS``.
    Its streams then end as if it had closed them, and what it held is freed: a draft's KV pages
    at its verifier, a scheduler's requests at its draft, a client's request at the scheduler.
    Without them an idle half-open connection stayed up for TCP's two hours or more. The server
    side accepts pings as often as half the interval (gRPC's default refuses them under 5 minutes
    apart, and closes the connection after two)."""
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),   # gRPC's own wait for the ack otherwise (60 s)
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2)]


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC reads it: an IPv6 host ("::", "::1") in brackets."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int, setting: str) -> None:
    """Fails start-up now, by the setting's name, where ``host:port`` cannot be bound, so a busy port
    is found before minutes of loading. The real bind (``listen``) comes just before the server
    starts: a port bound early accepts connections whose calls then hang until it starts, where an
    unbound one refuses them at once. Port 0 (any free one) is probed too, for the host."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no conflict
            probe.bind(addr)
    except (OSError, UnicodeError) as exc:
        raise cannot_listen(exc, host, port, setting) from None


def listen(server: grpc.aio.Server, address: str, setting: str,
           credentials: grpc.ServerCredentials | None = None) -> int:
    """Binds ``address`` (TLS with ``credentials``) and returns the port; a port that cannot be had
    fails start-up with the setting's name (``SettingsError``), not gRPC's bare RuntimeError."""
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:
        raise SettingsError(f"{setting}: cannot listen on {address} (the port is in use, "
                            "or the host is not an address of this machine)") from None


def new_server(service_full_names: Iterable[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               max_receive_bytes: int = MAX_MESSAGE_BYTES,
               on_unparsed: Callable[[str, str], None] | None = None) -> tuple[grpc.aio.Server, HealthServicer]:
    """An asyncio server with grpc.health.v1 (each service SERVING) and reflection registered.

    A request or stream message that does not parse is refused with INVALID_ARGUMENT
    (`on_unparsed(method, message)` is told of each), and a handler's unexpected exception is
    logged and ends its call INTERNAL (`CallErrorInterceptor`).
    """
    server = grpc.aio.server(options=server_options(max_receive_bytes),
                             interceptors=[*interceptors, CallErrorInterceptor(on_unparsed)])
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_full_names)
    for name in [HEALTH_SERVICE_NAME, *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    return server, health_servicer


async def report_health(health_servicer: HealthServicer, service_full_names: Iterable[str],
                        can_serve: Callable[[], bool], why_not: str, interval_s: float = 0.5,
                        wake: asyncio.Event | None = None) -> None:
    """Keeps grpc.health.v1 saying whether the service can serve now, not only that it started: a
    scheduler with no draft replica up, or a draft without its verifier, answered SERVING while it
    failed every request. ``can_serve`` is read every ``interval_s`` and at once when ``wake`` is
    set (the scheduler's replicas going down or up: polled alone, health said SERVING for up to
    half a second while requests were refused "no draft replica is up"). Runs until cancelled; a
    graceful shutdown's NOT_SERVING stays (the servicer ignores later changes)."""
    names = [HEALTH_SERVICE_NAME, *service_full_names]
    up = True
    while True:
        if wake is not None:
            wake.clear()
        now = bool(can_serve())
        if now != up:
            up = now
            status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in names:
                health_servicer.set(name, status)
            if up:
                get_logger("server").info("serving_again")
            else:
                get_logger("server").warning("not_serving", reason=why_not)
        if wake is None:
            await asyncio.sleep(interval_s)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval_s)


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches a port listening on ``host``."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:   # a name: it may resolve to any interface
        return False


def warn_if_reachable(host: str, setting: str, authenticated: bool) -> None:
    """An internal service (draft, verifier) without the internal token checks nothing: listening
    beyond loopback, anyone who reaches the port can hand-shake, hold KV and name rings. Said at
    start-up, not refused (a private network may be all a deployment wants)."""
    if authenticated or is_loopback(host):
        return
    get_logger("server").warning("internal_port_reachable", setting=setting, host=host,
                                 advice="no authentication on this port: set DDTREE_INTERNAL_TOKEN (or "
                                        "DDTREE_INTERNAL_TOKEN_FILE) for the three services, or keep it "
                                        "on a private network")


_serving = threading.Event()   # serve_until_signal watches the launcher from here on


def watch_launcher_during_start_up(poll_s: float = 1.0) -> None:
    """Ends this process if the launcher named by ``DDTREE_PARENT_PID`` goes before the service
    serves. A start-up (loading and warming up a model, waiting for a peer) runs before
    ``serve_until_signal`` watches the launcher, and a launcher killed then left the service
    holding its GPU memory and ports for minutes. Nothing is served yet, so nothing is drained."""
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit():
        exit_when_orphaned(int(parent), 1, poll_s, until=_serving,
                           message=f"launcher {parent} gone during start-up: exiting")


def exit_when_orphaned(parent_pid: int, code: int, poll_s: float = 1.0, until: threading.Event | None = None,
                       message: str = "") -> None:
    """A daemon thread that ends this process (``os._exit(code)``, ``message`` on stderr first) once
    its parent is no longer ``parent_pid`` (it was re-parented: the parent died), unless ``until``
    is set first. For processes whose parent's end nothing else would tell them of."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            if until is None:
                time.sleep(poll_s)
            elif until.wait(poll_s):
                return
        try:
            if message:
                print(message, file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    threading.Thread(target=watch, name="exit-when-orphaned", daemon=True).start()


async def serve_until_signal(server: grpc.aio.Server, health_servicer: HealthServicer,
                             grace_s: float = 5.0, parent_poll_s: float = 1.0,
                             on_stop: Callable[[], None] | None = None,
                             drain: Callable[[asyncio.Event], Awaitable[object]] | None = None) -> None:
    """Runs until SIGTERM/SIGINT, or until the launcher named by ``DDTREE_PARENT_PID`` is gone,
    then reports NOT_SERVING, calls ``on_stop`` (a service ends its idle streams there), awaits
    ``drain(now)`` (the scheduler lets its running requests finish, then ends the rest with a
    status of its own; ``now`` is set by a second signal, or at once where the launcher is gone,
    whose other services went with it) and stops with a grace period.

    Why the parent check: ``ddtree up`` starts each service in a session of its own (a Ctrl-C in
    the terminal must reach the launcher only, which stops the stack in order), so a SIGKILL of the
    launcher would leave the services running, holding their ports and GPU memory. A service is
    re-parented when its launcher dies, which ``os.getppid()`` shows; PR_SET_PDEATHSIG would not do,
    as it fires when the launching *thread* exits, and test stacks start from worker threads."""
    _serving.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig.name)
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    watcher = None
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit():
        watcher = asyncio.create_task(_stop_when_orphaned(int(parent), stop, parent_poll_s))
    try:
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        with contextlib.suppress(OSError):   # (a launcher gone may have taken our stdout's reader)
            get_logger("server").info("stopping", signal=signals[0] if signals else None, grpc_grace_s=grace_s)
        health_servicer.enter_graceful_shutdown()
        if on_stop is not None:
            on_stop()
        if drain is not None:
            now = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):   # a second one: stop waiting
                loop.add_signal_handler(sig, now.set)
            if parent.isdigit() and os.getppid() != int(parent):
                now.set()
            await drain(now)
        await server.stop(grace_s)


class IdleStreams:
    """The stream handlers of a service waiting for their caller's next message, which its stop
    ends at once (`end`): an open stream held a stopping server for its whole gRPC grace, and its
    caller saw the service as up until the process was gone. A handler busy with a message
    finishes it; `next` then ends its stream."""

    def __init__(self) -> None:
        self.stopping = False
        self._waiting: set[asyncio.Task] = set()

    async def next(self, requests: AsyncIterator[T]) -> T | None:
        """The stream's next message; None where it ended or the service is stopping."""
        if self.stopping:
            return None
        me = asyncio.current_task()
        self._waiting.add(me)
        try:
            return await requests.__anext__()
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if self.stopping:   # ended by `end`: the stream ends OK
                me.uncancel()   # (taken: nothing later in this task may read it as pending)
                return None
            raise
        finally:
            self._waiting.discard(me)

    def end(self) -> None:
        self.stopping = True
        for task in list(self._waiting):
            task.cancel()


async def _stop_when_orphaned(parent_pid: int, stop: asyncio.Event, poll_s: float) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            stop.set()
            try:  # the launcher's end of our stdout may be gone with it
                get_logger("server").warning("launcher_gone", launcher_pid=parent_pid, parent_pid=os.getppid())
            except OSError:
                pass
            return
        await asyncio.sleep(poll_s)
