"""Nsight Compute counters of the Gluon tree-attention MLA kernel at batch 32 x context 4096, 8 heads.

Why: the warp-specialised kernel's products alone take about twice the time its MMAs need at the
bf16 rate (``tree_mla_pingpong_diag.json``: 50 us at 64 rows a request against ~23 us of MMA
work), and tree 9 is compute-bound in it. These counters say which unit or wait holds it: the
tensor pipe, shared-memory bandwidth (``S = Q K^T`` reads both operands from shared memory),
or the warps' waits. For each point this runs ``ncu`` on itself (``--target``: three
``tree_mla_hopper`` calls, the third inside an NVTX range) and keeps that call's launches (the
split kernel and, with several splits, the merge).

    python -m bench.tree_mla_ncu --commit SHA --ncu /usr/local/cuda/bin/ncu --out bench/results/tree_mla_ncu.json
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.ncu import STALLS, profile, stall_metrics

POINTS = ((32, 4096, 8), (32, 4096, 9), (32, 4096, 17), (32, 4096, 33))  # batch, context, tree nodes; 8 heads
HEADS = 8
METRICS = [
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.avg.per_second",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__grid_size",
    "sm__cycles_active.max",
    "sm__cycles_elapsed.max",
    "launch__shared_mem_per_block_dynamic",
    "smsp__inst_executed.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
] + stall_metrics(STALLS)


def target(batch: int, context: int, nodes: int) -> None:
    """The profiled process: three calls, the third in the NVTX range ``third``."""
    import torch

    from bench.tree_mla_bench import Case
    from kernels.tree_mla_hopper import tree_mla_hopper

    case = Case(batch, context, nodes, HEADS, seed=1)
    for i in range(3):
        if i == 2:
            torch.cuda.nvtx.range_push("third")
        tree_mla_hopper(*case.args())
        if i == 2:
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs=3, type=int, metavar=("BATCH", "CONTEXT", "NODES"), help=argparse.SUPPRESS)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_ncu.json")
    ap.add_argument("--points", nargs="+", default=None, metavar="B,C,N",
                    help="batch,context,nodes triples (default: batch 32 x 4096, trees 8/9/17/33)")
    args = ap.parse_args()
    if args.target:
        target(*args.target)
        return
    from bench.common import write_result

    points = [tuple(int(v) for v in p.split(",")) for p in args.points] if args.points else list(POINTS)
    rows = []
    for batch, context, nodes in points:
        cmd = [sys.executable, "-m", "bench.tree_mla_ncu", "--target", str(batch), str(context), str(nodes)]
        for rec in profile(args.ncu, cmd, METRICS, nvtx_include="third/"):
            rows.append(dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, **rec))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith(".unit")}), flush=True)
    write_result(
        args.out, args.commit,
        dict(points=[list(p) for p in points], heads=HEADS, page_size=64, splits="the kernel's default (choose_splits)",
             launches="the third tree_mla_hopper call: the split kernel, then the merge where there are splits",
             stalls="smsp__average_warp_latency_issue_stalled_*.ratio: cycles a warp spent in that state per issued "
                    "instruction, over all warps (loader and consumers)",
             note="ncu serialises and replays each launch, clocks left alone (--clock-control none); "
                  "gpu__time_duration is one launch under the profiler, not a graph-replayed time"),
        rows,
    )


if __name__ == "__main__":
    main()
