"""Expert selection on the GPU: the one-launch Triton kernel against the torch expression.

For each router shape (Kimi-K2 per rank: 384 experts in one group, top 8; DeepSeek-V3: 256 experts
in 8 groups, 4 kept, top 8; the demo model: 16 in 4, 2 kept, top 4) and token count, checks the
kernel's ids and weights against `select_experts` on fresh random logits and biases, then times
both (CUDA-graph replay, so launch gaps count as they do in the verifier's graphs): the selection
alone, and with the router's float32 logits in front: the cast and cuBLAS GEMM, and (up to
`ROUTER_PARTIALS_MAX_TOKENS` tokens, as `route` serves them) the partial-logits kernel, whose ids are
compared with those from cuBLAS's logits. The router weight is the same each replay (11 MB at K2: it
stays in L2 here, unlike in a model's step). Writes bench/results/moe_routing.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.common import git_commit, graph_replay_us
from kernels.moe_routing import ROUTER_PARTIALS_MAX_TOKENS, router_logits_partials, select_experts_triton
from services.verifier.moe import select_experts

# name -> (hidden, experts, n_group, topk_group, top_k, routed_scaling_factor)
SHAPES = {
    "kimi_k2": (7168, 384, 1, 1, 8, 2.827),
    "deepseek_v3": (7168, 256, 8, 4, 8, 2.5),
    "demo": (256, 16, 4, 2, 4, 2.5),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 17, 33, 64, 272, 2176])
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
            if n <= ROUTER_PARTIALS_MAX_TOKENS:
                parts = router_logits_partials(x, gate)
                p_ids, p_w = select_experts_triton(parts, bias, top_k, groups, topk_group, True, scale)
                row.update({
                    "partials_splits": parts.shape[0],
                    "partials_max_logit_rel_diff": ((parts.sum(0) - logits).abs().max() / logits.abs().max()).item(),
                    "partials_rows_with_equal_ids": round((p_ids == ids).all(dim=1).float().mean().item(), 6),
                    "partials_max_weight_abs_diff": (p_w - weights).abs().max().item(),
                    "partials_route_us": round(graph_replay_us([lambda: select_experts_triton(
                        router_logits_partials(x, gate), bias, top_k, groups, topk_group, True, scale)]), 2)})
                row["speedup_route"] = round(row["triton_route_us"] / row["partials_route_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": None,
           "params": {"dtype": "router logits float32 from bf16 hidden states", "timing": "CUDA-graph replay, "
                      "median of 20; torch_ / triton_route_us include the float32 router matmul (a cast and a "
                      "cuBLAS GEMM), partials_route_us the partial-logits kernel instead (speedup_route: triton_route "
                      "/ partials_route)",
                      "check": "ids and weights against services.verifier.moe.select_experts on the same logits"},
           "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
