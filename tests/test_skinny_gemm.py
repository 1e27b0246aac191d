"""The few-row GEMM kernel (``kernels/skinny_gemm.py``), compiled on a GPU and under the Triton
interpreter on the CPU, against float64 torch: plain, batched and strided operands, written into a
view, added in place, K split over programs (whose partials the last program adds in a fixed order),
odd sizes."""

from __future__ import annotations

import pytest
import torch

from kernels import skinny_gemm as sg
from kernels.device import tile_counters

# The compiled kernel on a GPU, the interpreter on the CPU: inputs made on the CPU go to DEV, results
# come back (CPU tensors on a GPU machine, where nothing interprets, reached no kernel).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` (on DEV or the CPU) against the CPU float64 ``want``."""
    err = (got.cpu().double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 1e-2 * scale + 1e-2, f"max error {err} against max {scale}"


@pytest.mark.parametrize("m,n,k,plan", [
    (1, 40, 300, None), (5, 70, 1100, (16, 128, 4)), (17, 33, 130, (32, 128, 1)), (64, 48, 520, (16, 256, 2)),
    (3, 130, 2048, None), (40, 64, 600, (64, 256, 2, 4, 4)),
])
def test_matches_torch(m: int, n: int, k: int, plan: tuple | None) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    got = sg.skinny_linear_triton(x.to(DEV), w.to(DEV), plan=plan).cpu()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _close(got, x.double() @ w.double().T)


def test_split_k_is_deterministic_and_leaves_counters_at_zero() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2048, generator=g).half()
    w = torch.randn(64, 2048, generator=g).half()
    xd, wd = x.to(DEV), w.to(DEV)
    a = sg.skinny_linear_triton(xd, wd, plan=(16, 128, 8))
    b = sg.skinny_linear_triton(xd, wd, plan=(16, 128, 8))
    assert torch.equal(a, b)
    _close(a.cpu(), x.double() @ w.double().T)
    assert int(tile_counters(xd.device).abs().sum()) == 0


def test_batched_strided_views_and_out() -> None:
    """The attention's two per-head products: q_nope [N, H, nope] (a strided view) times w_uk [H,
    nope, kvr] read through its transpose, and latent [N, H, kvr] times w_uv^T written into the
    [H, N, v] view of an [N, H, v] output."""
    g = torch.Generator().manual_seed(2)
    N, H, nope, kvr, v = 3, 4, 32, 64, 16
    q = torch.randn(N, H, nope + 8, generator=g).bfloat16()
    w_uk = torch.randn(H, nope, kvr, generator=g).bfloat16()
    x = q[..., :nope].transpose(0, 1)  # [H, N, nope], strided
    q_d, w_uk_d = q.to(DEV), w_uk.to(DEV)  # the views are taken on DEV (.to of a view would pack it)
    got = sg.skinny_linear_triton(q_d[..., :nope].transpose(0, 1), w_uk_d.transpose(1, 2))
    _close(got.cpu(), x.double() @ w_uk.double())
    latent = torch.randn(N, H, kvr, generator=g).bfloat16()
    w_uv = torch.randn(H, v, kvr, generator=g).bfloat16()
    out = torch.full((N, H, v), float("nan"), dtype=torch.bfloat16, device=DEV)
    sg.skinny_linear_triton(latent.to(DEV).transpose(0, 1), w_uv.to(DEV), out=out.transpose(0, 1))
    _close(out.transpose(0, 1).cpu(), latent.transpose(0, 1).double() @ w_uv.double().transpose(1, 2))


def test_x_with_a_strided_k_dim_and_a_batched_split_k() -> None:
    """x at any strides (the module's contract): the transpose of a [K, M] tensor, K stride M. And
    a batched product split over K (the batched test above never splits): each batch entry's tiles
    keep counters and partials of their own."""
    g = torch.Generator().manual_seed(41)
    M, N, K = 5, 40, 300
    x = torch.randn(K, M, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    _close(sg.skinny_linear_triton(x.to(DEV).T, w.to(DEV), plan=(16, 128, 2)), x.T.double() @ w.double().T)
    xb = torch.randn(3, 2, 1024, generator=g).bfloat16()
    wb = torch.randn(3, 40, 1024, generator=g).bfloat16()
    _close(sg.skinny_linear_triton(xb.to(DEV), wb.to(DEV), plan=(16, 128, 4)), torch.bmm(xb.double(), wb.double().transpose(1, 2)))


@pytest.mark.parametrize("split", [1, 4])
def test_add_to_in_place(split: int) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1024, generator=g).bfloat16()
    w = torch.randn(50, 1024, generator=g).bfloat16()
    acc = torch.randn(2, 50, generator=g).bfloat16()
    want = acc.double() + x.double() @ w.double().T
    acc = acc.to(DEV)
    got = sg.skinny_linear_triton(x.to(DEV), w.to(DEV), add_to=acc, plan=(16, 256, split))
    assert got.data_ptr() == acc.data_ptr()
    _close(acc.cpu(), want)


