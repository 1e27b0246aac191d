"""The Hopper (Gluon) tree-MLA kernel off the GPU: backend choice, operand checks, and a build for sm_90.

The kernel itself cannot run here (Gluon has no CPU interpreter); ``bench/tree_mla_bench.py``
checks it against the float32 reference on an H200 (``checks_hopper`` in
``bench/results/tree_mla.json``). What the CPU can check: which backend ``tree_mla`` takes, that
unsupported operands are refused with a reason, and that the kernel still compiles for sm_90 on
the installed Triton (its Gluon API moves between releases) within the H200's shared memory.
"""

from __future__ import annotations


import pytest
import torch

from kernels import tree_mla_hopper as hop
from kernels.tree_mla import BACKEND_ENV, TreeAttentionMetadata, chain_mask, choose_backend, tree_mla, tree_mla_reference
from tests.compiled import build_main, build_result, run_compiled_batch
from tests.selection import selected_params

H100_SMEM_PER_BLOCK = 232448  # bytes of dynamic shared memory a CTA may use on sm_90


def _operands(kvr: int = 512, rope: int = 64, dtype: torch.dtype = torch.bfloat16, heads: int = 8, nodes: int = 3):
    g = torch.Generator().manual_seed(0)
    q_latent = torch.randn(nodes, heads, kvr, generator=g).to(dtype)
    q_pe = torch.randn(nodes, heads, rope, generator=g).to(dtype)
    kv_cache = torch.randn(4, 16, kvr + rope, generator=g).to(dtype)
    new_kv = torch.randn(nodes, kvr + rope, generator=g).to(dtype)
    return q_latent, q_pe, kv_cache, new_kv


def test_unsupported_reason() -> None:
    assert hop.unsupported_reason(*_operands()) is None  # Kimi-K2 per rank
    assert hop.unsupported_reason(*_operands(kvr=128, rope=32)) is None  # the demo model
    assert "bf16 / fp16" in hop.unsupported_reason(*_operands(dtype=torch.float32))
    assert "supported" in hop.unsupported_reason(*_operands(kvr=96, rope=32))
    q_latent, q_pe, kv_cache, new_kv = _operands()
    assert "one dtype" in hop.unsupported_reason(q_latent, q_pe, kv_cache.half(), new_kv)
    odd = torch.randn(3, 8, 520).to(torch.bfloat16)[..., 4:516]  # rows start 8 bytes off
    assert "aligned" in hop.unsupported_reason(odd, q_pe, kv_cache, new_kv)
    wide = torch.randn(3, 8, 520).to(torch.bfloat16)[..., :512]  # head stride 520: 8 mod 16 elements
    assert "multiples of 16" in hop.unsupported_reason(wide, q_pe, kv_cache, new_kv)
    assert "supported" in hop.unsupported_reason(*_operands(kvr=256, rope=64))  # not checked on a GPU


def _meta(nodes: int = 3) -> TreeAttentionMetadata:
    return TreeAttentionMetadata(
        query_starts=torch.tensor([0, nodes]), prefix_lens=torch.tensor([20]),
        page_tables=[torch.tensor([2, 0])], tree_masks=[chain_mask(nodes)],
    )


def test_backend_choice_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _operands()
    assert choose_backend(*ops) == "reference"  # CPU tensors
    monkeypatch.setenv(BACKEND_ENV, "reference")
    want = tree_mla_reference(*ops, _meta(), 0.1)
    torch.testing.assert_close(tree_mla(*ops, _meta(), 0.1), want)
    monkeypatch.setenv(BACKEND_ENV, "hopper")  # forced where it cannot run: a clear error, not a crash
    with pytest.raises(RuntimeError, match="compute capability 9"):
        tree_mla(*ops, _meta(), 0.1)
    monkeypatch.delenv(BACKEND_ENV)
    with pytest.raises(ValueError, match="'hopper', 'triton' or 'reference'"):
        tree_mla(*ops, _meta(), 0.1, backend="cuda")



