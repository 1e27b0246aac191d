"""Where a draft step's time goes on the GPU: propose vs tree build, main thread vs a worker thread.

The draft service runs `DraftEngine._draft` in a worker thread (`asyncio.to_thread`). This times
the same calls directly: the DFlash propose for one request, the tree build per budget, each
synchronised, median of `--reps`, both in the main thread and in a thread pool, and counts the
Triton tree kernel's compiled variants before and after (a variant compiled per step would show
as a growing count). Prints a table; writes JSON when `--out` is given.

``--graphs``: propose from the context pool's CUDA graphs, as the service does on a GPU, and also
time the draft engine's two ways to bring the trees to the host: built eagerly with one packed
copy (``tree_packed_ms``), and ``TreeGraphs`` replaying the build on the propose graphs' output,
ending in that copy into pinned memory (``tree_graph_ms``; ``step_graph_ms`` = propose + it).
``tree_ms`` / ``step_ms`` are the build with four copies, as the engine had it before. Each
path's trees are checked equal to the plain build's.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import copy_gbps_on, git_commit, wall_ms
from services.draft.dflash import DFlashDrafter
from services.draft.tree import build_trees_from_logits
from services.draft.tree_graphs import TreeGraphs, pack_trees, unpack_trees


def _variants() -> int:
    """Compiled variants of the tree kernel (-1 where this Triton keeps them elsewhere)."""
    try:
        from kernels.tree_build import _tree_build_kernel
        return sum(len(c[0]) for c in _tree_build_kernel.device_caches.values())
    except (ImportError, AttributeError, TypeError, IndexError):
        return -1


def _packed_and_captured(graphs: TreeGraphs, propose, lp: torch.Tensor, budget: int, depth: int, bonus: torch.Tensor,
                         reps: int, pool: ThreadPoolExecutor) -> dict:
    """The draft engine's two tree paths (see the module doc): eager with one packed copy, and
    ``TreeGraphs`` replayed on the propose graphs' output; each checked equal to the plain build."""
    dev = lp.device
    plain = build_trees_from_logits(lp[:, :depth], budget, bonus.to(dev))
    want = [t.cpu() for t in (plain.sizes, plain.tokens, plain.parents, plain.depths)]

    def tree_packed():
        return unpack_trees(pack_trees(build_trees_from_logits(lp[:, :depth], budget, bonus.to(dev))).cpu(), len(bonus))

    def tree_graph():
        return graphs.build(lp, budget, depth, bonus)

    def step_graph():
        return graphs.build(propose(), budget, depth, bonus)

    same = {}
    for name, fn in (("packed", tree_packed), ("graph", tree_graph)):
        got = fn()
        same[f"tree_{name}_equal"] = got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    return {"tree_packed_ms": wall_ms(tree_packed, reps), "tree_graph_ms": wall_ms(tree_graph, reps),
            "step_graph_ms": wall_ms(step_graph, reps),
            "step_graph_ms_worker_thread": wall_ms(lambda: pool.submit(step_graph).result(), reps), **same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo")
    p.add_argument("--budgets", default="8,16,32")
    p.add_argument("--context", type=int, default=60)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default="")
    p.add_argument("--graphs", action="store_true", help="propose from CUDA graphs; time packed / captured tree paths")
    args = p.parse_args()
    dev = "cuda"
    drafter = DFlashDrafter.load(Path(args.model) / "drafter", Path(args.model), dtype=torch.bfloat16, device=dev)
    tree_graphs = None
    if args.graphs:
        tree_graphs = TreeGraphs(drafter.enable_graphs(8, max(256, 2 * args.context)).out)
    ctx = drafter.new_context()
    feats = torch.randn(args.context, drafter.config.num_features, device=dev, dtype=torch.bfloat16)
    drafter.extend_context(ctx, feats)
    bonus = torch.tensor([5])
    depth = drafter.block_size - 1
    ctxs3 = [drafter.new_context() for _ in range(3)]
    for i, cx in enumerate(ctxs3):
        drafter.extend_context(cx, torch.randn(args.context + 7 * i, drafter.config.num_features, device=dev,
                                               dtype=torch.bfloat16))
    bonus3 = torch.tensor([5, 11, 17])
    pool = ThreadPoolExecutor(4)
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        def propose() -> torch.Tensor:
            return drafter.propose([ctx], bonus)

        lp = propose()

        def tree() -> None:
            t = build_trees_from_logits(lp[:, :depth], budget, bonus.to(dev))
            t.sizes.tolist()
            t.tokens.cpu(), t.parents.cpu(), t.depths.cpu()

        def both() -> None:
            t = build_trees_from_logits(propose()[:, :depth], budget, bonus.to(dev))
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
        if args.graphs:
            row.update(_packed_and_captured(tree_graphs, propose, lp, budget, depth, bonus, args.reps, pool))
            lp3 = drafter.propose(ctxs3, bonus3)  # three rows of the 4-row bucket: one padding row
            plain = build_trees_from_logits(lp3[:, :depth], budget, bonus3.to(dev))
            got = tree_graphs.build(lp3, budget, depth, bonus3)
            row["tree_graph_equal_batch3"] = got is not None and all(
                torch.equal(a, b.cpu()) for a, b in zip(got, (plain.sizes, plain.tokens, plain.parents, plain.depths)))
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        print(rows[-1], flush=True)
    if args.out:
        doc = {"benchmark": Path(args.out).stem, "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
               "copy_gbps": copy_gbps_on("cuda"),
               "params": {k: v for k, v in vars(args).items() if k not in ("out", "commit")}, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