def test_refusals_and_dispatch() -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(AssertionError, match="16-bit"):
        sg.skinny_linear_triton(x.float(), torch.randn(8, 64))
    with pytest.raises(AssertionError, match="rows"):
        sg.skinny_linear_triton(torch.randn(sg.KERNEL_ROWS + 1, 64).bfloat16(), torch.randn(8, 64).bfloat16())
    w = torch.randn(8, 64).bfloat16()
    assert torch.equal(sg.skinny_linear(x, w), x @ w.T)  # off CUDA: torch's own product
    if DEV == "cuda":  # on CUDA: the kernel up to MAX_ROWS rows (deterministic: bit for bit), cuBLAS above
        xd, wd = x.to(DEV), w.to(DEV)
        assert torch.equal(sg.skinny_linear(xd, wd), sg.skinny_linear_triton(xd, wd))
        tall = torch.randn(sg.MAX_ROWS + 1, 64).bfloat16().to(DEV)
        assert torch.equal(sg.skinny_linear(tall, wd), tall @ wd.T)


def test_plan_follows_the_sweep() -> None:
    """Kimi-K2's per-rank projections (132 SMs): the plans the H200 sweep found best or within 3%
    of it (``bench/results/skinny_gemm_sweep-4ad5b2d.json``)."""
    plans = {(n, k, b): sg.skinny_plan(n, k, b, 132) for n, k, b in (
        (2112, 7168, 1), (1536, 1536, 1), (512, 7168, 1), (7168, 1024, 1), (7168, 256, 1), (512, 128, 8), (128, 512, 8),
        (20480, 7168, 1))}
    assert plans[(2112, 7168, 1)] == (64, 256, 4, 4, 4)  # q_kv_a
    assert plans[(1536, 1536, 1)] == (64, 256, 4, 4, 4)  # q_b
    assert plans[(512, 7168, 1)] == (64, 256, 8, 4, 4)  # the shared expert's gate/up
    assert plans[(7168, 1024, 1)] == (64, 256, 1, 4, 4)  # o_proj
    assert plans[(7168, 256, 1)] == (64, 128, 1, 4, 4)  # the shared expert's down
    assert plans[(512, 128, 8)] == (64, 128, 1, 4, 4)  # w_uk, 8 heads
    assert plans[(128, 512, 8)] == (16, 256, 1, 4, 4)  # w_uv, 8 heads
    assert plans[(20480, 7168, 1)] == (64, 256, 1, 4, 4)  # lm_head


@pytest.mark.parametrize("n,k", [(256, 512), (576, 7168)])
def test_every_row_count_launches_a_key_some_graph_bucket_launched(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 1..32 tokens (an eager prefill) launches, by compile key, only what a verify
    bucket's step of batch x nodes tokens launched, so the verifier's start-up, which captures
    every bucket (``VerifyGraphs.capture_buckets``), has compiled it. The warm-up's verify-step
    buckets alone (1 / 8 / 64 requests of 1 / 9 / 17 / 33 nodes) never had 16 or 32 rows: on an
    H200 a 16-token prompt then compiled 5-8 kernels, 1.4-3.2 s (bench/results/verify_first_use-*)."""
    from services.verifier.graphs import BATCH_BUCKETS, NODE_BUCKETS
    from tests.launch_keys import Recorder
    recorder = Recorder(sg._skinny_kernel)
    monkeypatch.setattr(sg, "_skinny_kernel", recorder)
    w = torch.randn(n, k).bfloat16()

    def keys(rows: set[int]) -> set[tuple]:
        recorder.keys.clear()
        for m in sorted(rows):
            sg.skinny_linear_triton(torch.randn(m, k).bfloat16(), w)
        return set(recorder.keys)

    buckets = {b * t for b in BATCH_BUCKETS for t in NODE_BUCKETS if b * t <= sg.MAX_ROWS}
    assert keys(set(range(1, sg.MAX_ROWS + 1))) <= keys(buckets)
    warm_only = {b * t for b in (1, 8, 64) for t in (1, 9, 17, 33) if b * t <= sg.MAX_ROWS}
    assert not keys({16, 32}) <= keys(warm_only)
