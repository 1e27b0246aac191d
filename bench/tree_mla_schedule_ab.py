"""A/B of the Gluon tree-MLA kernel's two schedules on one GPU, same run, same inputs.

``sync``: one program, 8 warps, the logits split by keys between the warpgroups, every step
waited in turn (``_tree_mla_hopper_kernel``). ``pingpong``: a loader partition and two consumer
warpgroups that take turns computing a tile's logits while the other runs its products
(``_tree_mla_pingpong_kernel``). Both are first checked against the float32 reference
(``bench.tree_mla_bench.check_correctness``: NaN-poisoned outputs, 1 / 3 / default splits, page
sizes 1 / 16 / 64, the demo dims, graph replay == eager), then timed as ``tree_mla_bench`` times
(CUDA-graph replay, inputs rotated past L2), alternating the schedules at each shape.

Usage: python -m bench.tree_mla_schedule_ab --out bench/results/tree_mla_schedule_ab.json [--commit SHA] [--quick]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import kernels.tree_mla_hopper as hop
from bench.common import measure_copy_gbps, write_result
from bench.tree_mla_bench import check_correctness, time_kernel

SHAPES = [  # batch, context, tree nodes, heads
    (32, 4096, 8, 8), (32, 4096, 9, 8), (32, 4096, 17, 8), (32, 4096, 33, 8),
    (128, 4096, 9, 8), (32, 16384, 9, 8), (1, 4096, 9, 8), (32, 1024, 17, 64), (32, 4096, 9, 64),
]
BACKENDS = {"sync": "hopper", "pingpong": "hopper_pingpong"}
# pingpong variants timed beside the served settings: (module attribute, value)
VARIANTS = {"pingpong_cpasync": ("_PP_TMA", False), "pingpong_r232": ("_PP_CONSUMER_REGS", 232)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "tree_mla_schedule_ab.json"))
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    ap.add_argument("--quick", action="store_true", help="checks and the first two shapes only")
    ap.add_argument("--skip-checks", action="store_true")
    args = ap.parse_args()
    log: list[str] = []
    copy_gbps = measure_copy_gbps()
    checks = [] if args.skip_checks else [row for b in ("hopper_pingpong", "hopper") for row in check_correctness(log, b)]
    bad = [c for c in checks if not c.get("graph_equals_eager", True) or not c.get("finite", True) or c.get("rel_err", 0) > 5e-3]
    rows = []
    for batch, context, nodes, heads in SHAPES[:2] if args.quick else SHAPES:
        row = {"batch": batch, "context": context, "tree_nodes": nodes, "heads": heads}
        for name, backend in BACKENDS.items():
            t, case = time_kernel(batch, context, nodes, heads, backend=backend)
            row[f"{name}_us"] = round(t * 1e6, 2)
            row[f"{name}_frac_of_copy"] = round(case.bytes_read() / t / 1e9 / copy_gbps, 3)
        t, _ = time_kernel(batch, context, nodes, heads, backend="hopper_pingpong_bn64")
        row["pingpong_bn64_us"] = round(t * 1e6, 2)
        for name, (attr, value) in VARIANTS.items():
            keep = getattr(hop, attr)
            setattr(hop, attr, value)
            try:
                t, case = time_kernel(batch, context, nodes, heads, backend="hopper_pingpong")
            finally:
                setattr(hop, attr, keep)
            row[f"{name}_us"] = round(t * 1e6, 2)
        row["speedup"] = round(row["sync_us"] / row["pingpong_us"], 3)
        rows.append(row)
        print(row, flush=True)
    params = {"schedules": dict(BACKENDS), "variants": {k: f"pingpong with {a} = {v}" for k, (a, v) in VARIANTS.items()}
              | {"pingpong_bn64": "pingpong with 64-key tiles, 2 stages"}, "kvr": 512, "rope": 64, "page_size": 64, "dtype": "bfloat16",
              "timing": "bench.tree_mla_bench.time_kernel (CUDA-graph replay, median of 20, inputs rotated past L2)",
              "bytes": "KV prefix + q + tree kv (reads only), as tree_mla.json", "checks": checks, "checks_failed": bad}
    write_result(args.out, Path(args.out).stem, args.commit, params, rows)
    print("checks failed:", bad if bad else "none")


if __name__ == "__main__":
    main()
