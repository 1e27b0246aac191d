"""The Triton tree-attention MLA kernel must compute what ``tree_mla_reference`` computes.

On a machine without a GPU the kernel runs in Triton's interpreter, which is chosen when the
``@triton.jit`` decorators run; tests/conftest.py sets ``TRITON_INTERPRET=1`` before anything
imports triton (this module does too, for runs outside pytest's conftest).
"""

from __future__ import annotations

import os
import sys

import torch

# The interpreter needs the variable before triton's first import: triton's own @jit library
# functions (tl.sort, tl.cdiv, ...) are interpreted only if it was set then. Set it only while
# triton is still unimported, so no later module gets a mix of interpreted and compiled functions.
INTERPRET_PRESET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_FRESH = "triton" not in sys.modules
if not torch.cuda.is_available() and TRITON_FRESH:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import tree_mla as tm  # noqa: E402
from kernels.tree_mla import (  # noqa: E402
    TreeAttentionDeviceMetadata,
    TreeAttentionMetadata,
    TreeMlaConfig,
    default_config,
    fit_shared_memory,
    pack_ancestor_bits,
    tree_mla,
    tree_mla_reference,
    tree_mla_triton,
    unpack_ancestor_bits,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNEL_RUNNABLE = tm.triton is not None and (
    CUDA or ((TRITON_FRESH or INTERPRET_PRESET) and type(tm._tree_mla_split_kernel).__name__ == "InterpretedFunction")
)
needs_kernel = pytest.mark.skipif(
    not KERNEL_RUNNABLE,
    reason="the kernel needs a GPU or TRITON_INTERPRET=1 before triton's first import "
    "(tests/conftest.py sets it unless the environment sets it otherwise)",
)
KVR, ROPE = 64, 16  # small stand-ins for 512 / 64: powers of two, like the real ones


def parents_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i sees j iff j is i or an ancestor of i (parents[0] = -1)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_parents(kind: str, n: int, gen: torch.Generator) -> list[int]:
    if kind == "chain":
        return [i - 1 for i in range(n)]
    if kind == "star":
        return [-1] + [0] * (n - 1)
    # random: each node hangs under an earlier one
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def make_case(
    gen: torch.Generator,
    trees: list[tuple[int, list[int]]],
    heads: int,
    page_size: int,
    spare_pages: int = 3,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TreeAttentionMetadata]:
    """Random queries and a paged cache whose unused pages and page tails are NaN.

    trees: per request (prefix_len, parents). Pages are handed out in a shuffled order.
    """
    need = [-(-L // page_size) for L, _ in trees]
    num_pages = sum(need) + spare_pages
    kv_cache = torch.full((num_pages, page_size, KVR + ROPE), float("nan"), dtype=dtype)  # [P, ps, 80]
    order = torch.randperm(num_pages, generator=gen)
    tables, masks, starts, used = [], [], [0], 0
    for (L, parents), n_pages in zip(trees, need):
        table = order[used : used + n_pages]
        used += n_pages
        flat = torch.randn(L, KVR + ROPE, generator=gen, dtype=dtype)  # [L, 80]
        for p in range(n_pages):
            rows = flat[p * page_size : (p + 1) * page_size]
            kv_cache[table[p], : rows.shape[0]] = rows
        tables.append(table.to(torch.int64))
        masks.append(parents_mask(parents))
        starts.append(starts[-1] + len(parents))
    N = starts[-1]
    q_latent = torch.randn(N, heads, KVR, generator=gen, dtype=dtype)  # [N, H, kvr]
    q_pe = torch.randn(N, heads, ROPE, generator=gen, dtype=dtype)  # [N, H, rope]
    new_kv = torch.randn(N, KVR + ROPE, generator=gen, dtype=dtype)  # [N, kvr+rope]
    meta = TreeAttentionMetadata(
        query_starts=torch.tensor(starts, dtype=torch.int64),
        prefix_lens=torch.tensor([L for L, _ in trees], dtype=torch.int64),
        page_tables=tables,
        tree_masks=masks,
    )
    return q_latent, q_pe, kv_cache, new_kv, meta


def to_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def check(q_latent, q_pe, kv_cache, new_kv, meta, **kwargs) -> None:
    scale = 1.0 / (KVR + ROPE) ** 0.5
    expected = tree_mla_reference(q_latent.double(), q_pe.double(), kv_cache.double(), new_kv.double(), meta, scale)
    dev_meta = TreeAttentionDeviceMetadata.from_host(meta, device=DEVICE, **kwargs.pop("pad", {}))
    got = tree_mla_triton(*to_device(q_latent, q_pe, kv_cache, new_kv), dev_meta, scale, **kwargs)
    assert got.shape == expected.shape
    assert torch.isfinite(got).all(), "NaN/inf in the output: an unused page or tail was read"
    err = (got.double().cpu() - expected).abs().max().item()
    assert err < 1e-4, f"max abs err {err}"


# ---------------------------------------------------------------- kernel vs reference (interpreter)


@needs_kernel
@pytest.mark.parametrize(
    "kind,n,prefix,page_size",
    [
        ("chain", 1, 37, 16),  # a tree of one node (the plain decode step)
        ("chain", 6, 20, 8),
        ("star", 9, 45, 16),
        ("random", 33, 29, 5),  # two bitmask words; an odd page size
        ("random", 8, 2 * 16 - 3, 16),  # the tree starts 3 tokens before a page boundary
        ("random", 5, 0, 16),  # no prefix: only the tree's own keys
    ],
)
def test_single_request(kind: str, n: int, prefix: int, page_size: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + prefix)
    case = make_case(gen, [(prefix, tree_parents(kind, n, gen))], heads=4, page_size=page_size)
    check(*case, num_splits=1)


@needs_kernel
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_batch_with_split_k(num_splits: int | None) -> None:
    """Different prefix lengths (0 and 1 included), tree sizes and shapes in one launch."""
    gen = torch.Generator().manual_seed(11)
    trees = [
        (70, tree_parents("random", 7, gen)),
        (0, tree_parents("chain", 3, gen)),
        (1, tree_parents("star", 5, gen)),
        (33, tree_parents("random", 12, gen)),
    ]
    case = make_case(gen, trees, heads=2, page_size=16)
    check(*case, num_splits=num_splits)


@needs_kernel
def test_a_shared_prefill_forwards_chains() -> None:
    """Several prompts' chunks in one launch, as a step's short prompts share a prefill forward:
    chains of different lengths (one past the 129 nodes of a verify tree, one of a single token)
    after prefixes of their own (none, a piece's, mid-page)."""
    gen = torch.Generator().manual_seed(13)
    trees = [(0, tree_parents("chain", 150, gen)), (33, tree_parents("chain", 5, gen)),
             (7, tree_parents("chain", 1, gen)), (0, tree_parents("chain", 40, gen))]
    case = make_case(gen, trees, heads=2, page_size=16)
    check(*case)


@needs_kernel
@pytest.mark.parametrize("dv_splits", [1, 2])
def test_padded_bucket_and_many_heads(dv_splits: int) -> None:
    """Static shapes wider than needed (as a captured graph sees them), 16 heads, split-K, and
    each program writing half the value dims (dv_splits=2)."""
    gen = torch.Generator().manual_seed(5)
    trees = [(40, tree_parents("random", 9, gen)), (17, tree_parents("chain", 4, gen))]
    case = make_case(gen, trees, heads=16, page_size=8)
    config = TreeMlaConfig(block_m=32, block_n=16, num_warps=4, dv_splits=dv_splits)
    check(*case, num_splits=2, pad={"max_pages": 9, "max_nodes": 40}, config=config)
    check(*case, num_splits=1, config=config)


@needs_kernel
def test_default_config_above_64_rows_with_splits() -> None:
    """The served config above 64 rows a request (128 rows x half the value dims) with split-K:
    each half's partials merge with its own log-sum-exps."""
    gen = torch.Generator().manual_seed(9)
    trees = [(50, tree_parents("random", 9, gen)), (23, tree_parents("star", 9, gen))]
    case = make_case(gen, trees, heads=8, page_size=8)  # 72 rows a request
    assert default_config(72) == TreeMlaConfig(block_m=128, block_n=64, num_warps=8, num_stages=1, dv_splits=2)
    check(*case, num_splits=3)
    check(*case, num_splits=1)


def test_default_config_falls_back_where_shared_memory_is_small() -> None:
    """K2's latent (576 dims, bf16): 128 rows fit an H200's 227 KB a block, not an A100's 163 KB."""
    big = default_config(136)
    assert fit_shared_memory(big, 576, 2, 232448) == big
    assert fit_shared_memory(big, 576, 2, None) == big
    assert fit_shared_memory(big, 576, 2, 166912) == TreeMlaConfig(block_m=64)
    assert fit_shared_memory(big, 160, 2, 166912) == big  # the demo model's 128 + 32 dims
    small = default_config(40)
    assert fit_shared_memory(small, 576, 2, 166912) == small


@needs_kernel
def test_dispatcher_forced_triton_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(21, tree_parents("random", 6, gen))], 2, 4)
    scale = 0.125
    want = tree_mla_reference(q_latent, q_pe, kv_cache, new_kv, meta, scale)
    got = tree_mla(*to_device(q_latent, q_pe, kv_cache, new_kv), meta, scale, backend="triton")
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- host-side pieces (always run)


@pytest.mark.parametrize("num_splits,dv_splits", [(2, 1), (5, 1), (13, 2)])
def test_merge_splits_matches_float64_and_any_launch_shape(num_splits: int, dv_splits: int) -> None:
    """The merge equals a float64 log-sum-exp merge of random partials, with empty splits (-inf) and
    a row no split saw; and every launch shape (value dims cut into programs, splits read a block
    at a time, more splits than one block) gives the same bits, since the sums run in one order."""
    gen = torch.Generator().manual_seed(num_splits)
    n, h, kvr = 5, 7, 128
    rows = n * h
    o_part = torch.randn(num_splits, rows, kvr, generator=gen).to(DEVICE)
    lse = (torch.randn(num_splits, dv_splits, rows, generator=gen) * 4).to(DEVICE)
    lse[0, :, 3] = float("-inf")  # split 0 saw no key of row 3
    lse[:, :, 11] = float("-inf")  # no split saw row 11
    want = torch.zeros(rows, kvr, dtype=torch.float64)
    half = kvr // dv_splits
    for d in range(dv_splits):
        w = torch.softmax(lse[:, d].double().cpu() * torch.log(torch.tensor(2.0, dtype=torch.float64)), dim=0)  # 2^lse
        w = torch.nan_to_num(w)  # the row no split saw: weights 0, output 0
        want[:, d * half:(d + 1) * half] = torch.einsum("sr,srk->rk", w, o_part[:, :, d * half:(d + 1) * half].double().cpu())
    outs = []
    for d_chunks, split_block in ((None, None), (1, 1), (2, 4), (1, 16)):
        out = torch.full((n, h, kvr), float("nan"), device=DEVICE)
        tm.merge_splits(o_part, lse, out, num_splits, dv_splits, d_chunks=d_chunks, split_block=split_block)
        outs.append(out)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.view(rows, kvr).double().cpu(), want, rtol=1e-5, atol=1e-5)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_merge_plan_fills_the_gpu_and_keeps_64_dims() -> None:
    """Few rows (batch 1) cut the value dims into programs until the grid reaches the SM count,
    never below 64 dims a program; many rows keep whole rows; at most 8 splits are read at once."""
    assert tm.merge_plan(72, 512, 64, 1, 132) == (8, 8)  # 5 row blocks: 40 programs, 64 dims each
    assert tm.merge_plan(2048, 512, 4, 1, 132) == (2, 4)  # 128 row blocks: 256 programs
    assert tm.merge_plan(9216, 512, 2, 1, 132) == (1, 2)
    assert tm.merge_plan(72, 128, 3, 1, 132) == (2, 4)  # the demo's 128 dims: at most 2 chunks
    assert tm.merge_plan(72, 512, 13, 2, 132) == (4, 8)


