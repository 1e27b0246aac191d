"""Container health probe: `python -m services.healthcheck [PORT]` exits 0 when the local service is SERVING.

Compose runs it in each container; the port comes from the argument or DDTREE_HEALTH_PORT.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = argv[1] if len(argv) > 1 else os.environ.get("DDTREE_HEALTH_PORT", "50051")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
