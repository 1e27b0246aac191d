"""A/B of the MoE alignment's layout step: one program (as before) against ``ALIGN_PROGRAMS``.

Why: at K2 TP8 M = 1152 the one-program layout took 8.9 us of a ~625 us call
(``int4_moe_steps.json``): a cumsum over the experts, then serial loops of stores (padding
sentinels, rows past the last expert, block experts). ``int4_moe_align`` now lets
``ALIGN_PROGRAMS`` programs share those stores. Same run, same routings: the alignment alone and the
whole served ``fused_int4_moe`` call, CUDA-graph replay of R routings (R = 8), the better of two
rounds (variants interleaved, the second round in reverse order). Each alignment is checked: the
same block experts, and the same rows for each expert, as the one-program layout (the scatter's
atomics order an expert's rows freely), sentinels everywhere else.

    python bench/int4_moe_align_ab.py --commit SHA --out bench/results/int4_moe_align_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels.int4_moe as km
from bench.common import graph_replay_us, write_result
from bench.int4_moe_bench import GROUP, SHAPES, rand_routing, shape_weights

POINTS = (("tp8", 72), ("tp8", 288), ("tp8", 1152), ("ep8", 72), ("ep8", 288), ("ep8", 1152))
VARIANTS = {"one_program": 1, "programs": km.ALIGN_PROGRAMS}
R = 8


def same_layout(a: km.MoEAlignment, b: km.MoEAlignment, A: int) -> bool:
    """Equal block experts, and per expert the same rows (its assignments and sentinels), whatever
    block of the expert each landed in: the scatter's atomics order an expert's rows freely."""
    if not torch.equal(a.block_expert, b.block_expert) or a.sorted_ids.numel() != b.sorted_ids.numel():
        return False

    def by_expert(al: km.MoEAlignment) -> torch.Tensor:
        expert = al.block_expert.repeat_interleave(al.block_m).to(torch.int64)  # [P]
        return (expert * (A + 1) + al.sorted_ids.to(torch.int64)).sort().values

    ok = (a.sorted_ids >= 0) & (a.sorted_ids <= A)
    return bool(torch.equal(by_expert(a), by_expert(b))) and bool(ok.all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/int4_moe_align_ab.json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    weights = {}
    for shape, M in POINTS:
        sh = SHAPES[shape]
        E, K, I, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
        wg, wu, wd = shape_weights(weights, shape, gen)
        x = (torch.randn(M, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        routes = [rand_routing(M, E, k, "cuda", gen) for _ in range(R)]
        cfg = km.choose_config(M, E, K, I, k)
        row = dict(shape=shape, tokens=M, block_m=cfg.block_m, config=cfg.spec())
        times: dict[str, dict[str, list[float]]] = {n: dict(align=[], call=[]) for n in VARIANTS}
        layouts = {}
        for rnd in range(2):
            for name in (list(VARIANTS) if rnd == 0 else list(VARIANTS)[::-1]):
                km.ALIGN_PROGRAMS = VARIANTS[name]
                times[name]["align"].append(graph_replay_us([lambda ids=ids: km.int4_moe_align(ids, E, cfg.block_m)
                                                             for ids, _ in routes]))
                calls = [lambda ids=ids, w=w: km.fused_int4_moe(x, wg, wu, wd, ids, w, GROUP) for ids, w in routes]
                times[name]["call"].append(graph_replay_us(calls))
                if rnd == 0:
                    layouts[name] = km.int4_moe_align(routes[0][0], E, cfg.block_m)
        km.ALIGN_PROGRAMS = VARIANTS["programs"]
        row["layout_equal"] = same_layout(layouts["one_program"], layouts["programs"], M * k)
        for name in VARIANTS:
            row[f"{name}_align_us"] = round(min(times[name]["align"]), 2)
            row[f"{name}_call_us"] = round(min(times[name]["call"]), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(points=[list(p) for p in POINTS], variants=VARIANTS, routings_per_graph=R, group_size=GROUP,
                      timing="CUDA-graph replay of R routings, graph_replay_us (median of 20), min of two rounds",
                      config="choose_config's (the served one)"),
                 rows)


if __name__ == "__main__":
    main()
