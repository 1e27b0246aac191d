"""Benchmark of the tree-attention MLA kernels on one GPU; target T-mla.

Prints and writes ``bench/results/tree_mla.json`` (BENCHMARKS.md's result-file schema). Each row times the kernel
``tree_mla`` serves on this GPU (``choose_backend``: the Gluon kernel of
``kernels/tree_mla_hopper.py`` on Hopper) and the Triton kernel of ``kernels/tree_mla.py`` beside
it; both are first checked against the float32 reference (NaN-poisoned outputs, 1 / 3 / default
splits, the K2 and demo dims) and for graph replay == eager. For each shape:

* bytes the kernel must read: the KV prefix ``batch * context * 576 * 2`` + queries
  ``N * H * 576 * 2`` + the tree's own kv ``N * 576 * 2`` (bf16; N = batch * tree_nodes). Split
  partials and the output write are not counted, so GB/s is conservative.
* FLOPs: ``2 * N * H * (context + tree_nodes) * (576 + 512)`` (QK over 576 dims, PV over 512).
* floor: the larger of bytes / measured copy bandwidth and FLOPs / measured bf16 matmul rate;
  shapes with nodes x heads above ~100 rows are compute-bound on an H200, whatever the kernel.
* time: CUDA-graph replay of ``tree_mla`` (split + merge launches); inputs rotate over enough
  copies that the cache (60 MB L2) cannot hold them, as in a real step where every layer's KV
  differs.
* speedup_vs_reference: against dense-mask SDPA in torch (``dense_sdpa_reference``: gather the
  pages, build the [nodes x heads, context + nodes] mask, one SDPA call), skipped (null) where its
  mask and scores would pass ~1.5e9 elements.

Usage: python -m bench.tree_mla_bench [--out FILE] [--commit SHA] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from bench.common import add_out_argument, eager_us, git_commit, graph_replay_us, measure_copy_gbps
from kernels.tree_mla import (
    TreeAttentionDeviceMetadata,
    TreeAttentionMetadata,
    TreeMlaConfig,
    choose_backend,
    tree_mla_reference,
    tree_mla_triton,
)
from kernels.tree_mla_hopper import hopper_available, tree_mla_hopper

KVR, ROPE = 512, 64
PAGE_SIZE = 64
BATCHES = (1, 32, 128)
CONTEXTS = (1024, 4096, 16384)
TREES = (9, 17, 33)
HEADS = (8, 64)  # 8: Kimi-K2 per rank at TP8 (64 heads / 8); 64: the whole model on one GPU
ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
REF_MAX_ELEMS = 1.5e9


def measure_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        a @ b
    t1.record()
    t1.synchronize()
    return 2 * n**3 * 10 / (t0.elapsed_time(t1) * 1e-3) / 1e12


class Case:
    """One shape's inputs: a shuffled paged cache, random trees, device metadata."""

    def __init__(self, batch: int, context: int | list[int], nodes: int, heads: int, seed: int = 0,
                 page_size: int = PAGE_SIZE, dtype: torch.dtype = torch.bfloat16, device: str = "cuda",
                 kvr: int = KVR, rope: int = ROPE) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = device
        self.kvr, self.rope = kvr, rope
        lens = [context] * batch if isinstance(context, int) else list(context)
        self.batch, self.nodes, self.heads, self.lens = batch, nodes, heads, lens
        pages = [-(-L // page_size) for L in lens]
        num_pages = sum(pages) + 4
        self.kv_cache = torch.randn(num_pages, page_size, kvr + rope, dtype=dtype, device=device)  # [P, ps, 576]
        order = torch.randperm(num_pages, generator=gen)
        tables, used = [], 0
        for n_pages in pages:
            tables.append(order[used : used + n_pages].to(device))
            used += n_pages
        N = batch * nodes
        self.q_latent = torch.randn(N, heads, kvr, dtype=dtype, device=device)  # [N, H, 512]
        self.q_pe = torch.randn(N, heads, rope, dtype=dtype, device=device)  # [N, H, 64]
        self.new_kv = torch.randn(N, kvr + rope, dtype=dtype, device=device)  # [N, 576]
        masks = []
        for _ in range(batch):
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
            mask = torch.zeros(nodes, nodes, dtype=torch.bool)
            for i in range(nodes):
                j = i
                while j >= 0:
                    mask[i, j] = True
                    j = parents[j]
            masks.append(mask.to(device))
        self.host_meta = TreeAttentionMetadata(
            query_starts=torch.arange(0, N + 1, nodes, device=device),
            prefix_lens=torch.tensor(lens, device=device),
            page_tables=tables,
            tree_masks=masks,
        )
        self.meta = TreeAttentionDeviceMetadata.from_host(self.host_meta)
        self.scale = 1.0 / math.sqrt(192)  # DeepSeek-V3 / K2: qk_head_dim = 128 nope + 64 rope

    def args(self) -> tuple:
        return self.q_latent, self.q_pe, self.kv_cache, self.new_kv, self.meta, self.scale

    def spread_pages(self) -> None:
        """The same cache with a token of padding after each page, so pages no longer lie back to
        back (no flat row view for TMA: the kernels' cp.async path)."""
        pages, ps, dim = self.kv_cache.shape
        wide = torch.randn(pages, ps + 1, dim, dtype=self.kv_cache.dtype, device=self.device)
        wide[:, :ps] = self.kv_cache
        self.kv_cache = wide[:, :ps]

    def bytes_read(self) -> int:
        N = self.batch * self.nodes
        return 2 * (sum(self.lens) * (self.kvr + self.rope) + N * self.heads * (self.kvr + self.rope) + N * (self.kvr + self.rope))

    def flops(self) -> int:
        return 2 * self.nodes * self.heads * sum(L + self.nodes for L in self.lens) * (self.kvr + self.rope + self.kvr)


def dense_sdpa_reference(case: Case) -> torch.Tensor:
    """The torch baseline: gather pages to a dense [B, L + n, 576] key block, mask, one SDPA call.

    All requests share one context length here (the benchmark's shapes), so no padding.
    """
    B, n, H, L = case.batch, case.nodes, case.heads, case.lens[0]
    table = torch.stack(case.host_meta.page_tables)  # [B, pages]
    prefix = case.kv_cache[table].flatten(1, 2)[:, :L]  # [B, L, 576]
    keys = torch.cat([prefix, case.new_kv.view(B, n, -1)], dim=1)  # [B, L+n, 576]
    q = torch.cat([case.q_latent, case.q_pe], dim=-1).view(B, 1, n * H, KVR + ROPE)  # [B, 1, n*H, 576]
    tree = torch.stack(case.host_meta.tree_masks).repeat_interleave(H, dim=1)  # [B, n*H, n]
    visible = torch.cat([torch.ones(B, n * H, L, dtype=torch.bool, device=case.device), tree], dim=2)  # [B, n*H, L+n]
    out = F.scaled_dot_product_attention(q, keys[:, None], keys[:, None, :, :KVR], attn_mask=visible[:, None],
                                         scale=case.scale)  # [B, 1, n*H, 512]
    return out.view(B * n, H, KVR)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def time_graph(fns: list, reps: int = 20) -> float:
    """Seconds per call of the fns, replayed in one CUDA graph (median of reps replays)."""
    return graph_replay_us(fns, reps) * 1e-6


def time_eager(fn, reps: int = 3) -> float:
    """Seconds per call, eager, median of reps."""
    return eager_us([fn], reps) * 1e-6


def run_kernel(backend: str, case: Case, config: TreeMlaConfig | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One call of the named kernel ("triton" takes a config; both take a split count)."""
    if backend == "hopper":
        return tree_mla_hopper(*case.args(), num_splits=num_splits)
    return tree_mla_triton(*case.args(), config=config, num_splits=num_splits)


def rotating_cases(batch: int, context: int, nodes: int, heads: int) -> list[Case]:
    """Copies of one shape's inputs (seeds 1, 2, ...) that together pass ``ROTATE_BYTES``, so a graph
    replaying one call per copy reads them from HBM, not L2; the first is the one to check."""
    first = Case(batch, context, nodes, heads, seed=1)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / first.bytes_read())))
    return [first] + [Case(batch, context, nodes, heads, seed=1 + i) for i in range(1, copies)]


def time_kernel(batch: int, context: int, nodes: int, heads: int, config: TreeMlaConfig | None = None,
                num_splits: int | None = None, backend: str = "triton") -> tuple[float, Case]:
    """Graph-replay time of one kernel call, rotating over input copies bigger than L2."""
    cases = rotating_cases(batch, context, nodes, heads)
    first = cases[0]
    fns = [lambda c=c: run_kernel(backend, c, config, num_splits) for c in cases]
    t = time_graph(fns)
    del cases[1:]
    return t, first


def check_correctness(log: list, backend: str) -> list[dict]:
    """One kernel vs the float32 reference on bf16 inputs at awkward shapes (splits 1, 3 and the
    default; the demo model's 128 + 32 dims; a cache whose pages are not back to back); graph
    replay vs eager. Outputs are NaN-poisoned."""
    checks = []
    shapes = [  # (context per request, nodes, heads, page_size, kvr, rope, page stride padded by one token)
        ([1000, 37, 0, 4099], 9, 8, 64, KVR, ROPE, False),
        ([5000, 1200], 33, 64, 64, KVR, ROPE, False),
        ([300], 1, 128, 16, KVR, ROPE, False),
        ([777, 2048, 3], 17, 16, 1, KVR, ROPE, False),
        ([16384, 100], 129, 8, 64, KVR, ROPE, False),
        ([1500, 40, 900], 17, 8, 16, 128, 32, False),
        ([700, 64], 9, 8, 16, KVR, ROPE, True),  # pages not back to back: no flat row view for TMA
    ]
    real_empty = torch.empty
    for lens, n, h, ps, kvr, rope, padded in shapes:
        case = Case(len(lens), lens, n, h, seed=7, page_size=ps, kvr=kvr, rope=rope)
        if padded:
            case.spread_pages()
        want = tree_mla_reference(case.q_latent, case.q_pe, case.kv_cache, case.new_kv, case.host_meta, case.scale)
        for splits in (None, 1, 3):
            torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # an unwritten element shows
            try:
                got = run_kernel(backend, case, num_splits=splits)
            finally:
                torch.empty = real_empty
            row = {"backend": backend, "lens": lens, "nodes": n, "heads": h, "page_size": ps, "kvr": kvr, "rope": rope,
                   "cache_contiguous": case.kv_cache.is_contiguous(),
                   "num_splits": splits, "max_abs_err": (got.float() - want.float()).abs().max().item(),
                   "rel_err": rel_err(got, want), "finite": bool(torch.isfinite(got).all())}
            checks.append(row)
            log.append(f"check {row}")
            print(log[-1], flush=True)
    case = Case(4, 4096, 17, 8, seed=3)
    dense = dense_sdpa_reference(case)
    want = tree_mla_reference(case.q_latent, case.q_pe, case.kv_cache, case.new_kv, case.host_meta, case.scale)
    eager = run_kernel(backend, case)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run_kernel(backend, case)
    graph.replay()
    torch.cuda.synchronize()
    row = {"backend": backend, "dense_sdpa_rel_err": rel_err(dense, want), "graph_equals_eager": bool(torch.equal(replayed, eager))}
    checks.append(row)
    log.append(f"check {row}")
    print(log[-1], flush=True)
    return checks


SWEEP = {  # rows a request <= 128 (tree 9/17 at 8 heads) and above: two configs, chosen by total time
    "small": ((32, 4096, 9, 8), (32, 4096, 17, 8)),
    "large": ((32, 4096, 33, 8), (32, 1024, 17, 64)),
}
CANDIDATES = [  # block_m, block_n, num_warps, num_stages, dv_splits
    (128, 64, 8, 1, 2), (128, 32, 8, 1, 2), (128, 16, 8, 2, 2), (64, 64, 8, 1, 1), (64, 32, 8, 2, 1), (64, 32, 4, 2, 2),
]


def row_class(rows: int) -> str:
    return "small" if rows <= 128 else "large"


def sweep_configs(log: list) -> dict[str, TreeMlaConfig]:
    """Time each candidate config at the sweep shapes (after checking it against the reference)."""
    check = Case(3, [700, 64, 1500], 9, 16, seed=11)
    want = tree_mla_reference(check.q_latent, check.q_pe, check.kv_cache, check.new_kv, check.host_meta, check.scale)
    best: dict[str, TreeMlaConfig] = {}
    for cls, shapes in SWEEP.items():
        totals = []
        for bm, bn, warps, stages, dv in CANDIDATES:
            cfg = TreeMlaConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, dv_splits=dv)
            try:
                err = rel_err(tree_mla_triton(*check.args(), config=cfg), want)
                if not err < 1e-2:
                    raise ValueError(f"rel err {err}")
                total = 0.0
                for shape in shapes:
                    t, _ = time_kernel(*shape, config=cfg)
                    total += t
                    log.append(f"sweep {shape} {cfg}: {t * 1e6:.1f} us")
                    print(log[-1], flush=True)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip that config
                log.append(f"sweep {cls} {cfg}: failed {type(exc).__name__}: {str(exc)[:120]}")
                print(log[-1], flush=True)
                continue
            totals.append((total, cfg))
        if totals:
            best[cls] = min(totals, key=lambda x: x[0])[1]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "tree_mla")
    ap.add_argument("--commit", default=os.environ.get("BENCH_COMMIT"))
    ap.add_argument("--quick", action="store_true", help="one batch/context/tree per axis (smoke test)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Triton kernel's configs (its defaults come from such a sweep)")
    args = ap.parse_args()
    torch.manual_seed(0)
    log: list[str] = []
    gpu = torch.cuda.get_device_name()
    copy_gbps = measure_copy_gbps()
    matmul_tflops = measure_matmul_tflops()
    print(f"{gpu}: copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s", flush=True)
    probe = Case(1, 64, 9, 8)
    served = choose_backend(probe.q_latent, probe.q_pe, probe.kv_cache, probe.new_kv)  # what tree_mla runs here
    backends = ["triton"] + (["hopper"] if hopper_available("cuda") else [])
    log.append(f"served backend: {served}; measured: {backends}")
    print(log[-1], flush=True)
    checks = [row for b in backends for row in check_correctness(log, b)]
    best: dict[str, TreeMlaConfig] = {}
    if args.sweep:
        t0 = time.time()
        best = sweep_configs(log)
        log.append(f"sweep took {time.time() - t0:.1f}s; best {best}")
        print(log[-1], flush=True)

    splits_sweep = []
    for s in (1, 2, 3, 4, 6, 8):
        t, _ = time_kernel(32, 4096, 9, 8, config=best.get("small"), num_splits=s, backend=served)
        splits_sweep.append({"backend": served, "num_splits": s, "time_us": round(t * 1e6, 2)})
        print(f"splits {s}: {t * 1e6:.1f} us", flush=True)

    batches, contexts, trees = (BATCHES, CONTEXTS, TREES) if not args.quick else ((32,), (4096,), (9,))
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
                "kvr": KVR, "rope": ROPE, "page_size": PAGE_SIZE, "dtype": "bfloat16",
                "timing": "CUDA graph replay, median of 20, inputs rotated past L2",
                "bytes": "KV prefix + q + tree kv (reads only)",
                "matmul_tflops": round(matmul_tflops, 1),
                "torch": torch.__version__, "triton": __import__("triton").__version__,
                "backend": served,
                "backends": "time_us = the served backend (tree_mla's choice on this GPU: hopper = the Gluon kernel "
                            "of kernels/tree_mla_hopper.py on sm_90); triton_us = the Triton kernel (other GPUs), "
                            "default configs unless swept",
                "triton_configs": {cls: vars(cfg) for cls, cfg in best.items()} or "defaults (default_config)",
                "splits_sweep_32x4096_tree9_heads8": splits_sweep,
                "correctness": checks,
                "reference": "dense-mask SDPA in torch (gather + mask + F.scaled_dot_product_attention); "
                             f"null where batch*nodes*heads*(context+nodes) > {REF_MAX_ELEMS:.1e}",
                "log": log,
            },
            "rows": rows,
        }
        out.write_text(json.dumps(result, indent=1) + "\n")

    for batch in batches:
        for context in contexts:
            for nodes in trees:
                for heads in HEADS:
                    cfg = best.get(row_class(nodes * heads))
                    t, case = time_kernel(batch, context, nodes, heads, config=cfg, backend=served)
                    t_triton = t if served == "triton" else time_kernel(batch, context, nodes, heads, config=cfg)[0]
                    nbytes, flops = case.bytes_read(), case.flops()
                    floor = max(nbytes / (copy_gbps * 1e9), flops / (matmul_tflops * 1e12))
                    elems = batch * nodes * heads * (context + nodes)
                    ref_t = None
                    if elems <= REF_MAX_ELEMS:
                        try:
                            ref_t = time_eager(lambda c=case: dense_sdpa_reference(c))
                        except torch.OutOfMemoryError:
                            ref_t = None
                        torch.cuda.empty_cache()
                    row = {
                        "batch": batch, "context": context, "tree_nodes": nodes, "heads": heads,
                        "backend": served, "time_us": round(t * 1e6, 2),
                        "triton_us": round(t_triton * 1e6, 2), "speedup_vs_triton": round(t_triton / t, 2),
                        "gbps": round(nbytes / t / 1e9, 1),
                        "frac_of_copy": round(nbytes / t / 1e9 / copy_gbps, 3),
                        "speedup_vs_reference": round(ref_t / t, 2) if ref_t else None,
                        "reference_us": round(ref_t * 1e6, 1) if ref_t else None,
                        "bytes": nbytes, "tflops": round(flops / t / 1e12, 1),
                        "floor_us": round(floor * 1e6, 2), "frac_of_floor": round(floor / t, 3),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    write()
                    del case
                    torch.cuda.empty_cache()

    print(f"\n batch context nodes heads  {served}_us triton_us   GB/s  copy%  floor%  vs_ref")
    for r in rows:
        ref = f"{r['speedup_vs_reference']:.1f}x" if r["speedup_vs_reference"] else "-"
        print(f"{r['batch']:6d} {r['context']:7d} {r['tree_nodes']:5d} {r['heads']:5d} {r['time_us']:9.1f} {r['triton_us']:9.1f} "
              f"{r['gbps']:6.0f} {100 * r['frac_of_copy']:5.0f}% {100 * r['frac_of_floor']:6.0f}% {ref:>7}")


if __name__ == "__main__":
    main()
