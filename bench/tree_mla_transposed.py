"""The transposed tree-MLA kernel (keys on the MMA's M side, 64 + 8 rows a CTA) against the served call.

Why: at Kimi-K2's 8 heads a rank, a 9-node tree has 72 rows a request. The 64-row Gluon kernel
pays the products of 128 rows for them (a second 64-row CTA for the last 8) and runs its
two-warpgroup chain a 32-key tile; the transposed kernel (``kernels/tree_mla_hopper.py``,
``_tree_mla_transposed_kernel``) multiplies 64-key tiles by exactly 72 columns.

* Checks: the transposed kernel against the float32 reference on bf16 inputs, NaN-poisoned
  outputs, splits 1 / 3 / the served count, TMA and cp.async caches (page sizes 1 / 16 / 64, pages
  not back to back), empty prefixes, trees of 2 to 33 nodes at 8 and 16 heads; graph replay
  equals eager.
* Times: the whole ``tree_mla_hopper`` call (split kernel + merge), CUDA-graph replay rotating over
  input copies larger than L2, variants interleaved, the better of two rounds: served (whatever
  ``tree_mla_hopper`` picks) against ``transposed=True``, GB/s on the bytes the call must read
  (``Case.bytes_read``) and their ratio to the measured copy bandwidth.

    python -m bench.tree_mla_transposed --commit SHA --out bench/results/NAME.json [--shapes B,C,N;...]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import graph_replay_us, measure_copy_gbps, write_result
from bench.tree_mla_bench import Case, rel_err, rotating_cases
from kernels.tree_mla import tree_mla_reference
from kernels.tree_mla_hopper import tree_mla_hopper

HEADS = 8
SHAPES = [(b, c, n) for n in (8, 9, 17, 33) for b in (1, 8, 32, 128) for c in (1024, 4096, 16384)]
CHECKS = [  # (context per request, nodes, heads, page_size, page stride padded by one token)
    ([1000, 37, 0, 4099], 9, 8, 64, False),
    ([300, 5000], 9, 8, 16, False),
    ([777, 2048, 3], 9, 8, 1, False),
    ([700, 64], 9, 8, 16, True),
    ([0, 0], 9, 8, 64, False),
    ([1000, 37, 0, 4099], 5, 8, 64, False),
    ([5000, 1200], 17, 8, 16, False),
    ([777, 2048, 3], 33, 8, 64, False),
    ([300, 130], 2, 8, 16, False),
    ([300], 3, 16, 16, False),
    ([4100, 65], 9, 16, 64, False),
]


def check() -> list[dict]:
    """``transposed=True`` against the float32 reference, outputs NaN-poisoned; graph replay vs eager."""
    rows = []
    real_empty = torch.empty
    for lens, nodes, heads, ps, padded in CHECKS:
        case = Case(len(lens), lens, nodes, heads, seed=7, page_size=ps)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent.float(), case.q_pe.float(), case.kv_cache.float(), case.new_kv.float(),
                                  case.host_meta, case.scale)
        for splits in (None, 1, 3):
            torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
            try:
                got = tree_mla_hopper(*case.args(), num_splits=splits, transposed=True)
                served = tree_mla_hopper(*case.args(), num_splits=splits)
            finally:
                torch.empty = real_empty
            row = dict(lens=lens, nodes=nodes, heads=heads, page_size=ps, cache_contiguous=case.kv_cache.is_contiguous(),
                       num_splits=splits, max_abs_err=(got.float() - want).abs().max().item(), rel_err=rel_err(got, want),
                       rel_err_served=rel_err(served, want), finite=bool(torch.isfinite(got).all()))
            rows.append(row)
            print(f"check {row}", flush=True)
    case = Case(4, 4096, 9, HEADS, seed=3)
    eager = tree_mla_hopper(*case.args(), transposed=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = tree_mla_hopper(*case.args(), transposed=True)
    graph.replay()
    torch.cuda.synchronize()
    rows.append(dict(nodes=9, graph_equals_eager=bool(torch.equal(replayed, eager))))
    print(rows[-1], flush=True)
    return rows


def passed(rows: list[dict]) -> bool:
    return all(r.get("rel_err", 0) < 1e-2 and r.get("finite", True) and r.get("graph_equals_eager", True) for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_transposed.json")
    ap.add_argument("--shapes", default=None, help="batch,context,nodes;... (default: all)")
    args = ap.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    checks = check()
    ok = passed(checks)
    copy_gbps = measure_copy_gbps()
    rows = []
    for batch, context, nodes in shapes if ok else []:
        cases = rotating_cases(batch, context, nodes, HEADS)
        variants = {"served": {}, "transposed": dict(transposed=True)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(2):
            for name, kw in variants.items():
                times[name].append(graph_replay_us([lambda c=c, kw=kw: tree_mla_hopper(*c.args(), **kw) for c in cases]))
        nbytes = cases[0].bytes_read()
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, bytes_read=nbytes,
                   times_us={k: round(min(v), 2) for k, v in times.items()})
        row["gbps"] = {k: round(nbytes / (t * 1e3), 1) for k, t in row["times_us"].items()}
        row["copy_ratio"] = {k: round(g / copy_gbps, 3) for k, g in row["gbps"].items()}
        row["speedup"] = round(row["times_us"]["served"] / row["times_us"]["transposed"], 3)
        rows.append(row)
        print(row, flush=True)
        del cases
    params = dict(kvr=512, rope=64, page_size=64, dtype="bfloat16", heads=HEADS, copy_gbps=round(copy_gbps, 1),
                  checks=checks, checks_passed=ok,
                  timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies past L2, better of "
                         "two rounds; served: tree_mla_hopper's own choice; transposed: transposed=True")
    write_result(args.out, args.commit, params, rows)
    if not ok:
        raise SystemExit("checks failed: no timings")


if __name__ == "__main__":
    main()
