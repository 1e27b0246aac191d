"""The bearer-token check, the internal token's file and the TLS files, without a stack (the
stack's ports, TLS and tokens end to end are in test_security.py)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest

from services.common.auth import (INTERNAL_TOKEN_FILE_ENV, BearerTokenInterceptor, internal_token, server_credentials,
                                  write_internal_token)
from services.common.settings import SettingsError

TOKEN = "s3cret-token"


async def _codes(calls: list[tuple[str, tuple]]) -> list[grpc.StatusCode]:
    """The status of each (method, metadata) call to a server behind the token's check, with one
    unary and one server-streaming method."""
    async def echo(request: bytes, context) -> bytes:
        return request

    async def watch(request: bytes, context):
        yield request
        yield request

    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TOKEN)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Guarded", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Watch": grpc.unary_stream_rpc_method_handler(watch)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method, metadata in calls:
                try:
                    if method.endswith("Watch"):
                        [_ async for _ in channel.unary_stream(method)(b"hi", metadata=metadata, timeout=5)]
                    else:
                        await channel.unary_unary(method)(b"hi", metadata=metadata, timeout=5)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
    finally:
        await server.stop(0)
    return codes


def _bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


def test_only_the_exact_token_passes_and_an_unknown_method_is_refused_without_it() -> None:
    """A token that the expected one starts, or that starts it, is another token. Without the
    token a method the server lacks is UNAUTHENTICATED (not a crash in the interceptor, and not a
    map of the methods that exist); with it, UNIMPLEMENTED."""
    others = (TOKEN + "x", TOKEN[:-1], TOKEN[:3], TOKEN + TOKEN)
    calls = [(m, _bearer(TOKEN)) for m in ("/test.Guarded/Echo", "/test.Guarded/Watch")]
    calls += [(m, _bearer(t)) for m in ("/test.Guarded/Echo", "/test.Guarded/Watch") for t in others]
    calls += [("/test.Guarded/Nope", ()), ("/test.Guarded/Nope", _bearer(TOKEN))]
    codes = asyncio.run(_codes(calls))
    assert codes == ([grpc.StatusCode.OK] * 2 + [grpc.StatusCode.UNAUTHENTICATED] * 2 * len(others)
                     + [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED])


def test_an_internal_token_files_errors_name_the_file_variable_and_its_path(tmp_path: Path) -> None:
    """The operator set DDTREE_INTERNAL_TOKEN_FILE: its errors point there, not at
    DDTREE_INTERNAL_TOKEN (which they did not set)."""
    secret = tmp_path / "token"
    for content, needle in ((b"\n", "empty"), (b"\xff", "not ASCII"), (b"two words\n", "printable ASCII")):
        secret.write_bytes(content)
        with pytest.raises(SettingsError, match=needle) as info:
            internal_token({INTERNAL_TOKEN_FILE_ENV: str(secret)})
        assert str(info.value).startswith(f"{INTERNAL_TOKEN_FILE_ENV} ({secret})"), str(info.value)


def test_make_token_says_whether_it_wrote_and_writes_beside_the_token_not_in_the_temp_dir(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    """`ddtree make-token` says "wrote a new" or "kept the" token from the return value. Compose's
    token volume is a filesystem of its own, and a hard link cannot cross filesystems: the token is
    written beside its path (here a link across folders fails as it would across filesystems)."""
    volume, elsewhere = tmp_path / "volume", tmp_path / "tmp"
    volume.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    link = os.link

    def one_filesystem_a_folder(src, dst) -> None:
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        link(src, dst)

    monkeypatch.setattr(os, "link", one_filesystem_a_folder)
    path = volume / "token"
    assert write_internal_token(path) is True
    first = path.read_text()
    assert len(first.strip()) >= 32
    assert write_internal_token(path) is False and path.read_text() == first
    assert [p.name for p in volume.iterdir()] == ["token"] and list(elsewhere.iterdir()) == []


def test_a_tls_key_that_is_not_pem_names_the_key_setting(tmp_path: Path) -> None:
    """A good certificate beside a junk key: the error names scheduler.tls_key alone, not both files."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server_credentials(str(cert), str(key))   # the pair itself serves
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    with pytest.raises(SettingsError, match=r"^scheduler\.tls_key: .*junk\.key is not a PEM private key$"):
        server_credentials(str(cert), str(junk))
