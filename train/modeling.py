"""Training-mode forwards of the demo target (DeepSeek-V3) and its DFlash drafter.

Why separate from the serving code: training wants batched ``[B, T]`` tensors, autograd, bf16
autocast and dense expert compute (every expert on every token, mixed by the routing weights,
which gives the same result and gradients as sparse dispatch and is three large GEMMs on a GPU).
The serving code wants a paged cache, absorbed MLA and sparse dispatch. What the two share is
reused from ``services`` so the semantics cannot drift: rope tables and the interleaved rope,
the softmax scale, grouped sigmoid routing (``select_experts``) and the INT4 packing. Weights are
kept under their HF names, so ``hf_weights`` saves straight into the checkpoint that
``TargetModel.load`` / ``DFlashDrafter.load`` read; ``train/train_*.py`` check the agreement
numerically after saving.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.common.int4 import pack_int4, unpack_int4
from services.draft.dflash import grouped_attention
from services.draft.config import DraftConfig
from services.verifier.config import TargetConfig
from services.verifier.model import expected_tensors
from services.verifier.moe import select_experts
from services.verifier.rope import RotaryTable, apply_rope_interleaved, softmax_scale

__all__ = [
    "TrainTarget",
    "TrainDrafter",
    "KVCache",
    "fake_int4",
    "rms_norm",
    "INT4_GROUP",
]

INT4_GROUP = 32
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF RMSNorm: statistics in float32, the scale applied to the input dtype (as services do)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fake_int4(w: Tensor, group: int = INT4_GROUP) -> Tensor:
    """Straight-through fake quantisation, value-identical to ``pack_int4(w, group, bfloat16)``.

    w: [..., out, in] float. Forward returns the INT4-dequantised weight; backward passes the
    gradient to ``w`` unchanged (straight-through estimator).
    """
    shape = w.shape
    g = w.float().reshape(*shape[:-1], shape[-1] // group, group)  # [..., out, G, group]
    scale = (g.abs().amax(dim=-1, keepdim=True) / 7.0).clamp_min(1e-12).to(torch.bfloat16).float()  # [..., out, G, 1]
    wq = (torch.round(g / scale).clamp(-7, 7) * scale).reshape(shape)  # [..., out, in]
    return w + (wq.to(w.dtype) - w).detach()


def _key(name: str) -> str:
    return name.replace(".", "__")



def _init_weight(name: str, shape: tuple[int, ...], g: torch.Generator, out_std: float) -> Tensor:
    """Norms start at one; output projections (o_proj, down_proj) at the depth-scaled `out_std`,
    so the residual stream's variance does not grow with depth; everything else at 0.02."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
    return torch.randn(shape, generator=g) * std

class KVCache:
    """Per-layer K/V of an incremental greedy rollout (all rows of the batch share one length).

    Buffers are allocated once for ``capacity`` positions and written in place: concatenating a
    growing cache every step copies all of it, which made a rollout quadratic in its length (a
    1664-token rollout of 512 rows spent most of its time in those copies).
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity = capacity
        self.k: list[Tensor | None] = [None] * num_layers  # each [B, H, capacity, nope+rope]
        self.v: list[Tensor | None] = [None] * num_layers  # each [B, H, capacity, v]
        self.filled = [0] * num_layers

    @property
    def length(self) -> int:
        return self.filled[0]

    def append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store layer ``i``'s new keys/values ``[B, H, T, *]``; returns views of every key/value so far."""
        if self.k[i] is None:
            B, H = k.shape[:2]
            self.k[i] = k.new_empty(B, H, self.capacity, k.shape[-1])
            self.v[i] = v.new_empty(B, H, self.capacity, v.shape[-1])
        t0, t1 = self.filled[i], self.filled[i] + k.shape[2]
        if t1 > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {t1}")
        self.k[i][:, :, t0:t1] = k
        self.v[i][:, :, t0:t1] = v
        self.filled[i] = t1
        return self.k[i][:, :, :t1], self.v[i][:, :, :t1]


