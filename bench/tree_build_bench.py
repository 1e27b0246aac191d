"""Benchmark of the batched draft-tree builder (``build_trees``) on one GPU; target T-tree.

Each row times one ``build_trees`` call replayed in a CUDA graph (median of 50 replays) on
random peaked log-softmax tables ``[batch, block - 1, vocab]`` (DFlash predicts block - 1
positions). Two inputs per shape:

* ``vocab = budget``: the drafter hands over its per-position top-``budget`` (a top-k fused into
  its LM head); the time is the tree builder's own.
* ``vocab = 163840`` (Kimi-K2): the builder also runs the vocabulary top-k, which reads
  ``batch x 15 x 163840 x 4`` bytes (1.26 GB at batch 128, ~300 us of HBM time by itself).

``backend``: ``triton`` (``kernels.tree_build``: one launch, which ranks rows of up to 128 tokens
itself; torch.topk first above that) or ``torch`` (the tensor-op version). Triton rows use the
kernel's default warps; ``params`` keep a warps sweep at the T-tree shape and what ``torch.topk``
of those rows alone takes (``topk_us_128_64_16``, the launch the in-kernel ranking replaced).
``matches_reference``: the selected prefixes equal ``build_tree_heapq``'s on the first rows;
``matches_torch``: every output tensor equals the torch builder's.

Usage: python -m bench.tree_build_bench [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.common import add_out_argument, git_commit, graph_replay_us, measure_copy_gbps
from kernels.tree_build import pads_budget, tree_build_num_warps, tree_build_triton
from services.draft.tree import TreeBatch, build_tree_heapq, build_trees, tree_paths

K2_VOCAB = 163840
SHAPES = [  # (batch, budget, block)
    (128, 64, 16), (128, 8, 16), (128, 16, 16), (128, 32, 16), (128, 128, 16), (1, 64, 16), (32, 64, 16),
]
HEAPQ_ROWS = 4


def random_logprobs(batch: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = 0.5 + 4.0 * torch.rand(batch, depth, 1, generator=gen, device="cuda")
    logits = torch.randn(batch, depth, vocab, generator=gen, device="cuda") * scale
    return torch.log_softmax(logits, dim=-1)  # [batch, depth, vocab] float32


FIELDS = ("tokens", "parents", "depths", "scores", "sizes")


def build(logprobs: torch.Tensor, budget: int, roots: torch.Tensor, backend: str, num_warps: int | None) -> TreeBatch:
    """``build_trees(..., backend=backend)`` with the Triton launch's warps exposed."""
    if backend == "torch":
        return build_trees(logprobs, budget, roots, backend="torch")
    out = tree_build_triton(logprobs, budget, roots, num_warps=num_warps)
    return TreeBatch(out.tokens, out.parents, out.depths, out.scores, out.sizes)


def graph_time_us(fn, reps: int = 50) -> float:
    return graph_replay_us([fn], reps, warmup=2)  # two warm-ups: compile, then the cached candidate table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "tree_build")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    copy_gbps = measure_copy_gbps(1 << 30)
    # Warps per request's program: the per-depth sorts are latency-bound, so fewer warps (fewer
    # cross-warp exchanges) may win; swept at the T-tree shape to check the kernel's default.
    lp = random_logprobs(128, 15, 64, seed=1)
    roots0 = torch.zeros(128, dtype=torch.int64, device="cuda")
    warps_sweep: dict[int, float] = {}
    for w in (4, 8, 16, 32):
        try:
            warps_sweep[w] = round(graph_time_us(lambda w=w: build(lp, 64, roots0, "triton", w)), 2)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped
            print(f"num_warps {w}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    num_warps = None  # rows time the served launch: tree_build_triton's default warps
    topk_us = round(graph_time_us(lambda: lp.float().topk(64, dim=-1)), 2)
    print(f"num_warps sweep at 128/64/16: {warps_sweep} (rows: the default); torch top-k of its rows alone "
          f"{topk_us} us", flush=True)
    rows: list[dict] = []
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every row, so a run cut short still leaves its numbers
        result = {
            "benchmark": out.stem,
            "commit": git_commit(args.commit),
            "gpu": gpu,
            "copy_gbps": round(copy_gbps, 1),
            "params": {
                "depth": "block - 1", "dtype": "float32", "timing": "CUDA graph replay, median of 50",
                "matches_reference": f"heapq reference on the first {HEAPQ_ROWS} rows (prefix sets)",
                "torch": torch.__version__, "triton": __import__("triton").__version__,
                "num_warps_sweep_128_64_16_us": warps_sweep, "num_warps": "kernel default (one key a thread)",
                "topk_us_128_64_16": topk_us,
            },
            "rows": rows,
        }
        out.write_text(json.dumps(result, indent=1) + "\n")

    for batch, budget, block in SHAPES:
        depth = block - 1
        for vocab, backends in ((budget, ("triton", "torch")), (K2_VOCAB, ("triton",))):
            logprobs = random_logprobs(batch, depth, vocab, seed=batch * 1000 + budget)
            roots = torch.randint(0, vocab, (batch,), device="cuda")
            want = build_trees(logprobs, budget, roots, backend="torch")
            for backend in backends:
                got = build(logprobs, budget, roots, backend, num_warps)
                matches_torch = all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)
                cpu_lp = logprobs[:HEAPQ_ROWS].cpu()
                matches_ref = all(tree_paths(got, r) == set(build_tree_heapq(cpu_lp[r], budget))
                                  for r in range(min(batch, HEAPQ_ROWS)))
                try:
                    # Defaults bind now (and keep pyflakes from reading `del logprobs` below as unbound).
                    t = round(graph_time_us(lambda lp=logprobs, b=backend: build(lp, budget, roots, b, num_warps)), 2)
                    error = None
                except RuntimeError as exc:  # e.g. an op that cannot be captured: record, go on
                    t, error = None, f"{type(exc).__name__}: {str(exc)[:200]}"
                pads = pads_budget(budget)   # the served kernel's warps are those of its pads
                row = {"batch": batch, "budget": budget, "block": block, "vocab": vocab, "backend": backend,
                       "num_warps": tree_build_num_warps(pads, min(pads, vocab)) if backend == "triton" else None,
                       "time_us": t, "matches_reference": matches_ref, "matches_torch": matches_torch}
                if error:
                    row["error"] = error
                rows.append(row)
                print(json.dumps(row), flush=True)
                write()
            del logprobs
            torch.cuda.empty_cache()
    print("\n batch budget block  vocab backend  time_us  heapq  torch")
    for r in rows:
        t = f"{r['time_us']:8.1f}" if r["time_us"] is not None else "   error"
        print(f"{r['batch']:6d} {r['budget']:6d} {r['block']:5d} {r['vocab']:6d} {r['backend']:>7} "
              f"{t} {str(r['matches_reference']):>6} {str(r['matches_torch']):>6}")


if __name__ == "__main__":
    main()
