"""Nsight Compute counters of the Gluon MoE GEMMs at the K2 points that miss 50% of copy bandwidth.

Why: to say where the gate/up and down GEMMs lose time (DRAM busy, warp stall reasons, pipe use,
occupancy) before choosing the next kernel change. For each point this runs ``ncu`` on itself
(``--target``: three calls of ``fused_int4_moe`` at ``choose_config``'s config), profiles the
third call's two Gluon launches and writes the raw counters to ``bench/results/int4_moe_ncu.json``.
Counters, not times: ``ncu`` serialises and replays each launch (``gpu__time_duration`` is one
launch's time under the profiler, not the graph-replayed time of ``int4_moe_bench.py``).

    python bench/int4_moe_ncu.py --commit SHA --ncu /usr/local/cuda/bin/ncu --out bench/results/int4_moe_ncu.json
    python bench/int4_moe_ncu.py --points ep8:288 tp8:288 ...   # other points

The shared-memory counters (``l1tex__data_pipe_lsu_wavefronts_mem_shared``, ``sm__pipe_shared``,
``sm__memory_throughput``) say whether the SM's shared-memory bandwidth, which the wgmma's B reads,
the activation fills and the word reads share, limits a GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bench.ncu import STALLS, profile, stall_metrics

POINTS = (("tp8", 72), ("tp8", 1152), ("ep8", 288))
METRICS = [
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__memory_throughput.avg.pct_of_peak_sustained_active",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_active",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "smsp__inst_executed_op_shared_ld.sum",
    "smsp__inst_executed_op_ldgsts.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
    "smsp__inst_executed.sum",
    "dram__bytes_read.sum",
] + stall_metrics(STALLS[:14])


def target(shape: str, tokens: int) -> None:
    """The profiled process: three calls at the served config (the third's launches are kept)."""
    import torch

    import kernels.int4_moe as km
    from bench.int4_moe_bench import GROUP, SHAPES, rand_int4_stack, rand_routing

    sh = SHAPES[shape]
    E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    wg, wu, wd = (rand_int4_stack(E, I, K, "cuda", gen), rand_int4_stack(E, I, K, "cuda", gen),
                  rand_int4_stack(E, K, I, "cuda", gen))
    x = (torch.randn(tokens, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    ids, tw = rand_routing(tokens, E, k, "cuda", gen)
    for _ in range(3):
        km.fused_int4_moe(x, wg, wu, wd, ids, tw, GROUP)
    torch.cuda.synchronize()


def profile_point(ncu: str, shape: str, tokens: int) -> list[dict]:
    """``ncu`` raw counters of the third call's gate/up and down launches, one dict each."""
    target = [sys.executable, os.path.abspath(__file__), "--target", shape, str(tokens)]
    launches = profile(ncu, target, METRICS, kernel_regex="_moe_gemm_hopper_kernel", launch_skip=4, launch_count=2)
    return [dict(shape=shape, tokens=tokens, gemm=gemm, **rec) for gemm, rec in zip(("gate_up", "down"), launches)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", nargs=2, metavar=("SHAPE", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_ncu.json")
    ap.add_argument("--points", nargs="+", default=[f"{s}:{t}" for s, t in POINTS],
                    help="SHAPE:TOKENS points (default: the three that missed 50%% of copy)")
    args = ap.parse_args()
    if args.target:
        target(args.target[0], int(args.target[1]))
        return
    from bench.common import write_result

    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points]
    rows = []
    for shape, tokens in points:
        rows += profile_point(args.ncu, shape, tokens)
        for r in rows[-2:]:
            print(json.dumps({k: v for k, v in r.items() if not k.endswith(".unit")}), flush=True)
    write_result(
        args.out, args.commit,
        dict(points=[list(p) for p in points], config="choose_config's (the served one)",
             launches="the third fused_int4_moe call's gate/up and down Gluon launches",
             stalls="smsp__average_warp_latency_issue_stalled_*.ratio: cycles a warp spent in that state "
                    "per issued instruction (selected = issuing)",
             note="ncu serialises and replays each launch (clocks left alone since the shared runner, "
                  "bench/ncu.py), so gpu__time_duration is not the graph-replayed time of int4_moe_bench.py"),
        rows,
    )


if __name__ == "__main__":
    main()
