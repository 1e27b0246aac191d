"""Per-step feature payload through each transport, producer and consumer in two processes.

The payload is what the verifier sends the draft each step: the committed tokens' target features
(`tokens_per_request` x batch rows of `layers x hidden` bf16). Timed: producer write + message
bytes through a pipe + consumer read into a private GPU tensor (what the draft does) + ack.
Writes bench/results/transport.json (BENCHMARKS.md's result-file schema).

`--consumer-device cuda:1` puts the consumer on another GPU of the host (the draft on one GPU,
the verifier on another): it reads the producer's slot on the producer's GPU and copies it into
its own. Those rows carry `producer_device` and `consumer_device`; with `--append` they join the
rows already in `--out` (measured with the same payload parameters), replacing rows of the same
transport, batch and consumer device, so one transport.json holds both placements.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit

from ddtree.v1 import common_pb2
from services.common.transport import make_reader, make_writer

PRODUCER_DEVICE = "cuda:0"
_PAYLOAD_PARAMS = ("hidden", "layers", "tokens_per_request", "iters")


def _consumer(conn, kind: str, ring: str, slot_bytes: int, slots: int, device: str) -> None:
    torch.cuda.set_device(device)
    reader = make_reader(kind, ring or None, slot_bytes, slots)
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        bundle = common_pb2.TensorBundle.FromString(msg)
        # The read is a view where the ring lives (the producer's GPU for cuda_ipc); the private copy
        # lands on the consumer's device, across GPUs when the two differ.
        feats = reader.read(bundle)["features"].to(device, non_blocking=True).clone()   # private copy
        torch.cuda.synchronize(device)
        conn.send_bytes(bytes([int(feats.shape[0] > 0)]))
    reader.close()


def time_transport(kind: str, rows: int, width: int, iters: int, consumer_device: str = PRODUCER_DEVICE) -> float:
    payload = torch.randn(rows, width, device=PRODUCER_DEVICE).to(torch.bfloat16)        # [rows, F]
    slot_bytes = payload.numel() * 2 + 4096
    writer = make_writer(kind, slot_bytes, 4, "ddtree-bench", device=PRODUCER_DEVICE)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, kind, writer.ring_name or "", writer.slot_bytes, 4,
                                               consumer_device))
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


def row_key(row: dict) -> tuple:
    """Rows without a consumer_device were measured with both ends on the producer's GPU."""
    return row["transport"], row["batch"], row.get("consumer_device", PRODUCER_DEVICE)


def merge_rows(old: dict, new_rows: list[dict], commit: str, params: dict) -> list[dict]:
    """`old`'s rows plus `new_rows`, a new row replacing an old one of the same key. Old rows keep
    their own commit; refuses rows measured on another payload (their numbers would not compare)."""
    mismatched = {k: (old.get("params", {}).get(k), params.get(k)) for k in _PAYLOAD_PARAMS
                  if old.get("params", {}).get(k) != params.get(k)}
    if mismatched:
        raise ValueError(f"--append: the file's rows were measured with other parameters {mismatched}; "
                         f"use the same ones or another --out")
    fresh = {row_key(r) for r in new_rows}
    kept = [{**r, "commit": r.get("commit", old.get("commit", "unknown"))} for r in old.get("rows", [])
            if row_key(r) not in fresh]
    return kept + [{**r, "commit": commit} for r in new_rows]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/transport.json")
    p.add_argument("--hidden", type=int, default=7168)        # Kimi-K2
    p.add_argument("--layers", type=int, default=3)           # target layers the drafter reads
    p.add_argument("--tokens-per-request", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--consumer-device", default="", help="e.g. cuda:1: the consumer on another GPU "
                   f"(the producer stays on {PRODUCER_DEVICE}); default: the producer's GPU")
    p.add_argument("--append", action="store_true", help="merge the rows into --out instead of replacing the file")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    consumer = args.consumer_device or PRODUCER_DEVICE
    width = args.hidden * args.layers
    rows = []
    for batch in (1, 128):
        n = batch * args.tokens_per_request
        for kind in ("cuda_ipc", "shm", "inline"):
            us = time_transport(kind, n, width, args.iters, consumer)
            row = {"transport": kind, "batch": batch, "bytes": n * width * 2, "time_us": round(us, 1)}
            if args.consumer_device:
                row.update(producer_device=PRODUCER_DEVICE, consumer_device=consumer)
            rows.append(row)
            print(f"{kind:>9} batch={batch:>4} bytes={n * width * 2:>10} {PRODUCER_DEVICE}->{consumer} "
                  f"{us:9.1f} us", flush=True)
    commit = git_commit(args.commit)
    params = {k: v for k, v in vars(args).items() if k not in ("out", "commit", "append", "consumer_device")}
    out = Path(args.out)
    if args.append and out.is_file():
        rows = merge_rows(json.loads(out.read_text()), rows, commit, params)
    doc = {"benchmark": out.stem, "commit": commit or "unknown", "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": copy_gbps_on("cuda"), "rows": rows, "params": params}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
