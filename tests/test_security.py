"""The public port: bearer token on every call, TLS from a configured certificate and key."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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
                     extra_env={"DDTREE_SCHEDULER_AUTH_TOKEN": TOKEN,   # and a token the launcher makes, whatever this shell sets
                                "DDTREE_INTERNAL_TOKEN": "", "DDTREE_INTERNAL_TOKEN_FILE": ""}, startup_timeout_s=60)
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


def test_reflection_needs_the_token(tls_stack):
    """Only health is open: reflection lists the services and their schemas, so it takes the token."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stack, cert = tls_stack
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    listed = []
    with grpc.secure_channel(stack.scheduler_address, creds) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        for metadata in ((), (("authorization", f"Bearer {TOKEN}"),)):
            ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            try:
                answer = next(stub.ServerReflectionInfo(ask, metadata=metadata, timeout=5))
                listed.append(sorted(s.name for s in answer.list_services_response.service))
            except grpc.RpcError as exc:
                listed.append(exc.code())
    assert listed[0] == grpc.StatusCode.UNAUTHENTICATED
    assert "ddtree.v1.Scheduler" in listed[1]


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


def test_the_internal_ports_take_only_the_stacks_internal_token(tls_stack):
    """`ddtree up` makes one token a launch: its draft and verifier refused everyone else's calls
    (any local user could hand-shake with the verifier, reserve KV through the draft and make
    either map rings); the stack's own services present it (the good call above went through)."""
    from ddtree.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
    from services.common.auth import INTERNAL_TOKEN_ENV, internal_token

    stack, _ = tls_stack
    draft = next(s for s in stack.services if s.role == "draft")
    verifier = next(s for s in stack.services if s.role == "verifier")
    token = internal_token(draft.env)
    assert len(token) >= 32 and all(internal_token(s.env) == token for s in stack.services)
    for metadata in ((), (("authorization", "Bearer not-the-token"),)):
        with grpc.insecure_channel(draft.address) as ch:
            stub = draft_pb2_grpc.DraftStub(ch)
            for call in (lambda: stub.GetModelInfo(common_pb2.GetModelInfoRequest(), metadata=metadata, timeout=5),
                         lambda: list(stub.StepStream(iter([draft_pb2.StepRequest()]), metadata=metadata, timeout=5))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert INTERNAL_TOKEN_ENV in info.value.details() and token not in info.value.details()
        with grpc.insecure_channel(verifier.address) as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            hello = verifier_pb2.HandshakeRequest(draft_id="intruder", transports=["inline"])
            for call in (lambda: stub.Handshake(hello, metadata=metadata, timeout=5),
                         lambda: list(stub.VerifyStream(iter([verifier_pb2.VerifyRequest()]), timeout=5,
                                                        metadata=(("draft-id", "intruder"), *metadata)))):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING   # probes stay open
    with grpc.insecure_channel(draft.address) as ch:
        info = draft_pb2_grpc.DraftStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=5,
                                                         metadata=(("authorization", f"Bearer {token}"),))
    assert info.vocab_size > 0
    # What the scheduler keeps a step's reply under gRPC's message cap by: every feature layer, float32 here.
    drafter = json.loads((Path(stack.spec.model_path) / "drafter" / "config.json").read_text())
    target = json.loads((Path(stack.spec.model_path) / "config.json").read_text())
    assert info.feature_bytes_per_token == len(drafter["dflash_config"]["target_layer_ids"]) * target["hidden_size"] * 4
    assert info.device == "cpu"   # what the verifier runs on, as `ddtree bench --address` records it


