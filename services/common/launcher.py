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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import PARENT_PID_ENV
from services.common.settings import DraftSettings, SchedulerSettings, VerifierSettings, load_settings

_SETTINGS = {"verifier": VerifierSettings, "draft": DraftSettings, "scheduler": SchedulerSettings}

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
    scheduler_port: int = 50051               # 0 = any free port
    draft_port: int = 0                       # first draft replica's port; 0 = any free port
    verifier_port: int = 0
    draft_replicas: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per-service additions over extra_env, keyed by role ("verifier", "draft", "scheduler") or by
    # service name ("draft-1"), the name's entry winning: one draft replica per GPU, or a
    # CUDA_VISIBLE_DEVICES for one service only.
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    startup_timeout_s: float = 120.0
    log_path: str | None = None               # the services' stdout and stderr go here (appended), not to ours


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
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up (see its output)")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{name} at {address} not healthy after {timeout_s:.0f} s")


@dataclass
class _Service:
    """One process of the stack: its name (`draft-1`), role, address and environment."""

    name: str
    role: str
    address: str
    env: dict[str, str]
    proc: subprocess.Popen | None = None


class Stack:
    """Starts verifier -> draft replicas -> scheduler; `stop()` ends them in reverse, SIGTERM then SIGKILL."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.services: list[_Service] = []
        self.scheduler_address = ""

    def _plan(self) -> list[_Service]:
        spec = self.spec
        base = dict(os.environ)
        base.update({
            "DDTREE_VERIFIER_MODEL_PATH": spec.model_path,
            "DDTREE_DRAFT_TARGET_PATH": spec.model_path,
            "DDTREE_DRAFT_DRAFTER_PATH": spec.drafter_path or str(Path(spec.model_path) / "drafter"),
            # the model's tokenizer.json; a model without one serves token-id prompts only
            "DDTREE_SCHEDULER_TOKENIZER_PATH": spec.model_path if (Path(spec.model_path) / "tokenizer.json").is_file() else "",
            PARENT_PID_ENV: str(os.getpid()),   # the services stop if this process dies without stopping them
            # The launcher reaches the draft and verifier on loopback; a config file written for
            # containers (host = "0.0.0.0") must not open them to the network here.
            "DDTREE_VERIFIER_HOST": "127.0.0.1",
            "DDTREE_DRAFT_HOST": "127.0.0.1",
        })
        base.update(spec.extra_env)
        vport = spec.verifier_port or free_port()
        verifier = f"127.0.0.1:{vport}"
        plan = [_Service("verifier", "verifier", verifier,
                         {**self._env(base, "verifier", "verifier"), "DDTREE_VERIFIER_PORT": str(vport)})]
        drafts = []
        # Draft replicas after the first take the next metrics ports after the configured one that
        # no other service of the stack uses (replicas would otherwise share the file's port).
        taken = {load_settings(VerifierSettings, spec.config_path, env=plan[0].env).metrics_port,
                 load_settings(SchedulerSettings, spec.config_path, env=self._env(base, "scheduler", "scheduler")).metrics_port}
        for i in range(spec.draft_replicas):
            dport = (spec.draft_port + i) if spec.draft_port else free_port()
            drafts.append(f"127.0.0.1:{dport}")
            name = f"draft-{i}" if spec.draft_replicas > 1 else "draft"
            env = {**self._env(base, "draft", name), "DDTREE_DRAFT_PORT": str(dport),
                   "DDTREE_DRAFT_VERIFIER_ADDRESS": verifier}
            metrics = load_settings(DraftSettings, spec.config_path, env=env).metrics_port
            if metrics and "DDTREE_DRAFT_METRICS_PORT" not in spec.service_env.get(name, {}):
                while metrics in taken:
                    metrics += 1
                taken.add(metrics)
                env["DDTREE_DRAFT_METRICS_PORT"] = str(metrics)
            plan.append(_Service(name, "draft", drafts[-1], env))
        sport = spec.scheduler_port or free_port()
        plan.append(_Service("scheduler", "scheduler", f"127.0.0.1:{sport}",
                             {**self._env(base, "scheduler", "scheduler"), "DDTREE_SCHEDULER_PORT": str(sport),
                              "DDTREE_SCHEDULER_DRAFT_ADDRESSES": ",".join(drafts)}))
        return plan

    def _env(self, base: dict[str, str], role: str, name: str) -> dict[str, str]:
        """`base` with the spec's entries for this role, then for this service's name, on top."""
        env = {**base, **self.spec.service_env.get(role, {})}
        if name != role:
            env.update(self.spec.service_env.get(name, {}))
        return env

    def start(self) -> Stack:
        """Starts the services in order; raises ``SettingsError`` before starting any where one of
        them could not load its settings (file + environment), ``RuntimeError`` where one fails."""
        self.services = self._plan()
        for svc in self.services:
            load_settings(_SETTINGS[svc.role], self.spec.config_path, env=svc.env)
        self.scheduler_address = self.services[-1].address
        try:
            for svc in self.services:
                self._launch(svc)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, svc: _Service) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", svc.role]
        if self.spec.config_path:
            cmd += ["--config", self.spec.config_path]
        if self.spec.log_path:
            with open(self.spec.log_path, "ab") as log:   # the child keeps its own copy of the descriptor
                svc.proc = subprocess.Popen(cmd, env=svc.env, start_new_session=True, stdout=log,
                                            stderr=subprocess.STDOUT)
        else:
            svc.proc = subprocess.Popen(cmd, env=svc.env, start_new_session=True)
        roots = None
        if svc.role == "scheduler":  # a TLS-only scheduler (its cert from the config file or the environment)
            from services.healthcheck import scheduler_tls_cert
            cert = scheduler_tls_cert(self.spec.config_path, svc.env)
            roots = Path(cert).read_bytes() if cert and Path(cert).is_file() else None
        wait_healthy(svc.address, svc.proc, svc.name, self.spec.startup_timeout_s, roots)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        return [(s.name, s.proc) for s in self.services if s.proc is not None]

    def process(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def address(self, name: str) -> str:
        return next(s.address for s in self.services if s.name == name)

    def restart(self, name: str) -> None:
        """Starts a service again on the same address (after it died or was killed)."""
        svc = next(s for s in self.services if s.name == name)
        if svc.proc is not None and svc.proc.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._launch(svc)

    def supervise(self, should_stop: Callable[[], bool], poll_s: float = 0.5, max_restarts: int = 3,
                  window_s: float = 60.0, report: Callable[[str], None] = lambda msg: None) -> None:
        """Keeps the stack up until ``should_stop()``, as compose's ``restart: unless-stopped`` does:
        a service that exits is started again, unless it exited more than ``max_restarts`` times
        in ``window_s`` (a crash loop), which raises RuntimeError. A restart that dies before it is
        healthy counts as one more exit, to be retried on the next round, not as the end."""
        exits: dict[str, list[float]] = {}
        while not should_stop():
            for svc in self.services:
                if svc.proc is None or svc.proc.poll() is None:
                    continue
                now = time.monotonic()
                recent = [t for t in exits.get(svc.name, []) if now - t < window_s] + [now]
                exits[svc.name] = recent
                if len(recent) > max_restarts:
                    raise RuntimeError(f"{svc.name} exited {len(recent)} times in {window_s:.0f} s "
                                       f"(last code {svc.proc.returncode}); not restarting it again")
                report(f"{svc.name} exited with code {svc.proc.returncode}; restarting it")
                try:
                    self.restart(svc.name)
                except RuntimeError as exc:   # died (or hung) during its start-up: the next round sees it
                    report(f"{svc.name} restart failed: {exc}")
            time.sleep(poll_s)

    def stop(self, grace_s: float = 30.0) -> None:
        running = [s.proc for s in reversed(self.services) if s.proc is not None]
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for svc in self.services:
            svc.proc = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
