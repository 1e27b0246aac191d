"""The K2 slice's steps with one switch of the model flipped, in one process: same weights, cache
and trees, the two settings interleaved over two rounds (second round reversed), each step
captured afresh.

Switches:
* ``router``: the router's float32 logits from cuBLAS's float32 GEMM (``gate_parts`` None) against
  the bf16 parts (``router_partial_logits``);
* ``shared-stream``: the shared expert's gate/up on the main stream against a side stream beside
  the routing (``moe.SHARED_ON_SIDE_STREAM``): the same kernels on the same inputs;
* ``router-gemv``: one token's router logits from the GEMM path against ``router_gemv``
  (``moe.ROUTER_GEMV``; only steps of one token differ);
* ``few-rows``: the tree attention's 64-row kernel for every step against ``few_rows_serves``'
  choice (the few-row kernel for decode steps and small trees);
* ``skinny``: cuBLAS for the dense projections against ``skinny_linear``'s kernel
  (``skinny_gemm.SERVED``);
* ``moe-split``: the MoE gate/up's K slices on Hopper as ``a182555`` chose them (8 below half a
  row an expert, 2 up to two rows) against ``choose_config``'s (4 up to one row, 8 below half a
  row for a tree's tokens);
* ``pdl``: every Triton and Gluon kernel of the step launched plainly against with programmatic
  dependent launch (``kernels.pdl.PDL``);
* ``early-merge``: every tree-attention merge launched early (PDL) against the served rule, which
  launches it after the split launch completes where that launch held more than half the SMs
  (``tree_mla.EARLY_MERGE_MAX_SHARE``).

Each row says whether its logits equal the other setting's in the same round, and its own setting's
in the other round. Before ``a182555`` the MoE's split-K gate/up added its slices with atomics
(few rows per expert), so the second differed from run to run and the first could not be bit for
bit; now both should hold wherever the switch leaves the arithmetic alone.

Why in one process: the slice's synthetic router is sensitive to the last bit of its logits, so two
runs of different commits can touch different experts; here only the switch differs.

    python -m bench.k2_ab --switch router --commit SHA --out bench/results/router_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch

from bench.common import write_result
from bench.k2_slice import (K2_CONFIG, TP, build_cache, build_model, per_rank_config, random_trees, time_full_ms,
                            time_replay_ms)
from kernels import int4_moe, pdl, skinny_gemm, tree_mla, tree_mla_hopper
from services.verifier import moe as moe_mod
from services.verifier.config import TargetConfig
from services.verifier.graphs import VerifyGraphs
from services.verifier.model import TargetModel

CASES = ((0, 1), (16, 1), (16, 32))  # (budget, batch); budget 0 = autoregressive
CONTEXT, PAGE = 1024, 16


def switches(model: TargetModel) -> dict[str, tuple[tuple[str, str], Callable[[str], None]]]:
    """name -> ((setting A, setting B), set(setting))."""
    moes = [layer.moe for layer in model.layers if layer.moe is not None]
    parts = [m.gate_parts for m in moes]

    def router(v: str) -> None:
        for m, p in zip(moes, parts):
            m.gate_parts = p if v == "parts" else None

    def shared_stream(v: str) -> None:
        moe_mod.SHARED_ON_SIDE_STREAM = v == "side"

    def router_gemv(v: str) -> None:
        moe_mod.ROUTER_GEMV = v == "gemv"

    served = tree_mla_hopper.few_rows_serves

    def few_rows(v: str) -> None:
        tree_mla_hopper.few_rows_serves = served if v == "few" else (lambda *a: False)

    def skinny(v: str) -> None:
        skinny_gemm.SERVED = v == "skinny"

    rule = int4_moe._hopper_config

    def moe_split(v: str) -> None:
        def before(r: float, whole_experts: bool, shared: bool = False) -> int4_moe.Int4MoEConfig:
            cfg = rule(r, whole_experts, shared)
            if whole_experts or r > 2:
                return cfg
            return dataclasses.replace(cfg, gu_split_k=8 if r < 0.5 else 2)
        int4_moe._hopper_config = rule if v == "served" else before

    def pdl_switch(v: str) -> None:
        pdl.PDL = v == "pdl"

    share = tree_mla.EARLY_MERGE_MAX_SHARE

    def early_merge(v: str) -> None:
        tree_mla.EARLY_MERGE_MAX_SHARE = share if v == "served" else float("inf")

    return {"router": (("float32", "parts"), router), "shared-stream": (("main", "side"), shared_stream),
            "router-gemv": (("gemm", "gemv"), router_gemv), "few-rows": (("rows64", "few"), few_rows),
            "skinny": (("cublas", "skinny"), skinny), "moe-split": (("before", "served"), moe_split),
            "pdl": (("plain", "pdl"), pdl_switch), "early-merge": (("always", "served"), early_merge)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", required=True, choices=(
        "router", "shared-stream", "router-gemv", "few-rows", "skinny", "moe-split", "pdl", "early-merge"))
    ap.add_argument("--cases", nargs="+", default=None, metavar="BUDGET,BATCH",
                    help="steps to time (default: 0,1 16,1 16,32; budget 0 = autoregressive)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None, help="default bench/results/<switch>_ab.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=CONTEXT, help="prefix tokens a request (default %(default)s)")
    args = ap.parse_args()
    out = args.out or f"bench/results/{args.switch.replace('-', '_')}_ab.json"
    cases = [tuple(int(v) for v in c.split(",")) for c in args.cases] if args.cases else list(CASES)
    dev = torch.device("cuda")
    config = TargetConfig.from_hf(per_rank_config(K2_CONFIG, TP, None))
    model = build_model(config, torch.bfloat16, dev, 0)
    batch = max(b for _, b in cases)
    cache, rids = build_cache(config, batch, args.context, PAGE, torch.bfloat16, dev, 0)
    gen = torch.Generator().manual_seed(0)
    trees = {b: random_trees(b, batch, config.vocab_size, gen) for b in sorted({bud for bud, _ in cases})}
    (a, b), apply = switches(model)[args.switch]
    logits: dict[tuple[int, str, int, int], torch.Tensor] = {}
    rows = []
    for rnd, order in enumerate(((a, b), (b, a))):
        for setting in order:
            apply(setting)
            for budget, bsz in cases:
                nodes = budget + 1
                graphs = VerifyGraphs(model, cache, max_context=args.context, batch_buckets=(bsz,), node_buckets=(nodes,),
                                      capture=True)
                tokens, parents, depths, sizes = trees[budget].flat(bsz)
                step_args = (tokens, parents, depths, sizes, [args.context] * bsz, [cache.page_ids(r) for r in rids[:bsz]])
                logits[(rnd, setting, budget, bsz)] = graphs.run(*step_args).real().logits.clone()
                torch.cuda.synchronize()
                step = time_full_ms(lambda: graphs.run(*step_args), args.reps, dev)
                replay = time_replay_ms(graphs, (bsz, nodes), 30)
                rows.append({"round": rnd, args.switch: setting, "budget": budget, "batch": bsz, "tree_nodes": nodes,
                             "step_ms": round(step, 3), "replay_ms": round(replay, 3)})
                print(json.dumps(rows[-1]), flush=True)
                del graphs
                torch.cuda.empty_cache()
    for row in rows:   # the same setting run twice tells a switch's effect from run-to-run noise (atomics)
        key = (row["budget"], row["batch"])
        setting = row[args.switch]
        other = b if setting == a else a
        row["logits_equal_other_setting"] = bool(torch.equal(logits[(row["round"], setting, *key)],
                                                             logits[(row["round"], other, *key)]))
        row["logits_equal_other_round"] = bool(torch.equal(logits[(0, setting, *key)], logits[(1, setting, *key)]))
    write_result(out, args.commit,
                 dict(model="Kimi-K2 TP8 per-rank slice, 61 layers, random weights (bench.k2_slice)", context=args.context,
                      page_size=PAGE, routing="model", reps=args.reps, switch=args.switch, settings=[a, b],
                      cases=[list(c) for c in cases],
                      timing="step_ms: whole verify call, median of reps; replay_ms: the captured graph alone, "
                             "median of 30"), rows)


if __name__ == "__main__":
    main()
