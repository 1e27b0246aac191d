"""The router's float32 logits from bf16 parts (`router_partial_logits`) against cuBLAS's float32 GEMM.

Why: cuBLAS computes the float32 router GEMM on the CUDA cores (`sm80_xmma_gemm_f32f32`), 15% of
a K2 rank's budget-16 verify step at batch 32. `route` now computes the logits as one batched bf16
GEMM with a float32 output, over three bf16 matrices that sum to the router weight exactly and over
chunks of the hidden dims, and the selection kernel adds the partial logits. On fresh random router
weights and hidden states, per router shape:
* agreement: over 131072 tokens, the tokens whose experts differ from those chosen from float64
  logits (rounded to float32), and the largest logit error relative to the largest logit, for the
  float32 GEMM and for the parts over 1, 4 and 8 chunks; over the first 8192, one token a call,
  for ``router_gemv`` (served for single tokens);
* time: CUDA-graph replay of the whole route (GEMM + selection) per token count, cycling over 8
  router weights so they stream from HBM as in the model (each layer reads its own router).

    python -m bench.router_parts_check --commit SHA --out bench/results/router_parts.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_replay_us, write_result
from kernels.moe_routing import router_gemv, select_experts_triton
from services.verifier.moe import ROUTER_K_CHUNKS, ROUTER_PARTS, router_partial_logits, split_bf16

# name -> (hidden, experts, n_group, topk_group, top_k, routed_scaling_factor)
SHAPES = {
    "kimi_k2": (7168, 384, 1, 1, 8, 2.827),
    "deepseek_v3": (7168, 256, 8, 4, 8, 2.5),
    "demo": (256, 16, 4, 2, 4, 2.5),
}
CHUNKS = (1, ROUTER_K_CHUNKS, 8)
COPIES = 8  # router weights cycled through (8 x 11 MB at K2: past the 50 MB L2)
AGREEMENT_TOKENS, BLOCK = 131072, 8192


def agreement(hidden: int, e: int, sel: dict, g: torch.Generator) -> dict:
    """Tokens whose experts differ from the float64 logits' choice, and the largest relative error."""
    w = torch.randn(e, hidden, device="cuda", generator=g) / hidden ** 0.5
    bias = 0.05 * torch.randn(e, device="cuda", generator=g)
    parts = split_bf16(w).flatten(0, 1)
    stats = {k: {"tokens_differ": 0, "max_rel_err": 0.0} for k in ["fp32", *[f"parts_c{c}" for c in CHUNKS]]}
    stats["gemv"] = {"tokens": BLOCK, "tokens_differ": 0, "max_rel_err": 0.0}  # one token a call: one block
    for block in range(AGREEMENT_TOKENS // BLOCK):
        x = torch.randn(BLOCK, hidden, device="cuda", generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T
        want, _ = select_experts_triton(exact.float(), bias, **sel)
        runs = {"fp32": (x.float() @ w.T, 1)}
        runs.update({f"parts_c{c}": (router_partial_logits(x, parts, c), ROUTER_PARTS) for c in CHUNKS})
        for k, (logits, n_parts) in runs.items():
            ids, _ = select_experts_triton(logits, bias, **sel, parts=n_parts)
            stats[k]["tokens_differ"] += int((ids != want).any(1).sum())
            full = logits.double() if n_parts == 1 else logits.double().sum(0).view(BLOCK, n_parts, e).sum(1)
            err = ((full - exact).abs().max() / exact.abs().max()).item()
            stats[k]["max_rel_err"] = max(stats[k]["max_rel_err"], err)
        if block == 0:
            rows = [router_gemv(x[i:i + 1], w) for i in range(BLOCK)]  # [splits, 1, E] each
            ids = torch.cat([select_experts_triton(r, bias, **sel)[0] for r in rows])
            stats["gemv"]["tokens_differ"] = int((ids != want).any(1).sum())
            full = torch.cat([r.double().sum(0) for r in rows])
            stats["gemv"]["max_rel_err"] = ((full - exact).abs().max() / exact.abs().max()).item()
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 136, 544, 2176])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/router_parts.json")
    args = ap.parse_args()
    assert not torch.backends.cuda.matmul.allow_tf32, "the float32 baseline must not run in TF32"
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (hidden, e, groups, topk_group, top_k, scale) in SHAPES.items():
        sel = dict(top_k=top_k, n_group=groups, topk_group=topk_group, norm_topk_prob=True,
                   routed_scaling_factor=scale)
        gates = [torch.randn(e, hidden, device="cuda", generator=g) / hidden ** 0.5 for _ in range(COPIES)]
        parts = [split_bf16(w).flatten(0, 1) for w in gates]
        assert torch.equal(parts[0].double().view(ROUTER_PARTS, e, hidden).sum(0), gates[0].double()), \
            "the parts must sum to the weight"
        bias = 0.05 * torch.randn(e, device="cuda", generator=g)
        row = {"shape": name, "hidden": hidden, "experts": e, "agreement_tokens": AGREEMENT_TOKENS,
               "agreement": agreement(hidden, e, sel, g)}
        for n in args.tokens:
            x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
            x32 = x.float()  # the norm writes this copy for the float32 router
            row[f"fp32_route_us_{n}"] = round(graph_replay_us(
                [lambda w=w: select_experts_triton(x32 @ w.T, bias, **sel) for w in gates]), 2)
            if n == 1:
                row["gemv_route_us_1"] = round(graph_replay_us(
                    [lambda w=w: select_experts_triton(router_gemv(x, w), bias, **sel) for w in gates]), 2)
            for c in CHUNKS:
                row[f"parts_c{c}_route_us_{n}"] = round(graph_replay_us(
                    [lambda p=p: select_experts_triton(router_partial_logits(x, p, c), bias, **sel,
                                                       parts=ROUTER_PARTS) for p in parts]), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, args.commit,
                 dict(router_parts=ROUTER_PARTS, served_chunks=ROUTER_K_CHUNKS, chunks=list(CHUNKS),
                      tokens=args.tokens, weight_copies=COPIES,
                      weights="N(0, 1/hidden) float32; hidden states N(0, 1) rounded to bf16; bias 0.05 N(0, 1)",
                      exact="float64 GEMM of the same bf16 hidden states and float32 weights",
                      timing="CUDA-graph replay of route's GEMM + selection, 8 router weights in turn, median of 20",
                      fp32="cuBLAS float32 GEMM on the float32 copy of the hidden states (as route ran before)",
                      parts="router_partial_logits(x, parts, chunks): torch.bmm(bf16, bf16, out_dtype=float32), "
                            "partials added by the selection kernel",
                      gemv="kernels.moe_routing.router_gemv(x, float32 weight): one token, partials over slices of "
                           "the hidden dims added by the selection kernel"),
                 rows)


if __name__ == "__main__":
    main()
