"""The K2 slice's steps with the router's float32 logits from cuBLAS's float32 GEMM against the bf16
parts (`router_partial_logits`), in one process: same weights, cache and trees, the variants
interleaved over two rounds (second round reversed), each step captured afresh.

Why in one process: the slice's synthetic router is sensitive to the last bit of its logits, so two
runs of different commits touch different experts; here only the router's arithmetic differs.

    python -m bench.router_ab --commit SHA --out bench/results/router_ab.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import write_result
from bench.k2_slice import (K2_CONFIG, TP, build_cache, build_model, per_rank_config, random_trees,
                            time_full_ms, time_replay_ms)
from services.verifier.config import TargetConfig
from services.verifier.graphs import VerifyGraphs

CASES = ((0, 1), (16, 1), (16, 32))  # (budget, batch); budget 0 = autoregressive
CONTEXT, PAGE = 1024, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/router_ab.json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = TargetConfig.from_hf(per_rank_config(K2_CONFIG, TP, None))
    model = build_model(config, torch.bfloat16, dev, 0)
    batch = max(b for _, b in CASES)
    cache, rids = build_cache(config, batch, CONTEXT, PAGE, torch.bfloat16, dev, 0)
    gen = torch.Generator().manual_seed(0)
    trees = {b: random_trees(b, batch, config.vocab_size, gen) for b in sorted({bud for bud, _ in CASES})}
    moes = [layer.moe for layer in model.layers if layer.moe is not None]
    parts = [m.gate_parts for m in moes]
    assert all(p is not None for p in parts), "the bf16 router parts are built on CUDA for bf16 models"
    rows = []
    for rnd, order in enumerate((("float32", "parts"), ("parts", "float32"))):
        for variant in order:
            for m, p in zip(moes, parts):
                m.gate_parts = p if variant == "parts" else None
            for budget, b in CASES:
                nodes = budget + 1
                graphs = VerifyGraphs(model, cache, max_context=CONTEXT, batch_buckets=(b,), node_buckets=(nodes,),
                                      capture=True)
                tokens, parents, depths, sizes = trees[budget].flat(b)
                step_args = (tokens, parents, depths, sizes, [CONTEXT] * b, [cache.page_ids(r) for r in rids[:b]])
                graphs.run(*step_args)
                torch.cuda.synchronize()
                step = time_full_ms(lambda: graphs.run(*step_args), args.reps, dev)
                replay = time_replay_ms(graphs, (b, nodes), 30)
                rows.append(dict(round=rnd, router=variant, budget=budget, batch=b, tree_nodes=nodes,
                                 step_ms=round(step, 3), replay_ms=round(replay, 3)))
                print(json.dumps(rows[-1]), flush=True)
                del graphs
                torch.cuda.empty_cache()
    write_result(args.out, Path(args.out).stem, args.commit,
                 dict(model="Kimi-K2 TP8 per-rank slice, 61 layers, random weights (bench.k2_slice)", context=CONTEXT,
                      page_size=PAGE, routing="model", reps=args.reps,
                      timing="step_ms: whole verify call, median of reps; replay_ms: the captured graph alone, "
                             "median of 30", variants="float32: gate_parts None (cuBLAS float32 GEMM); parts: "
                             "router_partial_logits"), rows)


if __name__ == "__main__":
    main()