def test_choose_splits_counts_whole_waves() -> None:
    """Past half a GPU of CTAs a split, the split count minimises whole waves (132 SMs, K2 dims):
    batch 32 x 4096, tree 33 (5 row tiles, 160 CTAs: 2 waves at one split) takes 4 splits, which
    measured 252 us against 320 on an H200; tree 17 (96 CTAs, a part-empty wave) takes 4; batch 128
    (256+ CTAs, whole waves already) keeps one. Small grids keep ``choose_num_splits``."""
    from kernels.tree_mla import choose_num_splits

    def splits(batch: int, context: int, nodes: int, heads: int = 8) -> int:
        rows = nodes * heads
        return hop.choose_splits(batch, -(-rows // hop.BLOCK_M), rows, context, 512, 64, 132)

    assert splits(32, 4096, 33) == 4 and splits(32, 16384, 33) == 4
    assert splits(32, 4096, 17) == 4
    assert splits(128, 4096, 9) == splits(128, 4096, 17) == splits(128, 4096, 33) == 1
    assert splits(32, 1024, 33, heads=64) == 1  # 1056 CTAs: partials would cost more than the tail
    for batch, context, nodes in ((32, 4096, 9), (1, 4096, 17), (4, 4096, 17), (1, 100, 9)):
        rows = nodes * 8
        m_tiles = -(-rows // hop.BLOCK_M)
        assert splits(batch, context, nodes) == choose_num_splits(batch, m_tiles, rows, context, 512, 64, 132)
    assert all(4096 // splits(32, 4096, n) >= 64 for n in (9, 17, 33))



def test_tma_rows_stay_inside_a_page() -> None:
    """TMA takes whole tiles only from a cache whose pages lie back to back, in copies that divide
    both the page and the tile; anything else (page size 1, a padded page stride) goes by cp.async."""
    def cache(pages: int, page_size: int, pad: int = 0) -> torch.Tensor:
        return torch.zeros(pages, page_size + pad, 576, dtype=torch.bfloat16)[:, :page_size]

    assert hop.tma_rows_for(cache(4, 64), 32) == 32 and hop.tma_rows_for(cache(4, 64), 64) == 64
    assert hop.tma_rows_for(cache(4, 16), 32) == 16  # two copies a 32-key tile, one a page
    assert hop.tma_rows_for(cache(4, 48), 32) == 16  # a 48-token page: 16-row copies never cross it
    assert hop.tma_rows_for(cache(4, 128), 32) == 32
    assert hop.tma_rows_for(cache(4, 1), 32) == 0 and hop.tma_rows_for(cache(4, 8), 32) == 0
    assert hop.tma_rows_for(cache(4, 16, pad=1), 32) == 0  # pages not back to back


_ARG_TYPES = {
    **{n: "*bf16" for n in ("q_lat_ptr", "q_pe_ptr", "kv_ptr", "new_kv_ptr", "out_ptr")},
    **{n: "*i32" for n in ("page_table_ptr", "prefix_lens_ptr", "query_starts_ptr", "anc_bits_ptr")},
    **{n: "*fp32" for n in ("o_part_ptr", "lse_part_ptr")},
    **{n: "i32" for n in ("stride_ql_n", "stride_ql_h", "stride_qp_n", "stride_qp_h", "stride_kv_page", "stride_kv_tok",
                          "stride_new_n", "stride_pt_r", "stride_anc_n", "num_heads", "page_size", "total_rows", "num_splits")},
    "scale_log2": "fp32",
    "trace_ptr": "*i64",
}


def _compile(kernel, types: dict, constexprs: dict, no_divisibility: tuple[str, ...]):
    """``kernel`` compiled for sm_90 (no GPU: Triton ships ptxas) with these argument types; pointers
    and strides are declared 16-aligned except ``no_divisibility``, as the launches' are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [n for n in kernel.arg_names if n in types]
    assert len(names) == len(types), f"kernel arguments changed: {kernel.arg_names}"
    signature = {n: types[n] for n in names} | {k: "constexpr" for k in constexprs}
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_") and n not in no_divisibility]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def _desc_types(rows: int, kvr: int, rope: int, k_lat, k_pe) -> dict:
    return {"lat_desc": f"tensordesc<bf16[{rows}, {kvr}],{k_lat!r}>", "pe_desc": f"tensordesc<bf16[{rows}, {rope}],{k_pe!r}>"}


def _build(kvr: int, rope: int, direct: bool, trace_tiles: int = 0) -> dict:
    """Compile the served launch (32-key tiles, four stages, TMA rows of a 16-token page) for sm_90,
    or its traced copy (``trace_tiles`` > 0); run without TRITON_INTERPRET."""
    gl = hop.gl
    bn, tma_rows = 32, 16
    k_lat = gl.NVMMASharedLayout.get_default_for([bn, kvr], gl.bfloat16)
    k_pe = gl.NVMMASharedLayout.get_default_for([bn, rope], gl.bfloat16)
    constexprs = dict(
        KVR=kvr, ROPE=rope, BLOCK_N=bn, NUM_STAGES=4, DIRECT=direct, TMA_ROWS=tma_rows, CONSUMER_REGS=hop.CONSUMER_REGS,
        TRACE=trace_tiles > 0, TRACE_TILES=trace_tiles, PDL=True,
        Q_LAT_SMEM=gl.NVMMASharedLayout.get_default_for([hop.BLOCK_M, kvr], gl.bfloat16),
        Q_PE_SMEM=gl.NVMMASharedLayout.get_default_for([hop.BLOCK_M, rope], gl.bfloat16),
        K_LAT_SMEM=k_lat, K_PE_SMEM=k_pe, P_SMEM=gl.NVMMASharedLayout.get_default_for([hop.BLOCK_M, bn], gl.bfloat16),
        num_warps=4,
    )
    types = _ARG_TYPES | _desc_types(tma_rows, kvr, rope, k_lat, k_pe)
    compiled = _compile(hop._tree_mla_hopper_kernel, types, constexprs, ("stride_pt_r", "stride_anc_n"))
    ptx = compiled.asm["ptx"]
    return dict(cubin_bytes=len(compiled.asm["cubin"]), wgmma="warp_group_dot" in compiled.asm["ttgir"],
                tma="cp.async.bulk.tensor" in ptx, setmaxnreg="setmaxnreg" in ptx, shared=compiled.metadata.shared,
                clock_reads=ptx.count("%clock64"), timer_reads=ptx.count("%globaltimer"), gdc_wait=ptx.count("griddepcontrol.wait"))


def _build_few_rows(kvr: int, rope: int, direct: bool) -> dict:
    """Compile the few-row kernel as ``_launch_few_rows`` launches it (64-row TMA copies) for sm_90."""
    import re

    gl = hop.gl
    bn, rn = hop.FEW_KEYS, hop.FEW_ROWS
    k_lat = gl.NVMMASharedLayout.get_default_for([bn, kvr], gl.bfloat16)
    k_pe = gl.NVMMASharedLayout.get_default_for([bn, rope], gl.bfloat16)
    constexprs = dict(
        KVR=kvr, ROPE=rope, NUM_STAGES=hop.few_rows_stages(kvr, rope, 2, H100_SMEM_PER_BLOCK), DIRECT=direct, TMA_ROWS=bn,
        Q_LAT_SMEM=gl.NVMMASharedLayout.get_default_for([rn, kvr], gl.bfloat16),
        Q_PE_SMEM=gl.NVMMASharedLayout.get_default_for([rn, rope], gl.bfloat16),
        K_LAT_SMEM=k_lat, K_PE_SMEM=k_pe, P_SMEM=gl.NVMMASharedLayout.get_default_for([rn, bn], gl.bfloat16), PDL=True, num_warps=4,
    )
    types = {k: v for k, v in _ARG_TYPES.items() if k != "trace_ptr"}
    types |= _desc_types(bn, kvr, rope, k_lat, k_pe)
    compiled = _compile(hop._tree_mla_few_rows_kernel, types, constexprs, ("stride_pt_r", "stride_anc_n"))
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)[^;]*?, (\d), (\d);", compiled.asm["ptx"])
    return dict(cubin_bytes=len(compiled.asm["cubin"]), shared=compiled.metadata.shared, stages=constexprs["NUM_STAGES"],
                shapes=sorted({m for m, _, _ in mmas}), plain=sum(a == "0" for _, a, _ in mmas),
                a_transposed=sum(a == "1" for _, a, _ in mmas), tma="cp.async.bulk.tensor" in compiled.asm["ptx"])


def _wide_args(kvr: int, rope: int, direct: bool, trace_tiles: int) -> list[str]:
    return ["wide", str(kvr), str(rope), str(int(direct)), str(trace_tiles)]


def _few_args(kvr: int, rope: int, direct: bool) -> list[str]:
    return ["few", str(kvr), str(rope), str(int(direct))]


@pytest.fixture(scope="module")
def builds(request) -> dict:
    """The selected builds of both kernels, by this file's ``__main__`` in two child processes side by
    side (conftest sets TRITON_INTERPRET for this one, and the interpreter cannot compile Gluon); each
    child pays torch's and Triton's start-up once, not once a build."""
    wide = [_wide_args(**p) for p in selected_params(request, "test_kernel_builds_for_sm90")]
    few = [_few_args(**p) for p in selected_params(request, "test_few_rows_kernel_builds_for_sm90")]
    return run_compiled_batch(__file__, wide + few)


@pytest.mark.skipif(hop.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("kvr,rope,direct,trace_tiles", [(512, 64, False, 0), (128, 32, True, 0), (512, 64, False, 16)])
def test_kernel_builds_for_sm90(builds: dict, kvr: int, rope: int, direct: bool, trace_tiles: int) -> None:
    """The K2 and demo shapes compile to a cubin whose products are wgmma, whose loader issues TMA
    copies, whose partitions get their own register counts and whose shared memory fits a CTA. The
    served build reads no clock; the traced one (``bench/tree_mla_timeline.py``) reads the SM clock
    and the global timer."""
    built = build_result(builds, _wide_args(kvr, rope, direct, trace_tiles))
    assert built["cubin_bytes"] > 0 and built["wgmma"] and built["tma"] and built["setmaxnreg"], built
    assert built["gdc_wait"] == 1, built  # launched with PDL (kernels.pdl): it waits for its predecessor
    assert 0 < built["shared"] <= H100_SMEM_PER_BLOCK, f"{built['shared']} bytes of shared memory"
    if trace_tiles:
        assert built["clock_reads"] >= 10 and built["timer_reads"] >= 2, built
    else:
        assert built["clock_reads"] == built["timer_reads"] == 0, built


@pytest.mark.skipif(hop.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("kvr,rope,direct", [(512, 64, False), (128, 32, True)])
def test_few_rows_kernel_builds_for_sm90(builds: dict, kvr: int, rope: int, direct: bool) -> None:
    """The few-row kernel's products are 64-key x 16-row wgmmas: per 64-key tile, ``S^T = K Q^T``
    over kvr + rope dims (plain operands) and ``O^T += V^T P^T`` over kvr / 64 M tiles, whose A
    operand (V^T, read from the key tile as it lies) is the transposed one; its ring fits a CTA."""
    built = build_result(builds, _few_args(kvr, rope, direct))
    assert built["shapes"] == ["m64n16k16"], built
    assert built["plain"] == (kvr + rope) // 16 and built["a_transposed"] == (kvr // 64) * (hop.FEW_KEYS // 16), built
    assert built["tma"] and 0 < built["shared"] <= H100_SMEM_PER_BLOCK, built
    assert built["stages"] == (2 if kvr == 512 else 4), built


def test_few_rows_policy_follows_the_sweeps() -> None:
    """Which calls take the few-row kernel and at how many splits (132 SMs, 8 heads), against the
    H200 sweeps the rules cite: decode steps and 2-node trees always; trees where the few-row call
    was faster (1.10-1.43x), and not where it was slower (0.25-1.00x)."""
    def serves(batch: int, context: int, nodes: int) -> bool:
        return hop.few_rows_serves(batch, nodes * 8, context, 132)

    assert all(serves(b, c, n) for b in (1, 32, 128) for c in (1024, 16384) for n in (1, 2))
    faster = [(1, 1024, 9), (1, 4096, 9), (2, 4096, 9), (4, 1024, 9), (8, 1024, 9), (1, 4096, 17), (2, 1024, 17),
              (4, 1024, 17), (1, 1024, 33), (2, 1024, 33)]
    slower = [(2, 16384, 9), (4, 4096, 9), (8, 4096, 9), (1, 16384, 17), (2, 4096, 17), (8, 1024, 17), (1, 4096, 33),
              (4, 1024, 33), (32, 4096, 9), (128, 4096, 17)]
    assert all(serves(*s) for s in faster) and not any(serves(*s) for s in slower)
    assert [hop.few_rows_splits(b, c, 132) for b, c in ((1, 1024), (1, 4096), (1, 16384), (4, 4096), (8, 4096), (32, 4096))] \
        == [12, 24, 48, 24, 16, 4]
    assert hop.few_rows_splits(1, 100, 132) == 1 and hop.few_rows_splits(3, 0, 132) == 1


def test_few_rows_stages_fit() -> None:
    assert hop.few_rows_stages(512, 64, 2, H100_SMEM_PER_BLOCK) == 2
    assert hop.few_rows_stages(128, 32, 2, H100_SMEM_PER_BLOCK) == 4
    with pytest.raises(AssertionError, match="two 64-key slots"):
        hop.few_rows_stages(512, 64, 2, 100 << 10)


def _build_from_args(args: list[str]) -> dict:
    kind, dims = args[0], [int(a) for a in args[1:]]
    return _build(dims[0], dims[1], bool(dims[2]), dims[3]) if kind == "wide" else _build_few_rows(dims[0], dims[1], bool(dims[2]))


if __name__ == "__main__":
    build_main(_build_from_args)


@pytest.mark.skipif(hop.gluon is None, reason="this Triton has no Gluon")
def test_the_attention_warm_up_compiles_every_variant_a_launch_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm_up_attention`` (the verifier's start-up) launches the Gluon kernels with every compile
    key that prefills (one request, 1-512 tokens, any page-table width) and verify steps (batches
    and trees of the graph buckets, a context's whole width) launch at Kimi-K2's per-rank shape, and
    no other: a key only a request reached would compile there, seconds while the replica waits.
    The kernels are recorded here, not run (Gluon has no CPU interpreter)."""
    import kernels.tree_mla as tm
    from kernels.tree_mla import TreeAttentionDeviceMetadata, warm_up_attention
    from tests.launch_keys import Recorder
    main, few = Recorder(hop._tree_mla_hopper_kernel), Recorder(hop._tree_mla_few_rows_kernel)
    monkeypatch.setattr(hop, "_tree_mla_hopper_kernel", main)
    monkeypatch.setattr(hop, "_tree_mla_few_rows_kernel", few)
    monkeypatch.setattr(hop, "hopper_available", lambda device: True)
    monkeypatch.setattr(tm, "merge_splits", lambda *args, **kwargs: None)
    monkeypatch.setattr(tm, "split_partials", lambda out, splits, dv: (torch.empty(0), torch.empty(0)))
    heads, kvr, rope, page = 8, 512, 64, 16
    cache = torch.randn(8, page, kvr + rope).to(torch.bfloat16)

    def keys() -> set[tuple]:
        got = {("64-row", *k) for k in main.keys} | {("few-row", *k) for k in few.keys}
        main.keys.clear()
        few.keys.clear()
        return got

    assert warm_up_attention(cache, heads, rope, backend="hopper") == 4
    warm = keys()
    shapes = [(1, n, w) for n in (1, 2, 8, 64, 129, 512) for w in (1, 2, 5, 33, 64, 513, 8192)]   # prefills
    shapes += [(b, n, w) for b in (1, 8, 64) for n in (1, 9, 33, 129) for w in (128, 8192)]      # graph buckets
    for requests, nodes, width in shapes:
        g = torch.Generator().manual_seed(requests * nodes + width)
        n = requests * nodes
        q_latent = torch.randn(heads, n, kvr, generator=g).to(torch.bfloat16).transpose(0, 1)   # as the model makes it
        q_pe = torch.randn(n, heads, rope, generator=g).to(torch.bfloat16)
        new_kv = torch.randn(n, kvr + rope, generator=g).to(torch.bfloat16)
        words = -(-nodes // 32)
        meta = TreeAttentionDeviceMetadata(
            query_starts=torch.arange(requests + 1, dtype=torch.int32) * nodes,
            prefix_lens=torch.full((requests,), width * page - nodes, dtype=torch.int32).clamp(min=0),
            page_table=torch.zeros(requests, width, dtype=torch.int32),
            ancestor_bits=torch.zeros(n, words, dtype=torch.int32), max_nodes=nodes)
        hop.tree_mla_hopper(q_latent, q_pe, cache, new_kv, meta, 0.1)
    served = keys()
    assert served == warm, (served - warm, warm - served)
    assert {k[0] for k in warm} == {"64-row", "few-row"}


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["hopper", "triton"])
def test_the_served_kernels_match_the_reference_on_the_gpu(backend: str) -> None:
    """On a GPU: the kernel served there against the float32 reference on bf16 inputs, outputs
    NaN-poisoned, at the bench's awkward shapes (page sizes 1 / 16 / 64, prefixes 0 to 16384,
    trees 1 to 129 nodes, 8 to 128 heads, K2's and the demo's dims, pages not back to back), each
    with the default split count, 1 and 3; and graph replay equal to eager."""
    if backend == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper kernel needs an sm_90 GPU")
    from bench.tree_mla_bench import check_correctness

    rows = check_correctness([], backend)
    for row in rows[:-1]:
        assert row["finite"] and row["rel_err"] < 4e-3, row   # bf16 inputs: 1.1e-3 to 2.1e-3 on an H200
    assert rows[-1]["graph_equals_eager"] and rows[-1]["dense_sdpa_rel_err"] < 4e-3
