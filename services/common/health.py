"""grpc.health.v1 for the stack's asyncio servers.

Why not one of grpcio-health-checking's two servicers as it is:

* The synchronous one, on an asyncio server, runs each ``Watch`` in a thread of the server's pool
  and blocks that thread until the service's status next changes, even after the client has gone
  (nothing calls it back on the asyncio server). Some forty watches that came and went used every
  thread: later watches and every ``Check`` hung, and the process could not exit after its server
  stopped.
* The asyncio one drops a service's condition when any one watcher of it ends, so the other
  watchers of that service miss every later change; and its ``set`` is a coroutine, which the
  verifier's failure path (another thread) cannot simply call.

Here every call is a coroutine on the event loop, and a change wakes every watcher through one
event that is swapped for a fresh one: no thread or lock is held while a watcher waits, and nothing
is kept per watched name. A graceful shutdown sends NOT_SERVING to every watcher and then ends its
stream, so a stopping server does not wait out its grace period for watchers.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["HealthServicer", "OVERALL"]

OVERALL = ""  # the whole server's health: what `grpc_health_probe` asks by default

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Check and Watch of the statuses ``set`` gives. ``set`` and ``enter_graceful_shutdown`` are
    plain calls on the event loop's thread (another thread: ``loop.call_soon_threadsafe``)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {OVERALL: _SERVING}
        self._changed = asyncio.Event()
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        """Sets a service's status and tells its watchers; ignored once shutting down."""
        if self._shutting_down or self._status.get(service) == status:
            return
        self._status[service] = status
        self._wake()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; each watcher is told so and its stream ends."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in self._status:
            self._status[service] = _NOT_SERVING
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            # Cut short: a long name echoed whole passed the client's header limit (RESOURCE_EXHAUSTED).
            name = request.service if len(request.service) <= 200 else request.service[:200] + "..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {name!r} here")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """The status now, then each change (an unknown name: SERVICE_UNKNOWN until it is set).
        Changes between two writes may be missed; the last one is always sent."""
        last = None
        while True:
            changed = self._changed  # taken before the status is read: a change after it wakes us
            status = self._status.get(request.service, _UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
                continue   # read again: the status (or a shutdown) may have changed during the write
            if self._shutting_down:
                return
            await changed.wait()
