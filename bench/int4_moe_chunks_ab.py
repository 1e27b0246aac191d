"""A/B of the MoE's steps around its GEMMs: the top-k sum over column chunks of the down GEMM, and
side-stream overlap (``Int4MoEConfig.dn_chunks``, ``side_stream``), on the Kimi-K2 per-rank shapes.

Why: with ``reduce="sum"`` the down GEMM writes one bf16 row per assignment and a second kernel
sums each token's rows: at K2 TP8 M = 1152 that is 132 MB written and read back, the sum alone
37.7 us of a ~625 us call (``int4_moe_steps.json``), run after the GEMM while the GEMM itself
leaves more than half the memory's bandwidth unused. In chunks, each chunk's sum can run under the
next chunk's GEMM (side stream), and reads rows written shortly before. The hidden-state copy in
the Gluon kernel's K order (8.6 us at M = 1152) does not depend on the alignment and can run
beside it. Same run, same routings; every variant's output is compared with the one-chunk,
one-stream call's (it must be equal bit for bit: the same sums in the same order), then timed:
CUDA-graph replay of R routings, the better of two rounds (the second in reverse order).

    python bench/int4_moe_chunks_ab.py --commit SHA --out bench/results/int4_moe_chunks_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import kernels.int4_moe as km
from bench.common import graph_replay_us, write_result
from bench.int4_moe_bench import GROUP, SHAPES, rand_int4_stack, rand_routing

POINTS = (("tp8", 72), ("tp8", 288), ("tp8", 1152), ("ep8", 72), ("ep8", 288), ("ep8", 1152))
# name -> fields replaced in choose_config's config; "base" is the call as served before these fields
VARIANTS = {
    "base": dict(dn_chunks=1, side_stream=False),
    "side": dict(dn_chunks=1, side_stream=True),
    "chunks2": dict(dn_chunks=2, side_stream=True),
    "chunks4": dict(dn_chunks=4, side_stream=True),
    "chunks7": dict(dn_chunks=7, side_stream=True),
    "chunks14": dict(dn_chunks=14, side_stream=True),
    "chunks4_inline": dict(dn_chunks=4, side_stream=False),
    "chunks14_inline": dict(dn_chunks=14, side_stream=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_chunks_ab.json")
    ap.add_argument("--points", default="", help="comma list like tp8:1152 (default: all)")
    args = ap.parse_args()
    points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",") if p] or list(POINTS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    weights: dict = {}
    for shape, M in points:
        sh = SHAPES[shape]
        E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
        if shape not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            weights[shape] = (rand_int4_stack(E, I, K, "cuda", gen), rand_int4_stack(E, I, K, "cuda", gen),
                              rand_int4_stack(E, K, I, "cuda", gen))
        wg, wu, wd = weights[shape]
        R = 8 if M <= 288 else 4
        x = (torch.randn(M, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        routes = [rand_routing(M, E, k, "cuda", gen) for _ in range(R)]
        served = km.choose_config(M, E, K, I, k)
        cfgs = {n: dataclasses.replace(served, **v) for n, v in VARIANTS.items()}
        row = dict(shape=shape, tokens=M, served=served.spec())
        ids0, tw0 = routes[0]
        want = km.fused_int4_moe(x, wg, wu, wd, ids0, tw0, GROUP, cfgs["base"])
        row["base_finite"] = bool(torch.isfinite(want).all())
        for name, cfg in cfgs.items():
            got = km.fused_int4_moe(x, wg, wu, wd, ids0, tw0, GROUP, cfg)
            torch.cuda.synchronize()
            row[f"{name}_equal"] = bool(torch.equal(got, want))
        times: dict[str, list[float]] = {n: [] for n in cfgs}
        for rnd in range(2):
            for name in (list(cfgs) if rnd == 0 else list(cfgs)[::-1]):
                calls = [lambda i=i, t=t, c=cfgs[name]: km.fused_int4_moe(x, wg, wu, wd, i, t, GROUP, c) for i, t in routes]
                times[name].append(graph_replay_us(calls))
        for name in cfgs:
            row[f"{name}_us"] = round(min(times[name]), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, "int4_moe_chunks_ab", args.commit,
                 dict(points=[list(p) for p in points], variants=VARIANTS, group_size=GROUP,
                      routings_per_graph="8 (M <= 288), 4", config="choose_config's with the variant's fields replaced",
                      timing="CUDA-graph replay of R routings, graph_replay_us (median of 20), min of two rounds",
                      check="*_equal: output bit for bit the base variant's on the first routing"),
                 rows)


if __name__ == "__main__":
    main()
