"""A/B of the tail rows in the 64-row tree-attention kernel's loader (``kernels/tree_mla_hopper.py``,
``_tail_loop``) against a CTA of their own, on the served call (split kernel + merge).

Why: at 8 heads trees of 9, 17 and 33 nodes are 64, 128 and 256 rows + 8, and without a tail the
last 8 rows take a CTA of their own that repeats every key tile's products for 64 rows (the
T-mla shapes' largest cost, BENCHMARKS.md). With ``tail=True`` the loader warpgroup of a
request's last whole row tile attends them with 64-key x 8-row transposed products on each pair
of ring tiles, between its copies.

Checks first (NaN-poisoned outputs against the float32 reference on bf16 inputs; the tail forced
on, splits default / 1 / 3; page sizes 64 / 16 / 1, pages not back to back, empty and odd-length
prefixes, trees of 9 to 129 nodes, the demo model's 128 + 32 dims; graph replay equal to eager),
then each shape's whole call with the tail off and on (and on at other consumer register counts:
``TAIL_CONSUMER_REGS``), in one CUDA graph rotating over inputs larger than L2, each setting
captured afresh, two rounds in alternating order, the better of the two.

    python -m bench.tree_mla_tail_ab --commit SHA --out bench/results/tree_mla_tail_ab.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import Case, rel_err, rotating_cases
from kernels import tree_mla_hopper as hop
from kernels.tree_mla import tree_mla_reference

CHECKS = (  # (context per request, nodes, heads, page size, kvr, rope, pages not back to back)
    ([1000, 37, 0, 4099], 9, 8, 64, 512, 64, False),
    ([4096, 4096], 17, 8, 16, 512, 64, False),
    ([2000, 64, 33], 33, 8, 16, 512, 64, False),
    ([777, 2048, 3], 9, 8, 1, 512, 64, False),
    ([16384, 100], 129, 8, 64, 512, 64, False),
    ([1500, 40, 900], 17, 8, 16, 128, 32, False),
    ([700, 64, 95], 9, 8, 16, 512, 64, True),
    ([5000, 31], 9, 7, 64, 512, 64, False),  # 63 rows: no tail, the served path unchanged
)
SHAPES = ((32, 4096, 8, 8), (32, 4096, 9, 8), (32, 4096, 17, 8), (32, 4096, 33, 8), (128, 4096, 9, 8),
          (128, 4096, 17, 8), (128, 4096, 33, 8), (32, 16384, 9, 8), (32, 16384, 17, 8), (32, 16384, 33, 8),
          (128, 16384, 9, 8), (4, 4096, 17, 8), (1, 16384, 9, 8))
REGS = (176, 184, 192)  # consumer registers with a tail; the first is the served one
ABLATIONS = ("tail", "no_q_staging", "no_logits", "no_o_products", "no_products")  # TAIL_ABLATE 0..4


def run(case: Case, tail: bool | None, splits: int | None = None) -> torch.Tensor:
    return hop.tree_mla_hopper(*case.args(), num_splits=splits, few_rows=False, tail=tail)


def checks() -> list[dict]:
    out = []
    real_empty = torch.empty
    for lens, nodes, heads, ps, kvr, rope, padded in CHECKS:
        case = Case(len(lens), lens, nodes, heads, seed=11, page_size=ps, kvr=kvr, rope=rope)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent, case.q_pe, case.kv_cache, case.new_kv, case.host_meta, case.scale)
        tail = hop.tail_rows(nodes * heads) > 0
        for splits in (None, 1, 3):
            torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
            try:
                got = run(case, tail or None, splits)
                base = run(case, False, splits)
            finally:
                torch.empty = real_empty
            row = dict(lens=lens, nodes=nodes, heads=heads, page_size=ps, kvr=kvr, rope=rope, pages_padded=padded,
                       num_splits=splits, tail=tail, rel_err=rel_err(got, want), rel_err_no_tail=rel_err(base, want),
                       max_abs_err=(got.float() - want.float()).abs().max().item(),
                       finite=bool(torch.isfinite(got).all()),
                       full_rows_equal=bool(torch.equal(got.flatten(0, 1)[: (nodes * heads // 64) * 64],
                                                        base.flatten(0, 1)[: (nodes * heads // 64) * 64])))
            out.append(row)
            print(json.dumps(row), flush=True)
    case = Case(4, 4096, 17, 8, seed=3)
    eager = run(case, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run(case, True)
    graph.replay()
    torch.cuda.synchronize()
    out.append(dict(graph_equals_eager=bool(torch.equal(replayed, eager))))
    print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_tail_ab.json")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="instead of register counts: the tail with parts left out "
                    "(TAIL_ABLATE; timing only, wrong output)")
    ap.add_argument("--shapes", default=None, help="batch,context,nodes,heads;... (default: SHAPES)")
    args = ap.parse_args()
    served_regs = hop.TAIL_CONSUMER_REGS
    check_rows = [] if args.no_checks else checks()
    variants = {"no_tail": (False, served_regs, 0)}
    if args.ablate:
        variants |= {name: (True, served_regs, a) for a, name in enumerate(ABLATIONS)}
    else:
        variants |= {f"tail_{r}": (True, r, 0) for r in REGS}
    shapes = SHAPES if args.shapes is None else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    rows = []
    for batch, context, nodes, heads in shapes:
        cases = rotating_cases(batch, context, nodes, heads)
        has_tail = hop.tail_rows(nodes * heads) > 0
        names = [n for n, (t, _, _) in variants.items() if has_tail or not t]
        times: dict[str, list[float]] = {n: [] for n in names}
        outs = {}
        try:
            for rnd in range(2):
                for name in (names if rnd == 0 else names[::-1]):
                    tail, regs, ablate = variants[name]
                    hop.TAIL_CONSUMER_REGS, hop.TAIL_ABLATE = regs, ablate
                    times[name].append(graph_replay_us([lambda c=c, t=tail: run(c, t) for c in cases]))
                    if rnd == 0:
                        outs[name] = run(cases[0], tail)
        finally:
            hop.TAIL_CONSUMER_REGS, hop.TAIL_ABLATE = served_regs, 0
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=heads, tail_rows=hop.tail_rows(nodes * heads))
        for name, ts in times.items():
            row[f"{name}_us"] = round(min(ts), 2)
            row[f"{name}_us_rounds"] = [round(t, 2) for t in ts]
            row[f"{name}_speedup"] = round(min(times["no_tail"]) / min(ts), 3)
        want = tree_mla_reference(cases[0].q_latent, cases[0].q_pe, cases[0].kv_cache, cases[0].new_kv,
                                  cases[0].host_meta, cases[0].scale) if batch * context <= 32 * 4096 else None
        row["rel_err"] = {n: round(rel_err(o, want), 6) for n, o in outs.items()} if want is not None else None
        row["finite"] = all(bool(torch.isfinite(o).all()) for o in outs.values())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_rounds")}), flush=True)
        del cases, outs
        torch.cuda.empty_cache()
    write_result(args.out, args.commit,
                 dict(timing="whole tree_mla_hopper call (64-row kernel), CUDA-graph replay rotating over inputs > L2, "
                             "each setting captured afresh; min of two rounds in alternating order",
                      variants={k: dict(tail=v[0], consumer_regs=v[1] if v[0] else hop.CONSUMER_REGS, ablate=v[2])
                                for k, v in variants.items()},
                      served_tail_consumer_regs=served_regs, checks=check_rows),
                 rows)


if __name__ == "__main__":
    main()
