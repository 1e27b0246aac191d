"""Propose from CUDA graphs against the eager propose, on the GPU: same log-probs, and how long.

(Propose gives logits since the draft hands them to ``build_trees_from_logits``; they are
normalised here, so the figures stay log-prob differences.)

Two drafters from one checkpoint, one with the context pool and graphs: the same random features
go into both, then each (batch, context) is proposed by both. Reports the largest log-prob
difference, top-1 agreement, the eager and replayed wall time (synchronised, median) of a propose
and of a step's commit (4 tokens a request), the largest difference of the committed context
keys, and the time to capture every bucket at start-up. Writes JSON (BENCHMARKS.md's result-file schema).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit, wall_ms
from services.draft.dflash import DFlashDrafter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--batches", default="1,8,64,128")
    p.add_argument("--contexts", default="60,700")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--graph-context", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="bench/results/propose-graphs.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    load = lambda: DFlashDrafter.load(Path(args.model) / "drafter", Path(args.model), dtype=dtype, device=dev)  # noqa: E731
    eager, pooled = load(), load()
    graphs = pooled.enable_graphs(args.rows, args.graph_context)
    t0 = time.perf_counter()
    captured = graphs.warm_up(graphs.batch_buckets, graphs.context_buckets)
    capture_s = time.perf_counter() - t0
    print(f"captured {captured} buckets in {capture_s:.1f} s; pool {graphs.pool_bytes / 2**20:.0f} MB", flush=True)
    width = eager.config.num_features
    rows = []
    for n in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            e_ctx, p_ctx = [], []
            for i in range(batch):
                feats = torch.randn(n - (i % 7), width, device=dev, dtype=dtype)   # ragged lengths
                for d, out in ((eager, e_ctx), (pooled, p_ctx)):
                    ctx = d.new_context()
                    d.extend_context(ctx, feats)
                    out.append(ctx)
            assert all(c.row is not None for c in p_ctx), "the pool is smaller than the batch"
            bonus = torch.randint(2, eager.config.vocab_size, (batch,))
            want = torch.log_softmax(eager.propose(e_ctx, bonus).float(), dim=-1)
            got = torch.log_softmax(pooled.propose(p_ctx, bonus).float(), dim=-1)
            diff = (got - want).abs().max().item()
            top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            row = {"batch": batch, "context": n, "max_abs_logprob_diff": round(diff, 5), "top1_agreement": top1,
                   "finite": bool(torch.isfinite(got).all()),
                   "eager_ms": round(wall_ms(lambda: eager.propose(e_ctx, bonus), args.reps), 3),
                   "graph_ms": round(wall_ms(lambda: pooled.propose(p_ctx, bonus), args.reps), 3)}
            row["speedup"] = round(row["eager_ms"] / row["graph_ms"], 2)
            # The commit of one step (4 accepted tokens a request): eager projection + per-request
            # scatter against one replay into the pool rows. Contexts grow by 4 tokens a call.
            step = [torch.randn(4, width, device=dev, dtype=torch.float32) for _ in range(batch)]
            row["commit_eager_ms"] = round(wall_ms(lambda: eager.extend_contexts(e_ctx, step), args.reps), 3)
            row["commit_graph_ms"] = round(wall_ms(lambda: pooled.extend_contexts(p_ctx, step), args.reps), 3)
            row["context_keys_max_diff"] = max(
                (p.keys[:, :p.length].float() - e.keys[:, :e.length].float()).abs().max().item()
                for e, p in zip(e_ctx, p_ctx))
            rows.append(row)
            print(row, flush=True)
            for c in p_ctx:
                pooled.release_context(c)
    doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": copy_gbps_on("cuda"),
           "params": {**{k: v for k, v in vars(args).items() if k not in ("out", "commit")}, "dtype": "bfloat16",
                      "timing": "wall, synchronised, median of reps", "buckets_captured": captured,
                      "capture_all_s": round(capture_s, 2), "pool_mb": round(graphs.pool_bytes / 2**20, 1),
                      "torch": torch.__version__},
           "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
