"""What an operator reads: log events carry their service wherever they are logged from, and the
health probe says why a service is unhealthy."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import healthcheck
from services.common.grpc_server import ServiceError
from services.common.launcher import free_port
from services.draft import server as draft_server

REPO = Path(__file__).resolve().parent.parent


def test_an_event_logged_from_a_thread_names_its_service() -> None:
    """A rank watchdog logs from a thread of its own; its `rank_died` went out without `service`."""
    code = ("import threading; from services.common.logging import configure_logging, get_logger; "
            "configure_logging('verifier', True); get_logger('v').info('main_event'); "
            "t = threading.Thread(target=lambda: get_logger('v').error('thread_event')); t.start(); t.join()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    events = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert [(e["event"], e.get("service")) for e in events] == [("main_event", "verifier"), ("thread_event", "verifier")]


@pytest.mark.parametrize("json_logs", [True, False])
def test_ddtree_ups_restart_notices_are_json_events_where_the_services_log_json(json_logs) -> None:
    """`ddtree up` told of a restart in a plain line amid the services' JSON lines, which broke a
    parser of the stack's log; a console keeps its readable line."""
    code = ("from services.cli import _restart_reporter\n"
            f"report = _restart_reporter({json_logs})\n"
            "report('service_restarting', 'draft exited with code -9; restarting it', target='draft', code=-9)\n"
            "report('stack_stopped', 'draft exited 4 times in 60 s; stopping')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    if not json_logs:
        assert out.stderr == ("ddtree up: draft exited with code -9; restarting it\n"
                              "ddtree up: draft exited 4 times in 60 s; stopping\n")
        return
    restarted, stopped = [json.loads(line) for line in out.stderr.splitlines()]
    assert restarted["event"] == "service_restarting" and restarted["service"] == "launcher"
    assert restarted["level"] == "warning" and restarted["message"] == "draft exited with code -9; restarting it"
    assert restarted["target"] == "draft" and restarted["code"] == -9
    assert stopped["event"] == "stack_stopped" and stopped["level"] == "error"


def test_the_console_log_escapes_what_is_not_printable() -> None:
    """A value a client chose went out raw where it held no space or quote: a NUL made the log a
    binary file to grep, an escape sequence rewrote the terminal's lines, a vertical tab or U+2028
    broke a line for viewers that split on them."""
    code = ("from services.common.logging import configure_logging, get_logger; configure_logging('scheduler', False)\n"
            "get_logger('s').info('request_end', request_id='nul\\x00\\x1b[2K\\x1b[31mFORGED\\x0b\\u2028', plain='ok#1')\n"
            "try:\n    raise RuntimeError('boom')\nexcept RuntimeError:\n    get_logger('s').exception('failed')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True)
    err = out.stderr.decode()
    assert not any(c in err for c in "\x00\x1b\x0b\u2028")
    assert "request_id='nul\\x00\\x1b[2K\\x1b[31mFORGED\\x0b\\u2028'" in err and "plain=ok#1" in err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err   # still a traceback


def test_a_logged_exception_keeps_its_error_and_trace_in_json_logs() -> None:
    """The JSON renderer wrote only "exc_info": true (compose logs JSON): a draft's failed verifier
    reply, turned into UNAVAILABLE, kept no trace anywhere."""
    code = ("from services.common.logging import configure_logging, get_logger; configure_logging('draft', True)\n"
            "def step(prompt_text):\n    raise RuntimeError('CUDA error: an illegal memory access')\n"
            "try:\n    step('my confidential question')\n"
            "except RuntimeError:\n    get_logger('d').exception('verifier_reply_failed')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    (event,) = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert event["event"] == "verifier_reply_failed"
    (exc,) = event["exception"]
    assert exc["exc_type"] == "RuntimeError" and "illegal memory access" in exc["exc_value"] and exc["frames"]
    assert "confidential" not in out.stderr   # no frame's locals (a step's prompt, a reply of features)


def test_the_drafts_reconnect_warns_once_of_a_refused_token_not_each_second(monkeypatch) -> None:
    warned: list[str] = []
    monkeypatch.setattr(draft_server.log, "warning", lambda event, **kw: warned.append(kw.get("code", kw.get("error"))))
    monkeypatch.setattr(draft_server.log, "debug", lambda event, **kw: None)
    class Done(BaseException):   # ends the loop (it takes every Exception for a failed round)
        pass
    failures = iter([*[ServiceError(grpc.StatusCode.UNAUTHENTICATED, "wrong internal token")] * 20,
                     *[OSError("no room in /dev/shm")] * 20, None, ServiceError(grpc.StatusCode.UNAUTHENTICATED, "x")])

    class Engine:
        class verifier:
            connected = False
            handshake = None

        async def ensure_connected(self) -> None:
            failure = next(failures, Done())
            if failure is not None:
                raise failure

    with pytest.raises(Done):
        asyncio.run(draft_server._reconnect_when_lost(Engine(), interval_s=0.001))
    # one line a kind, and the token again after a reconnect in between
    assert warned == ["UNAUTHENTICATED", "OSError('no room in /dev/shm')", "UNAUTHENTICATED"], warned
    # ... also where a step or the scheduler's probe reconnected it between two rounds
    warned.clear()
    states = iter([False, True, False])   # lost, reconnected elsewhere, lost again
    failures = iter([ServiceError(grpc.StatusCode.UNAUTHENTICATED, "x")] * 2)

    def state(self) -> bool:
        value = next(states, None)
        if value is None:
            raise Done
        return value

    class Elsewhere(Engine):
        verifier = type("Verifier", (), {"connected": property(state), "handshake": None})()

    with pytest.raises(Done):
        asyncio.run(draft_server._reconnect_when_lost(Elsewhere(), interval_s=0.001))
    assert warned == ["UNAUTHENTICATED", "UNAUTHENTICATED"], warned
    # A verifier still down (UNAVAILABLE) is expected: debug only, and it does not end a spell of
    # refused tokens; a reconnect that works does, so the next refusal warns again.
    warned.clear()
    down, refused = (ServiceError(grpc.StatusCode.UNAVAILABLE, "connection refused"),
                     ServiceError(grpc.StatusCode.UNAUTHENTICATED, "wrong internal token"))
    failures = iter([down, refused, down, refused, down, None, refused])
    with pytest.raises(Done):
        asyncio.run(draft_server._reconnect_when_lost(Engine(), interval_s=0.001))
    assert warned == ["UNAUTHENTICATED", "UNAUTHENTICATED"], warned


def test_the_health_probe_says_not_serving(capsys) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        assert healthcheck.main(["probe", str(port)], env={}) == 1
        assert "unhealthy: NOT_SERVING" in capsys.readouterr().err
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert healthcheck.main(["probe", str(port)], env={}) == 0
        assert capsys.readouterr().out == "SERVING\n"
    finally:
        server.stop(0)
    # Any argument was taken for a port: `--help` probed "127.0.0.1:--help" and said "unhealthy".
    for argv, env in ((["probe", "--help"], {}), (["probe", "1", "2"], {}), (["probe"], {"DDTREE_HEALTH_PORT": "x"}),
                      (["probe", "70000"], {})):
        assert healthcheck.main(argv, env=env) == 1
        assert capsys.readouterr().err.startswith("usage: python -m services.healthcheck [PORT]")


def test_the_health_probe_finds_its_services_port_where_the_service_does(tmp_path, capsys) -> None:
    """Compose names the service (DDTREE_HEALTH_SERVICE) and its config file: a port changed there,
    or by DDTREE_<SERVICE>_PORT, is probed where the service listens. A fixed DDTREE_HEALTH_PORT
    kept probing the old one: the container unhealthy, and nothing that depends on it started."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port, other = free_port(), free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    config = tmp_path / "ddtree.toml"
    config.write_text(f"[draft]\nport = {port}\n[verifier]\nport = {other}\n")
    env = {"DDTREE_HEALTH_SERVICE": "draft", "DDTREE_HEALTH_CONFIG": str(config)}
    try:
        assert healthcheck.main(["probe"], env=env) == 0
        assert healthcheck.main(["probe"], env={**env, "DDTREE_HEALTH_SERVICE": "verifier"}) == 1   # not there
        assert healthcheck.main(["probe"], env={**env, "DDTREE_HEALTH_SERVICE": "verifier",
                                                "DDTREE_VERIFIER_PORT": str(port)}) == 0   # the environment's over the file's
        assert healthcheck.main(["probe"], env={**env, "DDTREE_HEALTH_PORT": str(other)}) == 1   # an explicit port first
        capsys.readouterr()
        assert healthcheck.main(["probe"], env={**env, "DDTREE_HEALTH_SERVICE": "drafts"}) == 1
        assert "DDTREE_HEALTH_SERVICE must be scheduler, draft or verifier (got 'drafts')" in capsys.readouterr().err
        config.write_text("[draft]\nport = \"x\"\n")
        assert healthcheck.main(["probe"], env=env) == 1
        assert capsys.readouterr().err.startswith("unhealthy: the draft's settings do not load: draft.port")
        config.write_text("[draft]\nport = 0\n")
        assert healthcheck.main(["probe"], env=env) == 1
        assert capsys.readouterr().err.startswith("unhealthy: the draft's port is 0")
    finally:
        server.stop(0)


def test_gpu_memory_is_reported_for_a_cuda_device_only(monkeypatch) -> None:
    """The draft holds GPU memory too (drafter, context pool, ring): its gauge stayed 0 before."""
    import torch
    from prometheus_client import generate_latest

    from services.common.metrics import Metrics

    seen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: seen.append(device) or 12345 * len(seen))
    on_gpu, on_cpu = Metrics("draft"), Metrics("draft")
    on_gpu.track_gpu_memory(torch.device("cuda", 1))
    on_cpu.track_gpu_memory(torch.device("cpu"))
    assert b"ddtree_gpu_memory_allocated_bytes 12345.0" in generate_latest(on_gpu.registry)
    assert b"ddtree_gpu_memory_allocated_bytes 24690.0" in generate_latest(on_gpu.registry)   # each scrape reads anew
    assert seen == [torch.device("cuda", 1)] * 2   # at scrape time, on the service's own device
    assert b"ddtree_gpu_memory_allocated_bytes 0.0" in generate_latest(on_cpu.registry)


def test_each_service_exports_the_metrics_it_updates_and_no_others() -> None:
    """A draft replica exported ddtree_generated_tokens_total and ddtree_transport_peers at 0
    forever (only the scheduler and the verifier update them). Each role's code is read for the
    metrics it updates, which must be exactly the ones it exports."""

    from prometheus_client import generate_latest

    from services.common.metrics import _EXPORTS, Metrics

    root = Path(__file__).resolve().parent.parent / "services"
    # Every metric there is, not the union of the exports: a name dropped from one role's set left
    # the union too, and the metric went from that role's /metrics without a failing test.
    every = {name for name in vars(Metrics("a-test")) if name not in ("registry", "service")}
    for role in ("scheduler", "draft", "verifier"):
        updated = {m for f in (root / role).glob("*.py") for m in re.findall(r"metrics\.(\w+)", f.read_text())}
        assert updated & every == _EXPORTS[role] - {"gpu_memory_allocated"}, role   # (that one via track_gpu_memory)
        registered = {m.name for m in Metrics(role).registry.collect()}
        assert {getattr(Metrics("a-test"), name)._name for name in _EXPORTS[role]} <= registered, role
        text = generate_latest(Metrics(role).registry).decode()
        assert ("ddtree_generated_tokens_total" in text) == (role == "scheduler")
        assert ("ddtree_transport_peers" in text) == (role == "verifier")
        assert "ddtree_step_ms" in text and "ddtree_running_requests" in text
        assert "process_start_time_seconds" in text   # a restart shows as a new start time
    assert "ddtree_transport_peers" in generate_latest(Metrics("a-test").registry).decode()   # others: all


def test_the_readmes_metrics_table_lists_what_each_service_exports() -> None:
    from services.common.metrics import Metrics

    readme = (REPO / "README.md").read_text()
    for role in ("scheduler", "draft", "verifier"):
        (row,) = re.findall(rf"^\| {role} \| (`.*`) \|$", readme, flags=re.M)
        listed = set(re.findall(r"`(\w+)`", row))
        exported = {m.name.removeprefix("ddtree_") + ("_total" if m.type == "counter" else "")
                    for m in Metrics(role).registry.collect() if m.name.startswith("ddtree_")}
        assert listed == exported, role


def test_metrics_port_zero_serves_nothing_and_every_fallback_reason_starts_at_zero() -> None:
    """`metrics_port = 0` is off (a random port, on 0.0.0.0, would expose /metrics unasked); the
    inline-fallback reasons a service can raise exist at 0 from the start, so an alert on their rate
    sees a series, and only those: the draft's ring_full / ring_error read 0 forever."""
    from prometheus_client import generate_latest

    from services.common.metrics import Metrics, serve_metrics

    assert serve_metrics(Metrics("draft"), "127.0.0.1", 0) is None
    for role, reasons in (("verifier", {"slot_too_small", "ring_full", "ring_error"}), ("draft", {"slot_too_small"})):
        text = generate_latest(Metrics(role).registry).decode()
        found = set(re.findall(r'ddtree_ring_inline_fallbacks_total\{reason="(\w+)"\} 0\.0', text))
        assert found == reasons, role


def test_a_metrics_connection_that_sends_no_request_is_closed_and_scrapes_go_on(monkeypatch, capfd) -> None:
    """prometheus_client's server gave each connection a thread that waited for its request for
    ever: 300 idle connections to a metrics port held 300 threads and fds until they were closed."""
    import socket
    import struct
    import threading
    import time
    import urllib.request

    from services.common import metrics as metrics_module

    assert 0 < metrics_module._ScrapeHandler.timeout <= 60   # the default: bounded (shortened below to test it)
    monkeypatch.setattr(metrics_module._ScrapeHandler, "timeout", 0.5)
    metrics = metrics_module.Metrics("draft")
    metrics.running.set(3)
    port = metrics_module.serve_metrics(metrics, "127.0.0.1", free_port())
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    idle[0].sendall(b"GET /metr")   # half a request line
    reset = socket.create_connection(("127.0.0.1", port))   # one that resets the connection: no traceback either
    reset.sendall(b"GET /metr")
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()
    time.sleep(0.2)
    assert threading.active_count() >= threads + 5   # a thread each while they wait
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as scrape:
        assert "ddtree_running_requests 3.0" in scrape.read().decode()
    for conn in idle:
        conn.settimeout(5)
        t0 = time.monotonic()
        assert conn.recv(1) == b"" and time.monotonic() - t0 < 2   # closed by the server
        conn.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads
    assert "Traceback" not in capfd.readouterr().err


def test_a_metrics_request_trickled_a_byte_at_a_time_is_closed_at_the_same_limit(monkeypatch) -> None:
    """The per-read timeout never fired for a client that sent a byte every few seconds: each such
    connection held a thread and an fd for as long as it went on."""
    import socket
    import time

    from services.common import metrics as metrics_module

    monkeypatch.setattr(metrics_module._ScrapeHandler, "timeout", 0.6)
    port = metrics_module.serve_metrics(metrics_module.Metrics("draft"), "127.0.0.1", free_port())
    conn = socket.create_connection(("127.0.0.1", port))
    t0, closed = time.monotonic(), None
    try:
        for byte in b"GET /metrics HTTP/1.0":   # a byte each 0.2 s: 4.2 s for the line, were it let
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                closed = time.monotonic() - t0
                break
            conn.settimeout(0.2)
            try:
                if conn.recv(1) == b"":
                    closed = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
    finally:
        conn.close()
    assert closed is not None and closed < 2.0, closed


def test_once_per_counts_every_event_between_two_lines_and_says_once_a_minute(monkeypatch) -> None:
    from services.common import logging as ddlog

    now = {"t": 1000.0}
    monkeypatch.setattr(ddlog.time, "monotonic", lambda: now["t"])
    once = ddlog.OncePer()
    assert once.due() == 1   # the first: at once
    now["t"] += 59.0
    assert [once.due() for _ in range(3)] == [None, None, None]
    now["t"] += 1.5
    assert once.due() == 4   # the three held back and this one
    assert once.due() is None


def test_json_logs_keep_a_values_text_and_stamp_utc() -> None:
    """JSON escapes a client's control characters itself: the console's escaping applied there
    turned the value into its repr; timestamps are UTC."""
    code = ("from services.common.logging import configure_logging, get_logger; configure_logging('draft', True)\n"
            "get_logger('d').info('request_end', request_id='nul\\x00\\x1b[2K')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    (event,) = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
    assert event["request_id"] == "nul\x00\x1b[2K"
    assert event["timestamp"].endswith("Z")


def test_metrics_serve_on_an_ipv6_host_and_log_no_line_a_scrape(capfd) -> None:
    import socket
    import urllib.request

    from services.common.metrics import Metrics, serve_metrics

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    metrics = Metrics("draft")
    metrics.running.set(2)
    port = serve_metrics(metrics, "::1", free_port())
    with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as scrape:
        assert "ddtree_running_requests 2.0" in scrape.read().decode()
    assert capfd.readouterr().err == ""