@pytest.mark.parametrize("kvr", [512, 128])
def test_the_merge_warm_up_compiles_every_launch_a_prefill_can_make(kvr: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_up_merges`` (the verifier's start-up) launches exactly the compile keys that the merge
    of any step can: rows from one to thousands (a prefill's length x heads: every value-dim cut),
    any split count (its page table's width), one or two value-dim splits, launched early or after
    a full GPU, with PDL on and off."""
    from tests.launch_keys import Recorder
    recorder = Recorder(tm._tree_mla_merge_kernel)
    monkeypatch.setattr(tm, "_tree_mla_merge_kernel", recorder)
    for pdl_on in (False, True):
        monkeypatch.setattr(tm.pdl, "enabled", lambda device: pdl_on)
        recorder.keys.clear()
        launches = tm.warm_up_merges(kvr, torch.bfloat16, "cpu", dv_splits=(1, 2))
        assert launches == 2 * len(tm.merge_launch_shapes(kvr, 1) + tm.merge_launch_shapes(kvr, 2))
        warm = set(recorder.keys)
        recorder.keys.clear()
        for rows in (1, 16, 100, 640, 1100, 1600, 2200, 3200, 9000):
            out = torch.empty(rows, 1, kvr, dtype=torch.bfloat16)
            for splits in (2, 3, 4, 5, 8, 16, 33):
                for dv in (1, 2):
                    o_part, lse_part = tm.split_partials(out, splits, dv)
                    for after in (None, 8, 1 << 30):
                        tm.merge_splits(o_part, lse_part, out, splits, dv, after_ctas=after)
        served = set(recorder.keys)
        assert served == warm, (served - warm, warm - served)
        assert {dict(k[5:])["launch_pdl"] for k in served} == ({True, False} if pdl_on else {False})   # after the 5 arguments


@pytest.mark.parametrize("kvr, rope, heads, dtype", [(512, 64, 8, torch.bfloat16), (128, 32, 4, torch.float32)])
def test_the_attention_warm_up_compiles_every_triton_variant_a_launch_takes(
        kvr: int, rope: int, heads: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the Triton backend ``warm_up_attention`` launches the split kernel with every compile key
    that prefills (one request, 1-512 tokens, any page-table width) and verify steps (the graph
    buckets' batches and trees, a context's whole width) launch, and no other. Kimi-K2's per-rank
    shape in bf16, and a small float32 model (float32 always takes this backend)."""
    from tests.launch_keys import Recorder
    recorder = Recorder(tm._tree_mla_split_kernel)
    monkeypatch.setattr(tm, "_tree_mla_split_kernel", recorder)
    monkeypatch.setattr(tm, "merge_splits", lambda *args, **kwargs: None)
    page = 16
    cache = torch.randn(8, page, kvr + rope).to(dtype)
    launches = tm.warm_up_attention(cache, heads, rope, backend="triton")
    warm = set(recorder.keys)
    recorder.keys.clear()
    shapes = [(1, n, w) for n in (1, 2, 3, 8, 9, 64, 129, 512) for w in (1, 2, 5, 33, 513, 8192)]   # prefills
    shapes += [(b, n, w) for b in (1, 8, 64) for n in (1, 2, 5, 9, 17, 33, 129) for w in (128, 8192)]  # graph buckets
    for requests, nodes, width in shapes:
        n = requests * nodes
        q_latent = torch.randn(heads, n, kvr).to(dtype).transpose(0, 1)   # as the model makes it
        meta = TreeAttentionDeviceMetadata(
            query_starts=torch.arange(requests + 1, dtype=torch.int32) * nodes,
            prefix_lens=torch.full((requests,), width * page - nodes, dtype=torch.int32).clamp(min=0),
            page_table=torch.zeros(requests, width, dtype=torch.int32),
            ancestor_bits=torch.zeros(n, -(-nodes // 32), dtype=torch.int32), max_nodes=nodes)
        tm.tree_mla_triton(q_latent, torch.randn(n, heads, rope).to(dtype), cache,
                           torch.randn(n, kvr + rope).to(dtype), meta, 0.1)
    served = set(recorder.keys)
    assert served == warm, (served - warm, warm - served)
    assert launches == len(warm) == 8   # 4 row tiles x one split or several


def test_the_merge_warm_up_follows_the_served_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon kernel's merges take one value-dim split, the Triton kernel's one or two; the
    reference and the CPU launch none."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(tm, "hopper_available", lambda device: True)
    monkeypatch.delenv(tm.BACKEND_ENV, raising=False)
    assert tm.served_dv_splits(512, 64, torch.bfloat16, cuda) == (1,)
    assert tm.served_dv_splits(512, 64, torch.float32, cuda) == (1, 2)   # float32 runs the Triton kernel
    assert tm.served_dv_splits(256, 64, torch.bfloat16, cuda) == (1, 2)   # dims the Gluon kernel lacks
    assert tm.served_dv_splits(512, 64, torch.bfloat16, torch.device("cpu")) == ()
    monkeypatch.setenv(tm.BACKEND_ENV, "triton")
    assert tm.served_dv_splits(512, 64, torch.bfloat16, cuda) == (1, 2)
    monkeypatch.setenv(tm.BACKEND_ENV, "reference")
    assert tm.served_dv_splits(512, 64, torch.bfloat16, cuda) == ()
    monkeypatch.setattr(tm, "hopper_available", lambda device: False)
    monkeypatch.delenv(tm.BACKEND_ENV)
    assert tm.served_dv_splits(512, 64, torch.bfloat16, cuda) == (1, 2)


def test_ancestor_bits_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 31, 32, 33, 64, 129):
        mask = parents_mask(tree_parents("random", n, gen))
        bits = pack_ancestor_bits(mask)  # [n, cdiv(n, 32)]
        assert bits.dtype == torch.int32 and bits.shape == (n, -(-n // 32))
        assert torch.equal(unpack_ancestor_bits(bits, n), mask)
    chain = parents_mask(tree_parents("chain", 32, gen))
    assert int(pack_ancestor_bits(chain)[31, 0]) == -1  # all 32 bits set: two's complement


def test_device_metadata_round_trip_and_cpu_dispatch() -> None:
    gen = torch.Generator().manual_seed(1)
    trees = [(19, tree_parents("random", 5, gen)), (0, tree_parents("chain", 2, gen))]
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, trees, heads=2, page_size=4)
    dev = TreeAttentionDeviceMetadata.from_host(meta, max_pages=8, max_nodes=40)
    assert dev.ancestor_bits.shape == (7, 2) and dev.page_table.shape == (2, 8)
    back = dev.to_host()
    for a, b in zip(meta.tree_masks, back.tree_masks):
        assert torch.equal(a, b)
    want = tree_mla_reference(q_latent, q_pe, kv_cache, new_kv, meta, 0.1)
    torch.testing.assert_close(tree_mla(q_latent, q_pe, kv_cache, new_kv, dev, 0.1, backend="reference"), want)
    if not CUDA:  # the dispatcher's CPU default is the reference
        torch.testing.assert_close(tree_mla(q_latent, q_pe, kv_cache, new_kv, meta, 0.1), want)


_FP32_BUILD = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.tree_mla import _tree_mla_split_kernel as kernel

dtype = sys.argv[1]
pointers = dict(q_lat_ptr=dtype, q_pe_ptr=dtype, kv_ptr=dtype, new_kv_ptr=dtype, out_ptr=dtype, o_part_ptr="*fp32",
                lse_part_ptr="*fp32", page_table_ptr="*i32", prefix_lens_ptr="*i32", query_starts_ptr="*i32",
                anc_bits_ptr="*i32", scale_log2="fp32")
consts = dict(KVR=64, ROPE=16, BLOCK_M=16, BLOCK_N=32, DV_SPLITS=2, DIRECT=False, **({"IEEE": dtype == "*fp32"} if "IEEE" in kernel.arg_names else {}))
sig = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=4, num_stages=2)).asm["ptx"]
mma = [line for line in ptx.splitlines() if "mma" in line and not line.lstrip().startswith("//")]
print(json.dumps(dict(mma=len(mma), tf32=sum("tf32" in line for line in mma))))
"""


def test_float32_attention_multiplies_in_float32_on_the_gpu() -> None:
    """tl.dot takes float32 operands as TF32 (10 mantissa bits) by default: the float32 model's
    attention, which goes to this kernel (the Gluon one takes 16-bit only), was ~1e-3 off on a GPU
    while the interpreter, whose dot is exact, passed it. Built for sm_90 in a child process: no
    TF32 product in the float32 build; the bf16 build keeps its tensor-core products."""
    from tests.compiled import run_compiled

    fp32 = run_compiled(["-c", _FP32_BUILD, "*fp32"], timeout=300)
    bf16 = run_compiled(["-c", _FP32_BUILD, "*bf16"], timeout=300)
    assert fp32["tf32"] == 0, fp32
    assert bf16["mma"] > 0 and bf16["tf32"] == 0, bf16


def test_the_kernels_refuse_operands_they_would_misread() -> None:
    """The kernels index rows by a stride of their own and assume every last dim, page-table row
    and bitmask row is contiguous, the metadata int32, R+1 query starts and enough bitmask words:
    metadata breaking one read the wrong pages or past a tensor's end, silently."""
    gen = torch.Generator().manual_seed(3)
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(20, tree_parents("random", 5, gen)),
                                                             (7, tree_parents("chain", 2, gen))], heads=2, page_size=4)
    dev = TreeAttentionDeviceMetadata.from_host(meta, max_pages=8, max_nodes=5)
    tm.check_operands(q_latent, q_pe, kv_cache, new_kv, dev)   # as made: accepted
    strided_q = torch.randn(q_latent.shape[0], q_latent.shape[1], 2 * KVR)[..., ::2]   # last dim stride 2
    with pytest.raises(AssertionError, match="q_latent must be contiguous in its last dim"):
        tm.check_operands(strided_q, q_pe, kv_cache, new_kv, dev)
    bad = [
        (dict(page_table=torch.zeros(16, 2, dtype=torch.int32).t()), "rows must be contiguous"),   # [2, 16] column-major
        (dict(ancestor_bits=torch.zeros(1, 7, dtype=torch.int32).t()), "rows must be contiguous"),
        (dict(page_table=dev.page_table.long()), "must be int32"),
        (dict(query_starts=dev.query_starts[:-1]), "R\\+1 entries"),
        (dict(max_nodes=33), "too few words"),   # one word holds 32 nodes
    ]
    for change, message in bad:
        with pytest.raises(AssertionError, match=message):
            tm.check_operands(q_latent, q_pe, kv_cache, new_kv, TreeAttentionDeviceMetadata(**{**dev.__dict__, **change}))


@pytest.mark.parametrize("dtype, ieee", [(torch.float32, True), (torch.bfloat16, False), (torch.float16, False)])
def test_the_split_launch_multiplies_float32_in_float32_and_16_bit_on_tensor_cores(
        dtype: torch.dtype, ieee: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build test compiles the kernel with an IEEE flag of its own choosing: this pins that the
    wrapper passes IEEE=True exactly for float32 operands (else the float32 model's attention runs
    in TF32 on a GPU, ~1e-3 off, which the interpreter's exact dot never shows)."""
    from tests.launch_keys import Recorder

    recorder = Recorder(tm._tree_mla_split_kernel)
    monkeypatch.setattr(tm, "_tree_mla_split_kernel", recorder)
    monkeypatch.setattr(tm, "merge_splits", lambda *args, **kwargs: None)
    gen = torch.Generator().manual_seed(0)
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(20, tree_parents("chain", 3, gen))], heads=2,
                                                       page_size=8, dtype=dtype)
    tm.tree_mla_triton(q_latent, q_pe, kv_cache, new_kv, meta, 0.1)
    (key,) = recorder.keys
    assert dict(kv for kv in key if len(kv) == 2 and kv[0] == "IEEE") == {"IEEE": ieee}


def test_the_reference_returns_its_inputs_dtype_and_computes_float64_in_float64() -> None:
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(9, tree_parents("chain", 2, gen))], heads=2,
                                                           page_size=4, dtype=dtype)
        assert tree_mla_reference(q_latent, q_pe, kv_cache, new_kv, meta, 0.3).dtype == dtype
    # a request of one node over a 9-token prefix, by hand in float64
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(9, [-1])], heads=1, page_size=4, dtype=torch.float64)
    out = tree_mla_reference(q_latent, q_pe, kv_cache, new_kv, meta, 0.3)
    pages = meta.page_tables[0][:3]
    keys = torch.cat([kv_cache[pages].reshape(12, KVR + ROPE)[:9], new_kv[:1]])
    logits = (keys[:, :KVR] @ q_latent[0, 0] + keys[:, KVR:] @ q_pe[0, 0]) * 0.3
    assert torch.allclose(out[0, 0], torch.softmax(logits, 0) @ keys[:, :KVR], rtol=0, atol=1e-12)


