"""Per-step feature payload through each transport, producer and consumer in two processes.

The payload is what the verifier sends the draft each step: the committed tokens' target features
(`tokens_per_request` x batch rows of `layers x hidden` bf16). Timed: producer write + message
bytes through a pipe + consumer read into a private GPU tensor (what the draft does) + ack.
Writes bench/results/transport.json (TARGETS.md schema).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.common import git_commit

from ddtree.v1 import common_pb2
from services.common.transport import make_reader, make_writer


def _consumer(conn, kind: str, ring: str, slot_bytes: int, slots: int) -> None:
    reader = make_reader(kind, ring or None, slot_bytes, slots)
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        bundle = common_pb2.TensorBundle.FromString(msg)
        feats = reader.read(bundle)["features"].to("cuda", non_blocking=True).clone()   # private copy
        torch.cuda.synchronize()
        conn.send_bytes(bytes([int(feats.shape[0] > 0)]))
    reader.close()


def time_transport(kind: str, rows: int, width: int, iters: int) -> float:
    payload = torch.randn(rows, width, device="cuda").to(torch.bfloat16)                # [rows, F]
    slot_bytes = payload.numel() * 2 + 4096
    writer = make_writer(kind, slot_bytes, 4, "ddtree-bench")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, kind, writer.ring_name or "", writer.slot_bytes, 4))
    proc.start()
    times = []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bundle = writer.write({"features": payload})
        parent.send_bytes(bundle.SerializeToString())
        parent.recv_bytes()
        times.append(time.perf_counter() - t0)
        slot = next((r.slot.slot for r in bundle.tensors if r.WhichOneof("payload") == "slot"), None)
        if slot is not None:
            writer.release([slot])
    parent.send_bytes(b"")
    proc.join()
    writer.close()
    return statistics.median(times[5:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/transport.json")
    p.add_argument("--hidden", type=int, default=7168)        # Kimi-K2
    p.add_argument("--layers", type=int, default=3)           # target layers the drafter reads
    p.add_argument("--tokens-per-request", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--commit", default="")
    args = p.parse_args()
    width = args.hidden * args.layers
    rows = []
    for batch in (1, 128):
        n = batch * args.tokens_per_request
        for kind in ("cuda_ipc", "shm", "inline"):
            us = time_transport(kind, n, width, args.iters)
            rows.append({"transport": kind, "batch": batch, "bytes": n * width * 2, "time_us": round(us, 1)})
            print(f"{kind:>9} batch={batch:>4} bytes={n * width * 2:>10} {us:9.1f} us", flush=True)
    commit = git_commit(args.commit)
    doc = {"benchmark": "transport", "commit": commit or "unknown", "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": None, "rows": rows,
           "params": {k: v for k, v in vars(args).items() if k not in ("out", "commit")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
