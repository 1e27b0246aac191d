"""Probe: gate and up as two one-matrix GEMMs instead of one gated GEMM (Gluon kernel, Hopper).

Why: at K2 EP8 M = 288 the gated gate/up GEMM (block_m 64) holds two accumulators and two A
operands a thread, 195 registers, so two 4-warp CTAs share an SM, and its counters show the warps
waiting on the dequantisation chains and the CTA barriers. A CTA that computes one matrix needs
about half the registers, so twice the warps fit an SM to hide those waits, at the price of reading
the activations twice and a SiLU-times-up pass over the two results. This times that shape with
what the kernel already has: its down-GEMM launch (one matrix, per-assignment rows) on the gate
and on the up weights, fed the activation rows gathered into block order first.

Per point (uniform routings, CUDA-graph replay of R calls, median of 20): the served gated
gate/up GEMM; gate plus up as two one-matrix GEMMs (64- or 128-row tiles, TMA words, 2 or 3
stages); the gather of the activation rows into block order that those need (and the served
call does not). Check: silu(gate) * up of the one-matrix results against the gated GEMM's h.

    python bench/int4_moe_one_matrix_probe.py --commit SHA --out bench/results/int4_moe_one_matrix_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels.int4_moe as km
from bench.common import graph_replay_us, write_result
from bench.int4_moe_bench import gated_point
from kernels import int4_moe_hopper as hop

POINTS = (("ep8", 72), ("ep8", 288), ("ep8", 1152), ("tp8", 288), ("tp8", 1152))
ONE = {  # name -> gemm keywords of each one-matrix GEMM
    "one_bn64_s2": dict(block_n=64, stages=2),
    "one_bn64_s3": dict(block_n=64, stages=3),
    "one_bn128_s2": dict(block_n=128, stages=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_one_matrix_probe.json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, weights = [], {}
    for shape, M in POINTS:
        pt = gated_point(weights, shape, M, gen)
        K, I, k, A, wg, wu, cfg, xk, aligns = pt.K, pt.I, pt.k, pt.A, pt.wg, pt.wu, pt.cfg, pt.xk, pt.aligns
        bm = cfg.block_m
        ones = torch.ones(A, device="cuda", dtype=torch.float32)

        def gather(al: km.MoEAlignment) -> torch.Tensor:  # block-ordered activation rows (padding: row 0)
            tok = torch.where(al.sorted_ids < A, al.sorted_ids // k, 0)
            return xk.index_select(0, tok)

        gathered = [gather(al) for al in aligns]

        def gated(al: km.MoEAlignment) -> torch.Tensor:
            out = torch.full((al.num_blocks * bm, I), float("nan"), dtype=torch.bfloat16, device="cuda")
            hop.gemm(xk, wg, wu, out, al.sorted_ids, al.block_expert, al.sorted_ids, I, K, A, k, K, gated=True, atomic=False,
                     block_m=bm, block_n=64, split_k=1, stages=cfg.hp_stages, w_tma=True,
                     max_regs=cfg.hp_gu_regs or None)
            return out

        def one(al: km.MoEAlignment, a: torch.Tensor, w, kw: dict) -> torch.Tensor:
            out = torch.full((A, I), float("nan"), dtype=torch.bfloat16, device="cuda")
            hop.gemm(a, w, w, out, al.sorted_ids, al.block_expert, ones, I, K, A, k, K, gated=False, atomic=False,
                     block_m=bm, split_k=1, w_tma=True, **kw)
            return out

        row = dict(shape=shape, tokens=M, block_m=bm, served=cfg.spec())
        al0 = aligns[0]
        h = gated(al0)
        real = al0.sorted_ids < A
        row["gated_us"] = round(graph_replay_us([lambda al=al: gated(al) for al in aligns]), 1)
        row["gather_us"] = round(graph_replay_us([lambda al=al: gather(al) for al in aligns]), 1)
        for name, kw in ONE.items():
            g = one(al0, gathered[0], wg, kw).float()
            u = one(al0, gathered[0], wu, kw).float()
            want = h[real].float()
            got = (g / (1 + torch.exp(-g)) * u)[al0.sorted_ids[real].long()]
            row[name + "_rel_vs_gated"] = round(float(((got - want).norm() / want.norm()).item()), 6)
            row[name + "_finite"] = bool(torch.isfinite(got).all())
            row[name + "_us"] = round(graph_replay_us(
                [lambda al=al, a=a: (one(al, a, wg, kw), one(al, a, wu, kw)) for al, a in zip(aligns, gathered)]), 1)
            row[name + "_vs_gated"] = round(row["gated_us"] / row[name + "_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(points=[list(p) for p in POINTS], one_matrix=ONE, routing="uniform, R = 8 (M <= 288) / 4 routings a graph",
                      timing="CUDA-graph replay, median of 20, us per call; one_* = gate GEMM + up GEMM (one matrix each, TMA "
                             "words, per-assignment output rows), not counting the gather or a SiLU pass",
                      check="silu(gate) * up from the one-matrix GEMMs against the gated GEMM's h, real rows"),
                 rows)


if __name__ == "__main__":
    main()
