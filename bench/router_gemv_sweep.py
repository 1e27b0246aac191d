"""Launch configs of ``router_gemv``'s few-token kernel (``_router_gemm_kernel``) on the Kimi-K2 router.

Why: the served config must beat the bf16 parts' route (``router_partial_logits``, about 9 us of GEMM
at 2-64 tokens on an H200) for ``route`` to serve it; the first configs did not (``router_gemv_check-56266a4.json``).
Per token count, every (precision, weight rows a program, hidden dims a step, slices, warps) is
checked against float64 logits (largest error relative to the largest logit) and timed alone:
CUDA-graph replay cycling over 8 router weights (each layer reads its own from HBM), median of 20.
The parts' GEMM is timed the same way for comparison.

    python -m bench.router_gemv_sweep --commit SHA --out bench/results/router_gemv_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton

from bench.common import graph_replay_us, write_result
from kernels.moe_routing import _router_gemm_kernel
from services.verifier.moe import ROUTER_K_CHUNKS, router_partial_logits, split_bf16

HIDDEN, EXPERTS, COPIES = 7168, 384, 8


def launch(x: torch.Tensor, w: torch.Tensor, precision: str, block_e: int, block_k: int, splits: int,
           warps: int, stages: int) -> torch.Tensor:
    n = x.shape[0]
    k_split = triton.cdiv(triton.cdiv(HIDDEN, splits), block_k) * block_k
    splits = triton.cdiv(HIDDEN, k_split)
    out = torch.empty(splits, n, EXPERTS, dtype=torch.float32, device=x.device)
    _router_gemm_kernel[(triton.cdiv(EXPERTS, block_e), splits)](
        x, w, out, n, HIDDEN, EXPERTS, x.stride(0), w.stride(0), K_SPLIT=k_split, BLOCK_T=max(16, triton.next_power_of_2(n)),
        BLOCK_E=block_e, BLOCK_K=block_k, PRECISION=precision, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 9, 17, 33, 64])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/router_gemv_sweep.json")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    gates = [torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5 for _ in range(COPIES)]
    parts = [split_bf16(w).flatten(0, 1) for w in gates]
    grid = list(itertools.product(("tf32x3",), (32, 64), (64, 128, 256), (7, 14, 28), (4, 8), (3,)))
    rows = []
    for n in args.tokens:
        x = torch.randn(n, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        exact = x.double() @ gates[0].double().T
        row = {"tokens": n, "parts_gemm_us": round(graph_replay_us(
            [lambda p=p: router_partial_logits(x, p, ROUTER_K_CHUNKS) for p in parts]), 2), "configs": []}
        for prec, be, bk, sp, wp, st in grid:
            try:
                got = launch(x, gates[0], prec, be, bk, sp, wp, st).double().sum(0)
                err = ((got - exact).abs().max() / exact.abs().max()).item()
                us = graph_replay_us([lambda w=w: launch(x, w, prec, be, bk, sp, wp, st) for w in gates])
            except Exception as e:  # noqa: BLE001 - a config that does not build is recorded, not fatal
                row["configs"].append({"config": [prec, be, bk, sp, wp, st], "error": str(e)[:200]})
                continue
            row["configs"].append({"config": [prec, be, bk, sp, wp, st], "us": round(us, 2), "max_rel_err": err})
        ok = [c for c in row["configs"] if "us" in c]
        row["best"] = min(ok, key=lambda c: c["us"]) if ok else None
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}), flush=True)
    write_result(args.out, Path(args.out).stem, args.commit,
                 dict(hidden=HIDDEN, experts=EXPERTS, weight_copies=COPIES,
                      config="[precision, weight rows a program, hidden dims a step, slices, warps, stages]",
                      timing="CUDA-graph replay of the GEMM alone (no selection), 8 router weights in turn, median of 20",
                      parts="router_partial_logits(x, parts, 4 chunks): torch.bmm bf16 x 3 bf16 parts, float32 out"),
                 rows)


if __name__ == "__main__":
    main()