def test_the_internal_token_comes_from_one_variable_or_a_file(tmp_path) -> None:
    from services.common.auth import INTERNAL_TOKEN_ENV as VAR
    from services.common.auth import INTERNAL_TOKEN_FILE_ENV as FILE
    from services.common.auth import internal_token, token_metadata
    from services.common.settings import SettingsError

    assert internal_token({}) == "" and token_metadata("") == ()
    assert internal_token({VAR: "abc-123"}) == "abc-123"
    assert token_metadata("abc-123") == (("authorization", "Bearer abc-123"),)
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")   # a compose secret ends in a newline
    assert internal_token({FILE: str(secret)}) == "from-a-file"
    for env, needle in (({VAR: "x", FILE: str(secret)}, "both set"),
                        ({FILE: str(tmp_path / "missing")}, "cannot read"),
                        ({VAR: "two words"}, "printable ASCII"),
                        ({VAR: "naïve"}, "printable ASCII")):
        with pytest.raises(SettingsError, match=needle) as info:
            internal_token(env)
        assert "two words" not in str(info.value) and "naïve" not in str(info.value)
    secret.write_text("  \n")
    with pytest.raises(SettingsError, match="empty"):
        internal_token({FILE: str(secret)})
    secret.write_bytes(b"\xff\xfe")
    with pytest.raises(SettingsError, match="not ASCII"):
        internal_token({FILE: str(secret)})


def test_the_launcher_keeps_a_given_internal_token_and_refuses_an_unreadable_one(tmp_path, monkeypatch) -> None:
    from services.common.auth import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_FILE_ENV
    from services.common.launcher import Stack, StackSpec
    from services.common.settings import SettingsError

    ckpt = build_checkpoint(tmp_path)
    monkeypatch.delenv(INTERNAL_TOKEN_ENV, raising=False)
    monkeypatch.delenv(INTERNAL_TOKEN_FILE_ENV, raising=False)
    fresh = [Stack(StackSpec(model_path=str(ckpt)))._plan() for _ in range(2)]
    tokens = [{s.env[INTERNAL_TOKEN_ENV] for s in plan} for plan in fresh]
    assert all(len(t) == 1 for t in tokens) and tokens[0] != tokens[1]   # shared in a launch, new each launch
    given = Stack(StackSpec(model_path=str(ckpt), extra_env={INTERNAL_TOKEN_ENV: "mine"}))._plan()
    assert {s.env[INTERNAL_TOKEN_ENV] for s in given} == {"mine"}
    empty = Stack(StackSpec(model_path=str(ckpt), extra_env={INTERNAL_TOKEN_ENV: "", INTERNAL_TOKEN_FILE_ENV: ""}))._plan()
    assert len({s.env[INTERNAL_TOKEN_ENV] for s in empty}) == 1 and len(empty[0].env[INTERNAL_TOKEN_ENV]) >= 32
    from_file = Stack(StackSpec(model_path=str(ckpt), extra_env={INTERNAL_TOKEN_FILE_ENV: str(tmp_path / "nope")}))
    assert all(INTERNAL_TOKEN_ENV not in s.env for s in from_file._plan())
    with pytest.raises(SettingsError, match="cannot read"):
        from_file.start()   # before any service starts
    assert all(s.proc is None for s in from_file.services)


def test_a_call_without_the_token_is_refused_before_its_request_arrives(tls_stack):
    """The refusal ran as a unary handler, which gRPC calls only once the whole request is in: a
    client without the token that never finished its message held the call (and up to the message
    cap of the server's memory) until its deadline. It is now refused as the headers arrive."""
    import threading

    stack, cert = tls_stack
    draft = next(s for s in stack.services if s.role == "draft")
    never = threading.Event()

    def unfinished():   # a request stream that sends nothing and never half-closes
        never.wait(30)
        return
        yield

    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    try:
        with grpc.secure_channel(stack.scheduler_address, creds) as public, grpc.insecure_channel(draft.address) as internal:
            for channel, method in ((public, "/ddtree.v1.Scheduler/GetModelInfo"), (public, "/ddtree.v1.Scheduler/Generate"),
                                    (internal, "/ddtree.v1.Draft/GetModelInfo")):
                with pytest.raises(grpc.RpcError) as info:
                    if method.endswith("Generate"):
                        list(channel.stream_stream(method)(unfinished(), timeout=20))
                    else:
                        channel.stream_unary(method)(unfinished(), timeout=20)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method   # not DEADLINE_EXCEEDED
    finally:
        never.set()