def test_shared_memory_keeps_8_kb_spare_and_configs_below_the_kernels_sizes_are_refused() -> None:
    big = TreeMlaConfig(block_m=128, block_n=64, num_warps=8, num_stages=1, dv_splits=2)
    need = (128 + 64) * 576 * 2
    assert fit_shared_memory(big, 576, 2, need + 8192 - 1) == TreeMlaConfig(block_m=64)
    assert fit_shared_memory(big, 576, 2, need + 8192) == big
    for bad in (dict(block_m=8), dict(block_m=16, block_n=8), dict(block_m=16, dv_splits=4), dict(block_m=48)):
        with pytest.raises(AssertionError):
            TreeMlaConfig(**bad)
    gen = torch.Generator().manual_seed(1)
    q_latent, q_pe, kv_cache, new_kv, meta = make_case(gen, [(9, [-1])], heads=1, page_size=4)
    short_rope = KVR + 8
    with pytest.raises(AssertionError, match="rope = 8: the kernel needs a power of two >= 16"):
        tree_mla_triton(q_latent, q_pe[..., :8].contiguous(), kv_cache[..., :short_rope].contiguous(),
                        new_kv[..., :short_rope].contiguous(), meta, 0.1)


def test_the_served_splits_read_an_empty_backend_variable_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches take DDTREE_TREE_MLA_BACKEND="" as unset; the warm-up's list of splits read it
    as a forced backend and compiled the Triton kernel's merges beside the Gluon kernel's."""
    monkeypatch.setattr(tm, "hopper_available", lambda device: True)
    cuda = torch.device("cuda", 0)
    for value, splits in (("", (1,)), ("triton", (1, 2)), ("hopper", (1,)), ("reference", ())):
        monkeypatch.setenv(tm.BACKEND_ENV, value)
        assert tm.served_dv_splits(512, 64, torch.bfloat16, cuda) == splits, value
    monkeypatch.setenv(tm.BACKEND_ENV, "tritonn")
    with pytest.raises(ValueError, match="must be 'hopper', 'triton' or 'reference'"):
        tm.served_dv_splits(512, 64, torch.bfloat16, cuda)
