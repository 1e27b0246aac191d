"""The public port: bearer token on every call, TLS from a configured certificate and key."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.launcher import Stack, StackSpec
from services.scheduler.client import Client, ClientError
from tests.stack_fixtures import build_checkpoint

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    ckpt = build_checkpoint(root)
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    # TLS from the config file (`ddtree up --config`): the launcher's health check must find the
    # certificate there, as the scheduler does (it used to look in the environment only, and waited
    # out its start-up timeout against a TLS-only port).
    config = root / "ddtree.toml"
    config.write_text(f'[scheduler]\ntls_cert = "{cert}"\ntls_key = "{key}"\n')
    spec = StackSpec(model_path=str(ckpt), scheduler_port=0, config_path=str(config),
                     extra_env={"DDTREE_SCHEDULER_AUTH_TOKEN": TOKEN}, startup_timeout_s=60)
    with Stack(spec) as stack:
        stack.config = config
        yield stack, cert


def test_good_call_succeeds(tls_stack):
    stack, cert = tls_stack
    with Client(stack.scheduler_address, tls_ca=str(cert), token=TOKEN) as c:
        out = c.generate("def f(x):", max_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated(tls_stack, token):
    stack, cert = tls_stack
    with Client(stack.scheduler_address, tls_ca=str(cert), token=token) as c:
        with pytest.raises(ClientError) as info:
            c.generate("def f(x):", max_tokens=5)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(ClientError) as info:
            c.model_info()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_to_tls_port_fails(tls_stack):
    stack, _ = tls_stack
    with Client(stack.scheduler_address, token=TOKEN, timeout_s=5) as c:
        with pytest.raises(ClientError) as info:
            c.generate("def f(x):", max_tokens=5)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_health_is_open_without_token(tls_stack):
    stack, cert = tls_stack
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(stack.scheduler_address, creds) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_container_probe_speaks_tls_to_a_tls_scheduler(tls_stack):
    """Compose's health probe: plaintext gets no answer from the TLS-only port, so with the
    scheduler's certificate in the environment it asks again over TLS."""
    from services import healthcheck

    stack, cert = tls_stack
    port = stack.scheduler_address.rsplit(":", 1)[1]
    assert healthcheck.main(["probe", port], env={}) == 1
    assert healthcheck.main(["probe", port], env={"DDTREE_SCHEDULER_TLS_CERT": str(cert)}) == 0
    assert healthcheck.main(["probe", port], env={"DDTREE_SCHEDULER_TLS_CERT": str(cert),
                                                 "DDTREE_HEALTH_TLS_NAME": "not-in-the-cert"}) == 1
    assert healthcheck.main(["probe", port], env={"DDTREE_SCHEDULER_TLS_CERT": str(cert) + ".missing"}) == 1
    assert healthcheck.main(["probe", port], env={"DDTREE_HEALTH_CONFIG": str(stack.config)}) == 0  # compose's way


def test_the_token_is_read_from_one_authorization_header_with_the_scheme_in_any_case() -> None:
    """Of two headers the last one won, so (wrong, right) passed; `bearer` in lower case (RFC 7235)
    was refused."""
    from services.common.auth import BearerTokenInterceptor, _bearer

    assert _bearer([("authorization", "Bearer s3cret")]) == b"s3cret"
    assert _bearer([("authorization", "bearer s3cret")]) == b"s3cret"
    assert _bearer([("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret")]) == b""
    assert _bearer([("authorization", "Basic s3cret")]) == b""
    assert _bearer([("authorization", "Bearer ")]) == b"" and _bearer([]) == b"" and _bearer(None) == b""
    with pytest.raises(ValueError, match="empty bearer token"):
        BearerTokenInterceptor("")
