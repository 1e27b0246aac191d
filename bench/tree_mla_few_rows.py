"""The few-row tree-MLA kernel against the 64-row one: decode steps, small trees, split counts.

Why: at Kimi-K2's 8 heads a rank, a decode step (one node) has 8 rows a request and a 2-node tree
16, yet the 64-row Gluon kernel multiplies 64 rows and runs its two-warpgroup chain for them. The
few-row kernel (``kernels/tree_mla_hopper.py``, ``_tree_mla_few_rows_kernel``) transposes the
products so the keys fill the MMA's 64-row side. This script checks it and times both.

* Checks (every mode but ``--splits`` / ``--merges``): both kernels against the float32 reference
  on bf16 inputs, NaN-poisoned outputs, splits 1 / 3 / the served count, TMA and cp.async caches
  (page size 1, pages not back to back), the K2 and demo dims, empty prefixes, 1- and 2-node
  requests and 9 / 17 / 33-node trees; graph replay equals eager.
* Times: the whole ``tree_mla_hopper`` call (split kernel + merge), CUDA-graph replay rotating over
  input copies larger than L2, variants interleaved, the better of two rounds. The default mode
  times decode shapes (1 and 2 nodes) with ``few_rows`` on and off, GB/s on the bytes the call must
  read (``Case.bytes_read``); ``--groups`` trees at batch 1-8 (``few_rows=True`` at several split
  counts against the 64-row kernel); ``--splits`` and ``--merges`` sweep the few-row call's split
  count and the merge's launch shape at decode shapes.

    python -m bench.tree_mla_few_rows [--groups | --splits | --merges] --commit SHA --out bench/results/NAME.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import graph_replay_us, kernel_times, measure_copy_gbps, write_result
from bench.tree_mla_bench import Case, rel_err, rotating_cases
from kernels.tree_mla import tree_mla_reference
from kernels.tree_mla_hopper import tree_mla_hopper

HEADS = 8
SHAPES = [(b, c, n) for n in (1, 2) for b in (1, 8, 32, 128) for c in (1024, 4096, 16384)]
CHECKS = [  # (context per request, nodes, heads, page_size, kvr, rope, page stride padded by one token)
    ([1000, 37, 0, 4099], 1, 8, 64, 512, 64, False),
    ([300, 5000], 2, 8, 16, 512, 64, False),
    ([777, 2048, 3], 1, 16, 1, 512, 64, False),
    ([1500, 40, 900], 2, 8, 16, 128, 32, False),
    ([700, 64], 2, 8, 16, 512, 64, True),
    ([0, 0], 1, 8, 64, 512, 64, False),
    ([1000, 37, 0, 4099], 9, 8, 64, 512, 64, False),  # trees: several 16-row groups a request
    ([777, 2048, 3], 17, 8, 1, 512, 64, False),
    ([5000, 1200], 33, 8, 16, 512, 64, False),
    ([1500, 40, 900], 17, 8, 16, 128, 32, False),
    ([300], 3, 16, 16, 512, 64, False),
]


def check(log: list) -> list[dict]:
    """Both kernels (``few_rows`` True and False) against the float32 reference, outputs NaN-poisoned."""
    rows = []
    real_empty = torch.empty
    for lens, nodes, heads, ps, kvr, rope, padded in CHECKS:
        case = Case(len(lens), lens, nodes, heads, seed=7, page_size=ps, kvr=kvr, rope=rope)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent.float(), case.q_pe.float(), case.kv_cache.float(), case.new_kv.float(),
                                  case.host_meta, case.scale)
        for splits in (None, 1, 3):
            torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
            try:
                got = tree_mla_hopper(*case.args(), num_splits=splits, few_rows=True)
                wide_kernel = tree_mla_hopper(*case.args(), num_splits=splits, few_rows=False)
            finally:
                torch.empty = real_empty
            row = dict(lens=lens, nodes=nodes, heads=heads, page_size=ps, kvr=kvr, rope=rope,
                       cache_contiguous=case.kv_cache.is_contiguous(), num_splits=splits,
                       max_abs_err=(got.float() - want).abs().max().item(), rel_err=rel_err(got, want),
                       rel_err_64_row_kernel=rel_err(wide_kernel, want), finite=bool(torch.isfinite(got).all()))
            rows.append(row)
            log.append(f"check {row}")
            print(log[-1], flush=True)
    for nodes in (1, 9):
        case = Case(4, 4096, nodes, 8, seed=3)
        eager = tree_mla_hopper(*case.args(), few_rows=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = tree_mla_hopper(*case.args(), few_rows=True)
        graph.replay()
        torch.cuda.synchronize()
        rows.append(dict(nodes=nodes, graph_equals_eager=bool(torch.equal(replayed, eager))))
        print(rows[-1], flush=True)
    return rows


GROUP_SHAPES = [(b, c, n) for n in (9, 17, 33) for b in (1, 2, 4, 8) for c in (1024, 4096, 16384)]
GROUP_SPLITS = (None, 8, 16, 24)


def groups(out: str, commit: str | None) -> None:
    """Trees at small batch: every 16 rows of a request on a few-row CTA (``few_rows=True``, split
    counts swept) against the 64-row kernel (``few_rows=False``, its served split count)."""
    checks = check([])
    ok = all(r.get("rel_err", 0) < 1e-2 and r.get("finite", True) and r.get("graph_equals_eager", True) for r in checks)
    rows = []
    for batch, context, nodes in GROUP_SHAPES if ok else []:
        cases = rotating_cases(batch, context, nodes, HEADS)
        variants = [(False, None)] + [(True, s) for s in GROUP_SPLITS if s is None or context // s >= 64]
        times: dict[tuple, list[float]] = {v: [] for v in variants}
        for _ in range(2):
            for few, s in variants:
                times[(few, s)].append(graph_replay_us(
                    [lambda c=c, f=few, n=s: tree_mla_hopper(*c.args(), num_splits=n, few_rows=f) for c in cases]))
        key = lambda v: ("few/" if v[0] else "rows64/") + str(v[1] or "auto")  # noqa: E731
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS,
                   times_us={key(v): round(min(t), 2) for v, t in times.items()})
        row["best"] = key(min(variants, key=lambda v: min(times[v])))
        row["few_auto_speedup"] = round(min(times[(False, None)]) / min(times[(True, None)]), 3)
        rows.append(row)
        print(row, flush=True)
        del cases
    params = dict(kvr=512, rope=64, page_size=64, dtype="bfloat16", heads=HEADS, checks=checks, checks_passed=ok,
                  timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies past L2, better "
                         "of two rounds; key: kernel/num_splits (few: few_rows=True, rows64: few_rows=False; auto: "
                         "few_rows_splits / choose_splits)")
    write_result(out, commit, params, rows)
    if not ok:
        raise SystemExit("checks failed: no timings")


SPLIT_SHAPES = [(b, c) for b in (1, 4, 8, 16) for c in (1024, 4096, 16384)]
SPLIT_COUNTS = (None, 4, 8, 16, 24, 32, 48, 64)


def splits(out: str, commit: str | None) -> None:
    """The few-row call at decode shapes (one node, 8 heads) across split counts, and where its time
    goes at the served count (split kernel and merge, torch.profiler, eager)."""
    rows = []
    for batch, context in SPLIT_SHAPES:
        cases = rotating_cases(batch, context, 1, HEADS)
        counts = [s for s in SPLIT_COUNTS if s is None or context // s >= 64]
        times: dict[int | None, list[float]] = {s: [] for s in counts}
        for _ in range(2):
            for s in counts:
                times[s].append(graph_replay_us([lambda c=c, n=s: tree_mla_hopper(*c.args(), num_splits=n) for c in cases]))
        first = cases[0]
        row = dict(batch=batch, context=context, tree_nodes=1, heads=HEADS,
                   times_us={str(s or "auto"): round(min(v), 2) for s, v in times.items()},
                   kernels_us=kernel_times(lambda: tree_mla_hopper(*first.args())))
        row["best"] = str(min(counts, key=lambda s: min(times[s])) or "auto")
        rows.append(row)
        print(row, flush=True)
        del cases
    params = dict(kvr=512, rope=64, page_size=64, dtype="bfloat16", heads=HEADS,
                  timing="whole tree_mla_hopper call (few-row kernel + merge), CUDA-graph replay rotating over input "
                         "copies past L2, better of two rounds; key: num_splits (auto: choose_splits); kernels_us: "
                         "the served count's launches, torch.profiler, eager")
    write_result(out, commit, params, rows)


MERGE_SHAPES = [(1, 4096), (1, 16384), (4, 4096), (8, 4096), (1, 1024)]
MERGE_SPLITS = (16, 24, 32, 48)
MERGE_PLANS = (None, (8, 8), (8, 16), (16, 16), (16, 32), (32, 32))  # (d_chunks, split_block); None: merge_plan's


def merges(out: str, commit: str | None) -> None:
    """The merge's launch shape at decode shapes: value-dim chunks a row block and splits read at once
    (``tree_mla.merge_plan`` patched), at several split counts; whole call, outputs compared bitwise."""
    import kernels.tree_mla as tm

    served_plan = tm.merge_plan
    rows = []
    for batch, context in MERGE_SHAPES:
        cases = rotating_cases(batch, context, 1, HEADS)
        counts = [s for s in MERGE_SPLITS if context // s >= 64]
        times: dict[tuple, list[float]] = {(s, p): [] for s in counts for p in MERGE_PLANS}
        equal = {}
        try:
            for rnd in range(2):
                for (splits, plan) in times:
                    tm.merge_plan = served_plan if plan is None else (lambda *a, p=plan: p)
                    times[(splits, plan)].append(graph_replay_us(
                        [lambda c=c, n=splits: tree_mla_hopper(*c.args(), num_splits=n) for c in cases]))
                    if rnd == 0:
                        got = tree_mla_hopper(*cases[0].args(), num_splits=splits)
                        tm.merge_plan = served_plan
                        equal[(splits, plan)] = bool(torch.equal(got, tree_mla_hopper(*cases[0].args(), num_splits=splits)))
        finally:
            tm.merge_plan = served_plan
        key = lambda k: f"s{k[0]}/" + ("plan" if k[1] is None else f"d{k[1][0]}_b{k[1][1]}")  # noqa: E731
        row = dict(batch=batch, context=context, tree_nodes=1, heads=HEADS,
                   served_plan=list(served_plan(batch * HEADS, 512, 32, 1, 132)),
                   times_us={key(k): round(min(v), 2) for k, v in times.items()},
                   equal_to_plan={key(k): v for k, v in equal.items()})
        row["best"] = key(min(times, key=lambda k: min(times[k])))
        rows.append(row)
        print(row, flush=True)
        del cases
    params = dict(kvr=512, rope=64, page_size=64, dtype="bfloat16", heads=HEADS,
                  timing="whole tree_mla_hopper call, CUDA-graph replay rotating over input copies past L2, better "
                         "of two rounds; key: s<num_splits>/d<d_chunks>_b<split_block> (plan: merge_plan's)")
    write_result(out, commit, params, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/tree_mla_few_rows.json")
    ap.add_argument("--shapes", default=None, help="batch,context,nodes;... (default: all)")
    ap.add_argument("--splits", action="store_true", help="sweep the split count at decode shapes instead")
    ap.add_argument("--merges", action="store_true", help="sweep the merge's launch shape at decode shapes instead")
    ap.add_argument("--groups", action="store_true", help="time trees at small batch on few-row CTAs instead")
    args = ap.parse_args()
    if args.groups:
        return groups(args.out, args.commit)
    if args.merges:
        return merges(args.out, args.commit)
    if args.splits:
        return splits(args.out, args.commit)
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    log: list[str] = []
    checks = check(log)
    ok = all(r.get("rel_err", 0) < 1e-2 and r.get("finite", True) and r.get("graph_equals_eager", True) for r in checks)
    copy = measure_copy_gbps()
    rows = []
    for batch, context, nodes in shapes if ok else []:
        cases = rotating_cases(batch, context, nodes, HEADS)
        first = cases[0]
        times: dict[str, list[float]] = {"few_rows": [], "rows64": []}
        for _ in range(2):
            for name in times:
                few = name == "few_rows"
                times[name].append(graph_replay_us([lambda c=c, f=few: tree_mla_hopper(*c.args(), few_rows=f) for c in cases]))
        few_us, wide_us = min(times["few_rows"]), min(times["rows64"])
        gbps = first.bytes_read() / few_us / 1e3
        row = dict(batch=batch, context=context, tree_nodes=nodes, heads=HEADS, rows=nodes * HEADS, copies=len(cases),
                   time_us=round(few_us, 2), rows64_us=round(wide_us, 2), speedup=round(wide_us / few_us, 3),
                   gbps=round(gbps, 1), frac_of_copy=round(gbps / copy, 3),
                   rows64_frac_of_copy=round(first.bytes_read() / wide_us / 1e3 / copy, 3))
        rows.append(row)
        print(row, flush=True)
        del cases
    params = dict(kvr=512, rope=64, page_size=64, dtype="bfloat16", heads=HEADS, checks=checks, checks_passed=ok,
                  timing="whole tree_mla_hopper call (split kernel + merge), CUDA-graph replay rotating over input "
                         "copies past L2, variants interleaved, better of two rounds",
                  variants="time_us: few_rows=True (the few-row kernel); rows64_us: few_rows=False (the 64-row kernel)")
    write_result(args.out, args.commit, params, rows)
    if not ok:
        raise SystemExit("checks failed: no timings")


if __name__ == "__main__":
    main()
