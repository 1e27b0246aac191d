"""A service started by ``ddtree up`` stops when its launcher dies without stopping it (SIGKILL),
and keeps serving while the launcher lives."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from grpc_health.v1 import health_pb2

from services.common import grpc_server
from services.common.grpc_server import PARENT_PID_ENV, exit_when_orphaned, new_server, serve_until_signal
from services.common.launcher import Stack, StackSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A server with nothing but health, run as the services run it (serve_until_signal).
SERVICE = textwrap.dedent("""
    import asyncio
    from services.common.grpc_server import new_server, serve_until_signal

    async def main():
        server, health = new_server([])
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print("serving", flush=True)
        await serve_until_signal(server, health, grace_s=0.1, parent_poll_s=0.1)
        print("stopped", flush=True)

    asyncio.run(main())
""")

# The launcher: starts the service in a session of its own, with its pid in the environment, as
# ``Stack`` does, prints the service's pid, then waits to be killed.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    env = dict(os.environ)
    env[{env}] = str(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", {service!r}], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "serving"
    print(proc.pid, flush=True)
    proc.stdout.close()
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_service_stops_when_its_launcher_is_killed() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(env=repr(PARENT_PID_ENV), service=SERVICE)],
                                env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        service_pid = int(launcher.stdout.readline())
        time.sleep(1.0)
        assert _alive(service_pid), "the service stopped while its launcher was alive"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(service_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(service_pid), "the service outlived its launcher by 10 s"
    finally:
        launcher.kill()
        launcher.wait()
        if "service_pid" in locals() and _alive(service_pid):
            os.kill(service_pid, signal.SIGKILL)


def test_stack_tells_each_service_its_launcher() -> None:
    plan = Stack(StackSpec(model_path="models/demo", scheduler_port=0))._plan()
    assert {s.env[PARENT_PID_ENV] for s in plan} == {str(os.getpid())}


def test_a_service_still_starting_exits_when_its_launcher_is_gone() -> None:
    """The launcher was watched only once a service served: one killed during a long start-up
    (a model loading, a scheduler waiting for its draft) left it holding GPU memory and ports."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "protos")]),
               DDTREE_SCHEDULER_PORT=str(port), DDTREE_SCHEDULER_DRAFT_ADDRESSES="127.0.0.1:1",
               DDTREE_SCHEDULER_DRAFT_WAIT_S="120", DDTREE_SCHEDULER_TOKENIZER_PATH="")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a launcher that has exited (and is not this service's parent)
    env[PARENT_PID_ENV] = str(gone.pid)
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "services.cli", "serve", "scheduler"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and f"launcher {gone.pid} gone during start-up: exiting" in run.stderr, \
        run.stderr[-2000:]
    assert time.monotonic() - t0 < 30   # not the 120 s its wait for a draft would have taken
    env.pop(PARENT_PID_ENV)   # no launcher named: no watch, the wait runs (cut short here)
    with subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "scheduler"], env=env, cwd=ROOT,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            proc.wait(5)
            raise AssertionError(f"the scheduler ended without a launcher to watch: {proc.stderr.read()[-2000:]}")
        except subprocess.TimeoutExpired:
            pass
        finally:
            proc.kill()


def test_serve_until_signal_stops_gracefully_on_sigint_and_sigterm(monkeypatch) -> None:
    """Each signal: health NOT_SERVING first (watchers told), then `on_stop` (idle streams end), then
    the server's stop with its grace (calls in flight finish); the start-up watch is told the
    service serves. Ctrl-C without its handler raised KeyboardInterrupt instead of draining."""
    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    monkeypatch.setattr(grpc_server, "_serving", threading.Event())
    previous = signal.signal(signal.SIGINT, lambda *a: None)   # a SIGINT the loop does not take lands here
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            calls: list[object] = []

            async def run() -> None:
                _, health = new_server([])
                task = asyncio.ensure_future(serve_until_signal(
                    _Server(calls), health, grace_s=2.5, on_stop=lambda: calls.append(("on_stop", health._status[""]))))
                await asyncio.sleep(0.05)
                assert grpc_server._serving.is_set()
                os.kill(os.getpid(), sig)
                await asyncio.wait_for(task, 5)
            asyncio.run(run())
            assert calls == [("on_stop", health_pb2.HealthCheckResponse.NOT_SERVING), ("stop", 2.5)], sig
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_start_up_watch_ends_when_the_service_serves(monkeypatch) -> None:
    """Once serving, the launcher's end is `serve_until_signal`'s to handle (a drain): the start-up
    watch ending the process with os._exit then would cut every request."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    ppid = {"now": os.getppid()}
    monkeypatch.setattr(os, "getppid", lambda: ppid["now"])
    until = threading.Event()
    exit_when_orphaned(ppid["now"], 1, poll_s=0.01, until=until)
    until.set()
    time.sleep(0.1)
    ppid["now"] = -1   # the launcher goes after the service serves
    time.sleep(0.2)
    assert exits == []
    exit_when_orphaned(12345, 3, poll_s=0.01)   # a parent gone, no `until`: it exits
    time.sleep(0.2)
    assert exits == [3]


class _Server:
    """`server.stop` recorded: what `serve_until_signal` does last."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def stop(self, grace: float) -> None:
        self.calls.append(("stop", grace))


def _drain_recorder(calls: list):
    async def drain(now: asyncio.Event) -> None:
        calls.append(("drain", now.is_set()))
        await now.wait()          # a scheduler's drain: its requests finish, or `now` cuts them
        calls.append(("drained", True))
    return drain


def test_a_second_signal_ends_the_drain_at_once(monkeypatch) -> None:
    """An operator's second Ctrl-C stops waiting for running requests. A shutdown that did not
    take the second signal would wait for every running request however long."""
    monkeypatch.delenv(PARENT_PID_ENV, raising=False)
    monkeypatch.setattr(grpc_server, "_serving", threading.Event())
    previous = signal.signal(signal.SIGINT, lambda *a: None)
    calls: list = []
    try:
        async def run() -> None:
            _, health = new_server([])
            task = asyncio.ensure_future(serve_until_signal(_Server(calls), health, grace_s=0.5,
                                                            drain=_drain_recorder(calls)))
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0.1)
            assert calls == [("drain", False)]     # the first signal: a drain, waiting
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(task, 1.0)
        asyncio.run(run())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert calls == [("drain", False), ("drained", True), ("stop", 0.5)]


def test_a_launcher_gone_drains_with_now_already_set(monkeypatch) -> None:
    """Its other services went with it: a drain that waited would keep the orphaned service on
    requests whose peers are dead until they time out."""
    monkeypatch.setenv(PARENT_PID_ENV, str(os.getppid() + 1))   # not our parent: the launcher is gone
    monkeypatch.setattr(grpc_server, "_serving", threading.Event())
    calls: list = []

    async def run() -> None:
        _, health = new_server([])
        await asyncio.wait_for(serve_until_signal(_Server(calls), health, grace_s=0.5, parent_poll_s=0.01,
                                                  drain=_drain_recorder(calls)), 1.0)
    asyncio.run(run())
    assert calls == [("drain", True), ("drained", True), ("stop", 0.5)]
