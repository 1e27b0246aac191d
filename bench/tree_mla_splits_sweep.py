"""Split-count sweep of the served Gluon tree-MLA kernel at small batch (C=1..8 verify shapes).

Why: at batch 1-8 a request's rows make 2-3 CTAs, so the split count sets how much of the GPU the
call uses and how many float32 partials the merge reads; ``choose_splits`` leaves such grids to
``tree_mla.choose_num_splits`` (fill one wave). This times every split count beside the default, as
``tree_mla_bench.time_kernel`` does (CUDA-graph replay, median of 20, inputs rotated past L2).

    python -m bench.tree_mla_splits_sweep --commit SHA --out bench/results/tree_mla_splits_sweep.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import write_result
from bench.tree_mla_bench import KVR, ROPE, time_kernel
from kernels.tree_mla_hopper import BLOCK_M, choose_splits

SHAPES = ((1, 1024, 9), (1, 4096, 9), (1, 4096, 17), (1, 4096, 33), (1, 16384, 9), (1, 16384, 17), (2, 4096, 9),
          (4, 4096, 17), (8, 4096, 17))
SPLITS = (4, 8, 12, 16, 24, 32, 48, 64)
HEADS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_splits_sweep.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, context, nodes in SHAPES:
        m_tiles = -(-(nodes * HEADS) // BLOCK_M)
        default = choose_splits(batch, m_tiles, nodes * HEADS, context, KVR, ROPE, sms)
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, default_splits=default)
        row["default_us"] = round(time_kernel(batch, context, nodes, HEADS, backend="hopper")[0] * 1e6, 2)
        for s in SPLITS:
            if s * 64 <= context:
                row[f"splits{s}_us"] = round(time_kernel(batch, context, nodes, HEADS, backend="hopper", num_splits=s)[0] * 1e6, 2)
        best = min((k for k in row if k.startswith("splits")), key=lambda k: row[k])
        row["best"], row["best_us"] = best, row[best]
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(heads=HEADS, page_size=64, sm_count=sms, splits=list(SPLITS),
                      timing="bench.tree_mla_bench.time_kernel: CUDA-graph replay, median of 20, inputs rotated past L2"),
                 rows)


if __name__ == "__main__":
    main()
