"""SM clock and board power while the served tree attention runs, at 64 rows a request and at a
9-node tree's 72 (8 heads), H200.

Why: at batch 32 x 4096 a 72-row tree takes 91 us against 61 for 64 rows, though its extra CTA a
request (8 live rows) runs beside the other on an SM of its own. A diagnostic of that kernel with
the copies left out still took 81 against 50 us (BENCHMARKS.md), so something the SMs share
slows them all. The clock is the candidate: a GPU at its power limit lowers it. This replays each
shape's call back to back for a while, samples the SM clock and power through NVML meanwhile, and
times the replays.

    python -m bench.tree_mla_clocks --commit SHA --out bench/results/tree_mla_clocks.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from bench.common import write_result
from bench.tree_mla_bench import rotating_cases
from kernels.tree_mla_hopper import tree_mla_hopper

SHAPES = ((32, 4096, 8, 8), (32, 4096, 9, 8), (32, 4096, 17, 8), (128, 4096, 9, 8), (32, 4096, 9, 64))


def sample(handle, stop: threading.Event, out: list) -> None:
    import pynvml  # nvidia-ml-py: the GPU extra

    while not stop.is_set():
        out.append((pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))
        time.sleep(0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_clocks.json")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    import pynvml  # nvidia-ml-py: the GPU extra

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    max_clock = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)
    rows = []
    for batch, context, nodes, heads in SHAPES:
        cases = rotating_cases(batch, context, nodes, heads)
        graph = torch.cuda.CUDAGraph()
        for c in cases:  # warm up and compile outside the capture
            tree_mla_hopper(*c.args())
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for c in cases:
                tree_mla_hopper(*c.args())
        graph.replay()
        torch.cuda.synchronize()
        samples: list = []
        stop = threading.Event()
        t = threading.Thread(target=sample, args=(handle, stop, samples))
        t.start()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.time()
        replays = 0
        start.record()
        while time.time() - t0 < args.seconds:
            for _ in range(20):
                graph.replay()
            replays += 20
            torch.cuda.synchronize()
        end.record()
        end.synchronize()
        stop.set()
        t.join()
        steady = samples[len(samples) // 4:]  # past the ramp
        clocks = sorted(s[0] for s in steady)
        power = sorted(s[1] for s in steady)
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=heads, rows=nodes * heads,
                   us_per_call=round(start.elapsed_time(end) * 1e3 / (replays * len(cases)), 2),
                   sm_clock_mhz_median=clocks[len(clocks) // 2], sm_clock_mhz_min=clocks[0],
                   power_w_median=round(power[len(power) // 2], 1), power_w_max=round(power[-1], 1), samples=len(steady))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del graph, cases
        torch.cuda.empty_cache()
    write_result(args.out, args.commit, dict(power_limit_w=limit_w, max_sm_clock_mhz=max_clock, seconds=args.seconds,
                                             timing="served tree_mla_hopper call, CUDA-graph replays back to back "
                                                    "(inputs rotated past L2) for --seconds; NVML sampled every 5 ms, "
                                                    "the first quarter of the samples dropped"), rows)


if __name__ == "__main__":
    main()
