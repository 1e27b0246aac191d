"""`ddtree up` start-up (a busy port, TLS names, the host, the timeout, a signal) and the one-line
errors of `generate`, `bench` and `make-checkpoint`; the README's synopsis of every command's flags."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import cli
from services.common.launcher import Stack, StackSpec, StartupStopped, free_port, wait_healthy
from services.common.settings import SettingsError
from services.scheduler.client import Chunk, ClientError

REPO = Path(__file__).resolve().parent.parent


def _up(*flags: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "up", *flags], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def _health_server(credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, str]:
    """A SERVING grpc.health.v1 server on a free loopback port: "another stack"."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = free_port()
    address = f"127.0.0.1:{port}"
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    server.start()
    return server, address


@pytest.fixture
def alive():
    """A process that stays up (the service under test, as far as wait_healthy can tell)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_up_refuses_a_scheduler_port_that_is_taken() -> None:
    """Another stack on 50051 answered the health probe: `up` said "serving" while its own
    scheduler crash-looped on "Address already in use". Now nothing starts."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = _up("--port", str(port), timeout=30)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "serving" not in out.stderr
    assert "service=verifier" not in out.stdout + out.stderr   # nothing was started


def test_wait_healthy_does_not_take_another_servers_answer_for_ours(alive) -> None:
    """A SERVING answer counts only while the launched process lives on after it: ours dies on the
    busy port a moment after its start, while the other server answers at once."""
    server, address = _health_server()
    try:
        dying = subprocess.Popen(["sh", "-c", "sleep 0.3; exit 2"])
        with pytest.raises(RuntimeError, match=r"scheduler exited with code 2 .*another process holds the port"):
            wait_healthy(address, dying, "scheduler", 10.0)
        wait_healthy(address, alive, "scheduler", 10.0)   # the same answer, from a process that stays up
    finally:
        server.stop(0)


def _cert(tmp_path: Path, name: str) -> tuple[bytes, bytes]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert.read_bytes(), key.read_bytes()


def test_wait_healthy_checks_the_tls_name_given_and_refuses_a_certificate_of_another_name(tmp_path, alive) -> None:
    """A certificate that does not name 127.0.0.1: 120 s of waiting, then "not healthy" without a
    reason; then the reason, but still after the whole timeout and as exit 1 ("may work later").
    Now refused as a setting (exit 2 from `up`) at the first answer that says so. The name comes
    from DDTREE_HEALTH_TLS_NAME (as for the compose probe)."""
    cert, key = _cert(tmp_path, "ddtree.test")
    server, address = _health_server(grpc.ssl_server_credentials([(key, cert)]))
    try:
        started = time.monotonic()
        with pytest.raises(SettingsError) as info:
            wait_healthy(address, alive, "scheduler", 60.0, cert)
        assert time.monotonic() - started < 10
        msg = str(info.value)
        assert msg.startswith(f"scheduler at {address}: its TLS certificate does not name 127.0.0.1 (UNAVAILABLE: "), msg
        assert "DDTREE_HEALTH_TLS_NAME" in msg
        wait_healthy(address, alive, "scheduler", 20.0, cert, tls_name="ddtree.test")
        with pytest.raises(SettingsError, match="does not name other.test"):
            wait_healthy(address, alive, "scheduler", 60.0, cert, tls_name="other.test")
    finally:
        server.stop(0)


def test_a_stop_request_ends_the_wait_and_the_start_up() -> None:
    started = time.monotonic()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(StartupStopped):
            wait_healthy(f"127.0.0.1:{free_port()}", proc, "verifier", 60.0, should_stop=lambda: True)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - started < 5
    stack = Stack(StackSpec(model_path="models/demo", scheduler_port=0))
    with pytest.raises(StartupStopped):
        stack.start(should_stop=lambda: True)
    assert stack.procs == []


def test_a_service_failing_its_start_stops_those_started_before_it() -> None:
    """A draft that fails its start-up after the verifier came up (loaded, serving) ends the
    verifier too: a start that raises leaves no process behind to hold the GPU and the ports."""
    stack = Stack(StackSpec(model_path="models/demo", scheduler_port=0))
    launch, started = stack._launch, []

    def draft_fails(svc, should_stop=None):
        if svc.role == "draft":
            raise RuntimeError("draft exited with code 1 during start-up (see its output)")
        launch(svc, should_stop)
        started.append(svc.proc)
    stack._launch = draft_fails
    with pytest.raises(RuntimeError, match="draft exited with code 1"):
        stack.start()
    assert len(started) == 1 and started[0].poll() is not None   # the verifier was up, and is ended
    assert stack.procs == []


