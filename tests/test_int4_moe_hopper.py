"""The Hopper (Gluon) INT4 MoE GEMM off the GPU: its K order, its routing, and a build for sm_90.

The kernel cannot run here (Gluon has no CPU interpreter); ``bench/int4_moe_bench.py`` checks
every served config against the reference on an H200. What the CPU checks: ``permute_k`` puts
physical column ``32t + 8j + 4i0 + q`` of each 128-block at ``32j + 8q + 2t + i0`` (the order in
which the kernel's threads hold the dequantised weights), so a product over permuted columns equals
the plain one; which launches it takes; and the kernel still compiles for
sm_90 on the installed Triton with its layout conversions register-only (``assert_trivial``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import int4_moe_hopper as hop
from services.common.int4 import pack_int4
from tests.compiled import build_main, build_result, run_compiled_batch
from tests.selection import selected_params

# ``permute_k`` (a Triton kernel, not Gluon): compiled on a GPU, the interpreter on the CPU. Inputs
# made on the CPU go to DEV, results come back (CPU tensors on a GPU machine, where nothing
# interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_permute_k_order() -> None:
    x = torch.arange(2 * 256, dtype=torch.float32).view(2, 256)
    y = hop.permute_k(x.to(DEV)).cpu()
    for blk in range(2):
        for t in range(4):
            for j in range(4):
                for q in range(4):
                    for i0 in range(2):
                        logical, physical = 32 * j + 8 * q + 2 * t + i0, 32 * t + 8 * j + 4 * i0 + q
                        assert y[1, 128 * blk + logical] == x[1, 128 * blk + physical]
    back = y.reshape(2, 2, 4, 4, 4, 2).permute(0, 1, 4, 2, 5, 3).reshape(2, 256)  # the inverse permutation
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="multiple of 128"):
        hop.permute_k(torch.zeros(1, 96))


def test_operand_order_matches_permute_k() -> None:
    """The kernel's nibble-plane join (replayed in torch) puts every weight where permute_k puts
    the activation it multiplies."""
    from services.common.int4 import unpack_int4

    wq = pack_int4(torch.randn(32, 128), 32, torch.float32)
    planes = [((wq.packed >> (4 * i)) & 0xF).float() - 8 for i in range(8)]  # nibble i of every word
    dense = unpack_int4(wq.packed, torch.ones_like(wq.scale), (32, 128)).float()  # n - 8 in column order
    torch.testing.assert_close(hop.planes_to_operand(planes), hop.permute_k(dense.to(DEV)).cpu(), rtol=0, atol=0)


def test_supported_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off sm_90 nothing goes to the Gluon kernel; on it (faked here), only what it was built for."""
    from kernels import int4_moe as km

    wq = pack_int4(torch.randn(128, 256), 32, torch.bfloat16)
    stack = lambda w: type(w)(packed=w.packed[None], scale=w.scale[None], shape=w.shape)  # noqa: E731
    w = stack(wq)
    x = torch.randn(4, 256).to(torch.bfloat16)
    assert not hop.available(x.device) and not hop.supported(x, w.packed, w.scale, 32, 64)
    monkeypatch.setattr(hop, "available", lambda device: True)
    assert hop.supported(x, w.packed, w.scale, 32, 64) and hop.supported(x, w.packed, w.scale, 32, 128)
    assert not hop.supported(x.half(), w.packed, w.scale, 32, 64)  # bf16 activations only
    assert not hop.supported(x, w.packed, w.scale.half(), 32, 64)  # bf16 scales only
    assert not hop.supported(x, w.packed, w.scale, 64, 64)  # group 32 only
    assert not hop.supported(x, w.packed, w.scale, 32, 256)  # 64- or 128-row tiles
    w96 = stack(pack_int4(torch.randn(96, 256), 32, torch.bfloat16))
    assert not hop.supported(x, w96.packed, w96.scale, 32, 64)  # rows a multiple of the tile
    w160 = stack(pack_int4(torch.randn(128, 160), 32, torch.bfloat16))
    assert not hop.supported(x[:, :160], w160.packed, w160.scale, 32, 64)  # K a multiple of 128
    cfg = km.Int4MoEConfig()
    assert km._use_hopper(cfg, x, w, 32, 64)
    assert not km._use_hopper(dataclasses.replace(cfg, hopper=False), x, w, 32, 64)
    assert not km._use_hopper(dataclasses.replace(cfg, swap_ab=False), x, w, 32, 64)


