"""A/B: the few-row tree-MLA kernel merging its own splits, against the merge launch after it.

Why: a decode step's attention (one node, 8 heads a rank) runs the few-row kernel over tens of KV
splits, then ``_tree_mla_merge_kernel``. On a chain of calls the merge launch cost 4-8 us of an
11-21 us call (the ``no_merge`` column: the split kernel alone, its output unmerged). Since
``kernels.tree_mla_hopper.few_rows_own_merge`` the last CTA of a request to finish reads every
split's partial and writes the output itself (an arrival counter a request), with the merge
kernel's sums in its order.

Checks first, on the GPU: the own merge's output against the merge launch's (bit for bit), and
against the float32 reference, output NaN-poisoned, at page sizes 1 / 16 / 64, pages not back to
back, the demo dims, empty prefixes and 2 to 48 splits; CUDA-graph replays with new inputs each
time equal to eager calls (the counters reset). Then times: the whole ``tree_mla_hopper`` call,
CUDA-graph replay rotating over input copies larger than L2, variants interleaved, better of two
rounds.

    python -m bench.tree_mla_own_merge_ab --commit SHA --out bench/results/NAME.json
"""

from __future__ import annotations

import argparse

import torch

from bench.common import graph_replay_us, result_file, write_result
from bench.tree_mla_bench import Case, rel_err, rotating_cases
from kernels import tree_mla_hopper as hop
from kernels.tree_mla import _LOG2E, _shared_memory_limit, _sm_count, split_partials, tree_mla_reference

HEADS = 8
SHAPES = [(b, c) for b in (1, 4, 8, 32) for c in (1024, 4096, 16384)]  # decode steps: one node a request
CHECKS = [  # (context per request, heads, page_size, kvr, rope, pages padded apart)
    ([1000, 37, 0, 4099], 8, 64, 512, 64, False),
    ([777, 2048, 3], 8, 1, 512, 64, False),
    ([1500, 40, 900], 4, 16, 128, 32, False),
    ([700, 64], 8, 16, 512, 64, True),
    ([0, 0], 8, 64, 512, 64, False),
    ([16384, 5000], 8, 16, 512, 64, False),
]


def served(case: Case, splits: int | None, own: bool, poison: bool = True) -> torch.Tensor:
    """One ``tree_mla_hopper`` call on the few-row kernel, its output NaN-poisoned first (``poison``)."""
    real_empty = torch.empty
    if poison:
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
    hop.OWN_MERGE = own
    try:
        return hop.tree_mla_hopper(*case.args(), num_splits=splits, few_rows=True)
    finally:
        torch.empty = real_empty
        hop.OWN_MERGE = True


def split_only(case: Case, splits: int):
    """The few-row split launch alone (partials unmerged; for timing only)."""
    q, q_pe, kv, new_kv, meta, scale = case.args()
    out = torch.empty_like(q)
    o_part, lse_part = split_partials(out, splits, 1)
    gdt = hop.gl.bfloat16 if q.dtype == torch.bfloat16 else hop.gl.float16
    return lambda: hop._launch_few_rows(q, q_pe, kv, new_kv, meta, scale * _LOG2E, out, o_part, lse_part, splits, 1, gdt,
                                        _shared_memory_limit(q.device))


def check() -> list[dict]:
    rows = []
    for lens, heads, ps, kvr, rope, padded in CHECKS:
        case = Case(len(lens), lens, 1, heads, seed=5, page_size=ps, kvr=kvr, rope=rope)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent.float(), case.q_pe.float(), case.kv_cache.float(), case.new_kv.float(),
                                  case.host_meta, case.scale)
        for splits in (None, 2, 3, 17, 48):
            launch, own = served(case, splits, False), served(case, splits, True)
            rows.append(dict(lens=lens, heads=heads, page_size=ps, kvr=kvr, rope=rope, pages_apart=padded,
                             num_splits=splits, own_equals_launch=bool(torch.equal(own, launch)),
                             finite=bool(torch.isfinite(own).all()), rel_err=rel_err(own, want)))
            print(rows[-1], flush=True)
    case = Case(2, [3000, 700], 1, HEADS, seed=3)
    static = [t.clone() for t in (case.q_latent, case.q_pe, case.new_kv)]

    def call() -> torch.Tensor:
        return hop.tree_mla_hopper(static[0], static[1], case.kv_cache, static[2], case.meta, case.scale, few_rows=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call()
    equal = []
    for _ in range(5):
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        equal.append(bool(torch.equal(replayed, call())))
    rows.append(dict(graph_replays_equal_eager=equal))
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=result_file, required=True)
    args = ap.parse_args()
    checks = check()
    sms = _sm_count(torch.device("cuda"))
    rows = []
    for batch, context in SHAPES:
        cases = rotating_cases(batch, context, 1, HEADS)
        splits = hop.few_rows_splits(batch, context, sms)
        variants = {
            "launch": [lambda c=c: served(c, None, False, poison=False) for c in cases],
            "own": [lambda c=c: served(c, None, True, poison=False) for c in cases],
            "no_merge": [split_only(c, splits) for c in cases],
        }
        times: dict[str, list[float]] = {n: [] for n in variants}
        for rnd in range(2):
            for name in (list(variants) if rnd == 0 else list(variants)[::-1]):
                times[name].append(graph_replay_us(variants[name], reps=30))
        row = dict(batch=batch, context=context, nodes=1, heads=HEADS, splits=splits, copies=len(cases),
                   **{f"{n}_us": round(min(t), 2) for n, t in times.items()},
                   **{f"{n}_us_rounds": [round(x, 2) for x in t] for n, t in times.items()})
        row["own_vs_launch"] = round(row["own_us"] / row["launch_us"], 3)
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("_rounds")}, flush=True)
        del cases
        torch.cuda.empty_cache()
    write_result(str(args.out), args.commit,
                 dict(checks=checks, heads=HEADS, page_size=64, split_rule="few_rows_splits",
                      timing="whole tree_mla_hopper call on the few-row kernel, CUDA-graph replay rotating over input "
                             "copies > L2; min of two rounds, variants interleaved (second round reversed); no_merge = "
                             "the split launch alone at the same split count, its output not merged"),
                 rows)


if __name__ == "__main__":
    main()
