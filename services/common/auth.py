"""Guarding the public port: an optional bearer token checked on every call, and TLS credentials.

Health checks stay open so orchestrators can probe without the token; reflection and every
`ddtree.v1` method need it.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from services.common.settings import SettingsError

__all__ = ["BearerTokenInterceptor", "server_credentials"]

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        if not token:   # b"" is what a call without the header presents
            raise ValueError("an empty bearer token would admit every call")
        self._expected = token.encode()

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        if hmac.compare_digest(_bearer(details.invocation_metadata), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def _bearer(metadata) -> bytes:
    """The token of the call's one `authorization: Bearer <token>` header (the scheme in any case,
    RFC 7235), else b"" (which no token equals). Two such headers are refused: the last one won,
    so a wrong token before the right one passed."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    if len(values) != 1 or not isinstance(values[0], str):
        return b""
    scheme, _, token = values[0].partition(" ")
    return token.encode() if scheme.lower() == "bearer" and token else b""


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS from PEM files. Checked when the scheduler starts, before it waits for its drafts: a file
    that cannot be read, or is not PEM, fails start-up naming the setting (gRPC itself would only
    fail to bind the port, which points at the wrong thing)."""
    pem = {}
    for setting, path, marker in (("scheduler.tls_cert", cert_file, b"-----BEGIN CERTIFICATE-----"),
                                  ("scheduler.tls_key", key_file, b"PRIVATE KEY-----")):
        try:
            pem[setting] = Path(path).read_bytes()
        except OSError as exc:
            raise SettingsError(f"{setting}: cannot read {path}: {exc.strerror}") from None
        if marker not in pem[setting]:
            raise SettingsError(f"{setting}: {path} is not a PEM {'certificate' if 'cert' in setting else 'private key'}")
    if b"ENCRYPTED" in pem["scheduler.tls_key"]:
        raise SettingsError(f"scheduler.tls_key: {key_file} is encrypted; the server needs the key without a passphrase")
    # A key of another certificate: gRPC would only fail to bind, reported as a port in use. The
    # host OpenSSL's security level is not gRPC's, so it is not applied here (a 1024-bit key serves).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise SettingsError(f"scheduler.tls_key: {key_file} does not go with scheduler.tls_cert {cert_file}") from None
        raise SettingsError(f"scheduler.tls_cert / tls_key: {cert_file} / {key_file} cannot be used: "
                            f"{exc.reason or exc}") from None
    return grpc.ssl_server_credentials([(pem["scheduler.tls_key"], pem["scheduler.tls_cert"])])
