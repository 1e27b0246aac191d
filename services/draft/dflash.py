"""DFlash block-diffusion drafter: one non-causal forward proposes a whole block of tokens.

The drafter conditions on target hidden features of the committed tokens. Those enter every
layer only as extra keys/values (k_proj/v_proj of the projected features), which depend on
nothing but the features themselves, so they are computed once per committed token and kept
in a per-request `DraftContext`; each step only runs the block of `block_size` query tokens
([bonus token, mask x (block-1)]) against that cache. The block's own K/V are never cached:
the next step's block is different.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.rms_norm import rms_norm  # Qwen3's RMSNorm is DeepSeek's: one Triton launch on CUDA
from services.common.checkpoint import CheckpointError, load_tensors, read_config, stored_tensors
from services.draft.config import DraftConfig, check_pairing
from services.draft.propose_graphs import ProposeGraphs

T = TypeVar("T")

_MIN_CAPACITY = 64
CONTEXT_BUCKET = 64   # propose pads context keys to a multiple of this (see DFlashDrafter.propose)


@dataclass
class DraftContext:
    """Per-request drafter context cache: rotated, normalised context keys and values per layer.

    Storage grows geometrically so that committing a few tokens per step stays amortised O(1).
    """

    keys: Tensor  # [num_layers, capacity, kv_heads, head_dim]
    values: Tensor  # [num_layers, capacity, kv_heads, head_dim]
    length: int = 0
    row: int | None = None  # the row of the drafter's context pool these are views of, if any

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    def layer_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The valid context K, V of one layer (views), each [length, kv_heads, head_dim]."""
        return self.keys[layer, : self.length], self.values[layer, : self.length]

    def _reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        cap = max(total, 2 * self.capacity, _MIN_CAPACITY)
        n_layers, _, kvh, hd = self.keys.shape
        keys = self.keys.new_zeros(n_layers, cap, kvh, hd)  # [layers, cap, kvh, hd]
        values = self.values.new_zeros(n_layers, cap, kvh, hd)  # [layers, cap, kvh, hd]
        keys[:, : self.length] = self.keys[:, : self.length]
        values[:, : self.length] = self.values[:, : self.length]
        self.keys, self.values = keys, values


@dataclass
class _Layer:
    """Weights of one Qwen3-style drafter layer (nn.Linear layout: [out, in])."""

    input_layernorm: Tensor  # [hidden]
    post_attention_layernorm: Tensor  # [hidden]
    q_proj: Tensor  # [H*hd, hidden]
    k_proj: Tensor  # [kvh*hd, hidden]
    v_proj: Tensor  # [kvh*hd, hidden]
    o_proj: Tensor  # [hidden, H*hd]
    q_norm: Tensor  # [hd]
    k_norm: Tensor  # [hd]
    gate_proj: Tensor  # [inter, hidden]
    up_proj: Tensor  # [inter, hidden]
    down_proj: Tensor  # [hidden, inter]


