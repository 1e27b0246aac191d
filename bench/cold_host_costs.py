"""Host time of the verifier's per-step Python (tree checks, accept walk, commit slots) hot in a
loop, after a 2 ms sleep, and after a sweep of memory larger than the caches.

Why: the step probe measured these functions in the running stack at several times what a loop of
the same call takes (tree checks 105-160 us on the probe's hosts against ~20 us in a loop): in a
stack, each step's host code runs once every few milliseconds, after the GPU wait or a forward on
the CPU has moved its data and code out of the caches, and after the core may have idled. A cut to
the step's host path is judged by the cold figures, not by a loop's. CPU only (no model forward).

    python -m bench.cold_host_costs --out bench/results/cold-host-costs-cpu-<sha>.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import host_us, write_result
from services.verifier.acceptance import accept
from services.verifier.engine import PrefillInput, VerifierEngine
from services.verifier.model import TargetModel
from services.verifier.sampling import Sampling


def _heap_trees(pending: list[int], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One binary-heap-shaped tree of ``n`` nodes a request, rooted at its pending token; flat."""
    parents = np.r_[-1, (np.arange(1, n) - 1) // 2]
    depths = np.zeros(n, np.int64)
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    tok = np.concatenate([np.r_[p, np.arange(1, n) + 10] for p in pending]).astype(np.int64)
    return tok, np.tile(parents, len(pending)).astype(np.int64), np.tile(depths, len(pending))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--trees", type=int, nargs="+", default=[1, 32])
    p.add_argument("--nodes", type=int, default=17)
    p.add_argument("--calls", type=int, default=600, help="timed calls a function and mode")
    p.add_argument("--sweep-mib", type=int, default=128, help="memory swept before a cold call")
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    model = TargetModel.load(args.model)
    sweep = np.random.default_rng(0).random((args.sweep_mib << 20) // 8)   # fresh values, not zeros
    rows = []
    for R in args.trees:
        engine = VerifierEngine(model, model.new_cache(64 * R, 16), max_context=2048, prefill_chunk=512)
        rids = [f"r{i}" for i in range(R)]
        pending = [o.tokens[0] for o in engine.prefill([PrefillInput(r, [5, 6, 7, 8], Sampling(), 40)
                                                        for r in rids]).items]
        tok, par, dep = _heap_trees(pending, args.nodes)
        sizes = [args.nodes] * R
        assert engine._check_trees(rids, tok, par, dep, sizes) == [None] * R, "the bench's trees were refused"
        posterior = [int(x) for x in tok[1:args.nodes]] + [0]   # the posterior follows the tree's first chain
        tl, pl = tok[:args.nodes].tolist(), par[:args.nodes].tolist()
        writes = [(rid, 4, 3) for rid in rids]
        parts = {"check trees (engine._check_trees)": lambda: engine._check_trees(rids, tok, par, dep, sizes),
                 "accept walk, each tree (acceptance.accept)": lambda: [accept(tl, pl, posterior) for _ in rids],
                 "commit slots (PagedKVCache.slots)": lambda: engine.cache.slots(writes)}
        def sweep_caches() -> None:
            np.multiply(sweep, 1.0000001, out=sweep)

        # what runs between two timed calls (outside the clock), by mode
        between = {"hot": None, "after 2 ms sleep": lambda: time.sleep(0.002), "after a cache sweep": sweep_caches}
        for name, fn in parts.items():
            got = {mode: host_us(fn, args.calls, sync=action) for mode, action in between.items()}
            rows.append({"part": name, "trees": R, "nodes": args.nodes} | {f"{m} median_us": v for m, v in got.items()})
            print(f"{name:44s} R={R:3d} " + "  ".join(f"{m}: {v:7.1f} us" for m, v in got.items()), flush=True)
    if args.out:
        write_result(args.out, args.commit, {"model": args.model, "nodes": args.nodes, "calls": args.calls,
                                             "sweep_mib": args.sweep_mib, "timing": "median host time of one call"},
                     rows, "cpu")


if __name__ == "__main__":
    main()
