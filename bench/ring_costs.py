"""Host time of the cuda_ipc ring's write and read, and of each torch call inside them, on a GPU host.

Why: the step probe (`bench.step_probe`, H100) put 82 µs between the verifier's features ring write
starting and its stream sync, and 66-87 µs in the draft's read of that bundle, for one small tensor
each way on every C=1 step; the same calls on a CPU tensor take a few µs. This times them one by one
in one process (the ring's writer, and a reader of the same ring as a second process would map it),
beside the two ways to make a slot's view (index, slice and two views, as the ring did before
`24b4c48`; one strided view of the ring seen as the tensor's dtype, as it does since: 13.8 against
2.8 µs on an H100 host), so a change to either is judged on the machine where the stack runs. GPU only.

    python -m bench.ring_costs --out bench/results/ring-costs-<gpu>-<sha>.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import host_us, write_result
from services.common.cuda_ipc import CudaIpcReader, CudaIpcWriter
from services.common.transport import bundle_slot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4, help="feature rows (a C=1 step's committed tokens)")
    p.add_argument("--width", type=int, default=1280, help="feature width")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    writer = CudaIpcWriter(8 << 20, 4, dev)
    reader = CudaIpcReader.__new__(CudaIpcReader)   # the writer's own ring: a peer's mapping, without a peer
    reader._buf, reader._views = writer._buf, writer._views
    feats = torch.randn(args.rows, args.width, device=dev).to(torch.bfloat16)   # [rows, F]
    bundle = writer.write({"features": feats})
    got = reader.read(bundle)["features"]
    assert torch.equal(got, feats), "the ring read back other bytes"
    writer.release([bundle_slot(bundle)])
    buf, stream = writer._buf, torch.cuda.current_stream(dev)
    dst = writer._views.at(1, 64, feats.dtype, feats.shape)
    assert dst.data_ptr() == buf[1][64:].data_ptr()

    def write_and_release() -> None:
        b = writer.write({"features": feats})
        writer.release([bundle_slot(b)])

    nbytes = feats.nbytes
    parts = {
        "write (whole, then release)": write_and_release,
        "read (whole)": lambda: reader.read(bundle),
        "view: index, slice, two views (before)": lambda: buf[1][64:64 + nbytes].view(feats.dtype).view(feats.shape),
        "view: one as_strided (the ring's)": lambda: writer._views.at(1, 64, feats.dtype, feats.shape),
        "copy_ into a view": lambda: dst.copy_(feats, non_blocking=True),
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(dev),
        "stream.synchronize() (idle)": stream.synchronize,
        "tuple(t.shape)": lambda: tuple(feats.shape),
        "t.is_cuda": lambda: feats.is_cuda,
    }
    rows = []
    for name, fn in parts.items():
        us = host_us(fn, args.reps, warmup=50)
        torch.cuda.synchronize()
        rows.append({"part": name, "median_us": us})
        print(f"{name:36s} {us:8.2f} us", flush=True)
    if args.out:
        write_result(args.out, args.commit, {"rows": args.rows, "width": args.width, "dtype": "bfloat16", "reps": args.reps,
                                             "timing": "median of single calls, host clock; no sync inside a call unless named"},
                     rows)

if __name__ == "__main__":
    main()