def test_tma_words_only_where_rows_are_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TMA weight path takes the experts' words as rows ``[E * N, K/8]``; weights that are not
    laid out so (a view of every other expert, say) go by cp.async instead of failing."""
    from kernels import int4_moe as km
    from services.common.int4 import Int4Weight

    # On DEV, as a GPU caller holds them: int4_moe_gate_up runs hop.permute_k on x before the (faked) gemm.
    words = torch.randint(-(2**31), 2**31 - 1, (4, 128, 32), dtype=torch.int32).to(DEV)  # [E, N, K/8], K = 256
    assert hop.tma_words_ok(words)
    assert not hop.tma_words_ok(words[::2])  # experts not back to back
    assert not hop.tma_words_ok(words[:, :, :30])  # rows not back to back
    assert not hop.tma_words_ok(torch.zeros(4, 128, 2, dtype=torch.int32))  # a row of 8 bytes: under TMA's 16

    seen = []
    monkeypatch.setattr(km, "_use_hopper", lambda *args: True)
    monkeypatch.setattr(hop, "gemm", lambda *args, **kw: seen.append(kw["w_tma"]))
    scale = torch.rand(4, 128, 8).to(torch.bfloat16).to(DEV)
    align = km.MoEAlignment(sorted_ids=torch.zeros(16, dtype=torch.int32).to(DEV),
                            block_expert=torch.zeros(1, dtype=torch.int32).to(DEV), block_m=16)
    x = torch.randn(2, 256).to(torch.bfloat16).to(DEV)
    cfg = km.Int4MoEConfig(block_m=16, gu_block_n=64)
    for packed, want in ((words, True), (words[::2].clone(), True), (torch.cat([words, words], 2)[:, :, :32], False)):
        w = Int4Weight(packed=packed, scale=scale[: packed.shape[0]], shape=(128, 256))
        km.int4_moe_gate_up(x, w, w, align, 8, cfg)
        km.int4_moe_gate_up(x, w, w, align, 8, dataclasses.replace(cfg, hp_gu_tma=False))
        assert seen[-2:] == [want, False], (packed.is_contiguous(), seen)


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize("experts,intermediate,top_k", [(16, 256, 4), (384, 256, 8), (48, 2048, 8)])
def test_every_prefill_chunk_takes_a_config_some_graph_bucket_compiles(
        monkeypatch: pytest.MonkeyPatch, hopper: bool, experts: int, intermediate: int, top_k: int) -> None:
    """A prefill chunk of any length (one routing group) takes a MoE config that a verify bucket's
    step (batch x nodes tokens, a group a request) also takes, so the verifier's start-up, which
    captures every bucket (``VerifyGraphs.capture_buckets``), has compiled it: no prompt compiles
    the MoE while the replica's requests wait. The demo's, K2 TP8's and K2 EP8's dims, both tables;
    the warm-up's verify-step buckets alone miss some on the Triton table."""
    from kernels import int4_moe as km
    from services.common.settings import VerifierSettings
    from services.verifier.graphs import BATCH_BUCKETS, NODE_BUCKETS

    monkeypatch.setattr(km, "_hopper_here", lambda: hopper)
    monkeypatch.delenv(km.CONFIG_ENV, raising=False)
    hidden = 7168

    def config(tokens: int, groups: int) -> km.Int4MoEConfig:
        return km.choose_config(tokens, experts, hidden, intermediate, top_k, routing_groups=groups)

    compiled = {config(b * t, b) for b in BATCH_BUCKETS for t in NODE_BUCKETS}
    missing = {n: config(n, 1) for n in range(1, VerifierSettings().prefill_chunk + 1) if config(n, 1) not in compiled}
    assert not missing, missing


