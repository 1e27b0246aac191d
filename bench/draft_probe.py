"""Where a draft step's time goes on the GPU: propose vs tree build, main thread vs a worker thread.

The draft service runs `DraftEngine._draft` in a worker thread (`asyncio.to_thread`). This times
the same calls directly: the DFlash propose for one request, the tree build per budget, each
synchronised, median of `--reps`, both in the main thread and in a thread pool, and counts the
Triton tree kernel's compiled variants before and after (a variant compiled per step would show
as a growing count). Prints a table; writes JSON when `--out` is given.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import git_commit, wall_ms
from services.draft.dflash import DFlashDrafter
from services.draft.tree import build_trees


def _variants() -> int:
    """Compiled variants of the tree kernel (-1 where this Triton keeps them elsewhere)."""
    try:
        from kernels.tree_build import _tree_build_kernel
        return sum(len(c[0]) for c in _tree_build_kernel.device_caches.values())
    except (ImportError, AttributeError, TypeError, IndexError):
        return -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--budgets", default="8,16,32")
    p.add_argument("--context", type=int, default=60)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    args = p.parse_args()
    dev = "cuda"
    drafter = DFlashDrafter.load(Path(args.model) / "drafter", Path(args.model), dtype=torch.bfloat16, device=dev)
    ctx = drafter.new_context()
    feats = torch.randn(args.context, drafter.config.num_features, device=dev, dtype=torch.bfloat16)
    drafter.extend_context(ctx, feats)
    bonus = torch.tensor([5])
    depth = drafter.block_size - 1
    pool = ThreadPoolExecutor(4)
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        def propose() -> torch.Tensor:
            return drafter.propose([ctx], bonus)

        lp = propose()

        def tree() -> None:
            t = build_trees(lp[:, :depth].float(), budget, bonus.to(dev))
            t.sizes.tolist()
            t.tokens.cpu(), t.parents.cpu(), t.depths.cpu()

        def both() -> None:
            t = build_trees(propose()[:, :depth].float(), budget, bonus.to(dev))
            t.sizes.tolist()
            t.tokens.cpu(), t.parents.cpu(), t.depths.cpu()

        tree()   # compile
        before = _variants()
        row = {"budget": budget, "context": args.context,
               "propose_ms": wall_ms(propose, args.reps), "tree_ms": wall_ms(tree, args.reps),
               "step_ms": wall_ms(both, args.reps),
               "step_ms_worker_thread": wall_ms(lambda: pool.submit(both).result(), args.reps),
               "tree_ms_worker_thread": wall_ms(lambda: pool.submit(tree).result(), args.reps)}
        row["tree_kernel_variants"] = [before, _variants()]
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        print(rows[-1], flush=True)
    if args.out:
        doc = {"benchmark": "draft-probe", "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
               "copy_gbps": None,
               "params": {k: v for k, v in vars(args).items() if k not in ("out", "commit")}, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
