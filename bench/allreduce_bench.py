"""Small all-reduce on 2 GPUs: one-shot symmetric memory (in a CUDA graph; one launch from an aligned
tensor, copies in and out from one that is not) vs NCCL eager and in a graph.

Run: python -m bench.allreduce_bench  (spawns one process per GPU). Sizes 1 KB..4 MB of bf16.
Writes bench/results/allreduce.json (BENCHMARKS.md's result-file schema). NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [1 << 10, 4 << 10, 14 << 10, 64 << 10, 126 << 10, 256 << 10, 896 << 10, 4 << 20]


def _time_graph(fn, x: torch.Tensor, reps: int = 50) -> float:
    """Mean microseconds per call, `reps` calls captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def _time_eager(fn, x: torch.Tensor, reps: int = 200) -> float:
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` that starts 1 element into its storage: torch's one-launch op refuses it, so it
    goes through a copy in and a copy out (the one-shot path before the one-launch op)."""
    return torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)[1:].copy_(x)


def _worker(rank: int, world: int, port: int, out: str, commit: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    from services.verifier.allreduce import SmallAllReduce

    custom = SmallAllReduce(max_bytes=max(SIZES), dtype=torch.bfloat16, device=f"cuda:{rank}")
    nccl = lambda t: dist.all_reduce(t)  # noqa: E731
    rows = []
    for nbytes in SIZES:
        x = torch.randn(nbytes // 2, device="cuda").to(torch.bfloat16)
        # correctness on fresh data before timing
        want = x.float().clone()
        dist.all_reduce(want)
        ok = all(bool(torch.allclose(custom(t).float(), want, rtol=2e-2, atol=2e-2)) for t in (x.clone(), _shifted(x)))
        custom_us = _time_graph(custom, x.clone()) if custom.one_shot else None
        custom_copying_us = _time_graph(custom, _shifted(x)) if custom.one_shot else None
        nccl_us = _time_eager(nccl, x.clone())
        nccl_graph_us = _time_graph(nccl, x.clone())
        row = {"bytes": nbytes, "custom_us": custom_us, "custom_copying_us": custom_copying_us,
               "nccl_us": nccl_us, "nccl_graph_us": nccl_graph_us,
               "speedup": nccl_us / custom_us if custom_us else None,
               "speedup_graph": nccl_graph_us / custom_us if custom_us else None, "correct": ok}
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        doc = {"benchmark": Path(out).stem, "commit": commit, "gpu": torch.cuda.get_device_name(0),
               "copy_gbps": copy_gbps_on("cuda"), "params": {"world_size": world, "dtype": "bfloat16", "graph_reps": 50,
                                             "one_shot": custom.one_shot, "fallback_reason": custom.reason},
               "rows": rows}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/allreduce.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    from services.common.launcher import free_port
    commit = git_commit(args.commit)
    world = torch.cuda.device_count()
    assert world >= 2, "needs two GPUs"
    mp.spawn(_worker, args=(2, free_port(), args.out, commit or "unknown"), nprocs=2)


if __name__ == "__main__":
    main()