def test_choose_config_on_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Gluon kernels run, the table changes (measured on an H200): the GEMV keeps up to
    five tokens of a TP-style shape, whole-expert shapes never take it, every tensor-core
    launch puts the weights on the MMA's M side in tiles the Gluon kernel takes, and TP-style
    down GEMMs stream several tiles a CTA."""
    from kernels import int4_moe as km

    monkeypatch.setattr(km, "_hopper_here", lambda: True)
    gemv = {(m, e, i): km.choose_config(m, e, 7168, i, 8).gemv for m, e, i in ((1, 384, 256), (5, 384, 256), (6, 384, 256), (1, 48, 2048))}
    assert gemv == {(1, 384, 256): True, (5, 384, 256): True, (6, 384, 256): False, (1, 48, 2048): False}, gemv
    for m, e, i in ((1, 384, 256), (72, 384, 256), (1152, 384, 256), (9, 48, 2048), (72, 48, 2048), (1152, 48, 2048)):
        cfg = dataclasses.replace(km.choose_config(m, e, 7168, i, 8), gemv=False)
        assert cfg.swap_ab and cfg.gu_block_n in (64, 128) and cfg.dn_block_n in (64, 128), cfg.spec()
        assert cfg.dn_warps == cfg.dn_block_n // 16, cfg.spec()
        # TP-style down GEMMs (K = 256: two steps) stream 8 tiles a CTA; whole experts one
        assert cfg.hp_dn_tiles == (8 if i < 1024 else 1), cfg.spec()
        # gate/up weights by TMA everywhere; down weights only on whole experts' 128-row tiles at large M
        assert cfg.hp_gu_tma and cfg.hp_dn_tma == (i >= 1024 and m * 8 / e > 32), cfg.spec()
        # block_m 32 gate/up capped at 128 registers (four CTAs an SM); the others uncapped
        assert cfg.hp_gu_regs == (128 if cfg.block_m == 32 else 0), cfg.spec()
    # gate/up K slices at TP8: up to one row an expert 4 (8 below half a row for a tree's tokens,
    # which share experts), up to two rows 2, then none
    splits = {(m, g): km.choose_config(m, 384, 7168, 256, 8, routing_groups=g).gu_split_k
              for m, g in ((9, 9), (9, 1), (23, 23), (23, 1), (24, 1), (48, 48), (49, 1), (96, 8), (97, 1), (288, 1))}
    assert splits == {(9, 9): 4, (9, 1): 8, (23, 23): 4, (23, 1): 8, (24, 1): 4, (48, 48): 4, (49, 1): 2, (96, 8): 2,
                      (97, 1): 1, (288, 1): 1}, splits
    # whole experts (EP8): 2 slices below half a row an expert, then none
    ep_splits = {m: km.choose_config(m, 48, 7168, 2048, 8).gu_split_k for m in (1, 2, 3, 9, 72)}
    assert ep_splits == {1: 2, 2: 2, 3: 1, 9: 1, 72: 1}, ep_splits
    # 8 slices: many short CTAs, capped at 112 registers so that more share an SM
    assert km.choose_config(17, 384, 7168, 256, 8, routing_groups=1).hp_gu_regs == 112
    assert km.choose_config(17, 384, 7168, 256, 8, routing_groups=17).hp_gu_regs == 0
    monkeypatch.setattr(km, "_hopper_here", lambda: False)
    assert km.choose_config(1152, 48, 7168, 2048, 8).swap_ab is False  # other GPUs keep the Triton table
    with pytest.raises(AssertionError, match="atomic"):
        km.Int4MoEConfig(reduce="atomic", dn_block_n=256)
    with pytest.raises(AssertionError, match="gu_split_k"):
        km.Int4MoEConfig(gu_split_k=2, gu_block_n=256)


def test_stream_plan() -> None:
    """Resident activations and 256-wide ring slots only where they were measured to pay and fit."""
    assert hop.stream_plan(256, 256, 16, 8, 2) == (2, 2)  # K2 TP8 down, 8 tiles: resident, two steps a slot
    assert hop.stream_plan(256, 256, 16, 1, 2) == (0, 1)  # one tile a CTA: the ring as before
    assert hop.stream_plan(7168, 3584, 16, 1, 2) == (0, 1)  # split-K gate/up: never resident
    assert hop.stream_plan(384, 384, 16, 8, 2) == (3, 1)  # an odd number of steps keeps 128-wide slots
    assert hop.stream_plan(2048, 2048, 16, 8, 2) == (0, 1)  # K2 EP8 down: 64 KB would not fit
    assert hop.stream_plan(2048, 2048, 16, 8, 2, resident=False, sub=2) == (0, 2)
    with pytest.raises(AssertionError, match="resident"):
        hop.stream_plan(2048, 2048, 16, 8, 2, resident=True)
    with pytest.raises(AssertionError, match="multiples of 256"):
        hop.stream_plan(384, 384, 16, 1, 2, sub=2)


def _build(gated: bool, block_m: int, block_n: int, split_k: int, n_tiles: int, k_resident: int, sub: int,
           w_tma: bool = False) -> dict:
    """Compile one launch for sm_90 (run without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = hop._moe_gemm_hopper_kernel
    layouts = hop._layouts(block_m, block_n, block_n // 16, gated, w_tma)
    desc = f"tensordesc<i32[{block_n}, 16],{layouts['W_SMEM']!r}>" if w_tma else "*i32"
    ptrs = {"a_ptr": "*bf16", "w0_desc": desc, "w1_desc": desc, "w0_ptr": "*i32", "s0_ptr": "*bf16", "w1_ptr": "*i32", "s1_ptr": "*bf16",
            "out_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32", "sorted_ids_ptr": "*i32",
            "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32"}
    ints = ("N", "K", "A", "top_k", "num_m_blocks", "k_split", "stride_am", "stride_we", "stride_wn", "stride_se",
            "stride_sn", "stride_om", "stride_ws")
    names = [n for n in kernel.arg_names if n in ptrs or n in ints]
    assert len(names) == len(ptrs) + len(ints), f"kernel arguments changed: {kernel.arg_names}"
    warps = block_n // 16
    constexprs = dict(GATED=gated, ATOMIC=False, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split_k, STAGES=2,
                      N_TILES=n_tiles, K_RESIDENT=k_resident, SUB=sub, K_ORDER=gated,
                      W_TMA=w_tma, **layouts, PDL=True, num_warps=warps)
    signature = {n: ptrs.get(n, "i32") for n in names} | {k: "constexpr" for k in constexprs}
    aligned = [n for n in names if (n in ptrs and not n.endswith("_desc"))
               or n in ("N", "K", "k_split", "stride_am", "stride_we", "stride_wn", "stride_om", "stride_ws")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # scale strides: K2 TP8 down has 8
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = compiled.asm["ptx"]
    return dict(cubin_bytes=len(compiled.asm["cubin"]), wgmma=ptx.count("wgmma.mma_async"), st_shared=ptx.count("st.shared"),
                st_b16=ptx.count("st.global.b16"), st_v4=ptx.count("st.global.v4.b32"), shared=compiled.metadata.shared,
                tma=ptx.count("cp.async.bulk.tensor"), cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                gdc_wait=ptx.count("griddepcontrol.wait"))


BUILD_PARAMS = ("gated", "block_m", "block_n", "split_k", "n_tiles", "k_resident", "sub", "w_tma")


def _build_args(gated: bool, block_m: int, block_n: int, split_k: int, n_tiles: int, k_resident: int, sub: int,
                w_tma: bool) -> list[str]:
    return [str(int(gated)), str(block_m), str(block_n), str(split_k), str(n_tiles), str(k_resident), str(sub), str(int(w_tma))]


@pytest.fixture(scope="module")
def builds(request) -> dict:
    """Every selected launch of ``test_kernel_builds_for_sm90``, built in two child processes side by
    side (each pays torch's and Triton's start-up once, not once a launch)."""
    params = selected_params(request, "test_kernel_builds_for_sm90")
    return run_compiled_batch(__file__, [_build_args(**{k: p[k] for k in BUILD_PARAMS}) for p in params])


@pytest.mark.skipif(hop.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize(",".join(BUILD_PARAMS),
                         [(True, 16, 64, 4, 1, 0, 1, True), (True, 32, 64, 1, 1, 0, 1, True), (True, 64, 64, 1, 1, 0, 1, False),
                          (False, 16, 128, 1, 1, 0, 1, False), (False, 32, 64, 1, 8, 2, 2, False), (False, 64, 128, 1, 1, 0, 1, True)])
def test_kernel_builds_for_sm90(builds: dict, gated: bool, block_m: int, block_n: int, split_k: int, n_tiles: int, k_resident: int,
                                sub: int, w_tma: bool) -> None:
    """The served K2 launches compile and their products are wgmma. Gate/up: no st.shared but the
    split's tile counter (no dequantised tile goes through shared memory; only cp.async and TMA
    write it). Down: its
    output leaves in 16-byte stores (the epilogue's one trip through shared memory), none of 2
    bytes. ``w_tma``: the weight words come by TMA (bulk tensor copies) and only the activations
    and scales by cp.async; else every copy is cp.async. A child process: conftest sets
    TRITON_INTERPRET for this one, and the interpreter cannot compile Gluon (the ``builds`` fixture)."""
    built = build_result(builds, _build_args(gated, block_m, block_n, split_k, n_tiles, k_resident, sub, w_tma))
    assert built["cubin_bytes"] > 0 and built["wgmma"] > 0, built
    assert built["gdc_wait"] == 1, built  # launched with PDL (kernels.pdl): it waits for its predecessor
    if gated:  # split over K, one 4-byte store: the tile counter's old value, from the one thread that added
        assert built["st_shared"] == (split_k > 1), f"the weight tile went through shared memory: {built}"
    else:
        assert built["st_v4"] > 0 and built["st_b16"] == 0, f"the down output is not written in 16-byte stores: {built}"
    assert (built["tma"] > 0) == w_tma, f"TMA copies: {built}"
    assert built["cp_async"] > 0, built  # scales (and activations) always
    assert 0 < built["shared"] <= 232448, built


def _build_from_args(args: list[str]) -> dict:
    g, bm, bn, sk, nt, kr, sub, wt = args
    return _build(bool(int(g)), int(bm), int(bn), int(sk), int(nt), int(kr), int(sub), bool(int(wt)))


if __name__ == "__main__":
    build_main(_build_from_args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", ["tp8", "ep8", "ep8-k2"])
def test_the_served_fused_moe_matches_the_reference_on_the_gpu(shape: str) -> None:
    """On a GPU: the fused MoE the verifier serves (``choose_config``'s path at each M: the Gluon
    kernels on an H100 / H200) against dequantise-then-matmul in float32, at Kimi-K2's per-rank
    shapes, random INT4 words, scales and routings, outputs NaN-poisoned."""
    from bench.int4_moe_bench import GROUP, SHAPES, k2_ep_routing, rand_int4_stack, rand_routing, rel_errs
    from kernels.int4_moe import fused_int4_moe, int4_moe_reference

    sh = SHAPES[shape]
    E, K, inter, k = sh["experts"], sh["hidden"], sh["inter"], sh["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(5)
    wg, wu, wd = (rand_int4_stack(E, inter, K, "cuda", gen), rand_int4_stack(E, inter, K, "cuda", gen),
                  rand_int4_stack(E, K, inter, "cuda", gen))
    real_empty = torch.empty
    for M in (1, 9, 72, 288):
        x = (torch.randn(M, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        if "global_experts" in sh:   # this rank's rows of K2's routing, one assignment each
            x, ids, weights = k2_ep_routing(x, sh["global_experts"], E, k, gen)
        else:
            ids, weights = rand_routing(M, E, k, "cuda", gen)   # k distinct experts a token
        want = int4_moe_reference(x, wg, wu, wd, ids, weights, GROUP, compute_dtype=torch.float32)
        torch.empty = lambda *a, **kw: _poisoned(real_empty(*a, **kw))   # an unwritten output element shows
        try:
            got = fused_int4_moe(x, wg, wu, wd, ids, weights, GROUP)
        finally:
            torch.empty = real_empty
        assert torch.isfinite(got).all(), (shape, M)
        rel, max_rel = rel_errs(got, want)
        assert rel < 6e-3 and max_rel < 2e-2, (shape, M, rel, max_rel)   # an H200: 2.5e-3 to 3.2e-3, at most 6.8e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_scales_dequantise_exactly_on_the_gpu() -> None:
    """Compiled (the CPU tests interpret it): float32 scales take `_dequant_int4_exact`, so a zero
    nibble is 0 (the one-FMA constants rounded for them: a gate of zeros gave outputs near 1e-6),
    and random words match the reference, at M = 1 (GEMV) and 72 (tensor cores)."""
    from bench.int4_moe_bench import GROUP, rand_routing, rel_errs
    from kernels.int4_moe import fused_int4_moe, int4_moe_reference
    from services.common.int4 import Int4Weight

    E, K, inter, k = 8, 512, 256, 2
    gen = torch.Generator(device="cuda").manual_seed(11)

    def stack(out_f: int, in_f: int, words: torch.Tensor | None = None) -> Int4Weight:
        packed = words if words is not None else torch.randint(
            -(2**31), 2**31 - 1, (E, out_f, in_f // 8), dtype=torch.int32, device="cuda", generator=gen)
        scale = torch.rand(E, out_f, in_f // GROUP, device="cuda", generator=gen) * 0.02 + 0.004   # float32
        return Int4Weight(packed=packed, scale=scale, shape=(out_f, in_f))

    zeros = torch.full((E, inter, K // 8), 0x88888888 - 2**32, dtype=torch.int32, device="cuda")   # nibbles of 8
    wz, wg, wu, wd = stack(inter, K, zeros), stack(inter, K), stack(inter, K), stack(K, inter)
    for M in (1, 72):
        x = (torch.randn(M, K, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        ids, weights = rand_routing(M, E, k, "cuda", gen)
        assert fused_int4_moe(x, wz, wu, wd, ids, weights, GROUP).abs().max().item() == 0.0, M
        want = int4_moe_reference(x, wg, wu, wd, ids, weights, GROUP, compute_dtype=torch.float32)
        got = fused_int4_moe(x, wg, wu, wd, ids, weights, GROUP)
        rel, max_rel = rel_errs(got, want)
        assert torch.isfinite(got).all() and rel < 6e-3 and max_rel < 2e-2, (M, rel, max_rel)


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    """A new float tensor full of NaN (index and count buffers as they come)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


def test_the_bench_k2_ep_routing_keeps_this_ranks_assignments_as_rows() -> None:
    """bench/int4_moe_bench.py's "ep8-k2" point: each token picks 8 of 384 experts, and the rank
    holding experts 0..47 gets exactly its assignments, a row each, with their tokens and weights."""
    from bench.int4_moe_bench import k2_ep_routing, rand_routing

    x = torch.randn(300, 16)
    gen = torch.Generator().manual_seed(3)
    rows, ids, w = k2_ep_routing(x, 384, 48, 8, gen)
    g_ids, g_w = rand_routing(300, 384, 8, "cpu", torch.Generator().manual_seed(3))   # the same draw
    tok, slot = (g_ids < 48).nonzero(as_tuple=True)
    assert ids.shape == w.shape == (len(tok), 1) and rows.shape == (len(tok), 16)
    assert 0 < len(tok) < 300 * 8 and int(ids.max()) < 48
    assert torch.equal(rows, x[tok]) and torch.equal(ids[:, 0], g_ids[tok, slot]) and torch.equal(w[:, 0], g_w[tok, slot])
    assert abs(len(tok) - 300) < 100   # about one assignment a token lands on one rank of eight
