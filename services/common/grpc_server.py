"""What every server of the stack shares: health, reflection, graceful stop, status helpers."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

__all__ = ["ServiceError", "new_server", "serve_until_signal", "HEALTH_SERVICE_NAME"]

HEALTH_SERVICE_NAME = ""  # the overall server health, what `grpc_health_probe` asks by default

# Inline tensor bundles (a payload larger than a ring slot, or no shared memory) can be large: a
# step that prefills 8192 prompt tokens of K2 carries ~700 MB of float32 features.
MAX_MESSAGE_BYTES = 1 << 30


class ServiceError(Exception):
    """An error meant for the caller: carries the gRPC status code and a message naming the cause."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes)]


def new_server(service_full_names: Iterable[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               max_receive_bytes: int = MAX_MESSAGE_BYTES) -> tuple[grpc.aio.Server, health.HealthServicer]:
    """An asyncio server with grpc.health.v1 (each service SERVING) and reflection registered."""
    server = grpc.aio.server(options=server_options(max_receive_bytes), interceptors=list(interceptors))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_full_names)
    for name in [HEALTH_SERVICE_NAME, *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    return server, health_servicer


async def serve_until_signal(server: grpc.aio.Server, health_servicer: health.HealthServicer,
                             grace_s: float = 5.0) -> None:
    """Runs until SIGTERM/SIGINT, then reports NOT_SERVING and stops with a grace period."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
