"""Probe: the gated gate/up GEMM on 128-row weight tiles (two warpgroups sharing each activation tile).

Why: at K2 EP8 M = 288 the served gate/up CTA (64 weight rows, block_m 64) copies a 64 x 128
activation tile (16 KB) every K step for 4 KB of INT4 words, and its counters show the warps
waiting, not a unit saturated (BENCHMARKS.md, fused INT4 MoE). The one-matrix probe
(``int4_moe_one_matrix_probe.py``) found 128-row tiles the only shape that gained there (424.5 vs
457.2 us, as two one-matrix GEMMs). This times the gated kernel itself on 128-row tiles (8 warps, one
CTA where two of 4 warps sit now): the same registers a thread, half the activation copies per weight
byte, but CTA barriers over 8 warps.

Per point (uniform routings, CUDA-graph replay of R calls, median of 20): the served gated gate/up
GEMM (64-row tiles) and the 128-row one at ring depths 2 and 3. Check: each variant's h against the
served h, bit for bit (every row sums the same K steps in the same order), every element written
(NaN-poisoned outputs, real rows).

    python bench/int4_moe_gu128_probe.py --commit SHA --out bench/results/int4_moe_gu128_probe-SHA.json
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels.int4_moe as km
from bench.common import graph_replay_us, write_result
from bench.int4_moe_bench import gated_point
from kernels import int4_moe_hopper as hop

POINTS = (("ep8", 72), ("ep8", 288), ("ep8", 1152), ("tp8", 72), ("tp8", 288), ("tp8", 1152))
VARIANTS = {  # name -> gate/up gemm keywords on top of the served ones
    "bn128_s2": dict(block_n=128, stages=2),
    "bn128_s3": dict(block_n=128, stages=3),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_gu128_probe.json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, weights = [], {}
    for shape, M in POINTS:
        pt = gated_point(weights, shape, M, gen)
        K, I, k, A, wg, wu, cfg, xk, aligns = pt.K, pt.I, pt.k, pt.A, pt.wg, pt.wu, pt.cfg, pt.xk, pt.aligns
        bm = cfg.block_m
        served = dict(block_n=cfg.gu_block_n, stages=cfg.hp_stages, max_regs=cfg.hp_gu_regs or None)

        def gated(al: km.MoEAlignment, kw: dict) -> torch.Tensor:
            out = torch.full((al.num_blocks * bm, I), float("nan"), dtype=torch.bfloat16, device="cuda")
            hop.gemm(xk, wg, wu, out, al.sorted_ids, al.block_expert, al.sorted_ids, I, K, A, k, K, gated=True,
                     atomic=False, block_m=bm, split_k=1, w_tma=True, **kw)
            return out

        row = dict(shape=shape, tokens=M, block_m=bm, served=cfg.spec())
        al0 = aligns[0]
        real = al0.sorted_ids < A
        want = gated(al0, served)[real]
        row["bn64_finite"] = bool(torch.isfinite(want).all())
        row["bn64_us"] = round(graph_replay_us([lambda al=al: gated(al, served) for al in aligns]), 1)
        for name, extra in VARIANTS.items():
            kw = {**served, **extra}
            got = gated(al0, kw)[real]
            row[name + "_bitwise_equal"] = bool(torch.equal(got, want))
            row[name + "_finite"] = bool(torch.isfinite(got).all())
            row[name + "_us"] = round(graph_replay_us([lambda al=al: gated(al, kw) for al in aligns]), 1)
            row[name + "_speedup"] = round(row["bn64_us"] / row[name + "_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(points=[list(p) for p in POINTS], variants=VARIANTS,
                      routing="uniform, R = 8 (M <= 288) / 4 routings a graph",
                      timing="CUDA-graph replay, median of 20, us per call of the gate/up GEMM alone (TMA words)",
                      check="h on the real rows bit for bit the served launch's; outputs NaN-poisoned"),
                 rows)


if __name__ == "__main__":
    main()
