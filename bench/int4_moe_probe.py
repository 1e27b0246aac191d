"""Probe for the INT4 MoE gate/up GEMM: is it bound by its access pattern, its ALU work, or neither?

``python bench/int4_moe_probe.py`` reads the packed weights of 298 random K2-TP8 experts (the
experts one M=72 step touches) in the kernel's tile pattern, once with loads alone (mode 0) and
once with a dequantisation-sized ALU chain (mode 1), and prints GB/s. On the H200 (2026-11-29):
3.5-4.2 TB/s for every tile shape with loads alone, i.e. the pattern is not the limit.
``ncu ... python bench/int4_moe_probe.py ncu`` runs one gate/up call for Nsight Compute.
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.int4_moe import Int4MoEConfig, int4_moe_align, int4_moe_gate_up  # noqa: E402


@triton.jit
def _read_tiles(w_ptr, out_ptr, experts_ptr, N, KW, stride_we, stride_wn, n_tiles,
                BN: tl.constexpr, BKW: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    e = tl.load(experts_ptr + pid // n_tiles).to(tl.int64)
    pn = pid % n_tiles
    rows = pn * BN + tl.arange(0, BN)
    base = w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    for k0 in range(0, KW, BKW):
        p = tl.load(base + k0 + tl.arange(0, BKW)[None, :])
        if MODE == 0:
            acc ^= p
        else:  # fp32 dequant-like ALU work without MMA
            v = ((p & 0xF0000) | 0x3F800000).to(tl.float32, bitcast=True)
            acc ^= (v * 3.0 + 1.0).to(tl.int32, bitcast=True)
    tl.store(out_ptr + pid * BN + tl.arange(0, BN), tl.sum(acc, 1))


def gtime(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / 4)
    return statistics.median(ts)


def main():
    dev = "cuda"
    E, N, K = 384, 256, 7168
    KW = K // 8
    w = torch.randint(-2**31, 2**31 - 1, (E, N, KW), dtype=torch.int32, device=dev)
    used = torch.randperm(E, device=dev)[:298].to(torch.int32)  # ~ TP8 M=72
    for BN, BKW, warps, stages in [(64, 16, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (32, 32, 4, 4), (128, 16, 4, 3), (16, 64, 4, 4), (64, 16, 4, 6), (64, 32, 8, 4)]:
        n_tiles = N // BN
        out = torch.empty(298 * N, dtype=torch.int32, device=dev)
        for mode in (0, 1):
            f = lambda: _read_tiles[(298 * n_tiles,)](w, out, used, N, KW, w.stride(0), w.stride(1), n_tiles, BN=BN, BKW=BKW, MODE=mode, num_warps=warps, num_stages=stages)
            t = gtime(f)
            gb = 298 * N * KW * 4 / (t * 1e-6) / 1e9
            print(f"read BN={BN:4d} BK={BKW*8:4d} ({BKW*4:4d} B/row) w={warps} s={stages} mode={mode}: {t:8.1f} us {gb:7.0f} GB/s", flush=True)
    # contiguous reference over the same bytes: xor of the two halves (reads all, writes half)
    flat = w[:298].reshape(-1)
    half = flat.numel() // 2
    t = gtime(lambda: torch.bitwise_xor(flat[:half], flat[half:]))
    print(f"contiguous xor of halves: {t:.1f} us  {(flat.numel() * 4 * 1.5) / (t * 1e-6) / 1e9:.0f} GB/s (read + write)")


def one_gate_up():
    dev = "cuda"
    E, N, K, k, M = 384, 256, 7168, 8, 72
    from services.common.int4 import Int4Weight
    mk = lambda: Int4Weight(torch.randint(-2**31, 2**31 - 1, (E, N, K // 8), dtype=torch.int32, device=dev),
                            (torch.rand(E, N, K // 32, device=dev) * 0.01 + 0.002).to(torch.bfloat16), (N, K))
    wg, wu = mk(), mk()
    x = torch.randn(M, K, device=dev).to(torch.bfloat16)
    ids = torch.rand(M, E, device=dev).topk(k, -1).indices
    cfg = Int4MoEConfig(block_m=16, gu_block_n=64, gu_block_k=128, gu_warps=4, gu_stages=3, swap_ab=True)
    a = int4_moe_align(ids, E, 16)
    for _ in range(3):
        int4_moe_gate_up(x, wg, wu, a, k, cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    one_gate_up() if sys.argv[1:] == ["ncu"] else main()
