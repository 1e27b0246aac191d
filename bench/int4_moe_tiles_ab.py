"""A/B of the Gluon MoE GEMMs' launch shapes on the Kimi-K2 per-rank shapes, H200: weight tiles a
CTA streams (``hp_dn_tiles``, ``n_tiles`` of ``int4_moe_hopper.gemm``), ring stages and slot width,
weight words by TMA (``w_tma``), and a register cap (``max_regs``) that lets more CTAs share an SM.

Why: K2 TP8's down GEMM has K = 256, two 128-wide steps, so a CTA that owns one weight tile
spends its life filling its ring and waiting on dependent loads (expert id, row ids, routing
weights). A CTA that streams several tiles keeps the ring full across them, and with a short K
keeps its activations resident. Each variant is first checked: NaN-poisoned output, every row of
every assignment written, result against the Triton path's; then timed alone (the GEMM) and, for
the down variants, inside the whole fused call. Each row also times the served call's steps
besides the two GEMMs (alignment, the K-order copies, the top-k sum) alone, and profiles the
device time of each kernel of one served call, so their shares are known.
Writes ``bench/results/int4_moe_tiles_ab.json``.

    python bench/int4_moe_tiles_ab.py --commit SHA --out bench/results/int4_moe_tiles_ab.json [--variants REGEX]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time

import torch

import kernels.int4_moe as km
from bench.common import graph_replay_us, kernel_times, write_result
from bench.int4_moe_bench import GROUP, SHAPES, rand_int4_stack, rand_routing
from kernels import int4_moe_hopper as hop

# name -> gemm keyword arguments; resident / sub None (absent) = gemm's defaults. The _overlap variants
# in the committed JSON (one MMA wait a ring slot) were measured at 138590a and not kept.
DOWN_VARIANTS = {
    "down_bn64_t1_s2": dict(block_n=64, n_tiles=1, stages=2),
    "down_bn64_t8_s2_k128": dict(block_n=64, n_tiles=8, stages=2, sub=1),
    "down_bn64_t8_s2_k256": dict(block_n=64, n_tiles=8, stages=2, sub=2),
    "down_bn64_t8_s3": dict(block_n=64, n_tiles=8, stages=3),
    "down_bn64_t8_s2_streamx": dict(block_n=64, n_tiles=8, stages=2, resident=False),
    "down_bn128_t1_s2": dict(block_n=128, n_tiles=1, stages=2),
    "down_bn128_t1_s2_k256": dict(block_n=128, n_tiles=1, stages=2, sub=2),
    "down_bn64_t1_s2_k256": dict(block_n=64, n_tiles=1, stages=2, sub=2),
    # _r{N}: at most N registers a thread (bn64 t8: 98 -> 80, 6 CTAs an SM; bn128: 119 -> 80, 3 CTAs)
    "down_bn64_t8_s2_r80": dict(block_n=64, n_tiles=8, stages=2, max_regs=80),
    "down_bn128_t1_s2_r80": dict(block_n=128, n_tiles=1, stages=2, max_regs=80),
    **{f"down_bn64_t8_s{st}_k256_tma": dict(block_n=64, n_tiles=8, stages=st, sub=2, w_tma=True) for st in (2, 3)},
    **{f"down_bn128_t1_s{st}_tma": dict(block_n=128, n_tiles=1, stages=st, w_tma=True) for st in (2, 3, 4)},
}
GATE_UP_VARIANTS = {
    "gate_up_bn64_s2": dict(block_n=64, stages=2),
    "gate_up_bn64_s3": dict(block_n=64, stages=3),
    "gate_up_bn64_s2_k256": dict(block_n=64, stages=2, sub=2),
    "gate_up_bn64_s3_k256": dict(block_n=64, stages=3, sub=2),
    "gate_up_bn64_t4_s2": dict(block_n=64, n_tiles=4, stages=2),
    # register caps (ptxas uncapped, sm_90, 2 stages: block_m 16 127, 32 159, 64 199 registers)
    "gate_up_bn64_s2_r168": dict(block_n=64, stages=2, max_regs=168),
    "gate_up_bn64_s2_r128": dict(block_n=64, stages=2, max_regs=128),
    "gate_up_bn64_s2_r96": dict(block_n=64, stages=2, max_regs=96),
    # 128 weight rows on 8 warps: two warpgroups share each activation tile (half its traffic a
    # weight byte); uncapped one CTA fits an SM, at 128 registers two
    "gate_up_bn128_s2": dict(block_n=128, stages=2),
    "gate_up_bn128_s2_r128": dict(block_n=128, stages=2, max_regs=128),
    "gate_up_bn128_s3_r128": dict(block_n=128, stages=3, max_regs=128),
    "gate_up_bn128_s2_r96": dict(block_n=128, stages=2, max_regs=96),
    # _tma: the weight words by TMA (one copy a matrix a step, on an mbarrier), scales still cp.async
    **{f"gate_up_bn64_s{st}_tma": dict(block_n=64, stages=st, w_tma=True) for st in (2, 3, 4)},
    "gate_up_bn64_s3_tma_r128": dict(block_n=64, stages=3, w_tma=True, max_regs=128),
    "gate_up_bn64_s2_tma_r128": dict(block_n=64, stages=2, w_tma=True, max_regs=128),
    "gate_up_bn64_s2_tma_r120": dict(block_n=64, stages=2, w_tma=True, max_regs=120),
}
# the whole call at choose_config's config with these fields replaced
FUSED_VARIANTS = {
    "fused_served": {},
    "fused_t1": dict(hp_dn_tiles=1),
    "fused_s3": dict(hp_stages=3),
    "fused_split1": dict(gu_split_k=1),
    "fused_split2": dict(gu_split_k=2),
    "fused_split1_s3": dict(gu_split_k=1, hp_stages=3),
    "fused_atomic": dict(reduce="atomic"),
    "fused_gur0": dict(hp_gu_regs=0),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm() / b.float().norm()).item())


def down_call(h, wd, align, weights, K, I, A, top_k, block_m, **kw):
    """The Gluon down GEMM into a NaN-poisoned [A, K] (reduce sum: one row per assignment)."""
    out = torch.full((A, K), float("nan"), dtype=torch.bfloat16, device=h.device)
    hop.gemm(hop.permute_k(h), wd, wd, out, align.sorted_ids, align.block_expert, weights, K, I, A, top_k, I,
             gated=False, atomic=False, block_m=block_m, split_k=1, **kw)
    return out


def gate_up_call(x, wg, wu, align, I, K, A, top_k, block_m, **kw):
    """The Gluon gate/up GEMM (one K slice) into a NaN-poisoned [P, I]."""
    P = align.num_blocks * block_m
    out = torch.full((P, I), float("nan"), dtype=torch.bfloat16, device=x.device)
    hop.gemm(hop.permute_k(x), wg, wu, out, align.sorted_ids, align.block_expert, align.sorted_ids, I, K, A, top_k, K,
             gated=True, atomic=False, block_m=block_m, split_k=1, **kw)
    return out


def stage_times(x, route, served: km.Int4MoEConfig, E: int, I: int, R: int) -> dict:
    """Microseconds of the served tensor-core call's steps besides the two GEMMs."""
    ids, tw = route
    M, K = x.shape
    k = ids.shape[1]
    align = km.int4_moe_align(ids, E, served.block_m)
    h = torch.randn(align.num_blocks * served.block_m, I, device=x.device, dtype=torch.bfloat16)
    per_assignment = torch.randn(M * k, K, device=x.device, dtype=torch.bfloat16)
    steps = dict(
        align=lambda: km.int4_moe_align(ids, E, served.block_m),
        permute_x=lambda: hop.permute_k(x),
        permute_h=lambda: hop.permute_k(h),  # what h written in K order saves the served call
        topk_sum=lambda: km._finish_down(per_assignment, False, x.dtype, M, k, K),  # the served reduction
    )
    return {f"step_{n}_us": round(graph_replay_us([f] * R), 1) for n, f in steps.items()}


