"""Paged latent KV cache for MLA.

Why paged latent: MLA caches one ``kv_lora_rank + qk_rope_head_dim`` vector per token per layer
(no per-head K/V), and pages let requests grow without copying. The forward pass never writes
here: tree nodes live in scratch (``ForwardOutput.new_kv``) and the engine commits only the
accepted path with ``write``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["OutOfPages", "PagedKVCache"]


class OutOfPages(RuntimeError):
    """Not enough free pages; an admission decision for the caller, nothing was changed."""


class PagedKVCache:
    """Per-layer pages ``kv[layer, page, slot, dim]`` plus per-request page lists."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_seed: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.dim = dim
        self.kv = torch.zeros(num_layers, num_pages, page_size, dim, dtype=dtype, device=device)  # [L, P, ps, D]
        order = list(range(num_pages))
        if shuffle_seed is not None:
            # Tests hand out pages in a scrambled order so page-table indexing bugs show.
            g = torch.Generator().manual_seed(shuffle_seed)
            order = torch.randperm(num_pages, generator=g).tolist()
        self._free: list[int] = order[::-1]  # pop() hands out order[0] first
        self._pages: dict[str, list[int]] = {}

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_needed(self, request_id: str, n_tokens: int) -> int:
        """Extra pages ``reserve(request_id, n_tokens)`` would take (0 when already covered)."""
        have = len(self._pages.get(request_id, ()))
        return max(0, -(-n_tokens // self.page_size) - have)

    def reserve(self, request_id: str, n_tokens: int) -> None:
        """Make ``request_id`` own pages for ``n_tokens`` tokens in total (never shrinks)."""
        need = self.pages_needed(request_id, n_tokens)
        if need > len(self._free):
            raise OutOfPages(f"request {request_id!r} needs {need} more pages for {n_tokens} tokens, {len(self._free)} free")
        pages = self._pages.setdefault(request_id, [])
        for _ in range(need):
            pages.append(self._free.pop())

    def free(self, request_id: str) -> None:
        """Return the request's pages to the free list (no-op for unknown ids)."""
        pages = self._pages.pop(request_id, None)
        if pages:
            self._free.extend(reversed(pages))

    def page_ids(self, request_id: str) -> list[int]:
        """The request's pages in order, on the host (no device tensor per request)."""
        return list(self._pages.get(request_id, ()))

    def page_table(self, request_id: str) -> Tensor:
        return torch.tensor(self._pages.get(request_id, []), dtype=torch.int64, device=self.kv.device)  # [n_pages]

    def reserved_tokens(self, request_id: str) -> int:
        return len(self._pages.get(request_id, ())) * self.page_size

    def _slots(self, request_id: str, start: int, k: int) -> tuple[Tensor, Tensor]:
        if start < 0 or start + k > self.reserved_tokens(request_id):
            raise IndexError(
                f"request {request_id!r}: tokens {start}..{start + k - 1} outside reserved {self.reserved_tokens(request_id)}"
            )
        pos = torch.arange(start, start + k, device=self.kv.device)  # [k]
        pages = self.page_table(request_id)[pos // self.page_size]  # [k]
        return pages, pos % self.page_size

    def write(self, request_id: str, start: int, kv: Tensor) -> None:
        """Store latent kv ``[num_layers, k, dim]`` for tokens ``start .. start+k-1``."""
        assert kv.dim() == 3 and kv.shape[0] == self.num_layers and kv.shape[2] == self.dim, (
            f"kv must be [num_layers={self.num_layers}, k, dim={self.dim}], got {tuple(kv.shape)}"
        )
        pages, slots = self._slots(request_id, start, kv.shape[1])
        self.kv[:, pages, slots] = kv.to(self.kv.dtype)  # [L, k, D]

    def write_many(self, items: list[tuple[str, int, int]], kv: Tensor) -> None:
        """Store ``kv [num_layers, sum(k), dim]`` for ``(request_id, start, k)`` runs, in one scatter."""
        slots = self.slots(items)
        self.write_slots(torch.from_numpy(slots).to(self.kv.device), kv)

    def slots(self, items: list[tuple[str, int, int]]) -> np.ndarray:
        """The flat cache slots (``page * page_size + slot``) of ``(request_id, start, k)`` runs, in
        order, on the host: the verifier's commit joins them to its accepted rows and copies both
        to the device at once (each small host-to-device copy costs a launch and a wait)."""
        ps, flat = self.page_size, []
        for request_id, start, k in items:
            if start < 0 or start + k > self.reserved_tokens(request_id):
                raise IndexError(f"request {request_id!r}: tokens {start}..{start + k - 1} outside "
                                 f"reserved {self.reserved_tokens(request_id)}")
            owned = self._pages[request_id] if k else []
            flat.extend(owned[pos // ps] * ps + pos % ps for pos in range(start, start + k))
        return np.asarray(flat, dtype=np.int64)                                        # [K]

    def write_slots(self, slots: Tensor, kv: Tensor) -> None:
        """Store ``kv [num_layers, K, dim]`` at ``slots [K]`` (from `slots`, on the cache's device)."""
        assert kv.dim() == 3 and kv.shape[0] == self.num_layers and kv.shape[2] == self.dim, (
            f"kv must be [num_layers={self.num_layers}, k, dim={self.dim}], got {tuple(kv.shape)}"
        )
        assert kv.shape[1] == slots.shape[0], "kv rows must match the slots"
        # a view of the pages as one run of slots: `kv` is made contiguous in __init__ and never replaced
        self.kv.view(self.num_layers, -1, self.dim).index_copy_(1, slots, kv.to(self.kv.dtype))   # [L, P * ps, D]

    def gather(self, layer: int, request_id: str, length: int) -> Tensor:
        """Contiguous copy of the first ``length`` cached tokens of one layer (tests, references)."""
        pages, slots = self._slots(request_id, 0, length)
        return self.kv[layer, pages, slots]  # [length, D]
