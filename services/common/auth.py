"""Guarding the ports: bearer tokens checked on every call, and the public port's TLS credentials.

The public port (scheduler) takes the optional `scheduler.auth_token`. The internal ports (draft,
verifier) take the internal token, one value shared by the three services through
``DDTREE_INTERNAL_TOKEN`` (or a file named by ``DDTREE_INTERNAL_TOKEN_FILE``): the scheduler and the
drafts present it, drafts and verifiers ask for it. Without it anyone who reaches an internal port
can hand-shake, hold KV pages and make a service map its rings. `ddtree up` makes one per launch.
Health checks stay open so orchestrators can probe without a token; reflection and every
`ddtree.v1` method need it.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import ssl
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import grpc

from services.common.settings import SettingsError

__all__ = ["BearerTokenInterceptor", "server_credentials", "internal_token", "internal_interceptors",
           "token_metadata", "write_internal_token", "INTERNAL_TOKEN_ENV", "INTERNAL_TOKEN_FILE_ENV"]

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

INTERNAL_TOKEN_ENV = "DDTREE_INTERNAL_TOKEN"
INTERNAL_TOKEN_FILE_ENV = "DDTREE_INTERNAL_TOKEN_FILE"
# What a gRPC metadata value may hold (printable ASCII; no space, which would end the scheme's token).
_TOKEN_TEXT = re.compile(r"[!-~]+")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED."""

    def __init__(self, token: str, refusal: str = "missing or wrong bearer token",
                 on_refused: Callable[[], None] | None = None) -> None:
        if not token:   # b"" is what a call without the header presents
            raise ValueError("an empty bearer token would admit every call")
        self._expected = token.encode()

        async def deny(requests, context: grpc.aio.ServicerContext):
            if on_refused is not None:   # refused before any handler: else no count and no log of it
                on_refused()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        # Refused as the headers arrive: handlers that take a request stream run before any message
        # is read. A unary one runs only once the whole request is in, so a client without the
        # token could hold up to the message cap of the server's memory a call by never finishing
        # its message (hundreds of MB with a few dozen calls).
        self._deny_unary = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)

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


def internal_token(env: Mapping[str, str] | None = None) -> str:
    """The internal token from ``DDTREE_INTERNAL_TOKEN`` or the file ``DDTREE_INTERNAL_TOKEN_FILE``
    names (a compose secret), or "" where neither is set (internal ports then check nothing). Read
    once at start-up: a file that cannot be read, an empty one, both variables, or a value gRPC
    metadata cannot carry fail the start naming the variable (never repeating the value)."""
    environ = os.environ if env is None else env
    token, path = environ.get(INTERNAL_TOKEN_ENV, ""), environ.get(INTERNAL_TOKEN_FILE_ENV, "")
    if token and path:
        raise SettingsError(f"{INTERNAL_TOKEN_ENV} and {INTERNAL_TOKEN_FILE_ENV} are both set; set one")
    source = INTERNAL_TOKEN_ENV
    if path:
        source = f"{INTERNAL_TOKEN_FILE_ENV} ({path})"
        try:
            token = Path(path).read_text(encoding="ascii").strip()
        except OSError as exc:
            raise SettingsError(f"{INTERNAL_TOKEN_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise SettingsError(f"{source}: the token is not ASCII text") from None
        if not token:
            raise SettingsError(f"{source}: the file is empty")
    if token and not _TOKEN_TEXT.fullmatch(token):
        raise SettingsError(f"{source}: the token must be printable ASCII without spaces")
    return token


def write_internal_token(path: str | Path) -> bool:
    """Writes a new internal token to ``path`` (owner-only) unless the file exists; True if it wrote.
    Kept when present, so a service restarted later reads the token its peers hold (compose runs
    this once before the services, into a volume they share). The token is written whole to a
    file of its own, then linked to ``path`` (which fails where ``path`` exists): a reader, or a
    second maker, never sees an empty or partial file, and a maker killed part-way leaves none."""
    path = Path(path)
    if path.is_dir():
        raise SettingsError(f"{path} is a directory: give the token file's path (e.g. {path / 'token'})")
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")   # owner-only
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            try:   # one that cannot be used fails here, not in three services
                internal_token({INTERNAL_TOKEN_FILE_ENV: str(path)})
            except SettingsError as exc:
                raise SettingsError(f"{exc}; remove it for a new one (compose: `docker compose down`, then "
                                    "`docker volume rm ddtree_internal-token`)") from None
            return False
    finally:
        os.unlink(temp)
    return True


def internal_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """A draft's or verifier's interceptors: the internal token's check, where one is set."""
    if not token:
        return []
    return [BearerTokenInterceptor(token, refusal=f"missing or wrong internal token: this is a draft or verifier "
                                                  f"port, which only the stack's own services call (clients call the "
                                                  f"scheduler); the scheduler, draft and verifier need the same "
                                                  f"{INTERNAL_TOKEN_ENV}")]


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a call to an internal port carries: the token, where one is set."""
    return (("authorization", f"Bearer {token}"),) if token else ()


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
