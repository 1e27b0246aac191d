"""The router's float32 logits from bf16 parts (`split_bf16`) against cuBLAS's float32 GEMM.

Why: cuBLAS computes the float32 router GEMM on the CUDA cores (`sm80_xmma_gemm_f32f32`), 15% of
a K2 rank's budget-16 verify step at batch 32. `route` now computes the logits as one bf16 GEMM
with a float32 output over three bf16 matrices that sum to the router weight exactly, and the
selection kernel adds the three partial logits. This checks, per router shape and token count, on
fresh random weights and hidden states:
* accuracy: both paths' logits against float64 logits (largest absolute error, and relative to
  the largest logit);
* selection: the rows whose expert ids equal those chosen from the float64 logits (rounded to
  float32), for each path;
* time: CUDA-graph replay of the whole route (GEMM + selection), cycling over 8 router weights so
  they stream from HBM as in the model (each layer reads its own router).

    python -m bench.router_parts_check --commit SHA --out bench/results/router_parts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import graph_replay_us, write_result
from kernels.moe_routing import select_experts_triton
from services.verifier.moe import ROUTER_PARTS, split_bf16

# name -> (hidden, experts, n_group, topk_group, top_k, routed_scaling_factor)
SHAPES = {
    "kimi_k2": (7168, 384, 1, 1, 8, 2.827),
    "deepseek_v3": (7168, 256, 8, 4, 8, 2.5),
    "demo": (256, 16, 4, 2, 4, 2.5),
}
COPIES = 8  # router weights cycled through (8 x 11 MB at K2: past the 50 MB L2)


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
        gates = [torch.randn(e, hidden, device="cuda", generator=g) / hidden ** 0.5 for _ in range(COPIES)]
        parts = [split_bf16(w).flatten(0, 1) for w in gates]
        assert torch.equal(split_bf16(gates[0]).double().sum(0), gates[0].double()), "parts must sum to the weight"
        bias = 0.05 * torch.randn(e, device="cuda", generator=g)
        sel = dict(top_k=top_k, n_group=groups, topk_group=topk_group, norm_topk_prob=True,
                   routed_scaling_factor=scale)
        for n in args.tokens:
            x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
            x32 = x.float()  # the norm writes this copy for the float32 router
            exact = x.double() @ gates[0].double().T
            fp32 = x32 @ gates[0].T
            partial = torch.mm(x, parts[0].T, out_dtype=torch.float32)
            summed = (partial[:, 2 * e:] + partial[:, e:2 * e]) + partial[:, :e]
            want_ids, _ = select_experts_triton(exact.float(), bias, **sel)
            fp32_ids, _ = select_experts_triton(fp32, bias, **sel)
            parts_ids, parts_w = select_experts_triton(partial, bias, **sel, parts=ROUTER_PARTS)
            sum_ids, sum_w = select_experts_triton(summed, bias, **sel)
            peak = exact.abs().max().item()
            row = {"shape": name, "tokens": n, "hidden": hidden, "experts": e,
                   "fp32_max_abs_err": (fp32.double() - exact).abs().max().item(),
                   "parts_max_abs_err": (summed.double() - exact).abs().max().item(),
                   "max_abs_logit": peak,
                   "fp32_rows_ids_equal_exact": (fp32_ids == want_ids).all(1).float().mean().item(),
                   "parts_rows_ids_equal_exact": (parts_ids == want_ids).all(1).float().mean().item(),
                   "parts_in_kernel_equals_summed": bool(torch.equal(parts_ids, sum_ids) and torch.equal(parts_w, sum_w))}
            row["fp32_rel_err"] = row["fp32_max_abs_err"] / peak
            row["parts_rel_err"] = row["parts_max_abs_err"] / peak
            row["fp32_route_us"] = round(graph_replay_us(
                [lambda w=w: select_experts_triton(x32 @ w.T, bias, **sel) for w in gates]), 2)
            row["parts_route_us"] = round(graph_replay_us(
                [lambda p=p: select_experts_triton(torch.mm(x, p.T, out_dtype=torch.float32), bias, **sel,
                                                   parts=ROUTER_PARTS) for p in parts]), 2)
            row["speedup"] = round(row["fp32_route_us"] / row["parts_route_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, Path(args.out).stem, args.commit,
                 dict(router_parts=ROUTER_PARTS, weight_copies=COPIES,
                      weights="N(0, 1/hidden) float32; hidden states N(0, 1) rounded to bf16; bias 0.05 N(0, 1)",
                      exact="float64 GEMM of the same bf16 hidden states and float32 weights",
                      timing="CUDA-graph replay of route's GEMM + selection, 8 router weights in turn, median of 20",
                      fp32="cuBLAS float32 GEMM on the float32 copy of the hidden states (as route ran before)",
                      parts="torch.mm(bf16 x, bf16 parts^T, out_dtype=float32), partials added by the selection kernel"),
                 rows)


if __name__ == "__main__":
    main()
