"""The fused INT4 MoE at verify sizes on the K2 TP8 shape: the served config against split and
down-tile variants, on uniform routing and on routing concentrated in a few experts.

Why: at C=1 a budget-8 / 16 / 32 verify step has 9 / 17 / 33 tokens, and ``choose_config`` sizes
its launch from ``tokens * top_k / experts`` as if routing were uniform (0.19-0.69 rows an expert:
gate/up in 8 or 2 K slices at ``15b2a32``). The K2 slice's router
sends a tree's tokens to 12-21 experts (about 6-13 rows each); its MoE GEMMs took 2.41 ms of a
8.43 ms budget-16 step (``k2-profile-1b127fe.json``), about 3.6x their bytes' HBM time. Which
config is best in each regime, and how far apart are they?

Per (tokens, routing): every config's whole call (alignment, gate/up, down, top-k sum),
CUDA-graph replay over 16 routings, median of 20; each checked against the served
config's output on the same routing first (relative error; and every output finite), and the
served config against ``int4_moe_reference`` in float32 arithmetic. With
``--profile``, each routing's served and best configs also get a per-kernel breakdown (torch.profiler,
eager, each call on the next routing so the experts come from HBM).

    python -m bench.int4_moe_verify_probe --commit SHA --out bench/results/int4_moe_verify_probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from bench.common import graph_replay_us, kernel_times, write_result
from bench.int4_moe_bench import GROUP, SHAPES, expert_bytes, rand_int4_stack, rand_routing
from kernels.int4_moe import choose_config, fused_int4_moe, int4_moe_reference

POOLS = {9: 12, 17: 15, 33: 21}  # distinct experts a layer in the K2 slice's verify steps (model routing)
ROUTINGS = 16


def pooled_routing(m: int, e: int, k: int, pool: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts drawn from one random pool of ``pool`` experts (a tree sharing experts)."""
    experts = torch.randperm(e, device="cuda", generator=gen)[:pool]
    ids = experts[torch.rand(m, pool, device="cuda", generator=gen).topk(k, dim=-1).indices]
    w = torch.rand(m, k, device="cuda", generator=gen) + 0.1
    return ids, (w / w.sum(-1, keepdim=True) * 2.827).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[9, 17, 33])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_verify_probe.json")
    args = ap.parse_args()
    sh = SHAPES["tp8"]
    E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    wg, wu, wd = (rand_int4_stack(E, I, K, "cuda", gen), rand_int4_stack(E, I, K, "cuda", gen),
                  rand_int4_stack(E, K, I, "cuda", gen))
    per_expert = sum(expert_bytes(w) for w in (wg, wu, wd))
    rows = []
    for m in args.tokens:
        served = choose_config(m, E, K, I, k, routing_groups=1)
        variants = {"served": served}
        for split in (1, 2, 4, 8):
            for tiles in (1, 2, 8):
                for bm in (16,) if m <= 17 else (16, 32):
                    cfg = dataclasses.replace(served, gemv=False, block_m=bm, gu_split_k=split, hp_dn_tiles=tiles,
                                              hp_gu_regs=128 if bm == 32 else 0)
                    variants[f"bm{bm}_split{split}_tiles{tiles}"] = cfg
            for stages in (3, 4):  # a deeper ring: more bytes in flight for CTAs of a few K steps
                variants[f"bm16_split{split}_tiles8_stages{stages}"] = dataclasses.replace(
                    served, gemv=False, block_m=16, gu_split_k=split, hp_dn_tiles=8, hp_stages=stages)
            for regs in (96, 112):  # gate/up capped to fit more CTAs an SM (about 127 registers uncapped)
                variants[f"bm16_split{split}_tiles8_regs{regs}"] = dataclasses.replace(
                    served, gemv=False, block_m=16, gu_split_k=split, hp_dn_tiles=8, hp_gu_regs=regs)
        x = (torch.randn(m, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        for routing in ("uniform", "pooled"):
            routes = [rand_routing(m, E, k, "cuda", gen) if routing == "uniform" else
                      pooled_routing(m, E, k, POOLS[m], gen) for _ in range(ROUTINGS)]
            touched = sum(int(torch.unique(ids).numel()) for ids, _ in routes) / ROUTINGS
            ids0, w0 = routes[0]
            want = fused_int4_moe(x, wg, wu, wd, ids0, w0, GROUP, config=served).float()
            ref = int4_moe_reference(x, wg, wu, wd, ids0, w0, GROUP, compute_dtype=torch.float32).float()
            row = {"tokens": m, "routing": routing, "experts_touched": touched, "served": served.spec(), "variants": {},
                   "served_rel_err_vs_reference": ((want - ref).norm() / ref.norm()).item()}
            for name, cfg in variants.items():
                got = fused_int4_moe(x, wg, wu, wd, ids0, w0, GROUP, config=cfg).float()
                err = ((got - want).norm() / want.norm()).item()
                us = graph_replay_us([lambda i=i, w=w: fused_int4_moe(x, wg, wu, wd, i, w, GROUP, config=cfg)
                                      for i, w in routes])
                row["variants"][name] = {"us": round(us, 2), "rel_err_vs_served": err, "finite": bool(got.isfinite().all()),
                                         "gbps": round(touched * per_expert / us / 1e3, 1)}
            best = min(row["variants"].items(), key=lambda kv: kv[1]["us"])
            row["best"] = best[0]
            row["served_us"] = row["variants"]["served"]["us"]
            row["best_us"] = best[1]["us"]
            if args.profile:
                for name in ("served", best[0]):
                    cfg, turn = variants[name], iter(range(10 ** 9))

                    def call(cfg=cfg, turn=turn) -> None:
                        i, w = routes[next(turn) % ROUTINGS]
                        fused_int4_moe(x, wg, wu, wd, i, w, GROUP, config=cfg)
                    row[f"kernels_us_{name}"] = kernel_times(call, reps=ROUTINGS)
            rows.append(row)
            print(json.dumps({kk: v for kk, v in row.items() if kk != "variants" and not kk.startswith("kernels")}), flush=True)
            for kk in (kk for kk in row if kk.startswith("kernels")):
                print("   ", kk, json.dumps(row[kk]), flush=True)
            print("   ", " ".join(f"{n}={v['us']}" for n, v in row["variants"].items()), flush=True)
    write_result(args.out, args.commit,
                 dict(shape="K2 TP8: 384 experts x hidden 7168 x intermediate 256, top-8, group 32",
                      pools=POOLS, routings=ROUTINGS,
                      timing="whole fused_int4_moe call, CUDA-graph replay over 16 routings, median of 20",
                      check="relative error (Frobenius) against the served config's output on routing 0; the "
                            "served config's against int4_moe_reference (float32 arithmetic)"), rows)


if __name__ == "__main__":
    main()