@dataclass(frozen=True)
class _Rope:
    """Standard (rotate_half) rotary tables for arbitrary position tensors."""

    inv_freq: Tensor  # [hd/2] float32

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos/sin computed in float32 then cast, as HF does, for positions of any shape [...]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Grouped-query attention that reads each KV head once: the query heads sharing a KV head are
    stacked as more query rows of it (``repeat_interleave`` of the keys and values wrote
    ``heads / kv_heads`` copies of a row's whole context a layer, every propose).

    q: [R, B, H, hd]; k, v: [R, L, kvh, hd] (query head h reads KV head h // (H / kvh));
    mask: [R, 1, 1, L] or, a mask per query row (training's blocks), [R, 1, B, L]; boolean, True
    where a key is attended. Returns [R, B, H * hd].
    """
    R, B, H, hd = q.shape
    kvh = k.shape[2]
    g = H // kvh
    if mask.shape[-2] != 1:
        mask = mask.repeat(1, 1, g, 1)   # [R, 1, g*B, L]: the rows' order below, a head group's B rows at a time
    rows = q.view(R, B, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(R, kvh, g * B, hd)  # [R, kvh, g*B, hd]
    out = F.scaled_dot_product_attention(rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)  # [R, kvh, g*B, hd]
    return out.view(R, kvh, g, B, hd).permute(0, 3, 1, 2, 4).reshape(R, B, H * hd)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., heads, hd] with cos/sin [..., hd] broadcast over the heads axis."""
    return x * cos.unsqueeze(-2) + _rotate_half(x) * sin.unsqueeze(-2)


_SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
_LAYER_TENSORS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj")


def _strip_prefix(weights: dict[str, T]) -> dict[str, T]:
    """Accept checkpoints saved with a leading 'model.' on every name."""
    if weights and all(k.startswith("model.") for k in weights):
        return {k[len("model.") :]: v for k, v in weights.items()}
    return weights


def drafter_shapes(c: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter of ``c`` stores and reads (the target's embedding and lm_head aside), by shape."""
    h, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = dict(zip(_LAYER_TENSORS, [(h,), (h,), (q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (c.head_dim,),
                                      (c.head_dim,), (c.intermediate_size, h), (c.intermediate_size, h),
                                      (h, c.intermediate_size)]))
    shapes = {"fc.weight": (h, c.num_features), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    return shapes


def check_drafter_tensors(c: DraftConfig, stored: dict[str, tuple[tuple[int, ...], torch.dtype | str]]) -> None:
    """CheckpointError for a tensor missing, of another shape, of a dtype the drafter does not
    load, or one it would leave unread. ``stored``: each tensor's (shape, dtype), read from the
    tensors or from the files' headers alone (``check_drafter_checkpoint``)."""
    stored = _strip_prefix(dict(stored))
    shapes = drafter_shapes(c)
    for name, shape in shapes.items():
        if name not in stored:
            raise CheckpointError(f"drafter weights: missing tensor '{name}'")
        got, dtype = stored[name]
        if tuple(got) != shape:
            raise CheckpointError(f"drafter weights: tensor '{name}' has shape {tuple(got)}, expected {shape}")
        # an FP8 one's scale would be dropped
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise CheckpointError(f"drafter weights: tensor '{name}' is {str(dtype).removeprefix('torch.')}; the "
                                  "drafter loads float32 / bfloat16 / float16 weights")
    # Every stored tensor is read: layers past num_hidden_layers, q/k/v biases, an FP8 scale
    # loaded as nothing and drafted garbage. The drafter's copies of the target's embedding and
    # output projection are not read: the target's own are (DFlash shares them).
    unread = sorted(n for n in stored if n not in shapes and n not in _SHARED_WITH_TARGET
                    and not f".{n}".endswith(".rotary_emb.inv_freq"))
    if unread:
        more = f" (+{len(unread) - 1} more)" if len(unread) > 1 else ""
        raise CheckpointError(f"drafter weights: tensor '{unread[0]}'{more} is not one its config.json implies "
                              f"(num_hidden_layers {c.num_hidden_layers}; no attention biases), and would be "
                              "left unread")


def check_drafter_checkpoint(drafter_dir: Path, target_dir: Path) -> DraftConfig:
    """The drafter's pairing with its target and its tensors, from configs and headers alone: what
    a launcher checks before any service starts (the draft starts after the verifier, which on a
    large target loads and warms up for minutes first). Returns the drafter's config."""
    config = check_pairing(Path(drafter_dir), Path(target_dir))
    stored = stored_tensors(drafter_dir)   # (its errors name the file)
    try:
        check_drafter_tensors(config, stored)
    except CheckpointError as e:
        raise CheckpointError(f"{drafter_dir}: {e}") from e
    return config


class DFlashDrafter:
    """DFlash drafter with per-request context caches; uses the target's embedding and lm_head."""

    def __init__(
        self,
        config: DraftConfig,
        weights: dict[str, Tensor],
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config
        weights = _strip_prefix(dict(weights))
        check_drafter_tensors(config, {name: (tuple(t.shape), t.dtype) for name, t in weights.items()})
        if dtype is None:
            dtype = weights["fc.weight"].dtype
        device = torch.device(device) if device is not None else embed_weight.device
        self.dtype = dtype
        self.device = device
        c = config

        def take(name: str) -> Tensor:
            return weights[name].to(device=device, dtype=dtype)

        h = c.hidden_size
        self.fc = take("fc.weight")  # [hidden, n_feat*hidden]
        self.hidden_norm = take("hidden_norm.weight")  # [hidden]
        self.norm = take("norm.weight")  # [hidden]
        self.layers = [_Layer(**{name.rsplit(".", 1)[-1]: take(f"layers.{i}.{name}.weight") for name in _LAYER_TENSORS})
                       for i in range(c.num_hidden_layers)]
        for name, t in (("embed_tokens", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(t.shape) != (c.vocab_size, h):
                raise CheckpointError(
                    f"target {name} has shape {tuple(t.shape)}, drafter expects ({c.vocab_size}, {h})"
                )
        self.embed_weight = embed_weight.to(device=device, dtype=dtype)  # [V, hidden]
        self.lm_head_weight = lm_head_weight.to(device=device, dtype=dtype)  # [V, hidden]
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=device) / c.head_dim
        self._rope = _Rope(inv_freq=1.0 / (c.rope_theta**exponents))  # [hd/2]
        self.graphs: ProposeGraphs | None = None

    def enable_graphs(self, rows: int, context: int, capture: bool | None = None) -> ProposeGraphs:
        """Keep up to ``rows`` contexts of up to ``context`` tokens in a GPU pool and propose over
        them from CUDA graphs (``capture=False``: the same pooled forward, eagerly; the CPU default).
        Contexts made before this keep their own storage."""
        c = self.config
        self.graphs = ProposeGraphs(
            self._block_forward, self._context_kv, c.num_features, c.num_hidden_layers, c.num_key_value_heads,
            c.head_dim, rows, context, (c.block_size - 1, c.vocab_size), self.dtype, self.device,
            capture=self.device.type == "cuda" if capture is None else capture)
        return self.graphs

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        drafter_dir: Path,
        target_dir: Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "DFlashDrafter":
        """Load a DFlash checkpoint and only the embedding and lm_head of its target.

        Pairing a drafter with the wrong target would silently produce garbage drafts (and zero
        acceptance), so every cross-checkpoint field is checked here with a message naming it.
        """
        drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
        config = check_pairing(drafter_dir, target_dir)
        tcfg = read_config(target_dir)
        weights = load_tensors(drafter_dir)
        tied = bool(tcfg.get("tie_word_embeddings", False))
        names = ["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.weight"]
        target = load_tensors(target_dir, names=names)
        embed = target["model.embed_tokens.weight"]
        lm_head = embed if tied else target["lm_head.weight"]
        try:
            return cls(config, weights, embed, lm_head, dtype=dtype, device=device)
        except CheckpointError as e:
            raise CheckpointError(f"{drafter_dir}: {e}") from e

    # ------------------------------------------------------------------ context cache
    def new_context(self) -> DraftContext:
        """An empty context: a row of the pool when graphs are on and one is free, else its own
        storage, allocated on the first extend. Give it back with :meth:`release_context`."""
        c = self.config
        row = self.graphs.acquire() if self.graphs is not None else None
        if row is not None:
            return DraftContext(keys=self.graphs.keys[:, row], values=self.graphs.values[:, row], row=row)
        empty = torch.zeros(
            c.num_hidden_layers, 0, c.num_key_value_heads, c.head_dim, dtype=self.dtype, device=self.device
        )  # [layers, 0, kvh, hd]
        return DraftContext(keys=empty, values=empty.clone())

    def release_context(self, ctx: DraftContext) -> None:
        """The request is done: its pool row (if any) goes back to the pool."""
        if ctx.row is not None and self.graphs is not None:
            self.graphs.release(ctx.row)
        ctx.row = None

    def extend_context(self, ctx: DraftContext, features: Tensor) -> None:
        """Append the context K/V of newly committed tokens, from their target features.

        features: [n, len(target_layer_ids) * hidden], in the order of `target_layer_ids`.
        """
        self.extend_contexts([ctx], [features])

    def extend_contexts(self, ctxs: Sequence[DraftContext], features: Sequence[Tensor]) -> None:
        """Batched `extend_context`: one projection over all requests' new tokens, then scatter
        (one replay when graphs are on and every context stays inside its pool row)."""
        if len(ctxs) != len(features):
            raise ValueError(f"got {len(ctxs)} contexts but {len(features)} feature tensors")
        c = self.config
        counts = [int(f.shape[0]) for f in features]
        for f in features:
            if f.dim() != 2 or f.shape[1] != c.num_features:
                raise ValueError(f"features must be [n, {c.num_features}], got {tuple(f.shape)}")
        total = sum(counts)
        if total == 0:
            return
        g = self.graphs
        if (g is not None and g.extend_bucket(total) is not None
                and all(cx.row is not None and cx.length + n <= cx.capacity for cx, n in zip(ctxs, counts))):
            rows = [cx.row for cx, n in zip(ctxs, counts) for _ in range(n)]
            positions = [p for cx, n in zip(ctxs, counts) for p in range(cx.length, cx.length + n)]
            g.extend([f for f in features if f.shape[0]], rows, positions)
            for cx, n in zip(ctxs, counts):
                cx.length += n
            return
        feats = torch.cat([f.to(device=self.device, dtype=self.dtype) for f in features])  # [N, n_feat*hidden]
        positions = torch.cat(
            [torch.arange(cx.length, cx.length + n, device=self.device) for cx, n in zip(ctxs, counts)]
        )  # [N]
        k_all, v_all = self._context_kv(feats, positions)  # [layers, N, kvh, hd] each
        start = 0
        for cx, n in zip(ctxs, counts):
            if n:
                if cx.row is not None and cx.length + n > cx.capacity:
                    # Outgrows its pool row: move to its own storage (it proposes eagerly from now).
                    cx.keys, cx.values = cx.keys[:, : cx.length].clone(), cx.values[:, : cx.length].clone()
                    self.release_context(cx)
                cx._reserve(cx.length + n)
                cx.keys[:, cx.length : cx.length + n] = k_all[:, start : start + n]
                cx.values[:, cx.length : cx.length + n] = v_all[:, start : start + n]
                cx.length += n
                start += n

    def _context_kv(self, feats: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Context keys and values of committed tokens from device tensors alone (capturable).

        feats: [N, n_feat*hidden] in the drafter's dtype; positions: [N] int64 context positions.
        Returns rotated, normalised keys and values, each [layers, N, kvh, hd].
        """
        c = self.config
        total = feats.shape[0]
        th = rms_norm(feats @ self.fc.T, self.hidden_norm, c.rms_norm_eps)  # [N, hidden]
        cos, sin = self._rope.cos_sin(positions, self.dtype)  # [N, hd]
        ks, vs = [], []
        for layer in self.layers:
            k = (th @ layer.k_proj.T).view(total, c.num_key_value_heads, c.head_dim)  # [N, kvh, hd]
            k = _apply_rope(rms_norm(k, layer.k_norm, c.rms_norm_eps), cos, sin)  # [N, kvh, hd]
            ks.append(k)
            vs.append((th @ layer.v_proj.T).view(total, c.num_key_value_heads, c.head_dim))  # [N, kvh, hd]
        return torch.stack(ks), torch.stack(vs)  # [layers, N, kvh, hd] each

    # ------------------------------------------------------------------ drafting
    def propose(self, ctxs: Sequence[DraftContext], bonus_tokens: Tensor) -> Tensor:
        """Draft logits for block positions 1..B-1 of every request, in one batched forward.

        Contexts are right-padded to the longest, rounded up to CONTEXT_BUCKET (a context bucket
        of the pool under graphs), and the padding keys masked out, so each row equals what that
        request would get alone. With graphs on and every context in the pool, one replay.
        bonus_tokens: [R] int64 (the pending token at position ctx.length).
        Returns [R, block_size - 1, V] logits (the drafter's dtype); from the graphs, a view that
        the next propose overwrites.
        """
        c = self.config
        R, B = len(ctxs), c.block_size
        if bonus_tokens.shape != (R,):
            raise ValueError(f"bonus_tokens must be [{R}], got {tuple(bonus_tokens.shape)}")
        if R == 0:
            return torch.zeros(0, B - 1, c.vocab_size, dtype=self.dtype, device=self.device)
        lens = [cx.length for cx in ctxs]
        g = self.graphs
        if g is not None and all(cx.row is not None for cx in ctxs) and g.bucket_for(R, max(lens)) is not None:
            return g.run([cx.row for cx in ctxs], lens, bonus_tokens.tolist())
        # Context keys padded to a multiple of CONTEXT_BUCKET (masked): the attention and matmul
        # shapes then change every 64 tokens, not every step, so per-shape costs on the GPU
        # (kernel selection and loading, attention plans) are paid once per bucket.
        l_max = -(-max(lens) // CONTEXT_BUCKET) * CONTEXT_BUCKET
        n_layers, kvh, hd = len(self.layers), c.num_key_value_heads, c.head_dim
        ctx_k = torch.zeros(n_layers, R, l_max, kvh, hd, dtype=self.dtype, device=self.device)  # [layers, R, Lmax, kvh, hd]
        ctx_v = torch.zeros_like(ctx_k)  # [layers, R, Lmax, kvh, hd]
        for r, cx in enumerate(ctxs):
            ctx_k[:, r, : cx.length] = cx.keys[:, : cx.length]
            ctx_v[:, r, : cx.length] = cx.values[:, : cx.length]
        lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)  # [R]
        bonus = bonus_tokens.to(device=self.device, dtype=torch.int64)  # [R]
        return self._block_forward(bonus, lens_t, lambda li: (ctx_k[li], ctx_v[li]), l_max)

    def _block_forward(self, bonus: Tensor, lens: Tensor,
                       context_kv: Callable[[int], tuple[Tensor, Tensor]], l_pad: int) -> Tensor:
        """The block forward from device tensors alone (no host sync, so the graphs capture it).

        bonus: [R] int64 pending tokens; lens: [R] int64 valid context tokens of each row;
        context_kv(layer): that layer's context keys and values, each [R, l_pad, kvh, hd], valid
        below ``lens`` (the rest is masked). Returns [R, block_size - 1, V] logits in the drafter's
        dtype: the tree builder normalises only the top of each row (``build_trees_from_logits``).
        """
        c = self.config
        R, B = bonus.shape[0], c.block_size
        dev, H, kvh, hd = self.device, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        ids = torch.full((R, B), c.mask_token_id, dtype=torch.int64, device=dev)  # [R, B]
        ids[:, 0] = bonus
        x = self.embed_weight[ids]  # [R, B, hidden]
        positions = lens[:, None] + torch.arange(B, device=dev)  # [R, B]
        cos, sin = self._rope.cos_sin(positions, self.dtype)  # [R, B, hd]
        ctx_valid = torch.arange(l_pad, device=dev)[None, :] < lens[:, None]  # [R, Lpad]
        block_valid = torch.ones(R, B, dtype=torch.bool, device=dev)  # [R, B]
        mask = torch.cat([ctx_valid, block_valid], dim=1)[:, None, None, :]  # [R, 1, 1, Lpad+B]

        for li, layer in enumerate(self.layers):
            ctx_k, ctx_v = context_kv(li)  # [R, Lpad, kvh, hd] each
            h = rms_norm(x, layer.input_layernorm, c.rms_norm_eps)  # [R, B, hidden]
            q = rms_norm((h @ layer.q_proj.T).view(R, B, H, hd), layer.q_norm, c.rms_norm_eps)  # [R, B, H, hd]
            q = _apply_rope(q, cos, sin)  # [R, B, H, hd]
            kb = rms_norm((h @ layer.k_proj.T).view(R, B, kvh, hd), layer.k_norm, c.rms_norm_eps)  # [R, B, kvh, hd]
            kb = _apply_rope(kb, cos, sin)  # [R, B, kvh, hd]
            vb = (h @ layer.v_proj.T).view(R, B, kvh, hd)  # [R, B, kvh, hd]
            attn = grouped_attention(q, torch.cat([ctx_k, kb], dim=1), torch.cat([ctx_v, vb], dim=1), mask)
            x = x + attn @ layer.o_proj.T  # [R, B, hidden]
            h = rms_norm(x, layer.post_attention_layernorm, c.rms_norm_eps)  # [R, B, hidden]
            x = x + (F.silu(h @ layer.gate_proj.T) * (h @ layer.up_proj.T)) @ layer.down_proj.T  # [R, B, hidden]
        x = rms_norm(x[:, 1:], self.norm, c.rms_norm_eps)  # [R, B-1, hidden]
        return x @ self.lm_head_weight.T  # [R, B-1, V] logits
