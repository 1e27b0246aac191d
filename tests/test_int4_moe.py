"""Fused INT4 MoE (kernels/int4_moe.py) against its torch reference, in the Triton CPU interpreter.

Why a child process: ``TRITON_INTERPRET=1`` takes effect only when it is set before triton is
first imported in a process, and another test module may import triton natively first. So this
module never imports triton itself: a module-scoped fixture runs this file as a script with the
variable set, the script runs every case (in a pool of worker processes) and prints one JSON line
per case, and the parametrised tests below check those lines. Running ``TRITON_INTERPRET=1 python
tests/test_int4_moe.py`` by hand prints the same table. The GEMV sweep's dry run (another child)
runs alongside the cases.

Shapes are small but odd: hidden 160 and intermediate 96 are multiples of the 32-wide scale group
and of no tile size used, so every K tail and N tail is exercised (the one-row-a-program served
GEMV launch takes intermediate 64: still two scale groups and a K tail of its down kernel). Scales
of experts no token chose are NaN, so reading them shows up in the output. The GEMV path's cases also allocate their outputs
NaN-filled (every element must be written) and are checked against the tensor-core path too.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    # one token, default config (choose_config: at M=1 the GEMV path, with gemv_served_m1's launch).
    # Not a job of its own: gemv_served_m1 runs the default config on its inputs (see DEFAULT_CONFIG_CASE).
    "m1_default_config": dict(M=1, top_k=4, cfg=None, I=64, tol=1e-5),
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
    # every expert chosen by every token (the last ones too: their scales are real here), hidden a
    # multiple of down's K step and intermediate not (the other cases have both or neither), and
    # hidden states a column slice of a wider tensor (row stride 152, not 128)
    "every_expert_strided_x": dict(M=3, top_k=8, K=128, every_expert=True, x_pad=24, cfg=dict(SMALL), tol=1e-5),
    # gate/up asked to split K four ways where 96 holds two 64-wide steps: it splits two ways
    "split_k_past_the_steps": dict(M=4, top_k=2, K=96, I=64, cfg=dict(SMALL, gu_block_k=64, gu_split_k=4), tol=1e-5),
    # float32 scales (a checkpoint may store them): the one-FMA dequant's constants rounded for
    # them, 1.6e-4 from the reference; their own path forms (n - 8) * scale as the reference does
    "fp32_scales": dict(M=3, top_k=2, scale_dtype="float32", cfg=dict(SMALL, swap_ab=True), tol=1e-5),
}
# GEMV path (cfg.gemv): name -> case parameters (see _run_gemv_case). Each case also runs the
# tensor-core path (SMALL) on the same inputs; with fp32 activations the two agree to fp32 rounding.
# Blocks are large where the tail is not the point: the interpreter's cost grows with programs.
GEMV_CASES: dict[str, dict] = {
    # one token; K 160 and I 96 are tails of every block (N and K) of both kernels; int64 ids
    "gemv_m1": dict(M=1, top_k=4, gv=(64, 64, 4, 1), gvd=(64, 64, 4, 1), tol=1e-5),
    # every token routes to expert 2, every other row to it twice; int32 ids; pipelined loops (GPU only)
    "gemv_hot_dup": dict(M=4, top_k=3, hot=2, dup=True, ids_dtype="int32", gv=(64, 256, 4, 2), gvd=(128, 128, 2, 3), tol=1e-5),
    # block_n 4 / 8, group 64, even K on both kernels (no masks)
    "gemv_small_blocks_group64": dict(M=1, top_k=2, group=64, K=128, I=64, gv=(4, 128, 2, 1), gvd=(8, 64, 4, 1), tol=1e-5),
    # hidden states a column slice of a wider tensor (the argument check asks only a unit last stride)
    "gemv_strided_x": dict(M=3, top_k=2, K=64, I=64, x_pad=24, gv=(32, 64, 4, 1), gvd=(64, 64, 4, 1), tol=1e-5),
    "gemv_bf16_fp16_scales": dict(M=3, top_k=2, dtype="bfloat16", scale_dtype="float16", gv=(64, 128, 4, 1), gvd=(64, 64, 4, 1), tol=3e-2),
    "gemv_fp32_scales": dict(M=2, top_k=2, scale_dtype="float32", gv=(32, 256, 4, 1), gvd=(128, 128, 4, 1), tol=1e-5),
    "gemv_fp16": dict(M=2, top_k=2, dtype="float16", gv=(32, 256, 4, 1), gvd=(128, 128, 4, 1), tol=2e-3),
    # the served launch at K2 TP8 M=1: one row a program on one warp, pipelined down. Intermediate 64
    # (two scale groups, a K tail of down's 256) as gate/up's programs are one a row: A * I of them.
    "gemv_served_m1": dict(M=1, top_k=4, I=64, gv=(1, 1024, 1, 1), gvd=(8, 256, 1, 3), tol=1e-5),
}
# At M=1 choose_config's default *is* the served GEMV launch, so running m1_default_config's default
# config and gemv_served_m1's launch on the same inputs would interpret the same kernels on the same
# data twice. gemv_served_m1 therefore runs ``fused_int4_moe(config=None)`` (NaN-poisoned outputs) as
# its GEMV run and reports m1_default_config's row from it; should the default at M=1 ever stop being
# that launch, both run, each with its own config (``_run_gemv_case``).
DEFAULT_CONFIG_CASE = {"gemv_served_m1": "m1_default_config"}
ALIGN_CASES = {"align_m1": (1, 8, 4, 16), "align_random": (50, 16, 3, 16), "align_hot": (40, 6, 2, 8), "align_wide": (300, 384, 8, 64),
               "align_one_each": (40, 40, 1, 16)}   # more experts than block rows, one assignment each: the padding bound is tight


def _rand_int4(E: int, out_f: int, in_f: int, group: int, scale_dtype, g):
    """Random nibbles (full int32 words) and random non-zero scales."""
    import torch

    from services.common.int4 import Int4Weight

    packed = torch.randint(-(2**31), 2**31 - 1, (E, out_f, in_f // 8), dtype=torch.int32, generator=g)  # [E, out, in/8]
    scale = (torch.rand(E, out_f, in_f // group, generator=g) * 0.02 + 0.004).to(scale_dtype)  # [E, out, in/g]
    return Int4Weight(packed=packed, scale=scale, shape=(out_f, in_f))


def _inputs(name: str, M: int, top_k: int, dtype: str = "float32", scale_dtype: str = "bfloat16", group: int = 32,
            K: int = 160, I: int = 96, E: int = 8, hot: int | None = None, dup: bool = False, every_expert: bool = False,
            x_pad: int = 0):
    """Random stacks, hidden states and a routing over experts ``0 .. E-3`` (the last two: NaN scales).

    ``hot``: every row holds that expert once, in a random slot. ``dup``: every other row holds one
    expert twice (``hot`` where given, else its slot-0 expert; the next slot takes the copy).
    ``every_expert``: the routing is over all E experts (no NaN scales). ``x_pad``: the hidden
    states are the first K columns of a [M, K + x_pad] tensor.
    """
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    sdt, dt = getattr(torch, scale_dtype), getattr(torch, dtype)
    wg, wu, wd = (_rand_int4(E, o, i, group, sdt, g) for o, i in ((I, K), (I, K), (K, I)))
    chosen = E if every_expert else E - 2  # experts chosen-from: 0..E-3
    if hot is None:
        ids = torch.stack([torch.randperm(chosen, generator=g)[:top_k] for _ in range(M)])  # [M, k] distinct per row
    else:  # every row holds `hot` once, in a random slot
        others = [e for e in range(chosen) if e != hot]
        rows = []
        for _ in range(M):
            row = [others[j] for j in torch.randperm(len(others), generator=g)[: top_k - 1].tolist()] + [hot]
            rows.append([row[j] for j in torch.randperm(top_k, generator=g).tolist()])
        ids = torch.tensor(rows)  # [M, k]
    if dup:
        for r in range(0, M, 2):
            e = int(ids[r, 0]) if hot is None else hot
            ids[r, (ids[r].tolist().index(e) + 1) % top_k] = e
    for w in (wg, wu, wd):
        w.scale[chosen:] = float("nan")  # never-chosen experts: any read poisons the output
    x = torch.randn(M, K + x_pad, generator=g).to(dt)[:, :K]  # [M, K], row stride K + x_pad
    tw = torch.rand(M, top_k, generator=g)  # [M, k]
    return x, wg, wu, wd, ids, tw


def _errors(out, ref) -> tuple[float, float]:
    diff = out.double() - ref.double()
    return (diff.norm() / ref.double().norm()).item(), (diff.abs().max() / ref.double().abs().max()).item()


def _run_case(name: str, M: int, top_k: int, cfg, tol: float, group: int = 32, **inputs) -> dict:
    import torch

    from kernels.int4_moe import Int4MoEConfig, fused_int4_moe, int4_moe_reference

    x, wg, wu, wd, ids, tw = _inputs(name, M, top_k, group=group, **inputs)
    config = Int4MoEConfig(**cfg) if cfg is not None else None
    out = fused_int4_moe(x, wg, wu, wd, ids, tw, group_size=group, config=config)  # [M, K]
    ref = int4_moe_reference(x, wg, wu, wd, ids, tw, group_size=group, compute_dtype=torch.float64)  # [M, K]
    return _row(name, out, ref, tol, x)


@contextlib.contextmanager
def _nan_empty():
    """``torch.empty`` fills floating tensors with NaN: an output element a kernel skips shows up."""
    import torch

    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


_GEMV_LAUNCH = ("gemv", "deq_asm", *(f"{p}_{f}" for p in ("gv", "gvd") for f in ("block_n", "block_k", "warps", "stages")))


def _run_gemv_case(name: str, M: int, top_k: int, gv: tuple, gvd: tuple, tol: float, group: int = 32,
                   ids_dtype: str = "int64", **inputs) -> list[dict]:
    """The GEMV path (outputs NaN-poisoned) against the float64 reference and the tensor-core path.

    For a case in ``DEFAULT_CONFIG_CASE`` also that CASES entry's row: ``fused_int4_moe`` with the
    default config on these inputs, the GEMV run itself when choose_config picks this very launch."""
    import torch

    from kernels.int4_moe import Int4MoEConfig, choose_config, fused_int4_moe, int4_moe_reference

    x, wg, wu, wd, ids, tw = _inputs(name, M, top_k, group=group, **inputs)
    ids = ids.to(getattr(torch, ids_dtype))
    cfg = Int4MoEConfig(**dict(SMALL, gemv=True), **{f"gv_{f}": v for f, v in zip(("block_n", "block_k", "warps", "stages"), gv)},
                        **{f"gvd_{f}": v for f, v in zip(("block_n", "block_k", "warps", "stages"), gvd)})
    ref = int4_moe_reference(x, wg, wu, wd, ids, tw, group_size=group, compute_dtype=torch.float64)  # [M, K]
    rows = []
    default_name = DEFAULT_CONFIG_CASE.get(name)
    if default_name is not None:
        case = CASES[default_name]
        assert case["cfg"] is None and (case["M"], case["top_k"], case.get("I", 96)) == (M, top_k, inputs.get("I", 96)), \
            f"{default_name} must name {name}'s shape"
        E, K, I = wg.packed.shape[0], x.shape[1], wg.packed.shape[1]
        chosen = choose_config(M, E, K, I, top_k)
        with _nan_empty():
            default_out = fused_int4_moe(x, wg, wu, wd, ids, tw, group_size=group)  # [M, K], config=None: choose_config's
        rows.append(_row(default_name, default_out, ref, case["tol"], x))
        same_launch = all(getattr(chosen, f) == getattr(cfg, f) for f in _GEMV_LAUNCH)
    if default_name is not None and same_launch:
        out = default_out  # the same kernels with the same launch parameters on the same inputs
    else:
        with _nan_empty():
            out = fused_int4_moe(x, wg, wu, wd, ids, tw, group_size=group, config=cfg)  # [M, K]
    tc = fused_int4_moe(x, wg, wu, wd, ids, tw, group_size=group, config=dataclasses.replace(cfg, gemv=False))  # [M, K]
    rel_tc, _ = _errors(out, tc)
    rows.append(dict(_row(name, out, ref, tol, x), rel_err_vs_tensor_cores=rel_tc, empty_ok=_gemv_m0_ok(x, wg, wu, wd, ids, tw, group, cfg)))
    return rows


def _row(name: str, out, ref, tol: float, x) -> dict:
    import torch

    rel, max_rel = _errors(out, ref)
    return dict(name=name, rel_err=rel, max_rel_err=max_rel, tol=tol, finite=bool(torch.isfinite(out).all()),
                shape=list(out.shape), dtype=str(out.dtype), want_dtype=str(x.dtype))


def _gemv_m0_ok(x, wg, wu, wd, ids, tw, group: int, cfg) -> bool:
    """Zero tokens: a [0, K] result from both entry points, no launch."""
    from kernels.int4_moe import fused_int4_moe, int4_moe_gemv

    outs = (f(x[:0], wg, wu, wd, ids[:0], tw[:0], group, cfg) for f in (fused_int4_moe, int4_moe_gemv))
    return all(tuple(o.shape) == (0, x.shape[1]) and o.dtype == x.dtype for o in outs)


def _run_align(name: str, M: int, E: int, top_k: int, block_m: int) -> dict:
    """Structural check of the alignment: a permutation of the assignments, padded per expert; the
    expert counts (kept in ``tile_counters``) are back at zero after it, so a second call agrees."""
    import torch

    from kernels.device import tile_counters
    from kernels.int4_moe import int4_moe_align

    g = torch.Generator().manual_seed(M * 131 + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(M)])  # [M, k]
    if name == "align_hot":
        ids[:, 0] = 1
        ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])
    if name == "align_one_each":
        ids = torch.randperm(E, generator=g).view(M, top_k)   # [E, 1]: every expert once
    al = int4_moe_align(ids, E, block_m)
    A = ids.numel()
    flat = ids.view(-1)
    sid = al.sorted_ids.view(-1, block_m)  # [blocks, BM]
    be = al.block_expert  # [blocks]
    errors = []
    real = al.sorted_ids[al.sorted_ids < A]
    if sorted(real.tolist()) != list(range(A)):
        errors.append("sorted_ids is not a permutation of the assignments")
    if not bool(((al.sorted_ids >= 0) & (al.sorted_ids <= A)).all()):
        errors.append("sorted_ids holds values other than assignments and the sentinel A")
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
    if bool(tile_counters(ids.device).any()):
        errors.append("the alignment left counters nonzero")
    again = int4_moe_align(ids, E, block_m)
    if not torch.equal(again.block_expert, al.block_expert) or not torch.equal(again.sorted_ids.sort().values, al.sorted_ids.sort().values):
        errors.append("a second alignment of the same ids differs")
    return dict(name=name, errors=errors)


def _run_k_order() -> dict:
    """The Gluon kernels' K order off the GPU: ``permute_k``'s Triton kernel equals the torch
    reference (rows not a multiple of its block), and ``int4_moe_gate_up(k_order=True)`` returns
    exactly ``permute_k`` of the plain h, split over K or not; split-K gate/up repeats bit for bit
    and leaves its tile counters at zero."""
    import torch

    from kernels import int4_moe_hopper as hop
    from kernels.device import tile_counters
    from kernels.int4_moe import Int4MoEConfig, int4_moe_align, int4_moe_down, int4_moe_gate_up

    errors = []
    g = torch.Generator().manual_seed(7)
    x = torch.randn(21, 384, generator=g)
    if not torch.equal(hop.permute_k(x), hop.permute_k_reference(x)):
        errors.append("permute_k's kernel differs from the reference")
    E, K, I, M, k = 6, 160, 128, 5, 2
    wg, wu, wd = (_rand_int4(E, o, i, 32, torch.bfloat16, g) for o, i in ((I, K), (I, K), (K, I)))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    xs = torch.randn(M, K, generator=g)
    for split in (1, 2):
        cfg = Int4MoEConfig(**SMALL, gu_split_k=split)
        al = int4_moe_align(ids, E, cfg.block_m)
        real = al.sorted_ids < M * k
        plain = int4_moe_gate_up(xs, wg, wu, al, k, cfg)
        ordered = int4_moe_gate_up(xs, wg, wu, al, k, cfg, k_order=True)
        if not torch.equal(ordered[real], hop.permute_k_reference(plain)[real]):
            errors.append(f"k_order h differs from permute_k of h (split {split})")
        if split > 1:  # the last slice of a tile adds the partials in slice order, then zeroes its counter
            if not torch.equal(int4_moe_gate_up(xs, wg, wu, al, k, cfg)[real], plain[real]):
                errors.append("split-K gate/up gave other bits on a second call")
            if int(tile_counters(xs.device).abs().sum()):
                errors.append("split-K gate/up left its tile counters set")
    try:
        int4_moe_down(ordered, wd, al, torch.rand(M, k, generator=g), cfg, h_k_order=True)
        errors.append("the Triton down accepted h in the Gluon K order")
    except ValueError:
        pass
    return dict(name="k_order", errors=errors)


def _run_host_paths() -> dict:
    """The host code around the launches: routing weights of another shape than the ids are refused,
    and the sum over top-k of the per-assignment rows covers a hidden size past its 1024-wide block."""
    import torch

    from kernels.int4_moe import Int4MoEConfig, _finish_down, fused_int4_moe

    errors = []
    x, wg, wu, wd, ids, tw = _inputs("host_paths", 2, 2, K=64, I=64)
    try:
        fused_int4_moe(x, wg, wu, wd, ids, tw[:, :1], group_size=32, config=Int4MoEConfig(**SMALL))
        errors.append("routing weights [M, 1] for ids [M, 2] were taken")
    except AssertionError as exc:
        if "topk_weights" not in str(exc):
            errors.append(f"the refusal does not name topk_weights: {exc}")
    M, top_k, K = 3, 4, 1100
    rows = torch.randn(M * top_k, K, generator=torch.Generator().manual_seed(21))  # [A, K]
    with _nan_empty():
        summed = _finish_down(rows, False, torch.float32, M, top_k, K)  # [M, K]
    if not torch.allclose(summed.double(), rows.double().view(M, top_k, K).sum(1), rtol=1e-6, atol=1e-6):
        errors.append("the top-k sum at K = 1100 differs from the rows' sum (columns past 1024 unwritten?)")
    return dict(name="host_paths", errors=errors)


def _run_config_spec() -> dict:
    """``Int4MoEConfig.spec`` round-trips through ``parse`` and through the pinning variable."""
    import kernels.int4_moe as km
    from kernels.int4_moe import CONFIG_ENV, Int4MoEConfig, choose_config

    km._hopper_here = lambda: False  # the Triton table; tests/test_int4_moe_hopper.py checks the Hopper one
    errors = []
    gemv = Int4MoEConfig(gemv=True, gv_block_n=4, gv_block_k=512, gv_warps=2, gv_stages=3,
                         gvd_block_n=64, gvd_block_k=64, gvd_warps=8, gvd_stages=2)
    tensor_cores = Int4MoEConfig(block_m=64, gu_block_n=128, dn_stages=4, swap_ab=False, reduce="atomic", gu_split_k=4, deq_asm=False,
                                 hp_stages=3, hp_dn_tiles=8, hp_gu_tma=False, hp_dn_tma=True, hp_gu_regs=128)
    for cfg in (Int4MoEConfig(), tensor_cores, gemv):
        if Int4MoEConfig.parse(cfg.spec()) != cfg:
            errors.append(f"parse(spec) differs for {cfg}")
    if Int4MoEConfig.parse("gemv=1,gv=4x512x2x3,gvd=64x64x8x2") != gemv:
        errors.append("parse of the gemv keys alone differs")
    try:
        Int4MoEConfig.parse("bm=16,zz=1")
        errors.append("an unknown key was accepted")
    except ValueError:
        pass
    for bad in (dict(gv_block_n=3), dict(gvd_block_n=0), dict(gv_block_k=16), dict(gvd_block_k=96), dict(gv_stages=0),
                dict(hp_stages=1), dict(hp_dn_tiles=0), dict(hp_gu_regs=16), dict(reduce="atomic", dn_block_n=256)):
        try:
            Int4MoEConfig(**bad)
            errors.append(f"{bad} accepted")
        except AssertionError:
            pass
    pinned = Int4MoEConfig(block_m=32, gu_block_k=64)
    os.environ[CONFIG_ENV] = pinned.spec()
    try:
        if choose_config(1, 384, 7168, 256, 8) != pinned or choose_config(4096, 8, 64, 64, 8) != pinned:
            errors.append("the pinned config is not used")
    finally:
        del os.environ[CONFIG_ENV]
    if choose_config(1, 384, 7168, 256, 8) == choose_config(100000, 8, 7168, 256, 8):
        errors.append("small and large M share one config")
    tp8_m1 = choose_config(1, 384, 7168, 256, 8)
    if not (tp8_m1.gemv and choose_config(1, 48, 7168, 2048, 8).gemv):
        errors.append("M=1 on K2 TP8 / EP8 does not take the GEMV path")
    if choose_config(72, 384, 7168, 256, 8).gemv or choose_config(72, 48, 7168, 2048, 8).gemv:
        errors.append("M=72 takes the GEMV path")
    # The threshold, 0.75 assignments per expert: TP8 M = 36 / 37, EP8 M = 4 / 5.
    edges = [choose_config(m, e, 7168, i, 8).gemv for m, e, i in ((36, 384, 256), (37, 384, 256), (4, 48, 2048), (5, 48, 2048))]
    if edges != [True, False, True, False]:
        errors.append(f"GEMV threshold edges {edges}, want [True, False, True, False]")
    # A draft tree's nodes share experts: only one token a routing group (decode) takes the GEMV.
    grouped = [choose_config(17, 384, 7168, 256, 8, routing_groups=g).gemv for g in (None, 17, 32, 1, 16)]
    if grouped != [True, True, True, False, False]:
        errors.append(f"GEMV by routing groups {grouped}, want [True, True, True, False, False]")
    tree, decode = choose_config(17, 384, 7168, 256, 8, routing_groups=1), choose_config(17, 384, 7168, 256, 8)
    tc_fields = ("block_m", "gu_block_n", "gu_block_k", "gu_split_k", "dn_block_n", "dn_block_k", "swap_ab")
    if [getattr(tree, f) for f in tc_fields] != [getattr(decode, f) for f in tc_fields]:
        errors.append("a tree step does not get its M's tensor-core config")
    tc = dataclasses.replace(tp8_m1, gemv=False)
    if (tc.gu_split_k, tc.dn_block_n, tc.dn_block_k) != (8, 256, 64):
        errors.append(f"the GEMV config at M=1 lost the tensor-core choice of that M: {tc.spec()}")
    return dict(name="config_spec", errors=errors)


def _run_sweep_helpers() -> dict:
    """The pure parts of bench/int4_moe_gemv_sweep.py the GPU run relies on."""
    from bench.int4_moe_gemv_sweep import (
        DN_GRID, GU_GRID, MAX_ACC_REGS, crossover, gemv_cfg, grid_split, launch_key, parse_grid,
    )
    from kernels.int4_moe import Int4MoEConfig

    errors = []
    cfg = gemv_cfg(gu=(4, 512, 2, 3), dn=(64, 64, 8, 2))
    if Int4MoEConfig.parse(f"gemv=1,gv={launch_key((4, 512, 2, 3))},gvd={launch_key((64, 64, 8, 2))}") != cfg:
        errors.append("launch_key does not give the CONFIG_ENV syntax of gemv_cfg's config")
    gu_keep, gu_skip = grid_split("gu", GU_GRID)
    dn_keep, dn_skip = grid_split("dn", DN_GRID)
    if (len(gu_keep), len(dn_keep)) != (32, 35) or "32x512x4x1" not in gu_skip or "64x256x2x1" not in dn_skip:
        errors.append(f"grid split: {len(gu_keep)} gate/up, {len(dn_keep)} down kept; skipped {gu_skip} {dn_skip} (max {MAX_ACC_REGS})")
    if parse_grid("1,2x512,1024x2") != [(1, 512, 2), (1, 1024, 2), (2, 512, 2), (2, 1024, 2)] or parse_grid("4x256x2") != [(4, 256, 2)]:
        errors.append("parse_grid")
    timings = ((1, 5, 9), (2, 6, 9), (4, 9, 8), (9, 7, 8))  # tokens, GEMV us, tensor-core us
    rows = [dict(shape="s", tokens=m, assignments=8 * m, gemv_us=g, tensor_core_us=t) for m, g, t in timings]
    if crossover(rows) != {"s": 16}:
        errors.append(f"crossover {crossover(rows)}, want s: 16 (the GEMV loses at M=4, so M=9 does not count)")
    return dict(name="sweep_helpers", errors=errors)


def _job_keys() -> list[str]:
    """Every job, the longest first (the one-row-a-program served launch, then the other GEMV cases,
    which also run the tensor-core path): a pool that hands out the long jobs first ends its workers
    close together."""
    shared = set(DEFAULT_CONFIG_CASE.values())  # run by their GEMV case
    gemv = sorted(GEMV_CASES, key=lambda n: n != "gemv_served_m1")
    return ([f"gemv:{n}" for n in gemv] + ["k_order"] + [f"case:{n}" for n in CASES if n not in shared]
            + [f"align:{n}" for n in ALIGN_CASES] + ["config_spec", "sweep_helpers", "host_paths"])


def _job(key: str) -> list[dict]:
    """One job's rows (a GEMV case may report a CASES row too)."""
    kind, _, name = key.partition(":")
    if kind == "case":
        return [_run_case(name, **CASES[name])]
    if kind == "gemv":
        return _run_gemv_case(name, **GEMV_CASES[name])
    if kind == "align":
        return [_run_align(name, *ALIGN_CASES[name])]
    return [{"k_order": _run_k_order, "config_spec": _run_config_spec, "sweep_helpers": _run_sweep_helpers,
             "host_paths": _run_host_paths}[kind]()]


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


