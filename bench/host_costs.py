"""What the host costs between two services, apart from any model: a message round trip on an open
`grpc.aio` bidi stream between two processes (and a unary call, for scale), and a step's trees and
features through the transport's encode / decode.

Why: at C=1 a stack step is a chain of such host steps across three processes (BENCHMARKS.md,
"Fewer host steps between the services"), and the same Python costs three times as much on one
host as on another, so the floor is measured where the stack runs. CPU only; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

import grpc
import torch

from bench.common import git_commit
from services.common.transport import make_reader, make_writer

SERVICE = "bench.Echo"


def _same(b: bytes) -> bytes:
    return b


async def _echo_server(port: int, ready) -> None:
    async def stream(requests, context):
        async for message in requests:
            yield message

    async def unary(message, context):
        return message

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _serve(port: int, ready, loop: str) -> None:
    if loop == "uvloop":
        import uvloop
        uvloop.run(_echo_server(port, ready))
    else:
        asyncio.run(_echo_server(port, ready))


async def _round_trips(port: int, n: int, size: int) -> tuple[float, float]:
    """Median µs of a stream round trip and of a unary call (the first tenth dropped as warm-up)."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = channel.stream_stream(f"/{SERVICE}/Stream", request_serializer=_same, response_deserializer=_same)
    unary = channel.unary_unary(f"/{SERVICE}/Unary", request_serializer=_same, response_deserializer=_same)
    message = bytes(size)
    call = stream()
    streamed, unaries = [], []
    for _ in range(n):
        t = time.perf_counter_ns()
        await call.write(message)
        await call.read()
        streamed.append(time.perf_counter_ns() - t)
    for _ in range(n // 2):
        t = time.perf_counter_ns()
        await unary(message)
        unaries.append(time.perf_counter_ns() - t)
    call.cancel()
    await channel.close()
    return statistics.median(streamed[n // 10:]) / 1e3, statistics.median(unaries[n // 20:]) / 1e3


def grpc_rows(n: int, size: int) -> list[dict]:
    from services.common.launcher import free_port

    rows = []
    spawn = mp.get_context("spawn")   # a forked child of a process that has used gRPC can crash (gRPC is not fork-safe)
    for loop in ("asyncio", "uvloop"):
        port, ready = free_port(), spawn.Event()
        server = spawn.Process(target=_serve, args=(port, ready, loop), daemon=True)
        server.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("the echo server did not start")
            if loop == "uvloop":
                import uvloop
                stream_us, unary_us = uvloop.run(_round_trips(port, n, size))
            else:
                stream_us, unary_us = asyncio.run(_round_trips(port, n, size))
        finally:
            server.terminate()
        rows += [{"what": "grpc_stream_round_trip", "loop": loop, "bytes": size, "p50_us": round(stream_us, 1)},
                 {"what": "grpc_unary_call", "loop": loop, "bytes": size, "p50_us": round(unary_us, 1)}]
    return rows


def _per_call_us(fn, n: int) -> float:
    for _ in range(100):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def transport_rows(n: int) -> list[dict]:
    """A budget-16 tree (four small int64 tensors) inline, and 4 tokens' features through a shm slot."""
    g = torch.Generator().manual_seed(0)
    trees = {"tokens": torch.randint(0, 1000, (17,), generator=g), "parents": torch.randint(0, 16, (17,), generator=g),
             "depths": torch.randint(0, 16, (17,), generator=g), "sizes": torch.tensor([17])}
    inline_w, inline_r = make_writer("inline"), make_reader("inline")
    bundle = inline_w.write(trees)
    shm_w = make_writer("shm", 1 << 16, 4, "bench-host-costs")
    features = {"features": torch.randn(4, 2048, generator=g).bfloat16()}

    def write_features():
        shm_w.write(features)
        shm_w.release([0, 1, 2, 3])

    try:
        return [{"what": "trees_inline_write", "p50_us": round(_per_call_us(lambda: inline_w.write(trees), n), 1)},
                {"what": "trees_inline_read", "p50_us": round(_per_call_us(lambda: inline_r.read(bundle), n), 1)},
                {"what": "features_shm_write", "p50_us": round(_per_call_us(write_features, n), 1)}]
    finally:
        shm_w.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--round-trips", type=int, default=2000)
    p.add_argument("--message-bytes", type=int, default=300)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    rows = grpc_rows(args.round_trips, args.message_bytes) + transport_rows(args.calls)
    for row in rows:
        print(row, flush=True)
    if args.out:
        doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": "cpu", "copy_gbps": None,
               "params": {"round_trips": args.round_trips, "message_bytes": args.message_bytes, "calls": args.calls,
                          "host": platform.processor() or platform.machine(), "cpus": mp.cpu_count()},
               "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
