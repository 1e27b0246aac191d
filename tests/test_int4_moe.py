"""Fused INT4 MoE (kernels/int4_moe.py) against its torch reference, in the Triton CPU interpreter.

Why a child process: ``TRITON_INTERPRET=1`` takes effect only when it is set before triton is
first imported in a process, and another test module may import triton natively first. So this
module never imports triton itself: a module-scoped fixture runs this file as a script with the
variable set, the script runs every case and prints one JSON line per case, and the parametrised
tests below check those lines. Running ``TRITON_INTERPRET=1 python tests/test_int4_moe.py`` by hand
prints the same table.

Shapes are small but odd: hidden 160 and intermediate 96 are multiples of the 32-wide scale group
and of no tile size used, so every K tail and N tail is exercised. Scales of experts no token chose
are NaN, so reading them shows up in the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# name -> case parameters (see _run_case). fp32 hidden states make the kernel's arithmetic exact up
# to fp32 rounding (the interpreter's dot is fp32), so those cases use a tight tolerance; bf16 cases
# also see the interpreter's bf16 rounding (it truncates) and get a loose one.
SMALL = dict(block_m=16, gu_block_n=64, gu_block_k=128, dn_block_n=128, dn_block_k=64)
CASES: dict[str, dict] = {
    # random routing over experts 0..5 of 8: experts 6 and 7 are never chosen (NaN scales)
    "random_swap_sum": dict(M=5, top_k=3, cfg=dict(SMALL, swap_ab=True, reduce="sum"), tol=1e-5),
    "random_noswap_atomic": dict(M=5, top_k=3, cfg=dict(SMALL, swap_ab=False, reduce="atomic"), tol=1e-5),
    # every token routes to expert 2: 37 rows -> three blocks of 16 for one expert
    "hot_expert": dict(M=37, top_k=2, hot=2, cfg=dict(SMALL, swap_ab=True, reduce="sum"), tol=1e-5),
    # one token, default config (block_k 256 > hidden 160: the whole K is one masked tail)
    "m1_default_config": dict(M=1, top_k=4, cfg=None, tol=1e-5),
    # bf16 activations and fp16 scales, block_m 32, large tiles
    "bf16_fp16_scales": dict(
        M=9, top_k=2, dtype="bfloat16", scale_dtype="float16",
        cfg=dict(block_m=32, gu_block_n=128, gu_block_k=64, dn_block_n=64, dn_block_k=32, swap_ab=False), tol=3e-2,
    ),
    # group size 64: scales gathered per word instead of interleaved
    "group64": dict(M=4, top_k=2, group=64, K=128, I=64, cfg=dict(SMALL, swap_ab=True), tol=1e-5),
    # split-K gate/up (3 K slices, the last one a tail) feeding down through the fp32 sums
    "split_k": dict(M=6, top_k=3, cfg=dict(SMALL, gu_block_k=64, gu_split_k=3, swap_ab=True), tol=1e-5),
    "split_k_bf16": dict(M=7, top_k=2, dtype="bfloat16", cfg=dict(SMALL, gu_split_k=2, swap_ab=False, reduce="atomic"), tol=3e-2),
    # top_k 1: no reduction over slots
    "top1": dict(M=3, top_k=1, cfg=dict(SMALL, swap_ab=False), tol=1e-5),
}
ALIGN_CASES = {"align_m1": (1, 8, 4, 16), "align_random": (50, 16, 3, 16), "align_hot": (40, 6, 2, 8), "align_wide": (300, 384, 8, 64)}


def _rand_int4(E: int, out_f: int, in_f: int, group: int, scale_dtype, g):
    """Random nibbles (full int32 words) and random non-zero scales."""
    import torch

    from services.common.int4 import Int4Weight

    packed = torch.randint(-(2**31), 2**31 - 1, (E, out_f, in_f // 8), dtype=torch.int32, generator=g)  # [E, out, in/8]
    scale = (torch.rand(E, out_f, in_f // group, generator=g) * 0.02 + 0.004).to(scale_dtype)  # [E, out, in/g]
    return Int4Weight(packed=packed, scale=scale, shape=(out_f, in_f))


def _run_case(name: str, M: int, top_k: int, cfg, tol: float, dtype: str = "float32", scale_dtype: str = "bfloat16",
              group: int = 32, K: int = 160, I: int = 96, E: int = 8, hot: int | None = None) -> dict:
    import torch

    from kernels.int4_moe import Int4MoEConfig, fused_int4_moe, int4_moe_reference

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    sdt, dt = getattr(torch, scale_dtype), getattr(torch, dtype)
    wg, wu, wd = (_rand_int4(E, o, i, group, sdt, g) for o, i in ((I, K), (I, K), (K, I)))
    chosen = E - 2  # experts chosen-from: 0..E-3
    if hot is None:
        ids = torch.stack([torch.randperm(chosen, generator=g)[:top_k] for _ in range(M)])  # [M, k] distinct per row
    else:  # every row holds `hot` once, in a random slot
        others = [e for e in range(chosen) if e != hot]
        rows = []
        for _ in range(M):
            row = [others[j] for j in torch.randperm(len(others), generator=g)[: top_k - 1].tolist()] + [hot]
            rows.append([row[j] for j in torch.randperm(top_k, generator=g).tolist()])
        ids = torch.tensor(rows)  # [M, k]
    for w in (wg, wu, wd):
        w.scale[chosen:] = float("nan")  # never-chosen experts: any read poisons the output
    x = torch.randn(M, K, generator=g).to(dt)  # [M, K]
    tw = torch.rand(M, top_k, generator=g)  # [M, k]
    config = Int4MoEConfig(**cfg) if cfg is not None else None
    out = fused_int4_moe(x, wg, wu, wd, ids, tw, group_size=group, config=config)  # [M, K]
    ref = int4_moe_reference(x, wg, wu, wd, ids, tw, group_size=group, compute_dtype=torch.float64)  # [M, K]
    diff = (out.double() - ref.double())
    rel = (diff.norm() / ref.double().norm()).item()
    max_rel = (diff.abs().max() / ref.double().abs().max()).item()
    return dict(name=name, rel_err=rel, max_rel_err=max_rel, tol=tol, finite=bool(torch.isfinite(out).all()),
                shape=list(out.shape), dtype=str(out.dtype), want_dtype=str(x.dtype))


def _run_align(name: str, M: int, E: int, top_k: int, block_m: int) -> dict:
    """Structural check of the alignment: a permutation of the assignments, padded per expert."""
    import torch

    from kernels.int4_moe import int4_moe_align

    g = torch.Generator().manual_seed(M * 131 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(M)])  # [M, k]
    if name == "align_hot":
        ids[:, 0] = 1
        ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    al = int4_moe_align(ids, E, block_m)
    A = ids.numel()
    flat = ids.view(-1)
    sid = al.sorted_ids.view(-1, block_m)  # [blocks, BM]
    be = al.block_expert  # [blocks]
    errors = []
    real = al.sorted_ids[al.sorted_ids < A]
    if sorted(real.tolist()) != list(range(A)):
        errors.append("sorted_ids is not a permutation of the assignments")
    used = be >= 0
    if not bool((sid[~used] == A).all()):
        errors.append("unused blocks hold assignments")
    if used.any() and not bool(used[: int(used.sum())].all()):
        errors.append("unused blocks are not all at the end")
    for b in torch.nonzero(used).flatten().tolist():
        rows = sid[b][sid[b] < A]
        if rows.numel() == 0:
            errors.append(f"block {b} has no assignment")
        elif not bool((flat[rows.long()] == be[b]).all()):
            errors.append(f"block {b} mixes experts")
    counts = torch.bincount(flat, minlength=E)
    want_blocks = int(((counts + block_m - 1) // block_m).sum())
    if int(used.sum()) != want_blocks:
        errors.append(f"{int(used.sum())} blocks used, want {want_blocks}")
    return dict(name=name, errors=errors)


def _run_config_spec() -> dict:
    """``Int4MoEConfig.spec`` round-trips through ``parse`` and through the pinning variable."""
    from kernels.int4_moe import CONFIG_ENV, Int4MoEConfig, choose_config

    errors = []
    for cfg in (Int4MoEConfig(), Int4MoEConfig(block_m=64, gu_block_n=128, dn_stages=4, swap_ab=False, reduce="atomic", gu_split_k=4, deq_asm=False)):
        if Int4MoEConfig.parse(cfg.spec()) != cfg:
            errors.append(f"parse(spec) differs for {cfg}")
    pinned = Int4MoEConfig(block_m=32, gu_block_k=64)
    os.environ[CONFIG_ENV] = pinned.spec()
    try:
        if choose_config(1, 384, 7168, 256, 8) != pinned or choose_config(4096, 8, 64, 64, 8) != pinned:
            errors.append("the pinned config is not used")
    finally:
        del os.environ[CONFIG_ENV]
    if choose_config(1, 384, 7168, 256, 8) == choose_config(100000, 8, 7168, 256, 8):
        errors.append("small and large M share one config")
    return dict(name="config_spec", errors=errors)


def _main() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    for name, case in CASES.items():
        print(json.dumps(_run_case(name, **case)), flush=True)
    for name, args in ALIGN_CASES.items():
        print(json.dumps(_run_align(name, *args)), flush=True)
    print(json.dumps(_run_config_spec()), flush=True)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row["name"]] = row
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fused_int4_moe_matches_reference(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert r["finite"], f"{name}: non-finite output (a never-chosen expert's NaN scales were read?)"
    assert r["dtype"] == r["want_dtype"], f"{name}: output dtype {r['dtype']}, want {r['want_dtype']}"
    assert r["rel_err"] < r["tol"], f"{name}: rel err {r['rel_err']:.3g} >= {r['tol']}"
    assert r["max_rel_err"] < 3 * r["tol"], f"{name}: max rel err {r['max_rel_err']:.3g} >= {3 * r['tol']}"


@pytest.mark.parametrize("name", list(ALIGN_CASES))
def test_int4_moe_align_structure(results: dict[str, dict], name: str) -> None:
    assert results[name]["errors"] == [], f"{name}: {results[name]['errors']}"


def test_int4_moe_config_spec(results: dict[str, dict]) -> None:
    assert results["config_spec"]["errors"] == [], results["config_spec"]["errors"]


if __name__ == "__main__":
    _main()
