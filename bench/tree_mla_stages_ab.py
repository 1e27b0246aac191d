"""A/B of the Gluon tree-MLA kernel's key ring: tile rows x ring depth, on the whole served call.

Why: the served ring (four 32-key slots) and the q tile fill the H200's shared memory (226 of
227 KB), and BENCHMARKS.md names that as the wall for a 9-node tree's 8 extra rows at 8 heads (a
narrow path for them needs their q, about 9 KB, in shared memory too). A three-deep ring frees 37
KB. This measures what the slot it gives up costs, next to the 64-key / two-slot shape.

Each variant times the whole ``tree_mla_hopper`` call (split kernel + merge) at the served split
count, CUDA-graph replays rotating over input copies larger than L2, variants interleaved, the
better of two rounds. 32-key variants must equal the served output bit for bit (the same sums in
the same order); 64-key tiles add in another order, so they are compared by relative error.

    python -m bench.tree_mla_stages_ab --commit SHA --out bench/results/tree_mla_stages_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import Case, rotating_cases
from kernels.tree_mla_hopper import tree_mla_hopper

SHAPES = ((32, 4096, 8), (32, 4096, 9), (32, 4096, 17), (32, 4096, 33), (128, 4096, 9), (32, 16384, 9), (1, 4096, 9))
HEADS = 8
VARIANTS = {"n32_s4": (32, 4), "n32_s3": (32, 3), "n32_s2": (32, 2), "n64_s2": (64, 2)}  # (block_n, num_stages)
SERVED = "n32_s4"


def call(case: Case, name: str) -> torch.Tensor:
    block_n, stages = VARIANTS[name]
    return tree_mla_hopper(*case.args(), block_n=block_n, num_stages=stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_stages_ab.json")
    args = ap.parse_args()
    rows = []
    for batch, context, nodes in SHAPES:
        cases = rotating_cases(batch, context, nodes, HEADS)
        first = cases[0]
        want = call(first, SERVED).float()
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, copies=len(cases))
        times: dict[str, list[float]] = {n: [] for n in VARIANTS}
        for rnd in range(2):
            for name in (list(VARIANTS) if rnd == 0 else list(VARIANTS)[::-1]):
                times[name].append(graph_replay_us([lambda c=c, n=name: call(c, n) for c in cases]))
                if rnd == 0:
                    got = call(first, name).float()
                    row[f"{name}_finite"] = bool(torch.isfinite(got).all())
                    row[f"{name}_equals_served"] = bool(torch.equal(got, want))
                    row[f"{name}_rel_vs_served"] = float(((got - want).norm() / want.norm()).item())
        for name in VARIANTS:
            row[f"{name}_us"] = round(min(times[name]), 2)
            row[f"{name}_us_rounds"] = [round(x, 2) for x in times[name]]
            row[f"{name}_vs_served"] = round(min(times[SERVED]) / min(times[name]), 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k.endswith(("_us", "_vs_served", "_equals_served"))
                          or k in ("batch", "context", "tree_nodes")}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 dict(variants={k: dict(block_n=v[0], num_stages=v[1]) for k, v in VARIANTS.items()}, served=SERVED,
                      heads=HEADS, splits="choose_splits' count (the served one)",
                      timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies > L2; min of two "
                             "rounds, variants interleaved (second round in reverse order)",
                      check="output of each variant against the served ring's on the same inputs: bit for bit "
                            "(equals_served) and relative error"),
                 rows)


if __name__ == "__main__":
    main()
