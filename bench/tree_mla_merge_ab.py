"""A/B of the split merge's launch shape (``tree_mla.merge_splits``) under the Gluon tree-MLA kernel.

Why: Nsight Compute (``bench/results/tree_mla_ncu.json``) has the merge at 7-14% of a call at batch 32
x 4096, 8 heads (6.5-23 us), at 30-65% of DRAM bandwidth: one program a 16 rows x 512 dims, 128
programs at 64 rows a request, each reading the splits one after another. The variants cut the value
dims into more programs (``d_chunks``) and read every split's partial at once (``unroll``).

Each variant times the whole ``tree_mla_hopper`` call (split kernel + merge) as served, CUDA-graph
replays rotating over input copies larger than L2, variants interleaved, the better of two rounds;
its output is compared bit for bit with the served merge's (the sums are the same, in the same order).

    python -m bench.tree_mla_merge_ab --commit SHA --out bench/results/tree_mla_merge_ab.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

import kernels.tree_mla as tm
from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import ROTATE_BYTES, Case, run_kernel

SHAPES = ((32, 4096, 8), (32, 4096, 9), (32, 4096, 17), (32, 4096, 33), (128, 4096, 9), (1, 16384, 9), (1, 4096, 9),
          (32, 16384, 9))
HEADS = 8
VARIANTS = {  # block_r, d_chunks, unroll
    "served": None,
    "r16_d1_unroll": (16, 1, True),
    "r16_d2_unroll": (16, 2, True),
    "r16_d4_unroll": (16, 4, True),
    "r16_d4_loop": (16, 4, False),
    "r8_d4_unroll": (8, 4, True),
    "r32_d4_unroll": (32, 4, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_merge_ab.json")
    args = ap.parse_args()
    served = tm.merge_splits

    def use(name: str) -> None:
        v = VARIANTS[name]
        tm.merge_splits = served if v is None else functools.partial(served, block_r=v[0], d_chunks=v[1], unroll=v[2])

    rows = []
    for batch, context, nodes in SHAPES:
        first = Case(batch, context, nodes, HEADS, seed=1)
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / first.bytes_read())))
        cases = [first] + [Case(batch, context, nodes, HEADS, seed=1 + i) for i in range(1, copies)]
        use("served")
        want = run_kernel("hopper", first)
        times: dict[str, list[float]] = {n: [] for n in VARIANTS}
        same = {}
        for rnd in range(2):
            for name in (list(VARIANTS) if rnd == 0 else list(VARIANTS)[::-1]):
                use(name)
                times[name].append(graph_replay_us([lambda c=c: run_kernel("hopper", c) for c in cases]))
                if rnd == 0:
                    got = run_kernel("hopper", first)
                    same[name] = bool(torch.equal(got, want))
        use("served")
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, copies=copies)
        for name in VARIANTS:
            row[f"{name}_us"] = round(min(times[name]), 2)
            row[f"{name}_us_rounds"] = [round(x, 2) for x in times[name]]
            row[f"{name}_equals_served"] = same[name]
            row[f"{name}_speedup"] = round(min(times["served"]) / min(times[name]), 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k.endswith("_us") or k in ("batch", "context", "tree_nodes")}
                         | {k: v for k, v in row.items() if k.endswith("_equals_served") and not v}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, "tree_mla_merge_ab", args.commit,
                 dict(variants={k: (None if v is None else dict(block_r=v[0], d_chunks=v[1], unroll=v[2]))
                                for k, v in VARIANTS.items()},
                      served="block_r 16, d_chunks 1, no unroll (the merge before this A/B)", heads=HEADS, page_size=64,
                      timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies > L2; min of two "
                             "rounds, variants interleaved (second round in reverse order)"),
                 rows)


if __name__ == "__main__":
    main()
