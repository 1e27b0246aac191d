"""Small-message all-reduce through peer-mapped GPU buffers, with NCCL as the fallback.

At batch 1 a verify step does two all-reduces per layer of a few KB each; NCCL spends ~35 us per
call there (eager, 2xH200). torch's symmetric-memory one-shot all-reduce reads every peer's buffer
directly over NVLink. It is a private torch API, so it sits behind this one class, is checked
against NCCL at start-up, and anything missing or wrong falls back to NCCL. Multicast (NVLS) is
never used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.common.logging import get_logger

__all__ = ["SmallAllReduce"]

log = get_logger("verifier")


class SmallAllReduce:
    """Sums `x` across the group in place; one-shot through symmetric memory up to `max_bytes`."""

    def __init__(self, max_bytes: int = 256 << 10, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", group: dist.ProcessGroup | None = None) -> None:
        self.max_bytes = max_bytes
        self.group = group or dist.group.WORLD
        self.dtype = dtype
        self._buf: torch.Tensor | None = None
        self._group_name = self.group.group_name
        self.reason = ""
        # Every rank must take the same path for every call, or the ranks' collectives no longer
        # pair up (a hang, or sums of unrelated tensors): each phase's outcome is agreed on by
        # all ranks before the next, and any rank's failure sends all of them to NCCL.
        buf = None
        try:
            import torch.distributed._symmetric_memory as symm_mem
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self._group_name)
            buf = symm_mem.empty(max_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self._group_name)
        except Exception as exc:  # noqa: BLE001 - any failure of the private API means NCCL
            buf, self.reason = None, f"{type(exc).__name__}: {exc}"
        if self._agreed(buf is not None, device):
            self._buf = buf
            try:
                self._check()
            except Exception as exc:  # noqa: BLE001
                self.reason = f"{type(exc).__name__}: {exc}"
            if not self._agreed(not self.reason, device):
                self._buf = None
        self.reason = self.reason or ("" if self._buf is not None else "another rank cannot use the one-shot path")
        log.info("small_allreduce", one_shot=self._buf is not None, max_bytes=max_bytes,
                 fallback_reason=self.reason or None)

    def _agreed(self, ok: bool, device: torch.device | str) -> bool:
        """True when `ok` holds on every rank (a MIN over the group through the default backend)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    @property
    def one_shot(self) -> bool:
        return self._buf is not None

    def _check(self) -> None:
        """The one-shot result must equal NCCL's on fresh random data, or it is not used."""
        n = min(4096, self._buf.numel())
        gen = torch.Generator(device=self._buf.device).manual_seed(1234 + dist.get_rank(self.group))
        x = torch.randn(n, device=self._buf.device, generator=gen).to(self.dtype)
        want = x.float().clone()
        dist.all_reduce(want, group=self.group)
        got = self._one_shot(x.clone()).float()
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            raise RuntimeError(f"one-shot all-reduce disagrees with NCCL (max err {(got - want).abs().max():.3g})")

    def _one_shot(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        buf = self._buf[:flat.numel()]
        buf.copy_(flat)
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self._group_name)
        x.copy_(out.view_as(x))
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._buf is not None and x.dtype == self.dtype and x.numel() * x.element_size() <= self.max_bytes:
            return self._one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x
