"""Host time of the verifier's commit tail (accepted rows -> KV pages and features), as the engine
did it before `41e0a08` and as it does since (one host-to-device copy), on one device.

Why: the step probe put 0.38 ms of a C=1 step between the posterior and the features' return on an
H100 host (`step-probe-h100-e1057ce.json`), for a handful of accepted rows. The engine's tail made
two small host-to-device copies (the accepted rows, then the pages and slots) and gathers the rows
twice (padded rows, then the KV) before an advanced-index scatter. Now it computes the padded rows
and the flat cache slots on the host (`PagedKVCache.slots`), copies them in one array, and gathers
and scatters with ``index_select`` / ``index_copy_`` (`write_slots`). Both are checked to write the same bytes before they are timed.

    python -m bench.commit_costs --device cuda --out bench/results/commit-costs-<gpu>-<sha>.json
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from bench.common import host_us, write_result
from services.verifier.kv_cache import PagedKVCache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=6, help="target layers (the demo model's)")
    p.add_argument("--dim", type=int, default=160, help="latent KV width (kv_lora_rank + rope)")
    p.add_argument("--width", type=int, default=768, help="feature width")
    p.add_argument("--trees", type=int, default=1)
    p.add_argument("--nodes", type=int, default=33, help="nodes a tree (padded bucket rows alike)")
    p.add_argument("--accepted", type=int, default=4, help="accepted rows a tree")
    p.add_argument("--reps", type=int, default=1000)
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    L, D, B, T, A = args.layers, args.dim, args.trees, args.nodes, args.accepted
    cache = PagedKVCache(L, 64 * B, 16, D, torch.bfloat16, dev, shuffle_seed=1)
    rids = [f"r{i}" for i in range(B)]
    for rid in rids:
        cache.reserve(rid, 600)
    starts = [int(x) for x in torch.randint(0, 500, (B,), generator=gen)]
    new_kv = torch.randn(L, B * T, D, generator=gen).to(dev, torch.bfloat16)        # [L, rows, D] padded rows
    features = torch.randn(B * T, args.width, generator=gen).to(dev, torch.bfloat16)  # [rows, F]
    real_rows = np.arange(B * T)                                                    # [N] real -> padded row
    rows_dev = torch.from_numpy(real_rows).to(dev)
    keep = [b * T + k for b in range(B) for k in sorted(torch.randperm(T, generator=gen)[:A].tolist())]
    writes = [(rid, s, A) for rid, s in zip(rids, starts)]

    def before():
        rows = torch.tensor(keep, dtype=torch.int64, device=dev)
        rows = rows_dev[rows]
        pages, slots = zip(*[(cache.page_ids(rid)[pos // cache.page_size], pos % cache.page_size)
                             for rid, s, k in writes for pos in range(s, s + k)])
        index = torch.tensor([pages, slots], dtype=torch.int64).to(dev)            # [2, K]
        cache.kv[:, index[0], index[1]] = new_kv[:, rows]
        return features[rows]

    def now():
        rows = real_rows[keep]
        idx = torch.from_numpy(np.concatenate([rows, cache.slots(writes)])).to(dev)   # [2K] one copy
        rows_d, slots_d = idx[:len(rows)], idx[len(rows):]
        cache.write_slots(slots_d, new_kv.index_select(1, rows_d))
        return features.index_select(0, rows_d)

    base = torch.rand(cache.kv.shape, generator=gen).to(dev, torch.bfloat16)     # fresh bytes, not zeros
    cache.kv.copy_(base)
    f1, kv1 = before(), cache.kv.clone()
    cache.kv.copy_(base)
    f2 = now()
    assert torch.equal(f1, f2), "features differ"
    assert torch.equal(cache.kv, kv1), "KV pages differ"
    assert int((kv1 != base).any(-1).sum()) == L * B * A, "not every accepted row was written"
    rows_out = []
    for name, fn in {"before 41e0a08: two copies, index / index_put": before,
                     "since: one copy, index_select / index_copy_": now}.items():
        us = host_us(fn, args.reps, sync)
        rows_out.append({"part": name, "median_us": us})
        print(f"{name:50s} {us:8.2f} us", flush=True)
    if args.out:
        write_result(args.out, args.commit, {k: getattr(args, k) for k in ("layers", "dim", "width", "trees", "nodes",
                                                                          "accepted", "reps")}
                     | {"timing": "median host time of one call, device synced outside the clock"}, rows_out, args.device)


if __name__ == "__main__":
    main()
