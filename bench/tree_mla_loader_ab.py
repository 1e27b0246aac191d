"""A/B of the Gluon tree-attention MLA kernel's schedule options on one GPU, same run, same inputs.

Why: Nsight Compute (``bench/results/tree_mla_ncu.json``) finds no unit of the kernel saturated at
batch 32 x 4096, 8 heads (tensor pipe 38-47% busy, DRAM 20-60%, issue slots 32-38%): it waits. Two
options of ``tree_mla_hopper`` attack two of the waits:

* ``prefetch=D``: the loader asks L2 for the key tile ``D`` tiles ahead (one bulk prefetch), so
  the tile's TMA copy later finds it in L2; the ring's four slots bound the bytes in flight to
  shared memory, L2 does not.
* ``early_s``: a consumer warpgroup issues the logits of its next tile while its ``P V`` still
  runs, instead of after it.

Every variant is first checked as ``tree_mla_bench.check_correctness`` checks the served kernel
(float32 reference, NaN-poisoned outputs, splits 1 / 3 / default, graph replay == eager). Times are
CUDA-graph replays rotating over input copies larger than L2, the variants interleaved, the
better of two rounds.

    python -m bench.tree_mla_loader_ab --commit SHA --out bench/results/tree_mla_loader_ab.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import ROTATE_BYTES, Case, check_correctness, run_kernel

SHAPES = ((32, 4096, 8), (32, 4096, 9), (32, 4096, 17), (32, 4096, 33), (128, 4096, 9), (1, 16384, 9), (32, 16384, 9))
HEADS = 8
VARIANTS = {
    "base": dict(),
    "base_again": dict(),  # the spread between two timings of one kernel
    "tau8": dict(tau=8.0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_loader_ab.json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = args.variants.split(",")
    log: list[str] = []
    checks = {}
    for name in names:
        rows = check_correctness(log, "hopper", **VARIANTS[name])
        ok = all(r.get("finite", True) and r.get("rel_err", 0) < 2e-2 for r in rows) and rows[-1]["graph_equals_eager"]
        checks[name] = dict(ok=ok, max_rel_err=max(r.get("rel_err", 0) for r in rows), graph_equals_eager=rows[-1]["graph_equals_eager"])
        print(name, checks[name], flush=True)
    rows = []
    for batch, context, nodes in SHAPES:
        first = Case(batch, context, nodes, HEADS, seed=1)
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / first.bytes_read())))
        cases = [first] + [Case(batch, context, nodes, HEADS, seed=1 + i) for i in range(1, copies)]
        base_out = run_kernel("hopper", first)
        times: dict[str, list[float]] = {n: [] for n in names}
        same = {}
        for rnd in range(2):
            for name in (names if rnd == 0 else names[::-1]):
                kw = VARIANTS[name]
                times[name].append(graph_replay_us([lambda c=c, kw=kw: run_kernel("hopper", c, **kw) for c in cases]))
                if rnd == 0:
                    same[name] = bool(torch.equal(run_kernel("hopper", first, **kw), base_out))
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS,
                   bytes_read=first.bytes_read(), copies=copies)
        for name in names:
            row[f"{name}_us"] = round(min(times[name]), 2)
            row[f"{name}_us_rounds"] = [round(x, 2) for x in times[name]]
            row[f"{name}_equals_base"] = same[name]
            row[f"{name}_speedup"] = round(min(times["base"]) / min(times[name]), 3) if "base" in times else None
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("rounds")}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, "tree_mla_loader_ab", args.commit,
                 dict(variants=VARIANTS, heads=HEADS, page_size=64, splits="choose_splits (default)",
                      timing="CUDA-graph replay rotating over input copies > L2; min of two rounds, variants interleaved "
                             "(second round in reverse order)", checks=checks),
                 rows)


if __name__ == "__main__":
    main()
