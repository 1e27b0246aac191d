"""Expert selection on the GPU: the one-launch Triton kernel against the torch expression.

For each router shape (Kimi-K2 per rank: 384 experts in one group, top 8; DeepSeek-V3: 256 experts
in 8 groups, 4 kept, top 8; the demo model: 16 in 4, 2 kept, top 4) and token count, checks the
kernel's ids and weights against `select_experts` on fresh random logits and biases, then times
both (CUDA-graph replay, so launch gaps count as they do in the verifier's graphs): the selection
alone, and with the router's float32 matmul in front as `route` runs it. Writes
bench/results/moe_routing.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_replay_us, write_result
from kernels.moe_routing import select_experts_triton
from services.verifier.moe import select_experts

# name -> (hidden, experts, n_group, topk_group, top_k, routed_scaling_factor)
SHAPES = {
    "kimi_k2": (7168, 384, 1, 1, 8, 2.827),
    "deepseek_v3": (7168, 256, 8, 4, 8, 2.5),
    "demo": (256, 16, 4, 2, 4, 2.5),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 272, 2176])
    p.add_argument("--out", default="bench/results/moe_routing.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (hidden, e, groups, topk_group, top_k, scale) in SHAPES.items():
        gate = torch.randn(e, hidden, device="cuda", generator=g) / hidden ** 0.5
        bias = 0.05 * torch.randn(e, device="cuda", generator=g)
        for n in args.tokens:
            x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
            logits = x.float() @ gate.T
            want = select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, True, scale)
            ids, weights = select_experts_triton(logits, bias, top_k, groups, topk_group, True, scale)
            same_ids = (ids == want.ids).all(dim=1).float().mean().item()
            weight_err = (weights - want.weights).abs().max().item()
            same_weights = (weights == want.weights).float().mean().item()

            def torch_select():
                return select_experts(torch.sigmoid(logits), bias, top_k, groups, topk_group, True, scale)

            def triton_select():
                return select_experts_triton(logits, bias, top_k, groups, topk_group, True, scale)

            row = {"shape": name, "tokens": n, "experts": e, "n_group": groups, "topk_group": topk_group,
                   "top_k": top_k, "rows_with_equal_ids": round(same_ids, 6), "max_weight_abs_diff": weight_err,
                   "weights_bitwise_equal": round(same_weights, 6),
                   "torch_select_us": round(graph_replay_us([torch_select]), 2),
                   "triton_select_us": round(graph_replay_us([triton_select]), 2),
                   "torch_route_us": round(graph_replay_us([lambda: (x.float() @ gate.T, torch_select())]), 2),
                   "triton_route_us": round(graph_replay_us([lambda: select_experts_triton(
                       x.float() @ gate.T, bias, top_k, groups, topk_group, True, scale)]), 2)}
            row["speedup_select"] = round(row["torch_select_us"] / row["triton_select_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, args.commit, dict(
        dtype="router logits float32 from bf16 hidden states",
        timing="CUDA-graph replay, median of 20; *_route_us includes the float32 router matmul (a cast and a GEMM)",
        check="ids and weights against services.verifier.moe.select_experts on the same logits"), rows)


if __name__ == "__main__":
    main()