def _main(workers: int = 1) -> None:
    """Every job, handed out one at a time to ``workers`` single-threaded processes (forked before
    torch is imported); one JSON line per row, in the order they finish."""
    sys.path.insert(0, str(ROOT))
    if workers <= 1:
        _worker_init()
        rows = (row for key in _job_keys() for row in _job(key))
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, initializer=_worker_init) as pool:
        for job_rows in pool.imap_unordered(_job, _job_keys(), chunksize=1):
            for row in job_rows:
                print(json.dumps(row), flush=True)


def _dry_run_cmd(out: Path) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "int4_moe_gemv_sweep.py"), "--dry-run", "--tokens", "1", "--out", str(out)]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.Popen, Path, Path]:
    """The GEMV sweep's dry run in a child of its own, started when first asked for (``results``
    starts it alongside the cases); ``test_gemv_sweep_dry_run`` waits for it."""
    tmp = tmp_path_factory.mktemp("gemv_dry_run")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    with open(tmp / "log.txt", "w") as log:
        proc = subprocess.Popen(_dry_run_cmd(tmp / "gemv.json"), env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    yield proc, tmp / "gemv.json", tmp / "log.txt"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def results(request) -> dict[str, dict]:
    """All cases under the interpreter in a pool of up to two single-threaded workers (CI has two
    cores; one process took 3-4 minutes). The GEMV sweep's dry run, when selected, runs alongside
    (three busy processes on two cores end sooner than the cases and then the dry run)."""
    from tests.selection import selected_names  # here: the child run of this file has no tests package

    if "test_gemv_sweep_dry_run" in selected_names(request):
        request.getfixturevalue("dry_run")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    workers = max(1, min(2, os.cpu_count() or 1))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(workers)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"interpreter run failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    out = {}
    for line in stdout.splitlines():
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


@pytest.mark.parametrize("name", list(GEMV_CASES))
def test_int4_moe_gemv_matches_reference_and_tensor_cores(results: dict[str, dict], name: str) -> None:
    test_fused_int4_moe_matches_reference(results, name)  # finite (every element written), dtype, error
    r = results[name]
    assert r["rel_err_vs_tensor_cores"] < r["tol"], f"{name}: rel diff to the tensor-core path {r['rel_err_vs_tensor_cores']:.3g}"
    assert r["empty_ok"], f"{name}: zero tokens did not give a [0, K] result"


@pytest.mark.parametrize("name", list(ALIGN_CASES))
def test_int4_moe_align_structure(results: dict[str, dict], name: str) -> None:
    assert results[name]["errors"] == [], f"{name}: {results[name]['errors']}"


def test_k_order_for_the_gluon_down(results: dict[str, dict]) -> None:
    assert results["k_order"]["errors"] == [], results["k_order"]["errors"]


def test_int4_moe_config_spec(results: dict[str, dict]) -> None:
    assert results["config_spec"]["errors"] == [], results["config_spec"]["errors"]


def test_gemv_sweep_helpers(results: dict[str, dict]) -> None:
    assert results["sweep_helpers"]["errors"] == [], results["sweep_helpers"]["errors"]


def test_int4_moe_host_paths(results: dict[str, dict]) -> None:
    assert results["host_paths"]["errors"] == [], results["host_paths"]["errors"]


def test_gemv_sweep_dry_run(dry_run: tuple[subprocess.Popen, Path, Path]) -> None:
    """The GPU sweep's whole flow (correctness checks, grids, stage variants, JSON) on a tiny shape."""
    proc, out, log = dry_run
    proc.wait(timeout=300)
    assert proc.returncode == 0, f"dry run failed:\n{log.read_text()[-9000:]}"
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["failed"] == {} and row["skipped_for_registers"] == ["64x256x2x1"], (row["failed"], row["skipped_for_registers"])
    # the grid configs at stages 1, then (the fastest three: here both) at stages 2
    assert set(row["gate_up"]) == {"32x128x4x1", "64x128x4x1", "32x128x4x2", "64x128x4x2"} and row["gv"] in row["gate_up"], row
    assert set(row["down"]) == {"64x64x4x1", "128x64x4x1", "64x64x4x2", "128x64x4x2"} and row["gvd"] in row["down"], row
    assert row["rel_err_vs_tensor_cores"] < 1e-2 and row["rel_err_default_vs_tensor_cores"] < 1e-2, row
    assert row["gemv_us"] > 0 and row["tensor_core_us"] > 0
    assert list(result["gemv_wins_up_to_assignments"]) == [row["shape"]]


if __name__ == "__main__":
    _main(*(int(a) for a in sys.argv[1:2]))
