"""`ddtree up`: the three services as local processes, started in dependency order, stopped together.

Each child gets its settings as `DDTREE_<SERVICE>_*` environment variables layered over the shared
config file, so the launcher and docker compose configure the services the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["StackSpec", "Stack", "free_port", "wait_healthy"]


def free_port() -> int:
    """A loopback port that is free now (the OS picks it), so tests never collide on fixed ports."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class StackSpec:
    model_path: str = "models/demo"
    drafter_path: str | None = None          # default: <model_path>/drafter
    config_path: str | None = None
    scheduler_port: int = 50051
    draft_port: int = 0                       # 0 = any free port
    verifier_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 120.0


def wait_healthy(address: str, proc: subprocess.Popen, name: str, timeout_s: float,
                 tls_roots: bytes | None = None) -> None:
    """Polls grpc.health.v1 until SERVING; raises if the process exits or time runs out.

    `tls_roots`: PEM roots to trust when the service speaks TLS (the launcher passes the
    scheduler's own certificate, which verifies a self-signed one).
    """
    deadline = time.monotonic() + timeout_s
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_roots)) if tls_roots
               else grpc.insecure_channel(address))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up (see its log above)")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{name} at {address} not healthy after {timeout_s:.0f} s")


class Stack:
    """Starts verifier -> draft -> scheduler; `stop()` ends them in reverse, SIGTERM then SIGKILL."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.scheduler_address = ""

    def _env(self) -> dict[str, str]:
        spec = self.spec
        vport = spec.verifier_port or free_port()
        dport = spec.draft_port or free_port()
        sport = spec.scheduler_port if spec.scheduler_port else free_port()
        self.addresses = {"verifier": f"127.0.0.1:{vport}", "draft": f"127.0.0.1:{dport}",
                          "scheduler": f"127.0.0.1:{sport}"}
        self.scheduler_address = self.addresses["scheduler"]
        env = dict(os.environ)
        env.update({
            "DDTREE_VERIFIER_PORT": str(vport), "DDTREE_VERIFIER_MODEL_PATH": spec.model_path,
            "DDTREE_DRAFT_PORT": str(dport), "DDTREE_DRAFT_VERIFIER_ADDRESS": self.addresses["verifier"],
            "DDTREE_DRAFT_TARGET_PATH": spec.model_path,
            "DDTREE_DRAFT_DRAFTER_PATH": spec.drafter_path or str(Path(spec.model_path) / "drafter"),
            "DDTREE_SCHEDULER_PORT": str(sport), "DDTREE_SCHEDULER_DRAFT_ADDRESSES": self.addresses["draft"],
            "DDTREE_SCHEDULER_TOKENIZER_PATH": spec.model_path,
        })
        env.update(spec.extra_env)
        return env

    def start(self) -> Stack:
        env = self._env()
        try:
            for name in ("verifier", "draft", "scheduler"):
                cmd = [sys.executable, "-m", "services.cli", "serve", name]
                if self.spec.config_path:
                    cmd += ["--config", self.spec.config_path]
                proc = subprocess.Popen(cmd, env=env, start_new_session=True)
                self.procs.append((name, proc))
                roots = None
                if name == "scheduler" and env.get("DDTREE_SCHEDULER_TLS_CERT"):
                    roots = Path(env["DDTREE_SCHEDULER_TLS_CERT"]).read_bytes()
                wait_healthy(self.addresses[name], proc, name, self.spec.startup_timeout_s, roots)
        except BaseException:
            self.stop()
            raise
        return self

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def stop(self, grace_s: float = 10.0) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