def test_up_startup_timeout_is_honoured_and_names_the_last_answer() -> None:
    out = _up("--startup-timeout", "0", timeout=30)
    assert out.returncode == 2 and "--startup-timeout 0: must be > 0" in out.stderr, out.stderr
    # The verifier needs seconds to import and load: half a second runs out, with the reason.
    out = _up("--port", "0", "--startup-timeout", "0.5", timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "ddtree up: verifier at 127.0.0.1:" in out.stderr
    assert "not healthy after 0.5 s (last answer: UNAVAILABLE" in out.stderr


def test_up_serves_tls_on_its_host_with_the_health_tls_name(tmp_path) -> None:
    """A config file written for containers (host 0.0.0.0) and a certificate that does not name
    127.0.0.1: `up` keeps the scheduler on --host (loopback by default), finds it healthy through
    DDTREE_HEALTH_TLS_NAME, prints the address it serves, and stops on SIGTERM."""
    cert, key = _cert(tmp_path, "ddtree.test")
    config = tmp_path / "ddtree.toml"
    config.write_text(f'[scheduler]\nhost = "0.0.0.0"\ntls_cert = "{tmp_path / "cert.pem"}"\n'
                      f'tls_key = "{tmp_path / "key.pem"}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--config", str(config),
                             "--startup-timeout", "90"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "DDTREE_HEALTH_TLS_NAME": "ddtree.test"})
    lines = _lines(proc)
    try:
        seen = _wait_for(lines, "ddtree up: serving", 120)
        assert "ddtree up: serving models/demo at 127.0.0.1:" in seen[-1], seen[-1]
        assert "--address 127.0.0.1:" in seen[-1]   # not the default port: the hint says where
        assert "--tls-server-name ddtree.test" in seen[-1]   # and the name its certificate has
        hint = seen[-1].split(" generate ", 1)[1].split("); Ctrl-C stops")[0]   # the line it says to try works
        tried = subprocess.run([sys.executable, "-m", "services.cli", "generate", *shlex.split(hint), "--max-tokens", "4"],
                               cwd=REPO, capture_output=True, text=True, timeout=60)
        assert tried.returncode == 0, tried.stderr[-2000:]
        scheduler = [ln for ln in seen if "service=scheduler" in ln and "serving" in ln]
        assert scheduler and "address=127.0.0.1:" in scheduler[-1], seen[-5:]   # not 0.0.0.0 from the file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        while (line := lines.get(timeout=5)) is not None:
            seen.append(line)
        assert seen[-1].strip() == "ddtree up: stopped (SIGTERM)", seen[-3:]   # the whole stack, said last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_ctrl_c_ends_the_schedulers_wait_for_running_requests() -> None:
    """The first Ctrl-C lets running requests finish (up to scheduler.stop_grace_s, 60 s here);
    a second one ends them now. It reached only the launcher, which did not pass it on: `up`
    waited for the request to finish by itself."""
    from services.scheduler.client import Client

    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "DDTREE_SCHEDULER_STOP_GRACE_S": "60"})
    lines = _lines(proc)
    got: list[str] = []
    try:
        seen = _wait_for(lines, "ddtree up: serving", 120)
        address = seen[-1].split("--address ")[1].split()[0]
        with Client(address) as client:
            running = threading.Event()

            def long_request() -> None:
                try:
                    for _ in client.stream("import os", max_tokens=4000, ignore_eos=True):
                        running.set()
                    got.append("finished")
                except ClientError as exc:
                    got.append(f"{exc.code.name}: {exc.message}")
            runner = threading.Thread(target=long_request)
            runner.start()
            assert running.wait(30)
            proc.send_signal(signal.SIGINT)
            _wait_for(lines, "service=scheduler signal=SIGTERM", 30)   # draining
            proc.send_signal(signal.SIGINT)
            second = time.monotonic()
            assert proc.wait(timeout=60) == 0
            runner.join(30)
        assert time.monotonic() - second < 15   # not the request's own end, nor the 60 s grace
        assert len(got) == 1 and got[0].startswith("UNAVAILABLE: the scheduler stopped"), got
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_signal_during_start_up_stops_the_stack_at_once() -> None:
    """Ctrl-C used to wait until every service was healthy, then exited 0."""
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _lines(proc)
    try:
        seen = _wait_for(lines, "service=verifier", 60)   # the verifier is loading: start-up is under way
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 130   # as a shell reports Ctrl-C: not a stack that served
        while (line := lines.get(timeout=5)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "ddtree up: stopped during start-up" in "".join(seen)
    assert not any(line.startswith("ddtree up: serving") for line in seen)


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """`proc`'s output lines as they come (None at its end)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue, needle: str, timeout_s: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} in the output:\n{''.join(seen[-30:])}")


class _FakeClient:
    """Client's place in `ddtree generate` / `ddtree bench`: streams the given chunks."""

    chunks: list[Chunk] = []
    error: ClientError | None = None

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def stream(self, prompt, **kwargs):
        yield from self.chunks

    def model_info(self):
        raise self.error


def _chunk(ids: list[int], text: str) -> Chunk:
    return Chunk(request_id="r", token_ids=ids, text=text, acceptance_lengths=[], finish_reason=None)


def test_generate_prints_token_ids_where_the_server_sends_no_text(monkeypatch, capsys) -> None:
    """A scheduler without a tokenizer streams ids only: the output was an empty line."""
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], ""), _chunk([6, 7], "")])
    assert cli.main(["generate", "--prompt", "1,2,3", "--token-ids"]) == 0
    assert capsys.readouterr().out == "5,6,7\n"
    # Text held back for a moment (a partial character) is text, not ids.
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], ""), _chunk([6], "é"), _chunk([7], "")])
    assert cli.main(["generate", "--prompt", "1,2,3", "--token-ids"]) == 0
    assert capsys.readouterr().out == "é\n"
    # Stop strings need a tokenizer: with one, empty text is the output, not the ids.
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([625], ""), Chunk("r", [263], "", [1], "stop")])
    assert cli.main(["generate", "--prompt", "1,2,3", "--token-ids", "--stop", " pass"]) == 0
    assert capsys.readouterr().out == "\n"


