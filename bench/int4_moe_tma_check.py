"""Stress check of the Gluon MoE GEMMs' TMA weight path: many calls, each against the cp.async path.

Why: TMA copies complete on mbarriers that the kernel re-arms every ring step; a mistake in that
protocol shows up as an occasional wrong or unwritten tile, not as a steady error. Each launch
below runs ``--reps`` times with fresh routings, outputs NaN-poisoned, and must equal the same
launch with ``cp.async`` weights bit for bit (same data, same products, same order). Split-K
gate/up launches add their K slices' float32 sums in slice order (the last slice of a tile adds
them), so they too must be equal, with their workspace NaN-poisoned, and leave their tile counters
at zero. The down GEMM's h has NaN in its padding rows, which the copies must zero-fill and which
must reach no output.

    python bench/int4_moe_tma_check.py --commit SHA --out bench/results/int4_moe_tma_check.json [--module M]
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

import kernels.int4_moe as km
from bench.common import write_result
from bench.int4_moe_bench import SHAPES, rand_routing, shape_weights
from kernels.device import tile_counters

# (shape, M, GEMM, gemm keyword arguments): the served TMA launches and the TMA launches that are not served
LAUNCHES = (
    ("tp8", 9, "gate_up", dict(block_m=16, block_n=64, stages=2, split_k=8)),
    ("tp8", 72, "gate_up", dict(block_m=16, block_n=64, stages=2, split_k=2)),
    ("tp8", 72, "gate_up", dict(block_m=16, block_n=64, stages=2)),
    ("tp8", 1152, "gate_up", dict(block_m=32, block_n=64, stages=2)),
    ("tp8", 72, "down", dict(block_m=16, block_n=64, stages=2, n_tiles=8)),
    ("tp8", 1152, "down", dict(block_m=32, block_n=64, stages=2, n_tiles=8)),
    ("ep8", 288, "gate_up", dict(block_m=64, block_n=64, stages=2)),
    ("ep8", 288, "down", dict(block_m=64, block_n=128, stages=2)),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_tma_check.json")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--module", default="kernels.int4_moe_hopper", help="the module whose gemm is checked")
    args = ap.parse_args()
    hop = importlib.import_module(args.module)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, weights = [], {}
    for shape, M, which, kw in LAUNCHES:
        sh = SHAPES[shape]
        E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
        wg, wu, wd = shape_weights(weights, shape, gen)
        A = M * k
        bad_nan = bad_diff = bad_count = 0
        for _ in range(args.reps):
            x = (torch.randn(M, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
            ids, tw = rand_routing(M, E, k, "cuda", gen)
            align = km.int4_moe_align(ids, E, kw["block_m"])
            P = align.num_blocks * kw["block_m"]
            h = None
            if which == "down":  # padding rows NaN: cp.async must zero-fill them, and none may leak
                h = torch.randn(P, I, device="cuda", generator=gen).to(torch.bfloat16)
                h[align.sorted_ids >= A] = float("nan")
            outs = []
            split = kw.get("split_k", 1)
            for tma in (False, True):
                if which == "gate_up" and split > 1:  # the slices' float32 sums in a NaN-poisoned workspace
                    out = torch.full((P, I), float("nan"), dtype=torch.bfloat16, device="cuda")
                    ws = torch.full((split, P, 2 * I), float("nan"), dtype=torch.float32, device="cuda")
                    hop.gemm(hop.permute_k(x), wg, wu, out, align.sorted_ids, align.block_expert, align.sorted_ids, I, K, A,
                             k, K // split, gated=True, atomic=False, w_tma=tma, ws=ws, counters=tile_counters(x.device), **kw)
                    outs.append(out[align.sorted_ids < A])
                    bad_count += int(bool(tile_counters(x.device).any()))
                elif which == "gate_up":
                    out = torch.full((P, I), float("nan"), dtype=torch.bfloat16, device="cuda")
                    hop.gemm(hop.permute_k(x), wg, wu, out, align.sorted_ids, align.block_expert, align.sorted_ids, I, K, A,
                             k, K, gated=True, atomic=False, split_k=1, w_tma=tma, **kw)
                    outs.append(out[align.sorted_ids < A])
                else:
                    out = torch.full((A, K), float("nan"), dtype=torch.bfloat16, device="cuda")
                    hop.gemm(hop.permute_k(h), wd, wd, out, align.sorted_ids, align.block_expert, tw.contiguous().view(-1),
                             K, I, A, k, I, gated=False, atomic=False, split_k=1, w_tma=tma, **kw)
                    outs.append(out)
            torch.cuda.synchronize()
            bad_nan += int(not bool(torch.isfinite(outs[1]).all()))
            bad_diff += int(not torch.equal(outs[0], outs[1]))
        row = dict(shape=shape, tokens=M, gemm=which, launch=dict(kw), reps=args.reps,
                   calls_not_finite=bad_nan, calls_not_equal=bad_diff, calls_leaving_counters_set=bad_count)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(module=args.module, reps=args.reps, check="TMA-weight output NaN-poisoned, then equal bit for bit "
                      "to the same launch with cp.async weights (split-K: workspace NaN-poisoned, tile counters zero after; down: h's "
                      "padding rows NaN), "
                      "fresh routing and inputs each call"), rows)


if __name__ == "__main__":
    main()