def point(shape: str, M: int, W: dict, gen, pick: re.Pattern) -> dict:
    sh = SHAPES[shape]
    E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    R = 16 if M <= 9 else 8 if M <= 288 else 4
    dev = W["gate"].packed.device
    x = (torch.randn(M, K, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    routes = [rand_routing(M, E, k, dev, gen) for _ in range(R)]
    served = dataclasses.replace(km.choose_config(M, E, K, I, k), gemv=False, reduce="sum")
    bm, A = served.block_m, M * k
    aligns = [km.int4_moe_align(ids, E, bm) for ids, _ in routes]
    hs = [km.int4_moe_gate_up(x, W["gate"], W["up"], a, k, served, GROUP) for a in aligns]
    wts = [tw.contiguous().view(-1) for _, tw in routes]
    tri = dataclasses.replace(served, hopper=False)
    ref_down = km.int4_moe_down(hs[0], W["down"], aligns[0], routes[0][1], tri, GROUP)  # [M, K], Triton path
    row = dict(shape=shape, tokens=M, served=served.spec())
    row.update(stage_times(x, routes[0], served, E, I, R))
    ids0, tw0 = routes[0]
    row["served_kernels_us"] = kernel_times(lambda: km.fused_int4_moe(x, W["gate"], W["up"], W["down"], ids0, tw0, GROUP, served))
    for name, kw in DOWN_VARIANTS.items():
        if not pick.search(name):
            continue
        try:
            out = down_call(hs[0], W["down"], aligns[0], wts[0], K, I, A, k, bm, **kw)
            row[name + "_all_written"] = bool(torch.isfinite(out).all())
            row[name + "_rel_vs_triton"] = round(rel(out.view(M, k, K).sum(1), ref_down), 6)
            row[name + "_us"] = round(graph_replay_us(
                [lambda h=h, a=a, w=w: down_call(h, W["down"], a, w, K, I, A, k, bm, **kw) for h, a, w in zip(hs, aligns, wts)]), 1)
        except Exception as e:  # a variant that does not build or fit is a finding, not a crash
            row[name + "_err"] = f"{type(e).__name__}: {str(e)[-300:]}"
    ref_gu = km.int4_moe_gate_up(x, W["gate"], W["up"], aligns[0], k, tri, GROUP)
    real = aligns[0].sorted_ids < A
    for name, kw in GATE_UP_VARIANTS.items():
        if not pick.search(name):
            continue
        try:
            out = gate_up_call(x, W["gate"], W["up"], aligns[0], I, K, A, k, bm, **kw)
            row[name + "_all_written"] = bool(torch.isfinite(out[real]).all())
            row[name + "_rel_vs_triton"] = round(rel(out[real], ref_gu[real]), 6)
            row[name + "_us"] = round(graph_replay_us(
                [lambda a=a: gate_up_call(x, W["gate"], W["up"], a, I, K, A, k, bm, **kw) for a in aligns]), 1)
        except Exception as e:
            row[name + "_err"] = f"{type(e).__name__}: {str(e)[-300:]}"
    for name, over in FUSED_VARIANTS.items():
        if not pick.search(name):
            continue
        cfg = dataclasses.replace(km.choose_config(M, E, K, I, k), **over)
        row[name + "_us"] = round(graph_replay_us(
            [lambda i=i, t=t, c=cfg: km.fused_int4_moe(x, W["gate"], W["up"], W["down"], i, t, GROUP, c) for i, t in routes]), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_tiles_ab.json")
    ap.add_argument("--shapes", default="tp8,ep8")
    ap.add_argument("--tokens", default="9,72,288,1152")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--variants", default="", help="regex: only the variants whose names it matches")
    args = ap.parse_args()
    pick = re.compile(args.variants)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        sh = SHAPES[shape]
        E, K, I = sh["experts"], sh["hidden"], sh["inter"]
        W = dict(gate=rand_int4_stack(E, I, K, "cuda", gen), up=rand_int4_stack(E, I, K, "cuda", gen),
                 down=rand_int4_stack(E, K, I, "cuda", gen))
        for M in (int(t) for t in args.tokens.split(",")):
            if time.time() - t0 > args.deadline_s:
                print(f"deadline: skipping {shape} M={M}", flush=True)
                continue
            rows.append(point(shape, M, W, gen, pick))
            print(json.dumps(rows[-1]), flush=True)
        del W
        torch.cuda.empty_cache()
    write_result(
        args.out, args.commit,
        dict(shapes={s: SHAPES[s] for s in args.shapes.split(",")}, group_size=GROUP, reduce="sum",
             variants="down_/gate_up_bn{rows}[_t{tiles a CTA}]_s{ring stages}[_k256: two 128-wide K steps a "
                      "ring slot][_overlap: one MMA wait a slot][_streamx: activations through the ring, not "
                      "resident][_tma: weight words by TMA][_r{N}: maxnreg N]; gate/up unsplit; fused_*: the whole call at choose_config's config "
                      "with FUSED_VARIANTS' fields replaced (t1: hp_dn_tiles=1, s3: hp_stages=3, split1 / split2: gu_split_k=1 / 2, "
                      "atomic: reduce='atomic', gur0: hp_gu_regs=0); step_*_us: the served call's other steps timed alone (topk_sum: "
                      "torch's sum in runs before adfe77e); served_kernels_us: device time of each kernel of one "
                      "served call (torch.profiler, eager, mean of 10)",
             variants_run=args.variants or "all",
             timing="CUDA-graph replay of R routings (16/8/4), median of 20, us per call",
             check="NaN-poisoned outputs, all_written = every assignment's row finite; rel_vs_triton = "
                   "relative Frobenius difference to the Triton kernel at the same block_m"),
        rows,
    )


if __name__ == "__main__":
    main()