def test_generate_into_a_closed_pipe_ends_quietly(monkeypatch, capsys) -> None:
    """`ddtree generate ... | head -c 5` printed a BrokenPipeError traceback."""
    import io
    import os

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return self.fd
    out = Closed()
    read, out.fd = os.pipe()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], "def"), _chunk([6], " f")])
    try:
        assert cli.main(["generate", "--prompt", "x"]) == 141
    finally:
        os.close(read)
        os.close(out.fd)
    assert capsys.readouterr().err == ""


def test_generate_passes_the_tls_name_and_hints_at_tls_when_nothing_answers(monkeypatch, capsys) -> None:
    seen = {}

    class Unanswered(_FakeClient):
        def __init__(self, *args, **kwargs) -> None:
            seen.update(kwargs)

        def stream(self, prompt, **kwargs):
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            yield

        def model_info(self):
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    monkeypatch.setattr("services.scheduler.client.Client", Unanswered)
    assert cli.main(["generate", "--prompt", "x", "--tls-server-name", "api.example"]) == 1
    assert seen["tls_server_name"] == "api.example"
    assert "does it speak TLS (--tls-ca FILE)?" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "x", "--tls-ca", "ca.pem"]) == 1
    assert "does it speak TLS" not in capsys.readouterr().err   # over TLS already: no such hint


def test_generate_hints_only_where_no_scheduler_answers_and_hides_a_stop_id(monkeypatch, capsys) -> None:
    """An UNAVAILABLE the scheduler sent itself (a draft replica died) read as "no scheduler
    answered"; a stop or end-of-sequence id was printed as if it were the output."""
    class DraftDied(_FakeClient):
        def stream(self, prompt, **kwargs):
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "draft replica 127.0.0.1:5 failed: Socket closed")
            yield

        def model_info(self):
            return object()   # the scheduler itself answers
    monkeypatch.setattr("services.scheduler.client.Client", DraftDied)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "draft replica 127.0.0.1:5 failed" in err and "no scheduler answered" not in err
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    stop = Chunk(request_id="r", token_ids=[338], text="", acceptance_lengths=[], finish_reason="stop")
    monkeypatch.setattr(_FakeClient, "chunks", [stop])
    assert cli.main(["generate", "--prompt", "x"]) == 0
    assert capsys.readouterr().out == "\n"
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], ""), Chunk("r", [6, 0], "", [2], "stop")])
    assert cli.main(["generate", "--prompt", "1,2", "--token-ids"]) == 0
    assert capsys.readouterr().out == "5,6\n"


