"""The fused rope on the GPU: bit for bit the torch expression, and what it saves.

For the query and key rope parts as an MLA layer has them (strided views of q [N, H, nope + rope]
and kv [N, kvr + rope]; Kimi-K2 per rank: 8 heads, 128 + 64, kvr 512; the demo model: 8 heads,
32 + 32, kvr 128), bf16, fresh random inputs: checks `rope_interleaved_triton` against
`apply_rope_interleaved` for bitwise equality (and that writing into the new-kv slice fills every
element), then times both ways of producing the layer's q_pe and new latent kv (CUDA-graph
replay): the torch expressions plus the concatenation, against two rope launches and the norm
writing in place. Writes bench/results/rope_check.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.common import graph_replay_us, write_result
from kernels.rms_norm import rms_norm
from kernels.rope import rope_interleaved_triton
from services.verifier.rope import apply_rope_interleaved

# name -> (heads, nope, rope, kvr)
SHAPES = {"kimi_k2_rank": (8, 128, 64, 512), "demo": (8, 32, 32, 128)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 272, 2176])
    p.add_argument("--out", default="bench/results/rope_check.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    rows = []
    for name, (H, nope, rope, kvr) in SHAPES.items():
        norm_w = (1 + 0.1 * torch.randn(kvr, device="cuda", generator=g)).to(dt)
        for n in args.tokens:
            q = (3 * torch.randn(n, H, nope + rope, device="cuda", generator=g)).to(dt)
            kv = (3 * torch.randn(n, kvr + rope, device="cuda", generator=g)).to(dt)
            ang = torch.rand(n, rope, device="cuda", generator=g) * 6.3
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)

            def torch_way():
                q_pe = apply_rope_interleaved(q[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1))
                c_kv = rms_norm(kv[:, :kvr], norm_w, 1e-6)
                return q_pe, torch.cat([c_kv, apply_rope_interleaved(kv[:, kvr:], cos, sin)], dim=-1)

            new_kv = torch.full((n, kvr + rope), float("nan"), dtype=dt, device="cuda")

            def fused_way():
                q_pe = rope_interleaved_triton(q[..., nope:], cos, sin)
                rms_norm(kv[:, :kvr], norm_w, 1e-6, out=new_kv[:, :kvr])
                rope_interleaved_triton(kv[:, kvr:], cos, sin, out=new_kv[:, kvr:])
                return q_pe, new_kv

            want_q, want_kv = torch_way()
            got_q, got_kv = fused_way()
            torch.cuda.synchronize()
            row = {"shape": name, "tokens": n, "heads": H, "rope": rope, "kvr": kvr,
                   "q_pe_bitwise_equal": bool(torch.equal(got_q, want_q)),
                   "new_kv_bitwise_equal": bool(torch.equal(got_kv, want_kv)),
                   "new_kv_all_written": bool(torch.isfinite(got_kv).all()),
                   "torch_us": round(graph_replay_us([torch_way]), 2),
                   "fused_us": round(graph_replay_us([fused_way]), 2)}
            row["speedup"] = round(row["torch_us"] / row["fused_us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, args.commit, dict(
        dtype="bfloat16",
        timing="CUDA-graph replay of one layer's q_pe and new latent kv, median of 20 (includes the replay's own "
               "launch cost)",
        torch="apply_rope_interleaved twice + rms_norm + torch.cat",
        fused="rope_interleaved_triton twice (the key's into the new-kv slice) + rms_norm(out=)"), rows)


if __name__ == "__main__":
    main()
