"""Container health probe: `python -m services.healthcheck [PORT]` exits 0 when the local service is SERVING.

Compose runs it in each container. The port: the argument, else DDTREE_HEALTH_PORT, else the port
of the service DDTREE_HEALTH_SERVICE names (scheduler, draft or verifier) as that service reads it
(the config file DDTREE_HEALTH_CONFIG names, then its DDTREE_<SERVICE>_PORT), else 50051: a port
changed in the config is probed where the service listens. A scheduler with `tls_cert` set speaks
only TLS on its port, so where the plaintext probe gets no answer and the scheduler's `tls_cert` is
known (`DDTREE_SCHEDULER_TLS_CERT`, or the config file, read as the scheduler reads it), the probe
of a scheduler asks again over TLS, trusting that certificate (as `ddtree up` does; it verifies a
self-signed one). The certificate must name 127.0.0.1, or DDTREE_HEALTH_TLS_NAME gives the name to
check instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, tls_roots: bytes | None = None, tls_name: str | None = None, timeout_s: float = 3.0) -> int:
    """The service's health status (``HealthCheckResponse.ServingStatus``); raises ``grpc.RpcError``."""
    if tls_roots is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_roots), options=options)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                         timeout=timeout_s).status


def scheduler_tls_cert(config_path: str | None, env: Mapping[str, str]) -> str:
    """The scheduler's `tls_cert` as the scheduler itself resolves it (file, then environment); ""
    when it has none, or when its settings do not load (the scheduler then fails on its own)."""
    from services.common.settings import SchedulerSettings, SettingsError, load_settings

    try:
        return load_settings(SchedulerSettings, config_path, env=env).tls_cert
    except SettingsError:
        return env.get("DDTREE_SCHEDULER_TLS_CERT", "")


def service_port(service: str, config_path: str | None, env: Mapping[str, str]) -> str:
    """The port ``service`` listens on, as it reads its settings (file, then environment)."""
    from services.common.settings import DraftSettings, SchedulerSettings, VerifierSettings, load_settings

    settings = {"scheduler": SchedulerSettings, "draft": DraftSettings, "verifier": VerifierSettings}[service]
    return str(load_settings(settings, config_path, env=env).port)


def main(argv: list[str], env: Mapping[str, str] | None = None) -> int:
    from services.common.settings import SettingsError

    env = os.environ if env is None else env
    config = env.get("DDTREE_HEALTH_CONFIG") or None
    service = env.get("DDTREE_HEALTH_SERVICE", "")
    if service not in ("", "scheduler", "draft", "verifier"):
        print(f"DDTREE_HEALTH_SERVICE must be scheduler, draft or verifier (got {service!r})", file=sys.stderr)
        return 1   # Docker reserves a health check's 2
    if len(argv) > 1:
        port = argv[1]
    elif "DDTREE_HEALTH_PORT" in env or not service:
        port = env.get("DDTREE_HEALTH_PORT", "50051")
    else:
        try:
            port = service_port(service, config, env)
        except SettingsError as exc:
            print(f"unhealthy: the {service}'s settings do not load: {exc}", file=sys.stderr)
            return 1
        if port == "0":
            print(f"unhealthy: the {service}'s port is 0 (the system picks one): give the probe the port", file=sys.stderr)
            return 1
    if len(argv) > 2 or not port.isdigit() or not 0 < int(port) < 65536:
        print("usage: python -m services.healthcheck [PORT]  (PORT: the local service's, else DDTREE_HEALTH_PORT, "
              f"else DDTREE_HEALTH_SERVICE's port, else 50051; got {' '.join(argv[1:]) or port!r})", file=sys.stderr)
        return 1
    address = f"127.0.0.1:{port}"
    try:
        status = check(address)
    except grpc.RpcError as exc:
        cert = scheduler_tls_cert(config, env) if service in ("", "scheduler") else ""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or not cert:
            print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        try:
            status = check(address, Path(cert).read_bytes(), env.get("DDTREE_HEALTH_TLS_NAME"))
        except OSError as err:
            print(f"unhealthy: cannot read the scheduler's tls_cert {cert}: {err.strerror}", file=sys.stderr)
            return 1
        except grpc.RpcError as err:
            print(f"unhealthy: {err.code().name} (plaintext and TLS): {err.details()}", file=sys.stderr)
            return 1
    if status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}", file=sys.stderr)
        return 1
    print("SERVING")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
