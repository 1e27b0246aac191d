"""The decoder's fused small ops on the GPU: bit for bit what they replace, and what they save.

At the shapes one MLA + MoE layer has them (Kimi-K2 per rank at TP8 and the demo model), bf16,
fresh random inputs, tokens 1 to 2176:

* ``add_rms_norm`` (residual add + the next RMSNorm, one launch) against ``x + r`` then
  ``rms_norm``: the sum and the normed rows bit for bit, x untouched;
* ``silu_mul`` (one launch from the stacked gate/up product) against ``F.silu(g) * u``: bit for bit;
* ``mla_norm_rope`` (the q LoRA's norm, the latent kv's norm and the key's rope, one launch) against
  the three launches it replaces (``rms_norm`` twice, ``rope_interleaved_triton``): bit for bit,
  every new-kv element written;
* the stacked GEMMs the model now runs, against the separate ones they replace: q_a (or q) with
  kv_a, the shared expert's gate with up, and the down GEMM adding the routed output (``addmm``, and
  ``addmm_`` in place as served: against ``addmm``).
  These are other cuBLAS calls, so not bit for bit: the fraction of equal elements and the largest
  difference relative to the output's scale are reported.

Each pair is timed by CUDA-graph replay (median of 20, including the replay's own launch cost).
Writes bench/results/fused_ops_check.json.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.common import graph_replay_us, write_result
from kernels.mla_norm_rope import mla_norm_rope
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.rope import rope_interleaved_triton
from kernels.swiglu import silu_mul

# name -> (hidden, q rows of the stacked projection, kv_a rows, shared-expert intermediate)
SHAPES = {"kimi_k2_rank": (7168, 1536, 576, 256), "demo": (256, 128, 160, 256)}
ROPE = {"kimi_k2_rank": 64, "demo": 32}


def _agreement(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    scale = want.float().abs().max().clamp_min(1e-30)
    return {"equal_frac": round(float((got == want).float().mean()), 4),
            "max_diff_rel": float((got.float() - want.float()).abs().max() / scale)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 272, 2176])
    p.add_argument("--out", default="bench/results/fused_ops_check.json")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, device="cuda", generator=g)).to(dt)

    rows = []
    for name, (hid, q_rows, kv_rows, inter) in SHAPES.items():
        norm_w = (1 + 0.1 * torch.randn(hid, device="cuda", generator=g)).to(dt)
        w_q, w_kv = rand(q_rows, hid, scale=0.02), rand(kv_rows, hid, scale=0.02)
        w_qkv = torch.cat([w_q, w_kv])
        w_g, w_u, w_d = rand(inter, hid, scale=0.02), rand(inter, hid, scale=0.02), rand(hid, inter, scale=0.05)
        w_gu = torch.cat([w_g, w_u])
        for n in args.tokens:
            x, r, h = rand(n, hid, scale=3.0), rand(n, hid, scale=2.0), rand(n, hid)
            routed = rand(n, hid, scale=0.5)
            x_before = x.clone()
            row: dict = {"shape": name, "tokens": n, "hidden": hid}

            def norm_torch():
                s = x + r
                return s, rms_norm(s, norm_w, 1e-6)

            def norm_fused():
                return add_rms_norm(x, r, norm_w, 1e-6)

            (ws, wn), (gs, gn) = norm_torch(), norm_fused()
            gu = h @ w_gu.T

            def swiglu_torch():
                return F.silu(gu[:, :inter]) * gu[:, inter:]

            def swiglu_fused():
                return silu_mul(gu)

            torch.cuda.synchronize()
            row.update({
                "add_rms_norm_sum_bitwise_equal": bool(torch.equal(gs, ws)),
                "add_rms_norm_bitwise_equal": bool(torch.equal(gn, wn)),
                "add_rms_norm_x_untouched": bool(torch.equal(x, x_before)),
                "add_rms_norm_all_finite": bool(torch.isfinite(gn).all() and torch.isfinite(gs).all()),
                "add_rms_norm_torch_us": round(graph_replay_us([norm_torch]), 2),
                "add_rms_norm_fused_us": round(graph_replay_us([norm_fused]), 2),
                "silu_mul_bitwise_equal": bool(torch.equal(swiglu_fused(), swiglu_torch())),
                "silu_mul_torch_us": round(graph_replay_us([swiglu_torch]), 2),
                "silu_mul_fused_us": round(graph_replay_us([swiglu_fused]), 2),
            })
            # Stacked GEMMs: other cuBLAS calls than the separate ones.
            sep_q = lambda: (h @ w_q.T, h @ w_kv.T)  # noqa: E731
            stk_q = lambda: h @ w_qkv.T  # noqa: E731
            sep_gu = lambda: (h @ w_g.T, h @ w_u.T)  # noqa: E731
            stk_gu = lambda: h @ w_gu.T  # noqa: E731
            act = swiglu_torch()
            sep_dn = lambda: routed + act @ w_d.T  # noqa: E731
            add_dn = lambda: torch.addmm(routed, act, w_d.T)  # noqa: E731
            scratch = routed.clone()
            add_dn_ = lambda: scratch.addmm_(act, w_d.T)  # noqa: E731  (served: in place, no copy first)
            q_a, kv_a = sep_q()
            g_, u_ = sep_gu()
            for key, got, want in (("q_kv_a", stk_q(), torch.cat([q_a, kv_a], dim=1)),
                                   ("gate_up", stk_gu(), torch.cat([g_, u_], dim=1)),
                                   ("down_addmm", add_dn(), sep_dn()),
                                   ("down_addmm_inplace", routed.clone().addmm_(act, w_d.T), add_dn())):
                row.update({f"{key}_{k}": v for k, v in _agreement(got, want).items()})
            row.update({
                "q_kv_a_separate_us": round(graph_replay_us([sep_q]), 2),
                "q_kv_a_stacked_us": round(graph_replay_us([stk_q]), 2),
                "gate_up_separate_us": round(graph_replay_us([sep_gu]), 2),
                "gate_up_stacked_us": round(graph_replay_us([stk_gu]), 2),
                "down_add_separate_us": round(graph_replay_us([sep_dn]), 2),
                "down_addmm_us": round(graph_replay_us([add_dn]), 2),
                "down_addmm_inplace_us": round(graph_replay_us([add_dn_]), 2),
            })
            rope = ROPE[name]
            kvr = kv_rows - rope
            q_kv = rand(n, q_rows + kv_rows, scale=3.0)
            q_w, kv_w = (1 + 0.1 * torch.randn(q_rows, device="cuda", generator=g)).to(dt), \
                (1 + 0.1 * torch.randn(kvr, device="cuda", generator=g)).to(dt)
            ang = torch.rand(n, rope, device="cuda", generator=g) * 6.3
            cos, sin = ang.cos().to(dt), ang.sin().to(dt)
            kv_sep = torch.full((n, kv_rows), float("nan"), dtype=dt, device="cuda")
            kv_fused = torch.full((n, kv_rows), float("nan"), dtype=dt, device="cuda")

            def prep_separate():
                rms_norm(q_kv[:, q_rows:q_rows + kvr], kv_w, 1e-6, out=kv_sep[:, :kvr])
                rope_interleaved_triton(q_kv[:, q_rows + kvr:], cos, sin, out=kv_sep[:, kvr:])
                return rms_norm(q_kv[:, :q_rows], q_w, 1e-6)

            def prep_fused():
                return mla_norm_rope(q_kv, q_rows, q_w, kv_w, cos, sin, 1e-6, kv_fused)

            q_sep, q_fused = prep_separate(), prep_fused()
            torch.cuda.synchronize()
            row.update({
                "mla_norm_rope_bitwise_equal": bool(torch.equal(q_fused, q_sep) and torch.equal(kv_fused, kv_sep)),
                "mla_norm_rope_all_written": bool(torch.isfinite(kv_fused).all()),
                "mla_norm_rope_separate_us": round(graph_replay_us([prep_separate]), 2),
                "mla_norm_rope_fused_us": round(graph_replay_us([prep_fused]), 2),
            })
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_result(args.out, args.commit, dict(
        dtype="bfloat16",
        shapes={k: dict(zip(("hidden", "q_rows", "kv_a_rows", "shared_inter"), v)) for k, v in SHAPES.items()},
        timing="CUDA-graph replay, median of 20 (includes the replay's own launch cost)",
        weights="random bf16, std 0.02 (projections) / 0.05 (down)",
        torch="x + r then rms_norm; F.silu(g) * u; separate GEMMs; routed + down GEMM; "
              "rms_norm x2 + rope_interleaved_triton",
        fused="add_rms_norm; silu_mul; stacked GEMMs; addmm(routed, h, W_down^T) and routed.addmm_(h, W_down^T); "
              "mla_norm_rope"), rows)


if __name__ == "__main__":
    main()
