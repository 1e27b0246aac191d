"""Tree-attention MLA over a paged latent cache: torch reference (Triton kernel later, same signature).

Why absorbed MLA: with W_UK folded into the query and W_UV applied after attention, every head
attends over the same cached latent vectors ``[c_kv (kvr) | k_pe (rope)]``, so the cache is read
once per request for all heads and all tree nodes (DESIGN.md §6).

Keys of a query token i of request r: every cached prefix token ``0 .. prefix_len-1`` plus the
request's own query tokens j with ``tree_masks[r][i, j]`` (itself and its ancestors); their latent
kv comes from ``new_kv`` because it is not in the cache yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TreeAttentionMetadata", "tree_mla_reference", "chain_mask"]


@dataclass
class TreeAttentionMetadata:
    """Where each request's query tokens are and what each may see."""

    query_starts: Tensor  # [R+1] int64 CSR offsets into the flat N query tokens
    prefix_lens: Tensor  # [R] int64 tokens already in the cache per request
    page_tables: list[Tensor]  # R x [n_pages] int64
    tree_masks: list[Tensor]  # R x [n_r, n_r] bool; mask[i, j] = j is i or an ancestor of i

    @property
    def num_requests(self) -> int:
        return len(self.page_tables)


def chain_mask(n: int, device: torch.device | str = "cpu") -> Tensor:
    """Causal mask of a prefill chunk (a tree where each token's parent is the previous one)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]


def tree_mla_reference(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    new_kv: Tensor,
    meta: TreeAttentionMetadata,
    softmax_scale: float,
) -> Tensor:
    """Attention output in latent space.

    Args:
        q_latent: [N, H, kvr] queries with W_UK absorbed (model dtype).
        q_pe: [N, H, rope] rope part of the queries (after rope).
        kv_cache: [num_pages, page_size, kvr + rope] one layer of the paged latent cache.
        new_kv: [N, kvr + rope] latent kv of the query tokens themselves (not yet cached).
        meta: per-request offsets, prefix lengths, page tables and tree masks.
        softmax_scale: multiplier on the logits before softmax.

    Returns:
        [N, H, kvr] softmax-weighted sum of c_kv, dtype of q_latent. Logits, softmax and the
        weighted sum run in float32 (float64 when the inputs are float64).
    """
    N, H, kvr = q_latent.shape
    rope = q_pe.shape[-1]
    page_size = kv_cache.shape[1]
    assert kv_cache.shape[-1] == kvr + rope, f"kv_cache last dim {kv_cache.shape[-1]} != kvr {kvr} + rope {rope}"
    assert new_kv.shape == (N, kvr + rope), f"new_kv must be [{N}, {kvr + rope}], got {tuple(new_kv.shape)}"
    assert meta.query_starts.numel() == meta.num_requests + 1, "query_starts must have R+1 entries"
    math_dtype = torch.promote_types(q_latent.dtype, torch.float32)
    out = torch.empty(N, H, kvr, dtype=math_dtype, device=q_latent.device)  # [N, H, kvr]
    starts = meta.query_starts.tolist()
    prefix_lens = meta.prefix_lens.tolist()
    for r in range(meta.num_requests):
        s, e, L = starts[r], starts[r + 1], prefix_lens[r]
        n = e - s
        if n == 0:
            continue
        mask = meta.tree_masks[r]
        assert mask.shape == (n, n), f"request {r}: tree mask {tuple(mask.shape)} != ({n}, {n})"
        n_pages = -(-L // page_size)
        table = meta.page_tables[r][:n_pages]  # [n_pages]
        assert table.numel() == n_pages, f"request {r}: page table has {meta.page_tables[r].numel()} pages, prefix {L} needs {n_pages}"
        prefix = kv_cache[table].reshape(n_pages * page_size, kvr + rope)[:L]  # [L, kvr+rope]
        keys = torch.cat([prefix, new_kv[s:e]], dim=0).to(math_dtype)  # [L+n, kvr+rope]
        ql = q_latent[s:e].to(math_dtype)  # [n, H, kvr]
        qp = q_pe[s:e].to(math_dtype)  # [n, H, rope]
        logits = torch.einsum("nhk,tk->nht", ql, keys[:, :kvr]) + torch.einsum("nhr,tr->nht", qp, keys[:, kvr:])  # [n, H, L+n]
        visible = torch.cat([torch.ones(n, L, dtype=torch.bool, device=mask.device), mask], dim=1)  # [n, L+n]
        logits = (logits * softmax_scale).masked_fill(~visible.unsqueeze(1), float("-inf"))  # [n, H, L+n]
        probs = torch.softmax(logits, dim=-1)  # [n, H, L+n]
        out[s:e] = torch.einsum("nht,tk->nhk", probs, keys[:, :kvr])  # [n, H, kvr]
    return out.to(q_latent.dtype)
