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

__all__ = ["SmallAllReduce", "fusable"]

log = get_logger("verifier")


def fusable(x: torch.Tensor) -> bool:
    """Whether the one-launch copy-in all-reduce takes `x` as it is: contiguous, and its start as
    aligned as the buffer's (torch refuses a local input whose alignment differs from the buffer
    slice's, which starts on 16 bytes)."""
    return x.is_contiguous() and (x.storage_offset() * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0


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
        self.fused, self.fused_reason = True, ""   # the one-launch path, for tensors aligned as the buffer
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
            # Agreed before the check runs it: a rank without the op while another's kernel waits
            # for it at the ranks' barrier would hang both.
            if not self._agreed(callable(getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)), device):
                self.fused, self.fused_reason = False, "this torch (on some rank) has no one_shot_all_reduce_copy_out"
            try:
                self.fused_reason = self._check() or self.fused_reason
            except Exception as exc:  # noqa: BLE001
                self.reason = f"{type(exc).__name__}: {exc}"
            if not self._agreed(not self.reason, device):
                self._buf = None
            elif self.fused and not self._agreed(not self.fused_reason, device):   # the copying path stays
                self.fused = False
                self.fused_reason = self.fused_reason or "another rank cannot use the one-launch path"
        self.reason = self.reason or ("" if self._buf is not None else "another rank cannot use the one-shot path")
        log.info("small_allreduce", one_shot=self._buf is not None, max_bytes=max_bytes,
                 fallback_reason=self.reason or None, one_launch=self.one_shot and self.fused,
                 one_launch_off_reason=self.fused_reason or None)

    def _agreed(self, ok: bool, device: torch.device | str) -> bool:
        """True when `ok` holds on every rank (a MIN over the group through the default backend)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    @property
    def one_shot(self) -> bool:
        return self._buf is not None

    def _check(self) -> str:
        """The one-shot result must equal NCCL's on fresh random data, or it is not used: raises
        where the copying path fails; returns why the one-launch path cannot be used ("" where it
        can). Both run on every rank before anything is judged: the collectives must pair up
        (torch refuses a call, as the one-launch op may, alike on every rank: by shapes and
        alignment, before any launch)."""
        n = min(4096, self._buf.numel())
        gen = torch.Generator(device=self._buf.device).manual_seed(1234 + dist.get_rank(self.group))
        x = torch.randn(n + 1, device=self._buf.device, generator=gen).to(self.dtype)
        fused_error, copying_error = "", ""
        for t in (x[:n].clone(), x.clone()[1:]):   # one launch, then (its start 1 element in) copied
            want = t.float().clone()   # a float32 `t`'s .float() is `t` itself, summed in place below
            dist.all_reduce(want, group=self.group)
            fused = self.fused and fusable(t)
            try:
                got = self._one_shot(t).float()
            except Exception as exc:  # noqa: BLE001 - the one-launch op refused: the copying path may still do
                if not fused:
                    raise
                fused_error = f"{type(exc).__name__}: {exc}"
                continue
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                error = (f"one-shot all-reduce ({'one-launch' if fused else 'copying'}) disagrees with NCCL "
                         f"(max err {(got - want).abs().max():.3g})")
                if fused:
                    fused_error = error
                else:
                    copying_error = error
        if copying_error:
            raise RuntimeError(copying_error)
        return fused_error

    def _one_shot(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._buf[:x.numel()]
        if self.fused and fusable(x):
            # One launch: each thread copies its elements of `x` into this rank's buffer, the ranks
            # meet, and the same thread writes their sum back over those elements (read before
            # written, so `x` may be both input and output). Three launches (copy in, all-reduce,
            # copy out) took 8.3-10.6 us in a graph where the all-reduce alone took 6.4-7.7 (BENCHMARKS.md).
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x.view(-1), "sum", self._group_name, x.view(-1))
            return x
        buf.copy_(x.reshape(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self._group_name)
        x.copy_(out.view_as(x))
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._buf is not None and x.dtype == self.dtype and x.numel() * x.element_size() <= self.max_bytes:
            return self._one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x
