"""The 64-row tree-attention kernel's narrow path (a CTA of at most 16 live rows takes the few-row
kernel's transposed products) against the kernel before it, on the H200.

Why: a 9-node tree at 8 heads is 72 rows a request, 64 + 8, and the second CTA multiplied 64 rows
for its 8 (BENCHMARKS.md: 91 us at batch 32 x 4096 against 61 for 64 rows). This checks the new
kernel first, then times both in one process.

* Checks (``--few-rows`` off, so the 64-row kernel runs): the float32 reference on bf16 inputs at
  ``tree_mla_bench``'s awkward shapes, splits default / 1 / 3, outputs NaN-poisoned; graph replay
  against eager.
* Timing: the whole served call (split kernel + merge, the served split count), CUDA-graph replay
  rotating over inputs larger than L2, base and new interleaved over two rounds, the better of the
  two; the outputs of both on the first input compared (rows of full tiles must be equal bit for
  bit: their path did not change).

``--base`` names a copy of ``kernels/tree_mla_hopper.py`` from the commit before (a module file).

    python -m bench.tree_mla_narrow_ab --base PATH --commit SHA --out bench/results/tree_mla_narrow_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import torch

from bench.common import graph_replay_us, write_result
from bench.tree_mla_bench import KVR, ROPE, Case, rel_err, rotating_cases
from kernels import tree_mla_hopper as new
from kernels.tree_mla import tree_mla_reference

CHECKS = [  # (context per request, nodes, heads, page_size, kvr, rope, pages not back to back)
    ([1000, 37, 0, 4099], 9, 8, 64, KVR, ROPE, False),
    ([777, 2048, 3], 17, 16, 1, KVR, ROPE, False),
    ([16384, 100], 129, 8, 64, KVR, ROPE, False),
    ([1500, 40, 900], 17, 8, 16, 128, 32, False),
    ([700, 64], 9, 8, 16, KVR, ROPE, True),
    ([33, 95, 4000], 2, 8, 16, KVR, ROPE, False),
    ([5000, 1200], 33, 64, 64, KVR, ROPE, False),
]
SHAPES = ((32, 4096, 9, 8), (32, 4096, 17, 8), (32, 4096, 33, 8), (32, 4096, 8, 8), (128, 4096, 9, 8), (32, 16384, 9, 8),
          (128, 16384, 9, 8), (4, 4096, 17, 8), (8, 4096, 9, 8), (8, 4096, 17, 8), (16, 1024, 17, 8), (32, 4096, 9, 64))


def load_base(path: str):
    spec = importlib.util.spec_from_file_location("tree_mla_hopper_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def checks() -> list[dict]:
    rows = []
    real_empty = torch.empty
    for lens, n, h, ps, kvr, rope, padded in CHECKS:
        case = Case(len(lens), lens, n, h, seed=11, page_size=ps, kvr=kvr, rope=rope)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent, case.q_pe, case.kv_cache, case.new_kv, case.host_meta, case.scale)
        for splits in (None, 1, 3):
            torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
            try:
                got = new.tree_mla_hopper(*case.args(), num_splits=splits, few_rows=False)
            finally:
                torch.empty = real_empty
            row = dict(lens=lens, nodes=n, heads=h, page_size=ps, kvr=kvr, num_splits=splits, padded=padded,
                       rel_err=rel_err(got, want), max_abs_err=(got.float() - want.float()).abs().max().item(),
                       finite=bool(torch.isfinite(got).all()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    case = Case(4, 4096, 9, 8, seed=3)
    eager = new.tree_mla_hopper(*case.args(), few_rows=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = new.tree_mla_hopper(*case.args(), few_rows=False)
    graph.replay()
    torch.cuda.synchronize()
    rows.append(dict(graph_equals_eager=bool(torch.equal(replayed, eager))))
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_narrow_ab.json")
    args = ap.parse_args()
    base = load_base(args.base)
    check_rows = checks()
    rows = []
    for batch, context, nodes, heads in SHAPES:
        cases = rotating_cases(batch, context, nodes, heads)
        fns = {"base": base.tree_mla_hopper, "narrow": new.tree_mla_hopper}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for rnd in range(2):
            for name in (list(fns) if rnd == 0 else list(fns)[::-1]):
                times[name].append(graph_replay_us([lambda c=c, f=fns[name]: f(*c.args()) for c in cases]))
        outs = {k: f(*cases[0].args()).float() for k, f in fns.items()}
        full = (nodes * heads) // new.BLOCK_M * new.BLOCK_M  # rows of full tiles, request by request
        per_req = outs["base"].reshape(batch, nodes * heads, -1), outs["narrow"].reshape(batch, nodes * heads, -1)
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=heads, rows=nodes * heads,
                   base_us=round(min(times["base"]), 2), narrow_us=round(min(times["narrow"]), 2),
                   rounds={k: [round(t, 2) for t in v] for k, v in times.items()},
                   full_tiles_equal=bool(torch.equal(per_req[0][:, :full], per_req[1][:, :full])),
                   rel_vs_base=rel_err(outs["narrow"], outs["base"]), finite=bool(torch.isfinite(outs["narrow"]).all()))
        row["speedup"] = round(row["base_us"] / row["narrow_us"], 3)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(args.out, "tree_mla_narrow_ab", args.commit,
                 dict(base=args.base, checks=check_rows,
                      timing="whole tree_mla_hopper call at the served split count, CUDA-graph replay rotating over "
                             "inputs > L2; min of two rounds, base and new interleaved"),
                 rows)


if __name__ == "__main__":
    main()
