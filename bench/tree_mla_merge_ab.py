"""A/B of the split merge's launch shape (``tree_mla.merge_splits``) under the Gluon tree-MLA kernel.

Why: the merge ran one program for every 16 rows x 512 dims, each reading the splits one after
another. At batch 1 (72 rows, tens of splits) that is 5 programs walking a chain of dependent loads;
a first run of this A/B (``tree_mla_merge_ab_first.json``, commit 4d5decf) found value dims cut into
4 programs 14-20% faster there on the whole call, and within 2% at batch 32 and 128. The variants
cut the value dims into more programs (``d_chunks``) and read several splits at once
(``split_block``); ``plan`` is ``tree_mla.merge_plan``'s choice, ``old`` the merge before it.

Each variant times the whole ``tree_mla_hopper`` call (split kernel + merge) as served, CUDA-graph
replays rotating over input copies larger than L2, variants interleaved, the better of two rounds;
its output is compared bit for bit with the old merge's (the sums are the same, in the same order).

    python -m bench.tree_mla_merge_ab --commit SHA --out bench/results/tree_mla_merge_ab.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import kernels.tree_mla as tm
from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import rotating_cases, run_kernel

SHAPES = ((32, 4096, 8), (32, 4096, 9), (32, 4096, 17), (32, 4096, 33), (128, 4096, 9), (32, 16384, 9),
          (1, 1024, 9), (1, 4096, 9), (1, 16384, 9), (1, 4096, 17), (4, 4096, 9))
HEADS = 8
VARIANTS = {  # d_chunks, split_block (None: merge_plan's)
    "plan": (None, None),
    "old": (1, 1),  # the merge before merge_plan: whole rows, one split at a time
    "d1_b8": (1, 8),
    "d2_b8": (2, 8),
    "d4_b8": (4, 8),
    "d8_b8": (8, 8),
    "d8_b4": (8, 4),
    "d16_b8": (16, 8),  # 32 value dims a program
    "d16_b16": (16, 16),
    "d32_b8": (32, 8),  # 16 value dims a program
    "d32_b16": (32, 16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_merge_ab.json")
    ap.add_argument("--small", action="store_true", help="batch <= 4 only (where the merge is a large share)")
    args = ap.parse_args()
    served = tm.merge_splits

    def use(name: str) -> None:
        v = VARIANTS[name]
        tm.merge_splits = functools.partial(served, d_chunks=v[0], split_block=v[1])

    rows = []
    for batch, context, nodes in [sh for sh in SHAPES if not args.small or sh[0] <= 4]:
        cases = rotating_cases(batch, context, nodes, HEADS)
        first = cases[0]
        use("old")
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
        tm.merge_splits = served
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, copies=len(cases))
        for name in VARIANTS:
            row[f"{name}_us"] = round(min(times[name]), 2)
            row[f"{name}_us_rounds"] = [round(x, 2) for x in times[name]]
            row[f"{name}_equals_old"] = same[name]
            row[f"{name}_speedup_vs_old"] = round(min(times["old"]) / min(times[name]), 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k.endswith("_us") or k in ("batch", "context", "tree_nodes")}
                         | {k: v for k, v in row.items() if k.endswith("_equals_old") and not v}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 dict(variants={k: dict(d_chunks=v[0], split_block=v[1]) for k, v in VARIANTS.items()},
                      plan="tree_mla.merge_plan's launch (the served one)", rows_a_program=tm._MERGE_ROWS,
                      heads=HEADS, page_size=64,
                      timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies > L2; min of two "
                             "rounds, variants interleaved (second round in reverse order)"),
                 rows)


if __name__ == "__main__":
    main()
