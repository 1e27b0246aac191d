"""Programmatic dependent launch on a chain of Kimi-K2 per-rank dense projections.

Why: a K2 decode step is about 1100 launches of a few microseconds each; with PDL
(``kernels.pdl``) a kernel's programs may start while its predecessor finishes, and a projection
may ask L2 for its weights before it waits. How much of a layer's dense chain does that save?

The chain, once a layer for ``--layers`` layers (each its own weights, so nothing stays in L2):
``add_rms_norm`` -> ``q_kv_a`` (7168 -> 2112) -> ``rms_norm`` of the q part -> ``q_b`` (1536 ->
1536) -> ``o_proj`` (1024 -> 7168) -> ``add_rms_norm`` -> shared expert gate/up (7168 -> 512) ->
``silu_mul`` -> shared down (256 -> 7168, added into the residual): nine launches. Variants: PDL
off, PDL on without and with the L2 prefetch; one CUDA graph each, median of 20 replays, over
two interleaved rounds; every variant's output is first compared with PDL off's, bit for bit.

    python -m bench.pdl_probe --commit SHA --out bench/results/pdl_probe.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import replay_ms, write_result
from kernels import pdl, skinny_gemm
from kernels.rms_norm import add_rms_norm, rms_norm
from kernels.skinny_gemm import skinny_linear
from kernels.swiglu import silu_mul

HIDDEN, QKV_A, Q_RANK, O_IN, SHARED = 7168, 2112, 1536, 1024, 256
VARIANTS = {"off": (False, False), "pdl": (True, False), "pdl+prefetch": (True, True)}


def build(layers: int, tokens: int, gen: torch.Generator) -> tuple[list[dict], torch.Tensor]:
    """Random bf16 weights a layer (N(0, 1/fan_in)) and a residual stream of ``tokens`` rows."""
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k ** 0.5).to("cuda", torch.bfloat16)

    out = []
    for _ in range(layers):
        out.append(dict(
            norm1=(torch.rand(HIDDEN, generator=gen) + 0.5).to("cuda", torch.bfloat16),
            q_kv_a=w(QKV_A, HIDDEN), q_norm=(torch.rand(Q_RANK, generator=gen) + 0.5).to("cuda", torch.bfloat16),
            q_b=w(Q_RANK, Q_RANK), o_proj=w(HIDDEN, O_IN),
            norm2=(torch.rand(HIDDEN, generator=gen) + 0.5).to("cuda", torch.bfloat16),
            gate_up=w(2 * SHARED, HIDDEN), down=w(HIDDEN, SHARED),
        ))
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    return out, x


def chain(weights: list[dict], x: torch.Tensor) -> torch.Tensor:
    """The layers' dense launches; the attention's output is stood in for by ``q_b``'s first 1024 columns."""
    residual = torch.zeros_like(x)
    h = x
    for lw in weights:
        residual, normed = add_rms_norm(h, residual, lw["norm1"], 1e-6)
        qkv = skinny_linear(normed, lw["q_kv_a"])
        q = rms_norm(qkv[:, :Q_RANK], lw["q_norm"], 1e-6)
        qb = skinny_linear(q, lw["q_b"])
        attn = skinny_linear(qb[:, :O_IN], lw["o_proj"])
        residual, normed = add_rms_norm(attn, residual, lw["norm2"], 1e-6)
        gu = skinny_linear(normed, lw["gate_up"])
        h = skinny_linear(silu_mul(gu), lw["down"], add_to=residual)  # in place: no copy launch in the chain
    return h


def capture(weights: list[dict], x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(weights, x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = chain(weights, x)
    return g, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 17])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results/pdl_probe.json")
    args = ap.parse_args()
    import triton

    gen = torch.Generator().manual_seed(0)
    print(f"triton {triton.__version__}, torch {torch.__version__}, pdl available: {pdl.gdc_wait is not None}, "
          f"enabled: {pdl.enabled(torch.device('cuda'))}", flush=True)
    rows = []
    for tokens in args.tokens:
        weights, x = build(args.layers, tokens, gen)
        graphs, ref = {}, None
        for name, (on, pre) in VARIANTS.items():
            pdl.PDL, skinny_gemm.PREFETCH = on, pre
            g, y = capture(weights, x)
            g.replay()
            torch.cuda.synchronize()
            same = None if ref is None else bool(torch.equal(y, ref))
            ref = y.clone() if ref is None else ref
            graphs[name] = (g, same)
        times: dict[str, list[float]] = {n: [] for n in VARIANTS}
        for rnd in range(2):
            for name in (VARIANTS if rnd == 0 else reversed(list(VARIANTS))):
                times[name].append(replay_ms(graphs[name][0], args.reps))
        base = min(times["off"])
        for name in VARIANTS:
            ms = min(times[name])
            row = dict(tokens=tokens, layers=args.layers, variant=name, launches=9 * args.layers, replay_ms=round(ms, 4),
                       rounds_ms=[round(t, 4) for t in times[name]], us_per_launch=round(ms * 1e3 / (9 * args.layers), 3),
                       speedup_vs_off=round(base / ms, 4), equal_to_off=graphs[name][1], finite=bool(torch.isfinite(ref).all()))
            rows.append(row)
            print(row, flush=True)
        del graphs, weights
        torch.cuda.empty_cache()
    pdl.PDL, skinny_gemm.PREFETCH = True, True
    write_result(args.out, args.commit, dict(layers=args.layers, tokens=args.tokens, reps=args.reps,
                 chain="add_rms_norm, q_kv_a, rms_norm, q_b, o_proj, add_rms_norm, shared gate/up, silu_mul, shared down",
                 variants={k: dict(pdl=v[0], prefetch=v[1]) for k, v in VARIANTS.items()}), rows)
    sys.exit(0 if all(r["equal_to_off"] in (None, True) for r in rows) else 1)


if __name__ == "__main__":
    main()
