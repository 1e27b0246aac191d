"""One step's messages between two processes: an open grpc.aio stream against the step socket.

The echo process plays the verifier: it answers each `VerifyRequest` with a `VerifyResponse` of a
C=1 step (one tree by ring reference in, four tokens and a features reference out), on a gRPC
bidirectional stream (the services' channel options) and on a step socket
(`services/common/step_socket.py`), both under uvloop as the services run. Timed: the caller's
write until its read returns, which is what a step's trip to the verifier costs beyond the
verifier's own work. Writes bench/results/step-socket-<gpu or cpu>.json (the result-file schema).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import grpc

from bench.common import write_result
from ddtree.v1 import common_pb2, verifier_pb2
from services.common import step_socket
from services.common.grpc_server import MAX_MESSAGE_BYTES, server_options

_METHOD = "/bench.Echo/Steps"


def _request(sequence: int) -> verifier_pb2.VerifyRequest:
    trees = common_pb2.TensorBundle(tensors=[common_pb2.TensorRef(
        name=n, dtype="int64", shape=[17], slot=common_pb2.SlotRef(slot=1, offset=136 * i, nbytes=136, sequence=sequence))
        for i, n in enumerate(("tokens", "parents", "depths"))])
    return verifier_pb2.VerifyRequest(sequence=sequence, verify_ids=["request-0"], trees=trees, released_slots=[2])


def _response(req: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
    features = common_pb2.TensorBundle(tensors=[common_pb2.TensorRef(
        name="features", dtype="bfloat16", shape=[4, 3 * 2048],
        slot=common_pb2.SlotRef(slot=3, offset=0, nbytes=4 * 3 * 2048 * 2, sequence=req.sequence))])
    return verifier_pb2.VerifyResponse(sequence=req.sequence, verifies=[verifier_pb2.ItemResult(
        request_id="request-0", token_ids=[5, 6, 7, 8], committed=4)], features=features, released_slots=[1],
        verify_ms=1.5)


def _echo(port: int, name: str, ready) -> None:
    import uvloop

    async def main() -> None:
        async def steps(requests, context):
            async for req in requests:
                yield _response(req)
        handler = grpc.method_handlers_generic_handler("bench.Echo", {"Steps": grpc.stream_stream_rpc_method_handler(
            steps, request_deserializer=verifier_pb2.VerifyRequest.FromString,
            response_serializer=verifier_pb2.VerifyResponse.SerializeToString)})
        server = grpc.aio.server(options=server_options())
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()

        async def on_socket(reader, writer):
            await step_socket.read_frame(reader, step_socket.KEY_BYTES)
            step_socket.write_message(writer, b"")
            async for req in step_socket.messages(reader, verifier_pb2.VerifyRequest, MAX_MESSAGE_BYTES):
                step_socket.write_message(writer, _response(req))
                await writer.drain()
            writer.close()
        await step_socket.listen(name, on_socket)
        ready.set()
        await server.wait_for_termination()
    uvloop.run(main())


async def _round_trips(call, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await call.write(_request(i))
        resp = await call.read()
        out.append((time.perf_counter() - t0) * 1e6)
        assert resp.sequence == i
    return out


async def _measure(port: int, name: str, n: int, rounds: int) -> dict[str, list[float]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=server_options())
    grpc_call = channel.stream_stream(_METHOD, request_serializer=verifier_pb2.VerifyRequest.SerializeToString,
                                      response_deserializer=verifier_pb2.VerifyResponse.FromString)()
    socket_call = await step_socket.StepSocketCall.open(name, os.urandom(step_socket.KEY_BYTES),
                                                        verifier_pb2.VerifyResponse, MAX_MESSAGE_BYTES)
    times: dict[str, list[float]] = {"grpc_stream": [], "step_socket": []}
    for _ in range(rounds):   # alternated, so drift falls on both
        for lane, call in (("grpc_stream", grpc_call), ("step_socket", socket_call)):
            times[lane] += (await _round_trips(call, n))[n // 10:]   # the first tenth warms up
    grpc_call.cancel()
    socket_call.cancel()
    await channel.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--round-trips", type=int, default=2000, help="a lane's round trips per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    import torch
    import uvloop
    from services.common.launcher import free_port

    device = "cuda" if torch.cuda.is_available() else "cpu"
    port, name = free_port(), step_socket.socket_name(f"bench-{os.getpid()}")
    ready = mp.get_context("spawn").Event()
    echo = mp.get_context("spawn").Process(target=_echo, args=(port, name, ready), daemon=True)
    echo.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the echo process did not start")
        times = uvloop.run(_measure(port, name, args.round_trips, args.rounds))
    finally:
        echo.kill()
    rows = []
    for lane, ts in times.items():
        ts = sorted(ts)
        rows.append(dict(lane=lane, round_trips=len(ts), median_us=round(statistics.median(ts), 1),
                         p10_us=round(ts[len(ts) // 10], 1), p90_us=round(ts[len(ts) * 9 // 10], 1)))
        print(f"{lane:12s} round trip median {rows[-1]['median_us']:7.1f} us  p10 {rows[-1]['p10_us']:7.1f}  "
              f"p90 {rows[-1]['p90_us']:7.1f}  ({len(ts)} timed)")
    out = args.out or f"bench/results/step-socket-{'gpu' if device == 'cuda' else 'cpu'}.json"
    write_result(out, args.commit or None, dict(round_trips=args.round_trips, rounds=args.rounds,
                                                cpus=os.cpu_count()), rows, device=device)


if __name__ == "__main__":
    main()
