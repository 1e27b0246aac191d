"""Tree-attention MLA over a paged latent cache: the Triton kernel and its torch reference.

Why absorbed MLA: with W_UK folded into the query and W_UV applied after attention, every head
attends over the same cached latent vectors ``[c_kv (kvr) | k_pe (rope)]``, so the cache is read
once per request for all heads and all tree nodes.

Keys of a query token i of request r: every cached prefix token ``0 .. prefix_len-1`` plus the
request's own query tokens j with ``tree_masks[r][i, j]`` (itself and its ancestors); their latent
kv comes from ``new_kv`` because it is not in the cache yet.

The trio: ``_tree_mla_split_kernel`` / ``_tree_mla_merge_kernel`` (Triton),
``tree_mla_triton`` (host wrapper: checks, launch parameters), ``tree_mla_reference`` (plain torch,
used by tests and benchmarks). ``tree_mla`` picks one (:func:`choose_backend`): on Hopper the Gluon
kernels of ``kernels/tree_mla_hopper.py`` (same contract; a TMA loader and two consumer warpgroups
taking turns on each 64-row tile, or one warpgroup a 16 rows where requests have few rows),
Triton on other CUDA GPUs, the reference elsewhere.

Kernel layout. The M dimension of every matrix product is (tree node x head) of one request: row
``m = node * H + head`` of the request's ``[n_r * H, kvr]`` query block, because every head and
every node attends over the same latent keys. One program owns ``BLOCK_M`` such rows (128 above 64
rows a request, with half the value dims each: two programs per M tile; see
:class:`TreeMlaConfig`) and one split of the request's prefix; it streams that split's KV tiles
once, through the page table, with an online softmax. Programs of the same request and split but
other M tiles or value halves are launched next to each other (grid axis 0), so their re-reads of
a KV tile mostly hit L2. The tree's own keys (``new_kv``) are attended by the last split only, and
the packed ancestor bitmask applies to those keys only. With more than one split each program
writes a normalised float32 partial and its log2-sum-exp; a second kernel merges them.

Performance (H200, BENCHMARKS.md): 20-22% of copy bandwidth at tree 9 x 8 heads, 1.9-4.0x over
dense-mask SDPA at batch x context >= 32 x 4096, far from the 80% target. Trees of 17+ nodes at 8
heads are compute-bound on an H200 anyway (~2 FLOP per row per KV byte). The kernel reaches 12-29%
of its roofline floor: q plus one KV tile fill shared memory (one CTA per SM, no overlap between
tiles), and both value-dim programs compute the logits. The Hopper kernel removes the second
cause; this one serves other GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import pdl
from kernels.device import on_input_device
from kernels.tree_mla_hopper import SUPPORTED_DIMS, hopper_available, tree_mla_hopper, unsupported_reason

try:  # Triton is optional: the CPU engine and its tests run on the reference alone.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is not installed
    triton = None
    tl = None

__all__ = [
    "TreeAttentionMetadata",
    "TreeAttentionDeviceMetadata",
    "TreeMlaConfig",
    "chain_mask",
    "pack_ancestor_bits",
    "unpack_ancestor_bits",
    "tree_mla",
    "choose_backend",
    "BACKEND_ENV",
    "tree_mla_triton",
    "tree_mla_reference",
    "fit_shared_memory",
    "merge_launch_shapes",
    "served_dv_splits",
    "warm_up_merges",
    "warm_up_attention",
]


# Forces tree_mla's backend ("hopper", "triton" or "reference") where the caller does not.
BACKEND_ENV = "DDTREE_TREE_MLA_BACKEND"


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


@dataclass
class TreeAttentionDeviceMetadata:
    """The same information in fixed-shape device tensors: what the kernel reads, graph-capturable.

    query_starts:  [R+1] int32 CSR offsets into the flat N query tokens; ``query_starts[R] == N``
                   (every query row must belong to a request, or its output is left unwritten).
    prefix_lens:   [R] int32 tokens already in the cache per request (0 allowed).
    page_table:    [R, max_pages] int32; row r's first ``cdiv(prefix_lens[r], page_size)`` entries
                   are read, the rest may hold anything.
    ancestor_bits: [N, words] int32; bit ``j % 32`` of word ``j // 32`` of row ``query_starts[r] + i``
                   says whether node j of request r is node i itself or one of its ancestors.
                   ``words >= cdiv(max_nodes, 32)``.
    max_nodes:     static upper bound on nodes per request; sets the M tiling (a Python int, so a
                   captured graph keeps its launch grid).
    """

    query_starts: Tensor
    prefix_lens: Tensor
    page_table: Tensor
    ancestor_bits: Tensor
    max_nodes: int

    @property
    def num_requests(self) -> int:
        return self.prefix_lens.shape[0]

    @classmethod
    def from_host(
        cls,
        meta: TreeAttentionMetadata,
        max_pages: int | None = None,
        max_nodes: int | None = None,
        device: torch.device | str | None = None,
    ) -> "TreeAttentionDeviceMetadata":
        """Pack a :class:`TreeAttentionMetadata` (host sync; not for the graph-captured path).

        ``max_pages``/``max_nodes`` pad to a capture bucket; unused page-table entries are 0.
        """
        device = device if device is not None else meta.query_starts.device
        R = meta.num_requests
        sizes = [int(m.shape[0]) for m in meta.tree_masks]
        max_nodes = max(sizes, default=1) if max_nodes is None else max_nodes
        assert max(sizes, default=0) <= max_nodes, f"a tree has {max(sizes)} nodes > max_nodes {max_nodes}"
        pages = max((t.numel() for t in meta.page_tables), default=0)
        max_pages = max(pages, 1) if max_pages is None else max_pages
        assert pages <= max_pages, f"a page table has {pages} pages > max_pages {max_pages}"
        page_table = torch.zeros(R, max_pages, dtype=torch.int32, device=device)  # [R, max_pages]
        for r, t in enumerate(meta.page_tables):
            page_table[r, : t.numel()] = t.to(device=device, dtype=torch.int32)
        words = max(1, -(-max_nodes // 32))
        bits = [pack_ancestor_bits(m.to(device), words) for m in meta.tree_masks]  # R x [n_r, words]
        return cls(
            query_starts=meta.query_starts.to(device=device, dtype=torch.int32),
            prefix_lens=meta.prefix_lens.to(device=device, dtype=torch.int32),
            page_table=page_table,
            ancestor_bits=torch.cat(bits) if bits else torch.zeros(0, words, dtype=torch.int32, device=device),
            max_nodes=max_nodes,
        )

    def to_host(self) -> TreeAttentionMetadata:
        """Unpack into the list form the reference reads (host sync)."""
        starts = self.query_starts.tolist()
        lens = self.prefix_lens.tolist()
        masks, tables = [], []
        for r in range(self.num_requests):
            s, e = starts[r], starts[r + 1]
            masks.append(unpack_ancestor_bits(self.ancestor_bits[s:e], e - s))
            tables.append(self.page_table[r].to(torch.int64))  # whole row: the reference slices it
        return TreeAttentionMetadata(
            query_starts=self.query_starts.to(torch.int64),
            prefix_lens=torch.tensor(lens, dtype=torch.int64, device=self.prefix_lens.device),
            page_tables=tables,
            tree_masks=masks,
        )


def chain_mask(n: int, device: torch.device | str = "cpu") -> Tensor:
    """Causal mask of a prefill chunk (a tree where each token's parent is the previous one)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]


def pack_ancestor_bits(mask: Tensor, words: int | None = None) -> Tensor:
    """Bit-pack a visibility mask row-wise: no host sync, so it can sit in a captured graph.

    Args:
        mask: [..., n, n] bool; ``mask[..., i, j]`` = node i sees node j.
        words: int32 words per row (default ``cdiv(n, 32)``); more pads with zero bits.

    Returns:
        [..., n, words] int32; bit ``j % 32`` of word ``j // 32`` is ``mask[..., i, j]``.
    """
    n = mask.shape[-1]
    words = max(1, -(-n // 32)) if words is None else words
    assert words * 32 >= n, f"{words} words hold {words * 32} bits < {n} nodes"
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, words * 32 - n))  # [..., n, words*32]
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (padded.unflatten(-1, (words, 32)) * weights).sum(-1)  # [..., n, words] in 0 .. 2^32-1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement


def unpack_ancestor_bits(bits: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_ancestor_bits`: [..., rows, words] int32 -> [..., rows, n] bool."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    flat = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., rows, words*32]
    return flat[..., :n].bool()


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


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeMlaConfig:
    """Launch parameters of the split kernel.

    block_m: rows (node x head) per program. 8 warps hold a [64, 512] or a [128, 256] float32
        accumulator (128 registers a thread).
    block_n: keys per tile.
    dv_splits: 2 gives each program half the value dims (both programs compute the logits).

    Above 64 rows a request the default is 128 rows x half the value dims, 64-key tiles, one
    stage: on an H200 (the sweep in bench/results/tree_mla.json, batch 32, context 4096, 8 heads)
    184 / 350 / 681 us at trees 9 / 17 / 33 against 246 / 481 / 951 for 64 rows x all 512 dims.
    At 128 rows each warpgroup owns 64 rows of the logits; at 64 rows on 8 warps Triton's
    chained-dot layout has both warpgroups compute the same logits, and a 72-row tree needs a
    second, nearly empty 64-row tile. q (144 KB) plus one 64-key tile (72 KB) fill shared
    memory: one stage, and on GPUs with less shared memory a block (A100: 163 KB) the 64-row
    config runs instead (:func:`fit_shared_memory`).
    """

    block_m: int
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 1
    dv_splits: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            assert v >= 16 and v & (v - 1) == 0, f"{name} must be a power of two >= 16, got {v}"
        assert self.dv_splits in (1, 2), f"dv_splits must be 1 or 2, got {self.dv_splits}"


def default_config(rows_per_request: int) -> TreeMlaConfig:
    """Smallest M tile that holds a request's rows, 128 rows above 64 (see :class:`TreeMlaConfig`)."""
    if rows_per_request > 64:
        return TreeMlaConfig(block_m=128, block_n=64, num_warps=8, num_stages=1, dv_splits=2)
    if rows_per_request > 32:
        return TreeMlaConfig(block_m=64)
    # Below 64 rows the product runs on mma.sync (wgmma needs 64 rows a warpgroup): 4 warps, and
    # a smaller q leaves room for two stages of 32-key tiles. Not swept on the GPU yet.
    return TreeMlaConfig(block_m=16 if rows_per_request <= 16 else 32, block_n=32, num_warps=4, num_stages=2)


def fit_shared_memory(cfg: TreeMlaConfig, kv_dim: int, elem_bytes: int, limit_bytes: int | None) -> TreeMlaConfig:
    """``cfg``, or the 64-row config where q plus its KV tiles would not fit ``limit_bytes``.

    The kernel keeps the q block and ``num_stages`` key tiles in shared memory; 8 KB is left for
    the probabilities and layout conversions. ``limit_bytes`` None: no limit known (CPU).
    """
    need = (cfg.block_m + cfg.block_n * max(1, cfg.num_stages)) * kv_dim * elem_bytes
    if limit_bytes is None or need + (8 << 10) <= limit_bytes or cfg.block_m <= 64:
        return cfg
    return TreeMlaConfig(block_m=64)


_SMEM_LIMIT: dict[int, int | None] = {}


def _shared_memory_limit(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM_LIMIT:
        _SMEM_LIMIT[idx] = getattr(torch.cuda.get_device_properties(idx), "shared_memory_per_block_optin", None)
    return _SMEM_LIMIT[idx]


def choose_num_splits(
    num_requests: int, tiles_per_request: int, rows: int, max_prefix: int, kvr: int, rope: int, sm_count: int
) -> int:
    """Split each request's prefix so the grid fills one wave of the GPU without starting a second.

    ``tiles_per_request`` = M tiles x value-dim splits (programs per request and split). At batch
    32, tree 9, 8 heads (64 programs a split) 2 splits ran in 189 us, 3 (192 programs, a second
    wave half empty) in 246 us, on an H200 (bench/results/tree_mla.json). Limits: every split
    keeps >= 64 keys, at most 32 splits (the merge reads every split's partial: at batch 1, tree
    9, on an H200, context 1024 took 27 us with 16 splits against 39 with 4, context 4096 41 us
    with 32 against 51 with 64; bench/results/tree_mla_variants.json), and where the shape is
    memory-bound (<= 128 rows a request) and the float32 partials (``rows x kvr`` per split,
    written then read by the merge) would spill out of L2 (> 16 MB), they stay under a quarter of
    the KV bytes read.
    """
    if max_prefix <= 0:
        return 1
    want = max(1, sm_count // max(1, num_requests * tiles_per_request))
    splits = max(1, min(want, max_prefix // 64, 32))
    partial_bytes = splits * num_requests * rows * kvr * 4
    if rows <= 128 and partial_bytes > 16 << 20:
        splits = max(1, min(splits, (max_prefix * (kvr + rope) * 2) // (4 * 2 * rows * kvr * 4)))
    return splits


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """``a @ b + acc``; ``IEEE``: float32 operands multiplied in float32 (tl.dot's default for
        them is TF32, 10 mantissa bits: ~1e-3 off in the float32 model's attention)."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
        """Fold one tile of log2-scaled logits ``s`` [BM, BN] and values ``v`` [BN, BLOCK_DV] in."""
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BM]
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay finite
        alpha = tl.exp2(m_i - m_use)  # [BM]
        p = tl.exp2(s - m_use[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)  # [BM, BLOCK_DV]
        return m_new, l_i, acc

    @triton.jit
    def _tile_logits(q_v, q_o, q_pe, base, slot, key_ok, offs_v, offs_o, offs_r,
                     KVR: tl.constexpr, DV_SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """Logits [BM, BN] of one key tile (rows at ``base + slot``) and its value slice [BN, BLOCK_DV]."""
        k_v = tl.load(base + slot[:, None] + offs_v[None, :], mask=key_ok[:, None], other=0.0)  # [BN, BLOCK_DV]
        k_pe = tl.load(base + slot[:, None] + KVR + offs_r[None, :], mask=key_ok[:, None], other=0.0)  # [BN, ROPE]
        if IEEE:
            s = _dot(q_pe, tl.trans(k_pe), tl.dot(q_v, tl.trans(k_v), input_precision="ieee"), IEEE)  # [BM, BN]
        else:
            s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q_v, tl.trans(k_v)))  # [BM, BN]
        if DV_SPLITS == 2:  # the other half of the latent dims: logits only
            k_o = tl.load(base + slot[:, None] + offs_o[None, :], mask=key_ok[:, None], other=0.0)
            s = _dot(q_o, tl.trans(k_o), s, IEEE)
        return s, k_v

    # Shape-dependent integers are not specialised (Triton would otherwise compile a variant per
    # divisibility class of each): one compiled kernel per (BLOCK_M, DIRECT, config).
    @triton.jit(do_not_specialize=["stride_pt_r", "stride_anc_n", "num_heads", "total_rows", "num_splits"])
    def _tree_mla_split_kernel(
        q_lat_ptr,  # [N, H, KVR]
        q_pe_ptr,  # [N, H, ROPE]
        kv_ptr,  # [pages, page_size, KVR + ROPE]
        new_kv_ptr,  # [N, KVR + ROPE]
        page_table_ptr,  # [R, max_pages] int32
        prefix_lens_ptr,  # [R] int32
        query_starts_ptr,  # [R + 1] int32
        anc_bits_ptr,  # [N, words] int32
        out_ptr,  # [N * H, KVR] when num_splits == 1
        o_part_ptr,  # [num_splits, N * H, KVR] float32 otherwise
        lse_part_ptr,  # [num_splits, DV_SPLITS, N * H] float32 (log2 domain)
        stride_ql_n, stride_ql_h,
        stride_qp_n, stride_qp_h,
        stride_kv_page, stride_kv_tok,
        stride_new_n,
        stride_pt_r,
        stride_anc_n,
        num_heads,
        page_size,
        total_rows,  # N * H
        num_splits,
        scale_log2,  # softmax_scale * log2(e)
        KVR: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DV_SPLITS: tl.constexpr,  # 1, or 2: each program outputs half of the value dims
        DIRECT: tl.constexpr,  # num_splits == 1: write the output, no partials
        IEEE: tl.constexpr,  # float32 operands: products in float32, not TF32 (``_dot``)
    ):
        BLOCK_DV: tl.constexpr = KVR // DV_SPLITS
        pid_m = tl.program_id(0) // DV_SPLITS  # the two halves of a tile are neighbours: shared L2
        dv = tl.program_id(0) % DV_SPLITS
        split = tl.program_id(1)
        r = tl.program_id(2)
        q_start = tl.load(query_starts_ptr + r)
        n_nodes = tl.load(query_starts_ptr + r + 1) - q_start
        rows = n_nodes * num_heads
        if pid_m * BLOCK_M >= rows:
            return

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] row within the request
        row_ok = offs_m < rows
        node = offs_m // num_heads  # [BM] node within the request
        head = offs_m % num_heads
        offs_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)  # latent dims this program outputs
        offs_o = (1 - dv) * BLOCK_DV + tl.arange(0, BLOCK_DV)  # the other half (DV_SPLITS == 2)
        offs_r = tl.arange(0, ROPE)
        tok = (q_start + node).to(tl.int64)  # [BM] flat query token
        q_row = q_lat_ptr + (tok * stride_ql_n + head * stride_ql_h)[:, None]  # [BM, 1] pointers
        q_v = tl.load(q_row + offs_v[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BLOCK_DV]
        q_o = q_v
        if DV_SPLITS == 2:
            q_o = tl.load(q_row + offs_o[None, :], mask=row_ok[:, None], other=0.0)  # [BM, BLOCK_DV]
        q_pe = tl.load(
            q_pe_ptr + (tok * stride_qp_n + head * stride_qp_h)[:, None] + offs_r[None, :],
            mask=row_ok[:, None], other=0.0)  # [BM, ROPE]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # Cached prefix: this split's share, rounded to whole tiles; every key visible to every row.
        prefix_len = tl.load(prefix_lens_ptr + r)
        chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, prefix_len)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)  # [BN] position in the prefix
            key_ok = offs_n < hi
            page = tl.load(page_table_ptr + r * stride_pt_r + offs_n // page_size, mask=key_ok, other=0)
            slot = page.to(tl.int64) * stride_kv_page + (offs_n % page_size) * stride_kv_tok  # [BN]
            s, k_v = _tile_logits(q_v, q_o, q_pe, kv_ptr, slot, key_ok, offs_v, offs_o, offs_r, KVR, DV_SPLITS, IEEE)
            s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, k_v, m_i, l_i, acc, IEEE)

        # The tree's own keys, once per request (last split): visible where the ancestor bit is set.
        if split == num_splits - 1:
            bits_row = anc_bits_ptr + tok * stride_anc_n  # [BM] pointers
            for start in range(0, n_nodes, BLOCK_N):
                offs_j = start + tl.arange(0, BLOCK_N)  # [BN] node within the request
                key_ok = offs_j < n_nodes
                slot = (q_start + offs_j).to(tl.int64) * stride_new_n  # [BN]
                s, k_v = _tile_logits(q_v, q_o, q_pe, new_kv_ptr, slot, key_ok, offs_v, offs_o, offs_r,
                                      KVR, DV_SPLITS, IEEE)
                both_ok = row_ok[:, None] & key_ok[None, :]
                word = tl.load(bits_row[:, None] + (offs_j // 32)[None, :], mask=both_ok, other=0)  # [BM, BN]
                visible = ((word >> (offs_j % 32)[None, :]) & 1) != 0
                s = tl.where(visible, s * scale_log2, float("-inf"))
                m_i, l_i, acc = _online_softmax_step(s, k_v, m_i, l_i, acc, IEEE)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split: weight 0 in the merge
        o = acc / l_safe[:, None]  # [BM, BLOCK_DV]
        flat_row = q_start.to(tl.int64) * num_heads + offs_m  # [BM] row of [N * H]
        if DIRECT:
            tl.store(out_ptr + flat_row[:, None] * KVR + offs_v[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = split.to(tl.int64) * total_rows + flat_row  # [BM]
            tl.store(o_part_ptr + part[:, None] * KVR + offs_v[None, :], o, mask=row_ok[:, None])
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            # Each value-dim half keeps its own: the two compute the logits in a different order, so
            # their sums differ in the last bits, and one shared slot would be a race.
            lse_part = (split * DV_SPLITS + dv).to(tl.int64) * total_rows + flat_row
            tl.store(lse_part_ptr + lse_part, lse, mask=row_ok)

    @triton.jit(do_not_specialize=["total_rows", "num_splits"])
    def _tree_mla_merge_kernel(
        o_part_ptr,  # [num_splits, rows, KVR] float32
        lse_part_ptr,  # [num_splits, DV_SPLITS, rows] float32
        out_ptr,  # [rows, KVR]
        total_rows,
        num_splits,
        KVR: tl.constexpr,
        BLOCK_R: tl.constexpr,
        DV_SPLITS: tl.constexpr,
        D_CHUNKS: tl.constexpr,  # programs a value-dim half is cut into
        SPLIT_BLOCK: tl.constexpr,  # splits read at once (a power of two)
        PDL: tl.constexpr,
    ):
        pdl.grid_sync(PDL)
        BLOCK_DV: tl.constexpr = KVR // DV_SPLITS
        BLOCK_D: tl.constexpr = BLOCK_DV // D_CHUNKS
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        dv = tl.program_id(1) // D_CHUNKS  # which value-dim half (and its log-sum-exps)
        chunk = tl.program_id(1) % D_CHUNKS
        row_ok = rows < total_rows
        rows64 = rows.to(tl.int64)
        offs_d = dv * BLOCK_DV + chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_s = tl.arange(0, SPLIT_BLOCK)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            ss = s0 + offs_s  # [SB]
            lse_rows = ((ss * DV_SPLITS + dv).to(tl.int64) * total_rows)[:, None] + rows64[None, :]  # [SB, BR]
            ok = (ss < num_splits)[:, None] & row_ok[None, :]
            m = tl.maximum(m, tl.max(tl.load(lse_part_ptr + lse_rows, mask=ok, other=float("-inf")), 0))
        m_use = tl.where(m == float("-inf"), 0.0, m)
        w_sum = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            for u in tl.static_range(SPLIT_BLOCK):  # splits past the last add w = 0 times o = 0: the same sums
                s = s0 + u
                ok = row_ok & (rows * 0 + s < num_splits)
                part = s * total_rows + rows64  # [BR]
                lse_row = (s * DV_SPLITS + dv) * total_rows + rows64
                w = tl.exp2(tl.load(lse_part_ptr + lse_row, mask=ok, other=float("-inf")) - m_use)  # [BR]
                o = tl.load(o_part_ptr + part[:, None] * KVR + offs_d[None, :], mask=ok[:, None], other=0.0)
                acc += w[:, None] * o
                w_sum += w
        w_sum = tl.where(w_sum == 0.0, 1.0, w_sum)
        tl.store(out_ptr + rows64[:, None] * KVR + offs_d[None, :],
                 (acc / w_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: size splits as on an H200
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@on_input_device
def tree_mla_triton(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    new_kv: Tensor,
    meta: TreeAttentionMetadata | TreeAttentionDeviceMetadata,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    config: TreeMlaConfig | None = None,
) -> Tensor:
    """:func:`tree_mla_reference` as two Triton launches (split pass, then merge when split).

    Args: as :func:`tree_mla_reference`; ``meta`` is best given as
    :class:`TreeAttentionDeviceMetadata` (the host form is packed here, with a host sync).
    ``kvr`` and ``rope`` must be powers of two (512 and 64 for DeepSeek-V3 / Kimi-K2).
    num_splits: KV splits per request (default: :func:`choose_num_splits`, from static shapes
        only, so a captured graph keeps it).
    config: launch parameters (default: :func:`default_config`); for benchmarks and debugging.

    Returns:
        [N, H, kvr] in q_latent's dtype. Softmax and accumulation run in float32.
    """
    if triton is None:
        raise RuntimeError("tree_mla_triton needs triton; install the 'gpu' extra or use tree_mla_reference")
    meta = check_operands(q_latent, q_pe, kv_cache, new_kv, meta)
    N, H, kvr = q_latent.shape
    rope = q_pe.shape[-1]
    num_pages, page_size, kv_dim = kv_cache.shape
    R = meta.num_requests
    for name, d in (("kvr", kvr), ("rope", rope)):
        assert d >= 16 and d & (d - 1) == 0, f"{name} = {d}: the kernel needs a power of two >= 16"

    out = torch.empty(N, H, kvr, dtype=q_latent.dtype, device=q_latent.device)  # [N, H, kvr]
    if N == 0 or R == 0:
        return out
    rows = meta.max_nodes * H  # static rows per request
    cfg = config or fit_shared_memory(default_config(rows), kv_dim, q_latent.element_size(),
                                      _shared_memory_limit(q_latent.device))
    m_tiles = -(-rows // cfg.block_m)
    if num_splits is None:
        max_prefix = meta.page_table.shape[1] * page_size  # static bound: graphs keep the grid
        num_splits = choose_num_splits(R, m_tiles * cfg.dv_splits, rows, max_prefix, kvr, rope,
                                       _sm_count(q_latent.device))
    assert num_splits >= 1
    total_rows = N * H
    o_part, lse_part = split_partials(out, num_splits, cfg.dv_splits)
    _tree_mla_split_kernel[(m_tiles * cfg.dv_splits, num_splits, R)](
        q_latent, q_pe, kv_cache, new_kv,
        meta.page_table, meta.prefix_lens, meta.query_starts, meta.ancestor_bits,
        out, o_part, lse_part,
        q_latent.stride(0), q_latent.stride(1),
        q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        new_kv.stride(0),
        meta.page_table.stride(0),
        meta.ancestor_bits.stride(0),
        H, page_size, total_rows, num_splits, softmax_scale * _LOG2E,
        KVR=kvr, ROPE=rope, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DV_SPLITS=cfg.dv_splits,
        DIRECT=num_splits == 1, IEEE=q_latent.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    merge_splits(o_part, lse_part, out, num_splits, cfg.dv_splits)
    return out


def split_partials(out: Tensor, num_splits: int, dv_splits: int) -> tuple[Tensor, Tensor]:
    """The split pass's float32 partials ``[splits, N*H, kvr]`` and log-sum-exps ``[splits,
    dv_splits, N*H]`` (``out`` twice, unused, when there is one split and it writes ``out``)."""
    if num_splits == 1:
        return out, out
    total_rows, kvr = out.shape[0] * out.shape[1], out.shape[2]
    o_part = torch.empty(num_splits, total_rows, kvr, dtype=torch.float32, device=out.device)
    lse_part = torch.empty(num_splits, dv_splits, total_rows, dtype=torch.float32, device=out.device)
    return o_part, lse_part


_MERGE_ROWS = 16  # rows a merge program


def merge_plan(total_rows: int, kvr: int, num_splits: int, dv_splits: int, sm_count: int) -> tuple[int, int]:
    """``(d_chunks, split_block)`` of the merge launch: cut each value-dim half into chunks (at least 64
    dims) until the grid fills the GPU, and read up to 8 splits at once. A request's rows alone
    make few programs (batch 1, tree 9 at 8 heads: 72 rows, 5 programs), and each walked the splits
    one by one, a dependent load at a time: on an H200 at batch 1 x 4096 this launch shape takes
    the whole call from 32 to 24 us (``bench/results/tree_mla_merge_ab.json``)."""
    programs = -(-total_rows // _MERGE_ROWS) * dv_splits
    d_chunks = 1
    while programs * d_chunks < sm_count and kvr // dv_splits // (2 * d_chunks) >= 64:
        d_chunks *= 2
    return d_chunks, min(8, triton.next_power_of_2(num_splits))


# A merge is launched early (PDL) only after a split launch of at most this share of the SMs' CTAs.
EARLY_MERGE_MAX_SHARE = 0.5


def merge_launches_early(after_ctas: int | None, sm_count: int) -> bool:
    """Whether ``merge_splits`` launches the merge early (PDL, where it is on) after a split launch of
    ``after_ctas`` CTAs, one an SM (None: not known, early); see ``merge_splits``."""
    return after_ctas is None or after_ctas <= EARLY_MERGE_MAX_SHARE * sm_count


def merge_splits(o_part: Tensor, lse_part: Tensor, out: Tensor, num_splits: int, dv_splits: int, *,
                 d_chunks: int | None = None, split_block: int | None = None, after_ctas: int | None = None) -> None:
    """``out`` from the partials of more than one split (one merge launch; nothing for one); the
    launch shape is ``merge_plan``'s unless given.

    ``after_ctas``: the CTAs of the split launch before it, one an SM. Launched early (PDL), the
    merge's programs become resident on whatever SMs that launch leaves free and stay there; where
    it leaves only a few (a 64-row Gluon launch filling a wave at batch 1), the whole merge runs on
    those few: at batch 1 x 4096, tree 33, 8 heads (130 CTAs on 132 SMs) the call took 31.7 us
    against 25.5 without PDL (``bench/results/tree_mla_pdl_ab-9c80eaa.json``). So above
    ``EARLY_MERGE_MAX_SHARE`` of the SMs it is launched after the split launch completes; it still
    lets the launch after it start early."""
    if num_splits == 1:
        return
    total_rows, kvr = out.shape[0] * out.shape[1], out.shape[2]
    sms = _sm_count(out.device)
    plan = merge_plan(total_rows, kvr, num_splits, dv_splits, sms)
    d_chunks = d_chunks or plan[0]
    split_block = split_block or plan[1]
    use_pdl = pdl.enabled(out.device)
    early = use_pdl and merge_launches_early(after_ctas, sms)
    _tree_mla_merge_kernel[(triton.cdiv(total_rows, _MERGE_ROWS), dv_splits * d_chunks)](
        o_part, lse_part, out, total_rows, num_splits, KVR=kvr, BLOCK_R=_MERGE_ROWS, DV_SPLITS=dv_splits,
        D_CHUNKS=d_chunks, SPLIT_BLOCK=split_block, PDL=use_pdl, num_warps=4,
        launch_pdl=early,
    )


def merge_launch_shapes(kvr: int, dv_splits: int) -> list[tuple[int, int]]:
    """Every ``(d_chunks, split_block)`` that ``merge_plan`` can give at these dims."""
    chunks = [1]
    while kvr // dv_splits // (2 * chunks[-1]) >= 64:
        chunks.append(2 * chunks[-1])
    return [(d, block) for d in chunks for block in (2, 4, 8)]


def served_dv_splits(kvr: int, rope: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The value-dim splits the merges of the backend ``tree_mla`` serves at these dims can take:
    the Gluon kernel's 1, the Triton kernel's 1 or 2 (``default_config``), none for the reference."""
    forced = backend_from_env()   # "" is unset, as for the launches (it was read as forced: extra merges compiled)
    if forced == "reference" or device.type != "cuda" or triton is None:
        return ()
    hopper = forced == "hopper" or (forced is None and hopper_available(device)
                                    and dtype in (torch.bfloat16, torch.float16) and (kvr, rope) in SUPPORTED_DIMS)
    return (1,) if hopper else (1, 2)


def warm_up_merges(kvr: int, dtype: torch.dtype, device: torch.device | str, dv_splits: Sequence[int] = (1,)) -> int:
    """Compiles the merge for every launch shape it can take at these dims, launched early and
    after a full GPU; returns the launches. Why: a prefill runs eagerly at any length and page
    table width, so it can meet a launch shape that no graph bucket of the start-up ran, and would
    compile it (a few hundred milliseconds) while the replica's requests wait."""
    out = torch.empty(1, 1, kvr, dtype=dtype, device=device)
    launches = 0
    for dv in dv_splits:
        for d_chunks, block in merge_launch_shapes(kvr, dv):
            o_part, lse_part = split_partials(out, block, dv)
            o_part.zero_()
            lse_part.zero_()
            for after_ctas in (None, 1 << 30):   # early, and after a split launch of many waves
                merge_splits(o_part, lse_part, out, block, dv, d_chunks=d_chunks, split_block=block,
                             after_ctas=after_ctas)
                launches += 1
    return launches


def warm_up_attention(kv_cache: Tensor, heads: int, rope: int, *, backend: str | None = None) -> int:
    """Compiles the attention kernel that ``tree_mla`` serves on this cache (one layer's
    ``[pages, page_size, kvr + rope]``) in each variant a launch can take; returns the launches.

    Why: a prefill runs eagerly at any length and page-table width, and its rows, requests and
    width pick the variant: on the Gluon backend the few-row or the 64-row kernel, each with one
    split (``DIRECT``) or several; on the Triton backend the row tile (:func:`default_config`) and
    ``DIRECT``. The graph buckets' steps all read the whole page-table width, so they need not take
    every variant, and a prefill taking a new one would compile it (seconds) while the replica's
    requests wait. Everything else in a launch's compile key is fixed by the model's dims, dtype
    and cache (the Gluon kernels refuse unaligned operands). Runs one 9-node chain with no prefix.
    """
    device, dtype = kv_cache.device, kv_cache.dtype
    kvr, nodes = kv_cache.shape[-1] - rope, 9
    g = torch.Generator(device=device).manual_seed(0)
    q_latent = torch.randn(nodes, heads, kvr, generator=g, device=device).to(dtype)
    q_pe = torch.randn(nodes, heads, rope, generator=g, device=device).to(dtype)
    new_kv = torch.randn(nodes, kvr + rope, generator=g, device=device).to(dtype)
    host = TreeAttentionMetadata(query_starts=torch.tensor([0, nodes]), prefix_lens=torch.tensor([0]),
                                 page_tables=[torch.zeros(1, dtype=torch.int64)], tree_masks=[chain_mask(nodes)])
    meta = TreeAttentionDeviceMetadata.from_host(host, device=device)
    backend = resolve_backend(backend, q_latent, q_pe, kv_cache, new_kv)
    launches = 0
    if backend == "hopper":
        for few_rows in (True, False):
            for splits in (1, 2):
                tree_mla_hopper(q_latent, q_pe, kv_cache, new_kv, meta, 1.0, num_splits=splits, few_rows=few_rows)
                launches += 1
    elif backend == "triton":
        limit = _shared_memory_limit(device)
        configs = {fit_shared_memory(default_config(rows), kvr + rope, kv_cache.element_size(), limit)
                   for rows in (16, 32, 64, 128)}   # each row tile default_config gives
        for cfg in sorted(configs, key=lambda c: c.block_m):
            for splits in (1, 2):
                tree_mla_triton(q_latent, q_pe, kv_cache, new_kv, meta, 1.0, num_splits=splits, config=cfg)
                launches += 1
    return launches


def check_operands(
    q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, new_kv: Tensor,
    meta: TreeAttentionMetadata | TreeAttentionDeviceMetadata,
) -> TreeAttentionDeviceMetadata:
    """The kernels' shared argument checks (both read these tensors raw); returns the device
    metadata (the host form is packed here, with a host sync)."""
    if isinstance(meta, TreeAttentionMetadata):
        meta = TreeAttentionDeviceMetadata.from_host(meta, device=q_latent.device)
    N, H, kvr = q_latent.shape
    rope = q_pe.shape[-1]
    kv_dim = kv_cache.shape[-1]
    R = meta.num_requests
    assert kv_dim == kvr + rope, f"kv_cache last dim {kv_dim} != kvr {kvr} + rope {rope}"
    assert q_pe.shape == (N, H, rope), f"q_pe must be [{N}, {H}, {rope}], got {tuple(q_pe.shape)}"
    assert new_kv.shape == (N, kv_dim), f"new_kv must be [{N}, {kv_dim}], got {tuple(new_kv.shape)}"
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("kv_cache", kv_cache), ("new_kv", new_kv)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
        assert t.device == q_latent.device, f"{name} is on {t.device}, q_latent on {q_latent.device}"
    assert meta.query_starts.shape == (R + 1,), "query_starts must have R+1 entries"
    assert meta.ancestor_bits.shape[0] == N, f"ancestor_bits has {meta.ancestor_bits.shape[0]} rows, N = {N}"
    assert meta.ancestor_bits.shape[1] * 32 >= meta.max_nodes, "ancestor_bits has too few words for max_nodes"
    for name in ("query_starts", "prefix_lens", "page_table", "ancestor_bits"):
        t = getattr(meta, name)
        assert t.dtype == torch.int32, f"meta.{name} must be int32, got {t.dtype}"
        assert t.device == q_latent.device, f"meta.{name} is on {t.device}, q_latent on {q_latent.device}"
    assert meta.page_table.stride(1) == 1 and meta.ancestor_bits.stride(1) == 1, (
        "page_table and ancestor_bits rows must be contiguous")
    return meta


def choose_backend(q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, new_kv: Tensor) -> str:
    """``"hopper"`` where the Gluon kernel runs (sm_90, 16-bit, the K2 or demo dims): 1.8-3.3x the
    Triton kernel at batch >= 32 (bench/results/tree_mla.json); ``"triton"`` on other CUDA GPUs;
    ``"reference"`` off the GPU."""
    if not q_latent.is_cuda or triton is None:
        return "reference"
    if hopper_available(q_latent.device) and unsupported_reason(q_latent, q_pe, kv_cache, new_kv) is None:
        return "hopper"
    return "triton"


BACKENDS = ("hopper", "triton", "reference")


def backend_from_env() -> str | None:
    """``BACKEND_ENV``'s choice, or None. A misspelt one is refused naming the variable: it passed
    to the warm-up, which compiled nothing for it, and failed at the first request."""
    value = os.environ.get(BACKEND_ENV) or None
    if value is not None and value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: must be 'hopper', 'triton' or 'reference' (or unset: chosen "
                         "for the GPU)")
    return value


def resolve_backend(backend: str | None, q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, new_kv: Tensor) -> str:
    """``backend`` where given, else ``BACKEND_ENV``, else :func:`choose_backend`'s."""
    if backend is not None:
        return backend
    return backend_from_env() or choose_backend(q_latent, q_pe, kv_cache, new_kv)


def tree_mla(
    q_latent: Tensor,
    q_pe: Tensor,
    kv_cache: Tensor,
    new_kv: Tensor,
    meta: TreeAttentionMetadata | TreeAttentionDeviceMetadata,
    softmax_scale: float,
    *,
    backend: str | None = None,
) -> Tensor:
    """Tree-attention MLA: the Gluon kernel on Hopper, the Triton kernel on other CUDA GPUs, the
    torch reference elsewhere.

    Same arguments and result as :func:`tree_mla_reference`. ``backend`` (default: ``BACKEND_ENV``,
    else :func:`choose_backend`) forces ``"hopper"``, ``"triton"`` (on CPU that needs
    ``TRITON_INTERPRET=1`` set before triton is imported: the tests do) or ``"reference"``.
    """
    backend = resolve_backend(backend, q_latent, q_pe, kv_cache, new_kv)
    if backend == "hopper":
        return tree_mla_hopper(q_latent, q_pe, kv_cache, new_kv, meta, softmax_scale)
    if backend == "triton":
        return tree_mla_triton(q_latent, q_pe, kv_cache, new_kv, meta, softmax_scale)
    if backend != "reference":
        raise ValueError(f"backend must be 'hopper', 'triton' or 'reference', got {backend!r}")
    if isinstance(meta, TreeAttentionDeviceMetadata):
        meta = meta.to_host()
    return tree_mla_reference(q_latent, q_pe, kv_cache, new_kv, meta, softmax_scale)
