"""Guarding the public port: an optional bearer token checked on every call, and TLS credentials.

Health checks stay open so orchestrators can probe without the token; reflection and every
`ddtree.v1` method need it.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

__all__ = ["BearerTokenInterceptor", "server_credentials"]

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS from PEM files; the error names the file that could not be read."""
    try:
        cert = Path(cert_file).read_bytes()
        key = Path(key_file).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS: cannot read {exc.filename}: {exc.strerror}") from None
    return grpc.ssl_server_credentials([(key, cert)])
