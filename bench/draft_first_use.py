"""Does a tree build compile anything on a request, after the draft's start-up?

The draft's start-up (``services.draft.tree.warm_up_tree_builds``, as ``DraftEngine.warm_up``
calls it, with its default budgets and batch sizes) runs first, in this process, on an empty
Triton cache. Then every budget 1..128 is built once from fresh bf16 logits ``[batch, 15, vocab]``
at a few batch sizes and depth caps, each call timed alone (wall clock, synchronised). A call that
compiles takes seconds, one that does not about a millisecond; ``new_cache_entries`` counts the
Triton cache entries the calls after the start-up added (0: nothing compiled on a request).

Usage: python -m bench.draft_first_use [--vocab 4096 163840] [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import time

from bench.empty_triton_cache import kernels_in_cache   # before triton's first import

import torch

from bench.common import write_result
from services.common.settings import MAX_BUDGET
from services.draft.tree import build_trees_from_logits, warm_up_tree_builds

DEPTH = 15   # block 16: the demo drafter's and the K2 drafter's
WARM_BUDGETS = (8, 16, 32)   # draft.warmup_budgets' default
WARM_BATCHES = (1, 4, 16, 64)   # DraftEngine.warm_up's
CALLS = ((1, None), (5, None), (32, None), (3, 2))   # (batch, depth cap)


def first_use(vocab: int) -> tuple[dict, list[dict]]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    warm_up_tree_builds(DEPTH, vocab, torch.bfloat16, "cuda", MAX_BUDGET, WARM_BUDGETS, WARM_BATCHES)
    torch.cuda.synchronize()
    start = {"row": "startup", "vocab": vocab, "seconds": round(time.perf_counter() - t0, 2),
             "cache_entries": len(kernels_in_cache())}
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    for budget in range(1, MAX_BUDGET + 1):
        for batch, cap in CALLS:
            logits = (torch.randn(batch, DEPTH, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
            roots = torch.zeros(batch, dtype=torch.int64, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trees = build_trees_from_logits(logits, budget, roots, max_depth=cap)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            assert int(trees.sizes.min()) >= 1 and int(trees.sizes.max()) <= budget + 1
            rows.append({"row": "first_call", "vocab": vocab, "budget": budget, "batch": batch, "max_depth": cap,
                         "ms": round(ms, 3)})
    start["new_cache_entries"] = len(kernels_in_cache()) - start["cache_entries"]
    return start, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 163840])
    p.add_argument("--out", default="bench/results/draft_first_use.json")
    p.add_argument("--commit", default=None)
    args = p.parse_args()
    rows = []
    for vocab in args.vocab:
        start, calls = first_use(vocab)
        slowest = max(calls, key=lambda r: r["ms"])
        summary = {**start, "calls": len(calls), "slowest_ms": slowest["ms"], "slowest_budget": slowest["budget"],
                   "median_ms": sorted(r["ms"] for r in calls)[len(calls) // 2]}
        print(summary, flush=True)
        rows += [summary, *calls]
    write_result(args.out, args.commit, {"depth": DEPTH, "dtype": "bfloat16", "warm_budgets": WARM_BUDGETS,
                                         "warm_batches": WARM_BATCHES, "calls": CALLS, "vocab": args.vocab}, rows)


if __name__ == "__main__":
    main()
