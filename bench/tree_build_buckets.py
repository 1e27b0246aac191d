"""What sharing tree kernels between budgets (``kernels.tree_build.pads_budget``) costs and saves.

The served kernel and, with ``--baseline FILE``, another version of ``kernels/tree_build.py`` (the
kernel compiled once per budget) run side by side at batch 128, block 16, over budgets 1..128, on
two inputs: ``vocab = budget`` (the T-tree input: the kernel ranks each row itself) and ``vocab =
4096`` (the demo drafter's: torch's top-k first, as the draft serves it). Per variant, input and
budget: ``time_us``, the call replayed in a CUDA graph (median of 50), and whether the trees equal
the torch builder's bit for bit and the heapq reference's prefix sets on the first rows.

``startup`` rows: the wall time of compiling every kernel budgets 1..128 need (one batch-1 call a
pads budget at vocab 4096, 14 calls for 10 kernels), each in a fresh process with an empty Triton
cache, one after another (``serial``) and from a thread each (``threads``, the draft's
``warm_up_kernels``).

Usage: python -m bench.tree_build_buckets [--baseline FILE] [--out FILE] [--commit SHA]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_out_argument, git_commit, graph_replay_us, measure_copy_gbps
from bench.tree_build_bench import FIELDS, HEAPQ_ROWS, random_logprobs
from services.draft.tree import TreeBatch, build_tree_heapq, build_trees, tree_paths

BUDGETS = (1, 2, 3, 5, 8, 12, 16, 24, 32, 33, 48, 64, 65, 96, 100, 127, 128)
DEMO_VOCAB = 4096


def load_variant(path: str):
    spec = importlib.util.spec_from_file_location(f"tree_build_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_all(mode: str) -> dict:
    """Compiles the served kernels for budgets 1..128 (this process, the Triton cache it was given)."""
    from kernels.tree_build import pads_budget, tree_build_triton, warm_up_kernels
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if mode == "threads":   # as the draft does at start-up
        shared = warm_up_kernels(15, DEMO_VOCAB, "cuda")
    else:
        shared = sorted({pads_budget(b) for b in range(1, 129)})
        logprobs = torch.log_softmax(torch.randn(1, 15, DEMO_VOCAB, device="cuda"), dim=-1)
        for b in shared:
            tree_build_triton(logprobs, b, torch.zeros(1, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    return {"row": "startup", "mode": mode, "pads_budgets": len(shared), "seconds": round(time.perf_counter() - t0, 2)}


def startup_row(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run([sys.executable, "-m", "bench.tree_build_buckets", "--startup", mode],
                              env={**os.environ, "TRITON_CACHE_DIR": cache}, capture_output=True, text=True)
    if proc.returncode:
        return {"row": "startup", "mode": mode, "error": proc.stderr[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="another kernels/tree_build.py to compare with")
    ap.add_argument("--startup", choices=["serial", "threads"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    add_out_argument(ap, "tree_build_buckets")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    args = ap.parse_args()
    if args.startup:   # a child of startup_row
        print(json.dumps(compile_all(args.startup)))
        return
    rows: list[dict] = [startup_row(mode) for mode in ("serial", "threads")]
    for r in rows:
        print(json.dumps(r), flush=True)
    import kernels.tree_build as served
    variants = {"shared": served}
    if args.baseline:
        variants["per_budget"] = load_variant(args.baseline)
    gpu = torch.cuda.get_device_name()
    copy_gbps = measure_copy_gbps(1 << 30)
    depth = args.block - 1
    for vocab_name in ("budget", DEMO_VOCAB):
        for name, module in variants.items():
            for budget in BUDGETS:
                vocab = budget if vocab_name == "budget" else vocab_name
                logprobs = random_logprobs(args.batch, depth, vocab, seed=budget)
                roots = torch.randint(0, vocab, (args.batch,), device="cuda")

                def call(module=module, logprobs=logprobs, budget=budget, roots=roots) -> TreeBatch:
                    out = module.tree_build_triton(logprobs, budget, roots)
                    return TreeBatch(out.tokens, out.parents, out.depths, out.scores, out.sizes)

                got = call()
                want = build_trees(logprobs, budget, roots, backend="torch")
                cpu_lp = logprobs[:HEAPQ_ROWS].cpu()
                row = {
                    "row": "time", "variant": name, "batch": args.batch, "budget": budget, "block": args.block,
                    "vocab": vocab, "time_us": round(graph_replay_us([call], 50, warmup=2), 2),
                    "matches_torch": all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS),
                    "matches_reference": all(tree_paths(got, r) == set(build_tree_heapq(cpu_lp[r], budget))
                                             for r in range(min(args.batch, HEAPQ_ROWS))),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": out.stem, "commit": git_commit(args.commit), "gpu": gpu,
        "copy_gbps": round(copy_gbps, 1),
        "params": {"dtype": "float32", "depth": "block - 1", "timing": "CUDA graph replay, median of 50",
                   "variants": {"shared": "kernels/tree_build.py at this commit",
                                "per_budget": Path(args.baseline).name if args.baseline else None},
                   "torch": torch.__version__, "triton": __import__("triton").__version__},
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows[:2]:
        print(f"start-up compile, {r['mode']}: {r.get('seconds', r.get('error'))} s ({r.get('pads_budgets')} pads budgets)")
    print("\nbudget " + " ".join(f"{n + ' v=' + str(v):>22}" for v in ("budget", DEMO_VOCAB) for n in variants))
    for budget in BUDGETS:
        cells = []
        for vocab_name in ("budget", DEMO_VOCAB):
            for name in variants:
                r = next(r for r in rows[2:] if r["variant"] == name and r["budget"] == budget
                         and (r["vocab"] == DEMO_VOCAB) == (vocab_name == DEMO_VOCAB))
                cells.append(f"{r['time_us']:7.1f} us {'ok' if r['matches_torch'] and r['matches_reference'] else 'BAD'}")
        print(f"{budget:6d} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