def test_generate_refuses_a_flag_it_cannot_use_with_status_2_naming_the_flag(capsys, tmp_path) -> None:
    """These exited 1, as a failed call does, naming the SDK's argument (timeout_s) and not the
    flag; an address gRPC cannot dial read as "is it running?"."""
    for argv, needle in ((["--timeout", "0"], "--timeout: timeout_s must be a positive number"),
                         (["--timeout", "-1"], "--timeout: timeout_s"),
                         (["--timeout", "0"], "or left out (no deadline), not 0.0"),   # no None to give a flag
                         (["--temperature", "1e-50"], "--temperature: temperature = 1e-50 is sent as a float32"),
                         (["--max-tokens", "5000000000"], "--max-tokens: cannot send this request (max_tokens)"),
                         (["--tls-ca", str(tmp_path / "none.pem")], "--tls-ca: tls_ca: cannot read"),
                         (["--tls-server-name", "api.example"], "--tls-server-name: tls_server_name"),
                         (["--token", "é"], "--token: token must be text of printable ASCII"),
                         (["--address", "http://127.0.0.1:1"], "--address takes HOST:PORT, not a URL"),
                         (["--address", "localhost"], "--address must be HOST:PORT"),
                         (["--address", "host:port"], "--address must be HOST:PORT")):
        assert cli.main(["generate", "--prompt", "x", "--address", "127.0.0.1:1", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "is it running" not in err, (argv, err)
    for address in ("[::1]:1", "unix:/tmp/none.sock", "dns:///127.0.0.1:1"):   # gRPC targets: dialled (nothing there)
        assert cli.main(["generate", "--prompt", "x", "--address", address, "--timeout", "2"]) == 1, address
        capsys.readouterr()


def test_generate_exits_2_for_the_servers_refusal_and_1_for_a_failure(monkeypatch, capsys) -> None:
    """A request refused as given is not worth a retry; a failed call may work later."""
    def failing(code: grpc.StatusCode, message: str, retryable: bool | None):
        class Refused(_FakeClient):
            def stream(self, prompt, **kwargs):
                raise ClientError(code, message, retryable)
                yield

            def model_info(self):
                return object()
        return Refused
    for code, retryable, status in (
            (grpc.StatusCode.INVALID_ARGUMENT, None, 2), (grpc.StatusCode.OUT_OF_RANGE, None, 2),
            (grpc.StatusCode.FAILED_PRECONDITION, None, 2), (grpc.StatusCode.UNAUTHENTICATED, None, 2),
            (grpc.StatusCode.RESOURCE_EXHAUSTED, True, 1),    # a full queue, as the scheduler says it
            (grpc.StatusCode.RESOURCE_EXHAUSTED, None, 2),    # gRPC's own: over its message size
            (grpc.StatusCode.UNAVAILABLE, None, 1), (grpc.StatusCode.UNAVAILABLE, False, 2),
            (grpc.StatusCode.DEADLINE_EXCEEDED, None, 1), (grpc.StatusCode.INTERNAL, None, 1)):
        monkeypatch.setattr("services.scheduler.client.Client", failing(code, "budget must be in 1..128", retryable))
        assert cli.main(["generate", "--prompt", "x", "--budget", "200"]) == status, code
        assert f"{code.name}: budget must be in 1..128" in capsys.readouterr().err


def test_generate_interrupted_prints_the_token_ids_received(monkeypatch, capsys) -> None:
    """Ctrl-C threw the ids away (an error printed them): the output so far is the ids so far."""
    class Interrupted(_FakeClient):
        def stream(self, prompt, **kwargs):
            yield _chunk([5], "")
            yield _chunk([6, 7], "")
            raise KeyboardInterrupt
    monkeypatch.setattr("services.scheduler.client.Client", Interrupted)
    assert cli.main(["generate", "--prompt", "1,2", "--token-ids"]) == 130
    out = capsys.readouterr()
    assert out.out == "5,6,7\n" and "interrupted" in out.err


def test_generate_hints_at_the_tls_set_up_or_the_host_from_the_failure(monkeypatch, capsys) -> None:
    """A handshake that failed, or a host not found, said "is it running (ddtree up)?"."""
    def unanswered(details: str):
        class Unanswered(_FakeClient):
            def stream(self, prompt, **kwargs):
                raise ClientError(grpc.StatusCode.UNAVAILABLE, details)
                yield

            def model_info(self):
                raise ClientError(grpc.StatusCode.UNAVAILABLE, details)
        return Unanswered
    cases = ((["--tls-ca", "ca.pem"], "failed to connect: Ssl handshake failed: CERTIFICATE_VERIFY_FAILED",
              "the TLS handshake failed: does --tls-ca hold the CA"),
             (["--tls-ca", "ca.pem"], "Hostname Verification Check failed", "else --tls-server-name NAME"),
             (["--address", "nosuchhost.invalid:5"], "DNS resolution failed for nosuchhost.invalid:5",
              "the host of --address nosuchhost.invalid:5 was not found"),
             ([], "failed to connect to all addresses; last error: Connection refused",
              "no scheduler answered at 127.0.0.1:50051 in plaintext: is it running (ddtree up)"))
    for argv, details, hint in cases:
        monkeypatch.setattr("services.scheduler.client.Client", unanswered(details))
        assert cli.main(["generate", "--prompt", "x", *argv]) == 1
        err = capsys.readouterr().err
        assert hint in err, (details, err)
        assert ("is it running" in err) == (not argv), err


def test_up_checks_files_and_ports_of_every_service_before_starting_any(tmp_path) -> None:
    """A scheduler's TLS file it cannot read, or a metrics port in use, failed start-up only once
    the scheduler started, after the verifier had loaded; a drafter directory without a checkpoint,
    once the draft did."""
    config = tmp_path / "c.toml"
    config.write_text(f'[scheduler]\ntls_cert = "{tmp_path}/nope.pem"\ntls_key = "{tmp_path}/nope.key"\n')
    tls = _up("--port", "0", "--config", str(config), timeout=30)
    assert tls.returncode == 2 and "scheduler.tls_cert: cannot read" in tls.stderr, tls.stderr[-2000:]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        metrics = _up("--port", "0", env={"DDTREE_VERIFIER_METRICS_PORT": str(held.getsockname()[1])}, timeout=30)
    assert metrics.returncode == 2 and "verifier.metrics_port: cannot listen" in metrics.stderr, metrics.stderr[-2000:]
    drafter = _up("--port", "0", "--drafter", str(tmp_path), timeout=30)
    assert drafter.returncode == 2 and f"no drafter checkpoint at {tmp_path}" in drafter.stderr, drafter.stderr[-2000:]
    # A tokenizer.json that does not parse: the scheduler said so once the verifier and the draft
    # had loaded (minutes on a large model).
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "drafter"):
        (model / name).symlink_to((Path(REPO) / "models" / "demo" / name).resolve())
    (model / "tokenizer.json").write_text('{"model": {')
    broken = _up("--port", "0", "--model", str(model), timeout=30)
    assert broken.returncode == 2 and f"scheduler.tokenizer_path: {model}/tokenizer.json is not a tokenizer" in \
        broken.stderr, broken.stderr[-2000:]
    assert "weights_loaded" not in broken.stdout + broken.stderr   # nothing started
    for run in (tls, metrics, drafter):
        assert "service=verifier" not in run.stdout + run.stderr   # nothing was started


def test_bench_writes_no_tracked_file_by_default() -> None:
    out = cli.build_parser().parse_args(["bench"]).out
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", out], cwd=REPO, capture_output=True)
    if tracked.returncode != 0 and b"not a git repository" in tracked.stderr:
        pytest.skip("no git checkout")
    assert tracked.returncode != 0, f"the default --out {out} is a committed file"


def test_bench_mistakes_are_one_line(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(signal, "signal", lambda *args: None)   # keep pytest's handlers
    monkeypatch.setattr(cli, "_copy_gbps", lambda: None)
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "error", ClientError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    out = str(tmp_path / "m.json")
    assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", out]) == 1
    assert capsys.readouterr().err == ("ddtree bench: 127.0.0.1:1: DEADLINE_EXCEEDED: no scheduler answered within "
                                       "30 s (is it running? does it speak TLS: --tls-ca FILE?)\n")
    assert cli.main(["bench", "--spawn-stack", str(tmp_path / "nope"), "--out", out]) == 2   # no checkpoint
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"ddtree bench: {tmp_path / 'nope'}") and "No such file" in err[-1], err
    monkeypatch.setenv("DDTREE_SCHEDULER_DEFAULT_BUDGET", "0")   # refused before any service starts
    assert cli.main(["bench", "--spawn-stack", "models/demo", "--out", out]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("ddtree bench: scheduler.default_budget")
    # Values that ran a matrix of errors or of nothing (0 clients: every cell "ok" at 0 tok/s).
    for flags, needle in ((["--concurrency", "0"], "--concurrency [0]: must be >= 1 each"),
                          (["--contexts", "-5"], "--contexts [-5]: prompt lengths must be >= 1"),
                          (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
                          (["--cell-timeout", "-1"], "--cell-timeout -1: must be > 0 seconds"),
                          (["--budgets", "8", "200"], "--budgets [8, 200]: must be in 1..128 (autoregressive cells run anyway)"),
                          # 0 reached the draft's warm-up (refused there) or recorded no budget
                          (["--budgets", "0"], "--budgets [0]: must be in 1..128 (autoregressive cells run anyway)"),
                          (["--draft-replicas", "0"], "--draft-replicas 0: must be >= 1"),
                          # ids are drawn from [2, vocab_high): an empty range divided by zero once the stack ran
                          (["--vocab-high", "2"], "--vocab-high 2: must be > 2 (ids are drawn from 2 up to it)"),
                          (["--draft-replicas", "2"], "--draft-replicas 2: only with --spawn-stack (a running stack "
                                                      "has its own)"),
                          (["--out", str(tmp_path)], f"--out {tmp_path}: is a directory; name the result file")):
        assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", out, *flags]) == 2
        assert capsys.readouterr().err == f"ddtree bench: {needle}\n"
    (tmp_path / "a-file").write_text("")
    assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", str(tmp_path / "a-file" / "sub" / "m.json")]) == 2
    assert f"{tmp_path / 'a-file'} is no directory this process can write in" in capsys.readouterr().err
    # A prompt file it cannot use: one line before anything starts (a traceback once the stack was up).
    for text, needle in (("not json", "JSONDecodeError"), ("{}", "KeyError"), ('{"prompts": []}', "no token ids"),
                         ('{"prompts": [{"ids": ["a"]}]}', "ValueError")):
        (tmp_path / "p.json").write_text(text)
        assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", out, "--prompt-file",
                         str(tmp_path / "p.json")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"ddtree bench: --prompt-file {tmp_path / 'p.json'}: ") \
            and needle in err, err


def test_make_checkpoint_says_what_is_wrong_in_one_line_and_leaves_nothing_half_made(capsys, tmp_path,
                                                                                     monkeypatch) -> None:
    assert cli.main(["make-checkpoint", str(tmp_path / "ckpt"), "--vocab-size", "10"]) == 2
    err = capsys.readouterr().err
    assert err == "ddtree make-checkpoint: vocab_size must be >= 258 (byte alphabet + special tokens), got 10\n"
    assert not (tmp_path / "ckpt").exists()   # an empty directory was left behind
    # An absurd vocabulary: refused at once, not a raw allocator traceback minutes in.
    assert cli.main(["make-checkpoint", str(tmp_path / "ckpt"), "--vocab-size", "99999999"]) == 2
    assert capsys.readouterr().err == (f"ddtree make-checkpoint: --vocab-size 99999999: at most {cli.MAX_RANDOM_VOCAB} "
                                       "for a small random checkpoint\n")
    # A failure after the tokenizer was written takes the directory it made with it, and is raised
    # as it is where it is no refusal (a bug); a directory that was there is left alone.
    from services.verifier import make_target

    def fails(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
    monkeypatch.setattr(make_target, "write_random_target", fails)
    monkeypatch.setattr("services.common.make_checkpoint.write_random_target", fails)
    with pytest.raises(RuntimeError, match="allocate"):
        cli.main(["make-checkpoint", str(tmp_path / "ckpt")])
    assert not (tmp_path / "ckpt").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(RuntimeError, match="allocate"):
        cli.main(["make-checkpoint", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_make_checkpoint_keeps_a_checkpoint_already_there_unless_forced(capsys, tmp_path) -> None:
    """`make-checkpoint models/demo` replaced the trained demo pair with random weights, exit 0."""
    ckpt = tmp_path / "ckpt"
    assert cli.main(["make-checkpoint", str(ckpt), "--seed", "1"]) == 0
    weights = (ckpt / "model.safetensors").read_bytes()
    assert cli.main(["make-checkpoint", str(ckpt), "--seed", "2"]) == 2
    assert "already holds a checkpoint; --force replaces it" in capsys.readouterr().err
    assert (ckpt / "model.safetensors").read_bytes() == weights
    assert cli.main(["make-checkpoint", str(ckpt), "--seed", "2", "--force"]) == 0
    assert (ckpt / "model.safetensors").read_bytes() != weights


def test_up_refuses_a_tp_out_of_range_by_its_flag(capsys) -> None:
    """`--tp 9` failed in the verifier's settings as `verifier.tp`, a name the command line never used."""
    for tp in ("9", "-1"):
        assert cli.main(["up", "--tp", tp]) == 2
        assert f"--tp {tp}: must be 1..8 (or 0: the config's)" in capsys.readouterr().err


def test_up_passes_on_a_services_refusal_of_its_checkpoint_as_status_2(tmp_path) -> None:
    """A verifier that refused its checkpoint (exit 2: fix it) made `ddtree up` exit 1, as a
    crash does (try again)."""
    from safetensors.torch import load_file, save_file

    from services.common.make_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "ckpt", vocab_size=512, seed=0)
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)
    save_file(tensors, str(file), metadata={"format": "pt"})
    out = _up("--model", str(ckpt), "--port", "0", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "verifier exited with code 2 during start-up" in out.stderr
    assert "model.embed_tokens.weight is int32; expected" in out.stderr


def test_up_refuses_a_drafter_that_does_not_fit_its_target_before_anything_starts(tmp_path) -> None:
    """The draft found it, after the verifier had loaded and warmed up the target (minutes on a
    large model)."""
    import json

    from services.common.checkpoint import load_tensors, save_tensors
    from services.common.make_checkpoint import make_random_checkpoint

    ckpt = make_random_checkpoint(tmp_path / "ckpt", vocab_size=512, seed=0)
    config = json.loads((ckpt / "drafter" / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] * 2
    (ckpt / "drafter" / "config.json").write_text(json.dumps(config))
    t0 = time.monotonic()
    out = _up("--model", str(ckpt), "--port", "0", timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "field 'hidden_size'" in out.stderr and "does not match the target's" in out.stderr
    assert "service=verifier" not in out.stdout + out.stderr and time.monotonic() - t0 < 30   # nothing started
    # A tensor of another shape, its config fitting: found from the file's header, before anything starts.
    config["hidden_size"] //= 2
    (ckpt / "drafter" / "config.json").write_text(json.dumps(config))
    tensors = load_tensors(ckpt / "drafter")
    tensors["norm.weight"] = tensors["norm.weight"][:-1]
    save_tensors(ckpt / "drafter", tensors)
    out = _up("--model", str(ckpt), "--port", "0", timeout=60)
    assert out.returncode == 2 and "drafter weights: tensor 'norm.weight' has shape" in out.stderr, out.stderr[-2000:]
    assert "service=verifier" not in out.stdout + out.stderr


def test_bench_records_what_served_the_run_not_this_machine(monkeypatch, capsys, tmp_path) -> None:
    """`gpu` and `copy_gbps` described the machine the bench ran on: a CPU stack on a GPU host, or a
    server at another address, was written as a run on this host's GPU."""
    import json

    import bench.matrix
    from ddtree.v1 import common_pb2

    served = {"device": "cpu"}

    class Answers(_FakeClient):
        def model_info(self):
            return common_pb2.ModelInfo(vocab_size=4096, max_context=2048, block_size=16, kv_capacity_tokens=65536,
                                        transport="shm", tp_size=2, model_type="deepseek_v3", device=served["device"])

    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(cli, "_copy_gbps", lambda: 4312.0)        # this machine has a GPU ...
    monkeypatch.setattr(bench.matrix, "local_gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr("services.scheduler.client.Client", Answers)
    monkeypatch.setattr(bench.matrix, "run_matrix", lambda params, on_row=None: [])
    out = tmp_path / "m.json"
    for device, gpu, copy in (("cpu", "cpu", None), ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3", None),
                              ("NVIDIA H200", "NVIDIA H200", 4312.0), ("", "unknown", None)):
        served["device"] = device
        assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", str(out), "--contexts", "60",
                         "--concurrency", "1", "--budgets", "8", "--max-tokens", "8"]) == 0
        doc = json.loads(out.read_text())
        assert (doc["gpu"], doc["copy_gbps"]) == (gpu, copy), device
        assert doc["params"]["model_info"]["tp_size"] == 2 and doc["params"]["model_info"]["model_type"] == "deepseek_v3"
    capsys.readouterr()


def test_generate_says_an_aborted_request_and_a_json_run_that_was_answered(monkeypatch, capsys) -> None:
    """An Abort by another caller cut the output and exited 0; with --json a scheduler that had
    streamed and then went away was reported as "no scheduler answered"."""
    import json

    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], "de"), Chunk("r", [6], "f", [], "aborted")])
    assert cli.main(["generate", "--prompt", "x"]) == 1
    got = capsys.readouterr()
    assert got.out == "def\n" and "the request was aborted" in got.err

    class GoneAfterAChunk(_FakeClient):
        def stream(self, prompt, **kwargs):
            yield _chunk([5], "de")
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    monkeypatch.setattr("services.scheduler.client.Client", GoneAfterAChunk)
    monkeypatch.setattr(cli, "_answers", lambda args: False)
    assert cli.main(["generate", "--prompt", "x", "--json"]) == 1
    got = capsys.readouterr()
    assert "no scheduler answered" not in got.err
    # The JSON object still comes, with the output before the failure and the error: a caller
    # parsing stdout got nothing at all.
    doc = json.loads(got.out)
    assert (doc["text"], doc["token_ids"], doc["finish_reason"]) == ("de", [5], None)
    assert doc["error"] == {"code": "UNAVAILABLE", "message": "Socket closed", "retryable": True}

    class InterruptedAfterAChunk(_FakeClient):
        def stream(self, prompt, **kwargs):
            yield _chunk([5], "de")
            raise KeyboardInterrupt

    monkeypatch.setattr("services.scheduler.client.Client", InterruptedAfterAChunk)
    assert cli.main(["generate", "--prompt", "x", "--json"]) == 130
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"] == "de" and doc["error"] == {"code": "CANCELLED", "message": "interrupted", "retryable": False}
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "chunks", [_chunk([5], "de"), Chunk("r", [6], "f", [], "length")])
    assert cli.main(["generate", "--prompt", "x", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"] == "def" and doc["finish_reason"] == "length" and "error" not in doc


def test_generate_json_has_every_field_and_says_whether_an_error_is_retryable(monkeypatch, capsys) -> None:
    """The object a script parses: each field from the stream, the usage of the last chunk, and an
    error a retry cannot mend said so (a client retrying on `retryable` alone)."""
    import json

    from services.scheduler.client import Usage

    class Refused(_FakeClient):
        def stream(self, prompt, **kwargs):
            yield Chunk("req-1", [5, 6], "de", [2], None)
            raise ClientError(grpc.StatusCode.RESOURCE_EXHAUSTED, "message too large", retryable=False)

    monkeypatch.setattr("services.scheduler.client.Client", Refused)
    assert cli.main(["generate", "--prompt", "x", "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {
        "request_id": "req-1", "text": "de", "token_ids": [5, 6], "acceptance_lengths": [2], "mean_acceptance": 2.0,
        "finish_reason": None, "usage": None,
        "error": {"code": "RESOURCE_EXHAUSTED", "message": "message too large", "retryable": False}}
    usage = Usage(prompt_tokens=3, completion_tokens=3, steps=2, mean_acceptance=1.5, tree_steps=1)
    monkeypatch.setattr("services.scheduler.client.Client", _FakeClient)
    monkeypatch.setattr(_FakeClient, "chunks", [Chunk("req-2", [5], "d", [1], None),
                                                Chunk("req-2", [6, 7], "ef", [2], "length", usage)])
    assert cli.main(["generate", "--prompt", "x", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "request_id": "req-2", "text": "def", "token_ids": [5, 6, 7], "acceptance_lengths": [1, 2],
        "mean_acceptance": 1.5, "finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "steps": 2, "mean_acceptance": 1.5, "tree_steps": 1}}


def test_bench_says_when_its_prompts_are_synthetic_token_ids(monkeypatch, capsys, tmp_path) -> None:
    """Against a running stack without --prompt-file the prompts are random ids, which a trained
    drafter accepts little of: a walkthrough read the result as the drafter's acceptance."""
    import json

    import bench.matrix
    from ddtree.v1 import common_pb2

    class Answers(_FakeClient):
        def model_info(self):
            return common_pb2.ModelInfo(vocab_size=4096, max_context=2048, block_size=16, kv_capacity_tokens=65536,
                                        transport="shm")

    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(cli, "_copy_gbps", lambda: None)
    monkeypatch.setattr("services.scheduler.client.Client", Answers)
    monkeypatch.setattr(bench.matrix, "run_matrix", lambda params, on_row=None: [])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [{"ids": list(range(2, 200))}]}))
    for extra, warned in (([], True), (["--prompt-file", str(prompts)], False)):
        assert cli.main(["bench", "--address", "127.0.0.1:1", "--out", str(tmp_path / "m.json"), "--contexts", "60",
                         "--concurrency", "1", "--budgets", "8", "--max-tokens", "8", *extra]) == 0
        assert ("prompts are synthetic token ids (no --prompt-file)" in capsys.readouterr().err) is warned


@pytest.mark.parametrize("code, want", [("FAILED_PRECONDITION", 2), ("INVALID_ARGUMENT", 2), ("UNAVAILABLE", 3),
                                        ("DEADLINE_EXCEEDED", 3)])
def test_serve_exits_2_where_a_peer_refuses_its_settings_and_3_where_none_could_be_used(monkeypatch, capsys, code,
                                                                                         want) -> None:
    """A verifier refusing the draft's handshake (its feature layers, no common transport) is a
    setting to fix: exit 2, which `ddtree up` reports as a refusal (it took 3 as a failure that may
    pass, exit 1). A peer that did not answer is 3."""
    import grpc

    import services.scheduler.server as scheduler_server
    from services.cli import main
    from services.common.grpc_server import ServiceError

    async def refused(settings):
        raise ServiceError(grpc.StatusCode[code], "draft.verifier_address x: refused")
    monkeypatch.setattr(scheduler_server, "serve", refused)
    monkeypatch.setattr("services.common.grpc_server.watch_launcher_during_start_up", lambda: None)
    assert main(["serve", "scheduler"]) == want
    assert f"{code}: draft.verifier_address x: refused" in capsys.readouterr().err


def test_serve_takes_settings_as_flags_over_the_environment_and_the_file(monkeypatch, capsys, tmp_path) -> None:
    """One typed config per service from file + environment + flags: `--set FIELD=VALUE`
    (or `SERVICE.FIELD=VALUE`) wins over both, typed and checked as the environment's text is."""
    import services.scheduler.server as scheduler_server
    from services.cli import main

    seen = []

    async def serve(settings):
        seen.append(settings)
    monkeypatch.setattr(scheduler_server, "serve", serve)
    monkeypatch.setattr("services.common.grpc_server.watch_launcher_during_start_up", lambda: None)
    config = tmp_path / "ddtree.toml"
    config.write_text("[scheduler]\nmax_batch = 8\nmax_queue = 100\n")
    monkeypatch.setenv("DDTREE_SCHEDULER_MAX_BATCH", "16")
    monkeypatch.setenv("DDTREE_SCHEDULER_DEFAULT_BUDGET", "12")
    assert main(["serve", "scheduler", "--config", str(config), "--set", "max_batch=24",
                 "--set", "scheduler.draft_addresses=127.0.0.1:7001,127.0.0.1:7002"]) == 0
    got = seen[-1]
    assert (got.max_batch, got.max_queue, got.default_budget) == (24, 100, 12)
    assert got.draft_addresses == ("127.0.0.1:7001", "127.0.0.1:7002")
    for flag, needle in (("max_batch", "give FIELD=VALUE or scheduler.FIELD=VALUE"),
                         ("verifier.page_size=32", "give FIELD=VALUE or scheduler.FIELD=VALUE"),
                         ("max_batchez=3", "scheduler.max_batchez: unknown setting"),
                         ("max_batch=lots", "scheduler.max_batch: 'lots' is not an integer"),
                         ("auth_token=s3cret", "scheduler.auth_token: not as a flag")):
        assert main(["serve", "scheduler", "--set", flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ddtree serve scheduler: ") and needle in err and "s3cret" not in err, err
    assert len(seen) == 1


def test_the_readme_command_synopsis_is_the_parsers() -> None:
    """Each flag the README's command synopsis shows is one its command takes, and each flag of a
    command but `bench` (whose synopsis points to `--help` for the rest) is shown: a flag renamed
    or added in one place only would send a user to the wrong one."""
    import argparse
    import re

    block = (REPO / "README.md").read_text().split("## Commands\n\n```\n", 1)[1].split("```", 1)[0]
    shown: dict[str, set[str]] = {}
    command = ""
    for line in block.splitlines():
        if m := re.match(r"ddtree (\S+)", line):
            command = m.group(1)
        shown.setdefault(command, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line.split("#")[0]))
    parsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(shown) == set(parsers), "a command missing from the synopsis, or one that no longer exists"
    for command, flags in shown.items():
        takes = {o for a in parsers[command]._actions for o in a.option_strings} - {"-h", "--help"}
        assert flags <= takes, (command, flags - takes)
        assert command == "bench" or takes <= flags, (command, takes - flags)
