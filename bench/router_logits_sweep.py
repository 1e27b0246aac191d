"""Launch shapes of the router's partial-logits kernel against cuBLAS, at the Kimi-K2 rank's router.

For each token count (decode to a 64-node tree) and each `RouterLogitsConfig` of a small grid, the
route as the verifier runs it (partial logits, then the selection that adds them) is timed by
CUDA-graph replay over 8 router weights in turn (88 MB: the weights stream from HBM as they do in
a 60-layer step, not from L2), against the cast + cuBLAS float32 GEMM + selection on the same
weights. Every config is checked first: logits within 1e-5 of the float32 matmul, the same experts.
Writes bench/results/router_logits_sweep.json; `router_logits_config` takes its defaults from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.common import git_commit, graph_replay_us
from kernels.moe_routing import RouterLogitsConfig, router_logits_config, router_logits_partials, select_experts_triton

HIDDEN, EXPERTS, TOP_K, SCALE = 7168, 384, 8, 2.827   # Kimi-K2: one expert group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 17, 33, 64])
    p.add_argument("--weights", type=int, default=8, help="router weights replayed in turn")
    p.add_argument("--out", default="bench/results/router_logits_sweep.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    gates = [torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5 for _ in range(args.weights)]
    bias = 0.05 * torch.randn(EXPERTS, device="cuda", generator=g)
    grid = [RouterLogitsConfig(k_chunk=c, block_k=k, block_e=e, num_warps=w)
            for c, k, e, w in itertools.product((256, 512, 1024), (128, 256), (16, 32), (4, 8)) if k <= c]
    rows = []
    for n in args.tokens:
        x = torch.randn(n, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        logits = x.float() @ gates[0].T
        want_ids, _ = select_experts_triton(logits, bias, TOP_K, 1, 1, True, SCALE)

        def cublas(gate):
            return lambda: select_experts_triton(x.float() @ gate.T, bias, TOP_K, 1, 1, True, SCALE)

        row = {"tokens": n, "cublas_route_us": round(graph_replay_us([cublas(w) for w in gates]), 2), "configs": []}
        for cfg in grid:
            parts = router_logits_partials(x, gates[0], cfg)
            ids, _ = select_experts_triton(parts, bias, TOP_K, 1, 1, True, SCALE)
            rel = ((parts.sum(0) - logits).abs().max() / logits.abs().max()).item()
            ok = rel < 1e-5 and bool(torch.equal(ids, want_ids))

            def partials(gate, cfg=cfg):
                return lambda: select_experts_triton(router_logits_partials(x, gate, cfg), bias, TOP_K, 1, 1, True, SCALE)

            us = round(graph_replay_us([partials(w) for w in gates]), 2) if ok else None
            row["configs"].append({**cfg.__dict__, "splits": parts.shape[0], "logit_rel_diff": rel, "ok": ok, "route_us": us})
        served = router_logits_config(n)
        row["served"] = served.__dict__
        row["served_route_us"] = round(graph_replay_us([
            (lambda gate: lambda: select_experts_triton(router_logits_partials(x, gate), bias, TOP_K, 1, 1, True, SCALE))(w)
            for w in gates]), 2)
        best = min((c for c in row["configs"] if c["ok"]), key=lambda c: c["route_us"])
        row["best"] = best
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
    doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
           "copy_gbps": None,
           "params": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "weights_in_turn": args.weights,
                      "timing": "CUDA-graph replay of one route per router weight, median of 20, per route",
                      "route": "router_logits_partials + select_experts_triton (partials) / x.float() @ W^T + "
                               "select_experts_triton (cublas)"},
           "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
