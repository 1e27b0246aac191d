"""A/B of programmatic dependent launch on the served tree-attention call (split kernels + merge).

Why: the tree-attention table rerun after PDL (``bench/results/tree_mla-88ab166.json``) had some
batch-1 rows on the 64-row kernel 10-20% slower than at ``a846691`` while the few-row rows were
faster and batch 32 / 128 unchanged, on another machine. This times the same calls with PDL on
and off in one process, so the machine cannot be the difference, and with it on for only one of
the call's two launches (the split kernel, the merge), to say which launch the change is in:
``kernels.pdl.enabled`` is replaced for the run by a stub answering each launch in turn (a call
asks it once a launch, split kernel first; every shape here has more than one split, so a merge).
``pdl`` is the served rule, under which a merge after a split launch of more than half the SMs'
CTAs is not launched early (``kernels.tree_mla.merge_splits``); ``pdl_early_merge`` launches every
merge early, as before that rule.

Each shape times the whole served ``tree_mla_hopper`` call back to back in one CUDA graph (inputs
rotated past L2, as ``bench/tree_mla_bench.py``), each setting captured afresh, two rounds in
alternating order, the better of the two; the outputs of every setting must be equal bit for bit.

    python -m bench.tree_mla_pdl_ab --commit SHA --out bench/results/tree_mla_pdl_ab.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import rotating_cases
from kernels import pdl, tree_mla
from kernels.tree_mla_hopper import few_rows_serves, tree_mla_hopper

SHAPES = ((1, 1024, 9, 8), (1, 4096, 9, 8), (1, 4096, 33, 8), (1, 16384, 33, 8), (1, 4096, 9, 64), (1, 4096, 17, 64),
          (1, 16384, 9, 64), (1, 1024, 1, 8), (4, 4096, 17, 8), (8, 4096, 17, 8), (16, 4096, 9, 8), (32, 4096, 9, 8),
          (8, 4096, 1, 8), (32, 4096, 1, 8), (128, 4096, 1, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_pdl_ab.json")
    args = ap.parse_args()
    variants = {"plain": (False, False), "pdl": (True, True), "pdl_early_merge": (True, True), "split_pdl": (True, False),
                "merge_pdl": (False, True)}
    served_share = tree_mla.EARLY_MERGE_MAX_SHARE
    served_enabled = pdl.enabled
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context, nodes, heads in SHAPES:
        cases = rotating_cases(batch, context, nodes, heads)
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=heads,
                   kernel="few-row" if few_rows_serves(batch, nodes * heads, context, sms) else "64-row")
        times: dict[str, list[float]] = {name: [] for name in variants}
        outs = {}
        try:
            for rnd in range(2):
                for name in (list(variants) if rnd == 0 else list(variants)[::-1]):
                    answers = itertools.cycle(variants[name])  # split kernel, then merge, call after call
                    pdl.enabled = lambda device, a=answers: next(a) and served_enabled(device)
                    tree_mla.EARLY_MERGE_MAX_SHARE = float("inf") if name == "pdl_early_merge" else served_share
                    times[name].append(graph_replay_us([lambda c=c: tree_mla_hopper(*c.args()) for c in cases]))
                    if rnd == 0:
                        outs[name] = tree_mla_hopper(*cases[0].args())
        finally:
            pdl.enabled = served_enabled
            tree_mla.EARLY_MERGE_MAX_SHARE = served_share
        for name, ts in times.items():
            row[f"{name}_us"] = round(min(ts), 2)
            row[f"{name}_us_rounds"] = [round(t, 2) for t in ts]
        for name in variants:
            row[f"{name}_vs_plain"] = round(row["plain_us"] / row[f"{name}_us"], 3)
        row["outputs_equal"] = all(torch.equal(outs["plain"], o) for o in outs.values())
        row["finite"] = all(bool(torch.isfinite(o).all()) for o in outs.values())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_rounds")}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 dict(timing="whole tree_mla_hopper call, CUDA-graph replay rotating over inputs > L2, each setting "
                             "captured afresh; min of two rounds in alternating order",
                      variants={k: dict(split_kernel_pdl=v[0], merge_pdl=v[1]) for k, v in variants.items()},
                      check="outputs of every variant equal bit for bit", kernel="few_rows_serves' choice"),
                 rows)


if __name__ == "__main__":
    main()