class TrainTarget(nn.Module):
    """DeepSeek-V3 decoder for training: MLA non-absorbed, dense expert compute, HF weight names.

    Routed experts are stacked per layer as ``[E, out, in]`` parameters; with ``qat`` set they pass
    through :func:`fake_int4` in the forward. ``e_score_correction_bias`` is a buffer moved by the
    aux-loss-free load-balancing rule (``update_router_bias``).
    """

    def __init__(self, config: TargetConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = dataclasses.replace(config, quantization=None)  # dense shapes
        c = self.config
        self.qat = False
        self.params = nn.ParameterDict()
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * c.num_hidden_layers)
        for name, shape in expected_tensors(c).items():
            if ".experts." in name:
                continue
            if name.endswith("e_score_correction_bias"):
                self.register_buffer(_key(name), torch.zeros(shape))
                continue
            self.params[_key(name)] = nn.Parameter(_init_weight(name, shape, g, out_std))
        E, I, D = c.n_routed_experts or 0, c.moe_intermediate_size, c.hidden_size
        for i in range(c.num_hidden_layers):
            if not c.is_moe_layer(i):
                continue
            for proj in EXPERT_PROJS:
                shape = (E, D, I) if proj == "down_proj" else (E, I, D)
                std = out_std if proj == "down_proj" else 0.02
                self.params[_key(f"model.layers.{i}.mlp.experts.{proj}")] = nn.Parameter(
                    torch.randn(shape, generator=g) * std)
        rope = RotaryTable(c, torch.float64, "cpu")  # cast with the model, like TargetModel
        self.register_buffer("rope_cos", rope.cos, persistent=False)  # [P, rope]
        self.register_buffer("rope_sin", rope.sin, persistent=False)  # [P, rope]
        self.scale = softmax_scale(c)
        self.expert_load: dict[int, Tensor] = {}  # layer -> [E] tokens routed in the last forward

    # ------------------------------------------------------------------ weights in / out
    def w(self, name: str) -> Tensor:
        return self.params[_key(name)]

    def bias(self, i: int) -> Tensor:
        return getattr(self, _key(f"model.layers.{i}.mlp.gate.e_score_correction_bias"))

    def experts(self, i: int, proj: str) -> Tensor:
        w = self.params[_key(f"model.layers.{i}.mlp.experts.{proj}")]  # [E, out, in]
        return fake_int4(w) if self.qat else w

    @torch.no_grad()
    def hf_weights(self, int4: bool) -> dict[str, Tensor]:
        """HF-named tensors as shipped: bf16, float32 router bias, INT4 (or bf16) routed experts."""
        c = self.config
        out: dict[str, Tensor] = {}
        for name in expected_tensors(c):
            if ".experts." in name:
                continue
            if name.endswith("e_score_correction_bias"):
                out[name] = getattr(self, _key(name)).detach().float().cpu()
            else:
                out[name] = self.w(name).detach().to(torch.bfloat16).cpu()
        for i in range(c.num_hidden_layers):
            if not c.is_moe_layer(i):
                continue
            for proj in EXPERT_PROJS:
                stacked = self.params[_key(f"model.layers.{i}.mlp.experts.{proj}")].detach().float().cpu()
                for j in range(stacked.shape[0]):
                    base = f"model.layers.{i}.mlp.experts.{j}.{proj}"
                    if int4:
                        q = pack_int4(stacked[j], group_size=INT4_GROUP, scale_dtype=torch.bfloat16)
                        out[base + ".weight_packed"] = q.packed
                        out[base + ".weight_scale"] = q.scale
                        out[base + ".weight_shape"] = torch.tensor(q.shape, dtype=torch.int64)
                    else:
                        out[base + ".weight"] = stacked[j].to(torch.bfloat16)
        return out

    @classmethod
    def from_hf(cls, config: TargetConfig, weights: dict[str, Tensor]) -> "TrainTarget":
        """A float32 model holding exactly the checkpoint's values (INT4 experts dequantised)."""
        m = cls(config)
        c = m.config
        with torch.no_grad():
            for name in expected_tensors(c):
                if ".experts." in name:
                    continue
                if name.endswith("e_score_correction_bias"):
                    getattr(m, _key(name)).copy_(weights[name].float())
                else:
                    m.w(name).copy_(weights[name].float())
            for i in range(c.num_hidden_layers):
                if not c.is_moe_layer(i):
                    continue
                for proj in EXPERT_PROJS:
                    rows = []
                    for j in range(c.n_routed_experts or 0):
                        base = f"model.layers.{i}.mlp.experts.{j}.{proj}"
                        if base + ".weight_packed" in weights:
                            rows.append(unpack_int4(weights[base + ".weight_packed"], weights[base + ".weight_scale"],
                                                    weights[base + ".weight_shape"], INT4_GROUP, dtype=torch.float32))
                        else:
                            rows.append(weights[base + ".weight"].float())
                    m.params[_key(f"model.layers.{i}.mlp.experts.{proj}")].copy_(torch.stack(rows))
        return m

    # ------------------------------------------------------------------ forward
    def _attention(self, i: int, h: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None) -> Tensor:
        c = self.config
        a = f"model.layers.{i}.self_attn."
        B, T, _ = h.shape
        H, nope, rope, vd, kvr = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q = h @ self.w(a + "q_proj.weight").T  # [B, T, H*(nope+rope)]
        else:
            qa = rms_norm(h @ self.w(a + "q_a_proj.weight").T, self.w(a + "q_a_layernorm.weight"), c.rms_norm_eps)
            q = qa @ self.w(a + "q_b_proj.weight").T  # [B, T, H*(nope+rope)]
        q = q.view(B, T, H, nope + rope).transpose(1, 2)  # [B, H, T, nope+rope]
        q_pe = apply_rope_interleaved(q[..., nope:], cos.to(q.dtype), sin.to(q.dtype))  # [B, H, T, rope]
        kv = h @ self.w(a + "kv_a_proj_with_mqa.weight").T  # [B, T, kvr+rope]
        c_kv = rms_norm(kv[..., :kvr], self.w(a + "kv_a_layernorm.weight"), c.rms_norm_eps)  # [B, T, kvr]
        k_pe = apply_rope_interleaved(kv[..., kvr:], cos.to(kv.dtype), sin.to(kv.dtype))  # [B, T, rope]
        kvb = (c_kv @ self.w(a + "kv_b_proj.weight").T).view(B, T, H, nope + vd).transpose(1, 2)  # [B, H, T, nope+v]
        dt = kvb.dtype
        k = torch.cat([kvb[..., :nope], k_pe.to(dt).unsqueeze(1).expand(B, H, T, rope)], dim=-1)  # [B, H, T, nope+rope]
        qf = torch.cat([q[..., :nope].to(dt), q_pe.to(dt)], dim=-1)  # [B, H, T, nope+rope]
        v = kvb[..., nope:]  # [B, H, T, v]
        causal = True
        if cache is not None:
            if cache.filled[i]:
                assert T == 1, "incremental decode takes one token per step after the prefill"
                causal = False
            k, v = cache.append(i, k, v)
        out = F.scaled_dot_product_attention(qf, k, v, is_causal=causal and T > 1, scale=self.scale)  # [B, H, T, v]
        out = out.transpose(1, 2).reshape(B, T, H * vd)  # [B, T, H*v]
        return out @ self.w(a + "o_proj.weight").T  # [B, T, hidden]

    def _mlp(self, prefix: str, x: Tensor) -> Tensor:
        return (F.silu(x @ self.w(prefix + "gate_proj.weight").T) * (x @ self.w(prefix + "up_proj.weight").T)) \
            @ self.w(prefix + "down_proj.weight").T

    def _moe(self, i: int, x: Tensor) -> Tensor:
        c = self.config
        m = f"model.layers.{i}.mlp."
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # [N, hidden]
        N, E, I = xf.shape[0], c.n_routed_experts or 0, c.moe_intermediate_size
        with torch.autocast(device_type=xf.device.type, enabled=False):
            rdt = torch.promote_types(xf.dtype, torch.float32)
            scores = torch.sigmoid(xf.to(rdt) @ self.w(m + "gate.weight").to(rdt).T)  # [N, E]
            routing = select_experts(scores, self.bias(i).to(rdt), c.num_experts_per_tok, c.n_group, c.topk_group,
                                     c.norm_topk_prob, c.routed_scaling_factor)
            mix = torch.zeros_like(scores).scatter(1, routing.ids, routing.weights)  # [N, E]
        if self.training:
            self.expert_load[i] = torch.bincount(routing.ids.flatten(), minlength=E).detach()  # [E]
        wg, wu, wd = self.experts(i, "gate_proj"), self.experts(i, "up_proj"), self.experts(i, "down_proj")
        # Every expert on every token, mixed by the (mostly zero) routing weights: three GEMMs.
        gate = xf @ wg.reshape(E * I, -1).T  # [N, E*I]
        up = xf @ wu.reshape(E * I, -1).T  # [N, E*I]
        act = (F.silu(gate) * up).view(N, E, I) * mix.to(gate.dtype).unsqueeze(-1)  # [N, E, I]
        out = act.reshape(N, E * I) @ wd.permute(0, 2, 1).reshape(E * I, -1)  # [N, hidden]
        out = out.view(shape)
        if c.n_shared_experts:
            out = out + self._mlp(m + "shared_experts.", x)
        return out

    def forward(self, ids: Tensor, cache: KVCache | None = None,
                feature_layers: Sequence[int] = ()) -> tuple[Tensor, Tensor | None]:
        """Logits ``[B, T, V]`` and the features ``[B, T, len(feature_layers)*hidden]`` (HF
        hidden_states[i+1] convention: the last layer's after the final norm), or None.

        ids: [B, T] int64. With ``cache`` the positions continue from ``cache.length``.
        """
        c = self.config
        B, T = ids.shape
        start = 0 if cache is None else cache.length
        pos = torch.arange(start, start + T, device=ids.device)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [T, rope]
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))  # [B, T, hidden]
        kept: dict[int, Tensor] = {}
        L = c.num_hidden_layers
        for i in range(L):
            p = f"model.layers.{i}."
            x = x + self._attention(i, rms_norm(x, self.w(p + "input_layernorm.weight"), c.rms_norm_eps), cos, sin, cache)
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            x = x + (self._moe(i, h) if c.is_moe_layer(i) else self._mlp(p + "mlp.", h))
            if i in feature_layers:
                kept[i] = x
        x = rms_norm(x, self.w("model.norm.weight"), c.rms_norm_eps)
        if L - 1 in kept:
            kept[L - 1] = x
        logits = x @ self.w("lm_head.weight").T  # [B, T, V]
        feats = torch.cat([kept[i] for i in feature_layers], dim=-1) if feature_layers else None
        return logits, feats

    @torch.no_grad()
    def update_router_bias(self, rate: float) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts, lower over-loaded."""
        for i, load in self.expert_load.items():
            load = load.float()
            self.bias(i).add_(rate * torch.sign(load.mean() - load))
        self.expert_load.clear()

    @torch.no_grad()
    def greedy(self, prompt: Tensor, n: int) -> Tensor:
        """Greedy continuation ``[B, n]`` of equal-length prompts ``[B, P]`` (incremental KV cache)."""
        cache = KVCache(self.config.num_hidden_layers, prompt.shape[1] + n)
        logits, _ = self.forward(prompt, cache)
        tok = logits[:, -1].argmax(-1)  # [B]
        out = [tok]
        for _ in range(n - 1):
            logits, _ = self.forward(tok[:, None], cache)
            tok = logits[:, -1].argmax(-1)
            out.append(tok)
        return torch.stack(out, dim=1)  # [B, n]


# ============================================================================ drafter


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class TrainDrafter(nn.Module):
    """DFlash drafter (Qwen3-style layers) with a batched multi-anchor training forward.

    Same weights, names and math as ``services.draft.dflash.DFlashDrafter``: context tokens enter
    every layer only as keys/values projected from ``hidden_norm(fc(features))``; a block is
    ``[bonus, mask x (B-1)]`` at positions ``L .. L+B-1`` attending to context ``0 .. L-1`` and to
    its whole block (non-causal). The embedding and lm_head are the frozen target's.
    """

    def __init__(self, cfg: dict, embed: Tensor, lm_head: Tensor, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        c = DraftConfig.from_hf(cfg)   # as the server reads it: block_size in either place, rope_parameters
        h, n_feat = c.hidden_size, c.num_features
        H, kvh, hd, inter = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        self.H, self.kvh, self.hd, self.eps = H, kvh, hd, c.rms_norm_eps
        self.block = c.block_size
        self.mask_id = c.mask_token_id
        g = torch.Generator().manual_seed(seed)
        L = c.num_hidden_layers
        out_std = 0.02 / math.sqrt(2 * L)
        shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, n_feat), "hidden_norm.weight": (h,), "norm.weight": (h,)}
        for i in range(L):
            p = f"layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (H * hd, h), p + "self_attn.k_proj.weight": (kvh * hd, h),
                p + "self_attn.v_proj.weight": (kvh * hd, h), p + "self_attn.o_proj.weight": (h, H * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            })
        self.params = nn.ParameterDict()
        for name, shape in shapes.items():
            self.params[_key(name)] = nn.Parameter(_init_weight(name, shape, g, out_std))
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)  # [V, hidden]
        self.register_buffer("lm_head", lm_head.detach().float().clone(), persistent=False)  # [V, hidden]
        exps = torch.arange(0, hd, 2, dtype=torch.float32) / hd
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** exps), persistent=False)  # [hd/2]
        self.num_layers = L

    def w(self, name: str) -> Tensor:
        return self.params[_key(name)]

    def hf_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
        return {k.replace("__", "."): v.detach().to(dtype).cpu() for k, v in self.params.items()}

    @classmethod
    def from_hf(cls, cfg: dict, weights: dict[str, Tensor], embed: Tensor, lm_head: Tensor) -> "TrainDrafter":
        m = cls(cfg, embed, lm_head)
        with torch.no_grad():
            for name, t in weights.items():
                m.w(name).copy_(t.float())
        return m

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, n, heads, hd]; cos/sin [B, n, hd] or [n, hd]."""
        return x * cos.unsqueeze(-2) + _rotate_half(x) * sin.unsqueeze(-2)

    def forward(self, features: Tensor, tokens: Tensor, anchors: Tensor) -> Tensor:
        """Logits ``[B, K, block-1, V]`` for block positions 1..block-1 of each anchor.

        features: [B, S, n_feat*hidden] target features of the sequence's tokens 0..S-1.
        tokens:   [B, S] int64 the sequence; anchor L's bonus token is tokens[:, L].
        anchors:  [B, K] int64 positions L (context = tokens 0..L-1); L + block <= S is not required.
        """
        B, S, _ = features.shape
        K, Bk = anchors.shape[1], self.block
        H, kvh, hd, eps = self.H, self.kvh, self.hd, self.eps
        dev = features.device
        th = rms_norm(features @ self.w("fc.weight").T, self.w("hidden_norm.weight"), eps)  # [B, S, hidden]
        ctx_pos = torch.arange(S, device=dev)  # [S]
        blk_pos = (anchors[:, :, None] + torch.arange(Bk, device=dev)).reshape(B, K * Bk)  # [B, K*Bk]
        ids = torch.full((B, K, Bk), self.mask_id, dtype=torch.int64, device=dev)  # [B, K, Bk]
        ids[:, :, 0] = tokens.gather(1, anchors)
        x = F.embedding(ids.reshape(B, K * Bk), self.embed)  # [B, K*Bk, hidden]
        # Query (k, j) sees context s < L_k and every position of its own block k.
        ctx_ok = ctx_pos[None, None, :] < anchors[:, :, None]  # [B, K, S]
        ctx_ok = ctx_ok[:, :, None, :].expand(B, K, Bk, S).reshape(B, K * Bk, S)
        blk_id = torch.arange(K, device=dev).repeat_interleave(Bk)  # [K*Bk]
        blk_ok = (blk_id[:, None] == blk_id[None, :]).expand(B, K * Bk, K * Bk)
        mask = torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]  # [B, 1, K*Bk, S+K*Bk]
        c_cos, c_sin = self._cos_sin(ctx_pos, torch.float32)  # [S, hd]
        b_cos, b_sin = self._cos_sin(blk_pos, torch.float32)  # [B, K*Bk, hd]
        Q = K * Bk
        for li in range(self.num_layers):
            p = f"layers.{li}."
            kc = (th @ self.w(p + "self_attn.k_proj.weight").T).view(B, S, kvh, hd)
            kc = self._rope(rms_norm(kc, self.w(p + "self_attn.k_norm.weight"), eps), c_cos, c_sin)  # [B, S, kvh, hd]
            vc = (th @ self.w(p + "self_attn.v_proj.weight").T).view(B, S, kvh, hd)  # [B, S, kvh, hd]
            h = rms_norm(x, self.w(p + "input_layernorm.weight"), eps)  # [B, Q, hidden]
            q = rms_norm((h @ self.w(p + "self_attn.q_proj.weight").T).view(B, Q, H, hd), self.w(p + "self_attn.q_norm.weight"), eps)
            q = self._rope(q, b_cos, b_sin)  # [B, Q, H, hd]
            kb = rms_norm((h @ self.w(p + "self_attn.k_proj.weight").T).view(B, Q, kvh, hd), self.w(p + "self_attn.k_norm.weight"), eps)
            kb = self._rope(kb, b_cos, b_sin)  # [B, Q, kvh, hd]
            vb = (h @ self.w(p + "self_attn.v_proj.weight").T).view(B, Q, kvh, hd)  # [B, Q, kvh, hd]
            k = torch.cat([kc.to(kb.dtype), kb], dim=1)  # [B, S+Q, kvh, hd]
            v = torch.cat([vc.to(vb.dtype), vb], dim=1)  # [B, S+Q, kvh, hd]
            attn = grouped_attention(q.to(k.dtype), k, v, mask)  # [B, Q, H*hd]
            x = x + attn @ self.w(p + "self_attn.o_proj.weight").T
            h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), eps)
            x = x + (F.silu(h @ self.w(p + "mlp.gate_proj.weight").T) * (h @ self.w(p + "mlp.up_proj.weight").T)) \
                @ self.w(p + "mlp.down_proj.weight").T
        x = x.view(B, K, Bk, -1)[:, :, 1:]  # [B, K, Bk-1, hidden]
        x = rms_norm(x, self.w("norm.weight"), eps)
        return x @ self.lm_head.T  # [B, K, Bk-1, V]
