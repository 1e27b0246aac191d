"""A plain, slow, float64 DeepSeek-V3 forward: the ground truth the verifier is tested against.

Why it differs on purpose from ``model.py``: MLA is *not* absorbed (k_nope and v are
materialised per head from kv_b_proj, as HF does), there is no cache (the whole sequence is
recomputed, causal mask), and routed experts are computed densely for every token and mixed
with a dense [T, E] weight matrix. Agreement therefore checks absorption, paging, tree masks and
the sparse expert dispatch at once.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from services.common.int4 import unpack_int4
from services.verifier.config import TargetConfig
from services.verifier.model import load_checkpoint, validate_weights
from services.verifier.moe import select_experts
from services.verifier.rope import RotaryTable, apply_rope_interleaved, softmax_scale

__all__ = ["ReferenceModel"]


def _norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def _swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


class ReferenceModel:
    """Dense, non-absorbed, full-recompute DeepSeek-V3 forward in ``dtype`` (float64 by default)."""

    def __init__(self, config: TargetConfig, weights: dict[str, Tensor], dtype: torch.dtype = torch.float64) -> None:
        validate_weights(config, weights)
        self.config = config
        self.dtype = dtype
        self.w: dict[str, Tensor] = {}
        for name, t in weights.items():
            if name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                assert config.quantization is not None
                self.w[base + ".weight"] = unpack_int4(
                    t, weights[base + ".weight_scale"], tuple(weights[base + ".weight_shape"].tolist()),
                    config.quantization.group_size, dtype=dtype,
                )
            elif not name.endswith((".weight_scale", ".weight_shape")):
                self.w[name] = t.to(dtype)
        self.rope = RotaryTable(config, dtype, "cpu")
        self.scale = softmax_scale(config)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float64) -> "ReferenceModel":
        config, weights = load_checkpoint(Path(path))
        return cls(config, weights, dtype)

    def _attention(self, i: int, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        c, w = self.config, self.w
        a = f"model.layers.{i}.self_attn."
        T = h.shape[0]
        H, nope, rope, v, kvr = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is None:
            q = h @ w[a + "q_proj.weight"].T  # [T, H*(nope+rope)]
        else:
            qa = _norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], c.rms_norm_eps)  # [T, q_lora]
            q = qa @ w[a + "q_b_proj.weight"].T  # [T, H*(nope+rope)]
        q = q.view(T, H, nope + rope).transpose(0, 1)  # [H, T, nope+rope]
        q_pe = apply_rope_interleaved(q[..., nope:], cos, sin)  # [H, T, rope]
        kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T  # [T, kvr+rope]
        c_kv = _norm(kv[:, :kvr], w[a + "kv_a_layernorm.weight"], c.rms_norm_eps)  # [T, kvr]
        k_pe = apply_rope_interleaved(kv[:, kvr:], cos, sin)  # [T, rope]
        kvb = (c_kv @ w[a + "kv_b_proj.weight"].T).view(T, H, nope + v).transpose(0, 1)  # [H, T, nope+v]
        k = torch.cat([kvb[..., :nope], k_pe.expand(H, T, rope)], dim=-1)  # [H, T, nope+rope]
        qf = torch.cat([q[..., :nope], q_pe], dim=-1)  # [H, T, nope+rope]
        scores = (qf @ k.transpose(1, 2)) * self.scale  # [H, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)  # [H, T, T]
        out = (probs @ kvb[..., nope:]).transpose(0, 1).reshape(T, H * v)  # [T, H*v]
        return out @ w[a + "o_proj.weight"].T  # [T, hidden]

    def _moe(self, i: int, x: Tensor) -> Tensor:
        c, w = self.config, self.w
        m = f"model.layers.{i}.mlp."
        E = c.n_routed_experts or 0
        scores = torch.sigmoid(x @ w[m + "gate.weight"].T)  # [T, E]
        routing = select_experts(
            scores, w[m + "gate.e_score_correction_bias"], c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )
        mix = torch.zeros_like(scores).scatter_(1, routing.ids, routing.weights)  # [T, E] dense routing weights
        out = torch.zeros_like(x)
        for j in range(E):
            e = f"{m}experts.{j}."
            y = _swiglu(x, w[e + "gate_proj.weight"], w[e + "up_proj.weight"], w[e + "down_proj.weight"])  # [T, hidden]
            out = out + mix[:, j : j + 1] * y
        if c.n_shared_experts:
            s = m + "shared_experts."
            out = out + _swiglu(x, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
        return out

    @torch.inference_mode()
    def forward(self, input_ids: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Logits ``[T, V]`` and HF-style hidden states (index 0 embeddings, last one after the final norm)."""
        c, w = self.config, self.w
        ids = torch.as_tensor(input_ids, dtype=torch.int64).flatten()  # [T]
        T = ids.numel()
        cos, sin = self.rope.lookup(torch.arange(T))  # [T, rope]
        x = w["model.embed_tokens.weight"][ids]  # [T, hidden]
        hidden_states = [x]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, _norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps), cos, sin)
            h = _norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            if c.is_moe_layer(i):
                x = x + self._moe(i, h)
            else:
                x = x + _swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
            hidden_states.append(x)
        x = _norm(x, w["model.norm.weight"], c.rms_norm_eps)
        hidden_states[-1] = x
        return x @ w["lm_head.weight"].T, hidden_states

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``prompt`` (full recompute each step: slow, obviously right)."""
        ids = list(prompt)
        out: list[int] = []
        for _ in range(n):
            logits, _ = self.forward(torch.tensor(ids))
            tok = int(logits[-1].argmax())
            out.append(tok)
            ids.append(tok)
        return out
