"""Where a draft step's time goes on the GPU: propose vs tree build, main thread vs a worker thread.

The draft service runs `DraftEngine._draft` in a worker thread (`asyncio.to_thread`). This times
the same calls directly: the DFlash propose for one request, the tree build per budget, each
synchronised, median of `--reps`, both in the main thread and in a thread pool, and counts the
Triton tree kernel's compiled variants before and after (a variant compiled per step would show
as a growing count). Prints a table; writes JSON when `--out` is given.

``--graphs``: propose from the context pool's CUDA graphs, as the service does on a GPU, and also
time two ways to bring the tree to the host: one packed copy instead of four (``tree_packed_ms``),
and the tree build captured in a CUDA graph that ends in that copy into pinned memory
(``tree_graph_ms``); ``step_*`` = propose + that tree path. Each path's trees are checked equal to
the served path's.
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


def _packed_and_captured(propose, lp: torch.Tensor, budget: int, depth: int, bonus: torch.Tensor, reps: int) -> dict:
    """The tree to the host in one packed copy, eagerly and from a captured graph (see the module doc)."""
    dev = lp.device
    want = build_trees(lp[:, :depth].float(), budget, bonus.to(dev))
    want = [t.cpu() for t in (want.sizes[:, None], want.tokens, want.parents, want.depths)]

    def packed(t) -> torch.Tensor:  # [R, 1 + 3 n_max] int64: size, tokens, parents, depths
        return torch.cat([t.sizes[:, None], t.tokens, t.parents, t.depths], dim=1)

    def tree_packed() -> torch.Tensor:
        return packed(build_trees(lp[:, :depth].float(), budget, bonus.to(dev))).cpu()

    bonus_host = torch.empty_like(bonus).pin_memory()
    bonus_dev = torch.empty(bonus.shape, dtype=torch.int64, device=dev)
    out_host = torch.empty(tree_packed().shape, dtype=torch.int64).pin_memory()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tree_packed()  # compiled and allocated before capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bonus_dev.copy_(bonus_host, non_blocking=True)
        out_host.copy_(packed(build_trees(lp[:, :depth].float(), budget, bonus_dev)), non_blocking=True)

    def tree_graph() -> torch.Tensor:
        bonus_host.copy_(bonus)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        return out_host

    def step_graph() -> torch.Tensor:
        propose()
        return tree_graph()

    n = 1 + 3 * (budget + 1)
    same = {}
    for name, fn in (("packed", tree_packed), ("graph", tree_graph)):
        got = fn()
        got = [got[:, :1], got[:, 1:1 + budget + 1], got[:, 2 + budget:2 + 2 * budget + 1], got[:, n - budget - 1:]]
        same[f"tree_{name}_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    return {"tree_packed_ms": wall_ms(tree_packed, reps), "tree_graph_ms": wall_ms(tree_graph, reps),
            "step_graph_ms": wall_ms(step_graph, reps), **same}


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
    if args.graphs:
        drafter.enable_graphs(8, max(256, 2 * args.context))
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
        if args.graphs:
            row.update(_packed_and_captured(propose, lp, budget, depth, bonus, args.reps))
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        print(rows[-1], flush=True)
    if args.out:
        doc = {"benchmark": "draft-probe", "commit": git_commit(args.commit), "gpu": torch.cuda.get_device_name(0),
               "copy_gbps": None,
               "params": {k: v for k, v in vars(args).items() if k not in ("out", "commit")}, "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
