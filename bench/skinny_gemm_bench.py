"""The few-row GEMM kernel against cuBLAS at Kimi-K2's per-rank dense projections (TP8).

Why: at C=1 a K2 layer's dense projections read 63 MB of bf16 weights (15 us of HBM time) and a
profile puts them near 49 us a layer in cuBLAS (BENCHMARKS.md). For each projection and token count
this times the call as the model makes it (``F.linear`` / ``addmm_`` / ``bmm`` on strided views)
and ``kernels.skinny_gemm.skinny_linear_triton`` on the same operands: CUDA-graph replay over
weight copies past L2, better of two rounds. Both are checked against float64 (relative error of
the whole output); the kernel must also give the same bits on a second call.

    python -m bench.skinny_gemm_bench --commit SHA --out bench/results/skinny_gemm.json
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from bench.common import graph_replay_us, measure_copy_gbps, write_result
from kernels.skinny_gemm import skinny_linear_triton, skinny_plan

ROTATE_BYTES = 256 << 20
# name: (batch, n, k, kind); kind: linear (x @ w^T), add (acc.addmm_(x, w^T)), uk / uv (the attention's bmm)
SHAPES = {
    "q_kv_a": (1, 2112, 7168, "linear"), "q_b": (1, 1536, 1536, "linear"), "w_uk": (8, 512, 128, "uk"),
    "w_uv": (8, 128, 512, "uv"), "o_proj": (1, 7168, 1024, "linear"), "shared_gate_up": (1, 512, 7168, "linear"),
    "shared_down": (1, 7168, 256, "add"), "lm_head": (1, 20480, 7168, "linear"),
}
TOKENS = (1, 9, 17, 33, 64)


class Operands:
    """One copy of a projection's operands, laid out as the model has them."""

    def __init__(self, batch: int, n: int, k: int, kind: str, m: int, seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        bf = dict(dtype=torch.bfloat16, device="cuda")
        self.kind = kind
        if kind == "uk":  # q [N, H, 192] -> q[..., :128]^T per head; w_uk [H, 128, 512] read transposed
            self.q = torch.randn(m, batch, k + 64, generator=g, **bf)
            self.x = self.q[..., :k].transpose(0, 1)  # [H, N, 128]
            self.w_raw = torch.randn(batch, k, n, generator=g, **bf) / math.sqrt(k)
            self.w = self.w_raw.transpose(1, 2)  # [H, 512, 128]
        elif kind == "uv":  # latent [N, H, 512]; w_uv [H, 128, 512]; out [N, H, 128] written as [H, N, 128]
            self.x = torch.randn(m, batch, k, generator=g, **bf).transpose(0, 1)
            self.w = torch.randn(batch, n, k, generator=g, **bf) / math.sqrt(k)
        else:
            self.x = torch.randn(m, k, generator=g, **bf)
            self.w = torch.randn(n, k, generator=g, **bf) / math.sqrt(k)
        self.acc = torch.randn(m, n, generator=g, **bf) if kind == "add" else None
        self.out = torch.empty(m, batch, n, **bf) if kind == "uv" else None

    def torch_call(self) -> torch.Tensor:
        if self.kind == "uk":
            return torch.bmm(self.x, self.w_raw)
        if self.kind == "uv":
            return torch.bmm(self.x, self.w.transpose(1, 2), out=self.out.transpose(0, 1))
        if self.kind == "add":
            return self.acc.addmm_(self.x, self.w.T)
        return self.x @ self.w.T

    def kernel_call(self) -> torch.Tensor:
        if self.kind == "uv":
            return skinny_linear_triton(self.x, self.w, out=self.out.transpose(0, 1))
        if self.kind == "add":
            return skinny_linear_triton(self.x, self.w, add_to=self.acc)
        return skinny_linear_triton(self.x, self.w)

    def want(self, acc0: torch.Tensor | None) -> torch.Tensor:
        prod = self.x.double() @ self.w.double().transpose(-1, -2)
        return prod if acc0 is None else acc0.double() + prod


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


SWEEP_TOKENS = (1, 17)


def sweep_plans(n: int, k: int, batch: int, sms: int) -> list[tuple[int, ...]]:
    """``skinny_plan``'s plan, and tiles 16 / 32 / 64 rows x 256 / 512 K (128 at K <= 256) x its split count and twice
    it x 3 / 4 stages (4 warps), and 8 warps on the widest tiles."""
    bn0, bk0, sk0 = skinny_plan(n, k, batch, sms)
    plans = [(bn0, bk0, sk0, 3, 4)]
    for bn in (16, 32, 64):
        for bk in (128, 256, 512):
            if bk > max(128, k) or (bk == 128 and k > 256):
                continue
            for sk in sorted({sk0, 2 * sk0}):
                if k // sk < bk:
                    continue
                for st in (3, 4):
                    plans.append((bn, bk, sk, st, 4))
            plans.append((bn, bk, sk0, 3, 8))
    return list(dict.fromkeys(plans))


def sweep(out: str, commit: str | None, names: list[str]) -> None:
    """Every plan of ``sweep_plans`` at 1 and 17 tokens, against the model's torch call (one round)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in names:
        batch, n, k, kind = SHAPES[name]
        w_bytes = batch * n * k * 2
        for m in SWEEP_TOKENS:
            copies = max(1, min(64, math.ceil(ROTATE_BYTES / w_bytes)))
            ops = [Operands(batch, n, k, kind, m, seed=s) for s in range(copies)]
            torch_us = graph_replay_us([o.torch_call for o in ops])
            times = {}
            for plan in sweep_plans(n, k, batch, sms):
                calls = [lambda o=o, p=plan: (skinny_linear_triton(o.x, o.w, add_to=o.acc, plan=p) if o.kind == "add"
                                              else skinny_linear_triton(o.x, o.w, plan=p, out=None if o.out is None
                                                                        else o.out.transpose(0, 1))) for o in ops]
                try:
                    times[plan] = graph_replay_us(calls)
                except triton.runtime.errors.OutOfResources:  # too much shared memory: not a plan here
                    continue
            best = min(times, key=times.get)
            row = dict(projection=name, tokens=m, torch_us=round(torch_us, 2), served_plan=list(sweep_plans(n, k, batch, sms)[0]),
                       served_us=round(times[sweep_plans(n, k, batch, sms)[0]], 2), best_plan=list(best),
                       best_us=round(times[best], 2), best_speedup=round(torch_us / times[best], 3),
                       plans_us={"x".join(map(str, p)): round(t, 2) for p, t in times.items()})
            rows.append(row)
            print({k2: v for k2, v in row.items() if k2 != "plans_us"}, flush=True)
            del ops
    write_result(out, commit,
                 dict(dtype="bfloat16", plans="block_n x block_k x split_k x num_stages x num_warps",
                      timing="CUDA-graph replay over operand copies past 256 MB, one round"), rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/skinny_gemm.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true", help="sweep the kernel's launch plans instead")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args.out, args.commit, args.shapes.split(","))
    copy = measure_copy_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in args.shapes.split(","):
        batch, n, k, kind = SHAPES[name]
        w_bytes = batch * n * k * 2
        for m in (int(t) for t in args.tokens.split(",")):
            copies = max(1, min(64, math.ceil(ROTATE_BYTES / w_bytes)))
            ops = [Operands(batch, n, k, kind, m, seed=s) for s in range(copies)]
            first = ops[0]
            acc0 = first.acc.clone() if first.acc is not None else None
            got_t = first.torch_call().clone()
            if acc0 is not None:
                first.acc.copy_(acc0)
            got_k = first.kernel_call().clone()
            if acc0 is not None:
                first.acc.copy_(acc0)
            again = first.kernel_call().clone()
            want = first.want(acc0)
            times = {"torch": [], "kernel": []}
            for _ in range(2):
                times["torch"].append(graph_replay_us([o.torch_call for o in ops]))
                times["kernel"].append(graph_replay_us([o.kernel_call for o in ops]))
            t_us, k_us = min(times["torch"]), min(times["kernel"])
            row = dict(projection=name, batch=batch, n=n, k=k, tokens=m, weight_mb=round(w_bytes / 1e6, 2),
                       plan=list(skinny_plan(n, k, batch, sms)), torch_us=round(t_us, 2), kernel_us=round(k_us, 2),
                       speedup=round(t_us / k_us, 3), kernel_gbps=round(w_bytes / k_us / 1e3, 1),
                       kernel_frac_of_copy=round(w_bytes / k_us / 1e3 / copy, 3),
                       rel_err_kernel=rel(got_k, want), rel_err_torch=rel(got_t, want),
                       kernel_repeat_equal=bool(torch.equal(got_k, again)))
            rows.append(row)
            print(row, flush=True)
            del ops
    params = dict(dtype="bfloat16", shapes={k: list(v) for k, v in SHAPES.items()},
                  timing="CUDA-graph replay of one call per operand copy (copies past 256 MB), better of two rounds",
                  torch="the model's own call: x @ w.T, acc.addmm_(x, w.T), torch.bmm on the attention's views")
    write_result(args.out, args.commit, params, rows)


if __name__ == "__main__":
    main()
