"""The target model (DeepSeek-V3 / Kimi-K2 architecture) as the verifier runs it.

Why absorbed MLA over a paged latent cache: verification attends many tree nodes x heads to a
long shared prefix; folding W_UK into the query and W_UV after attention means the cache holds
one latent vector per token and is read once for all heads. The forward pass is
pure with respect to the cache: it returns every query token's latent kv in ``new_kv`` and the
engine commits only the accepted path with ``PagedKVCache.write``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kernels.mla_norm_rope import fusable as mla_fusable, mla_norm_rope
from kernels.rms_norm import add_rms_norm, rms_norm  # one Triton launch on CUDA, torch elsewhere
from kernels.skinny_gemm import skinny_linear  # x @ w^T: one Triton launch for a few rows on CUDA, torch elsewhere
from kernels.tree_mla import TreeAttentionDeviceMetadata, TreeAttentionMetadata, tree_mla
from services.common.checkpoint import CheckpointError, tensor_index
from services.verifier.config import TargetConfig, read_target_config
from services.verifier.kv_cache import PagedKVCache
from services.verifier.moe import MLPWeights, MoEWeights, fused_config, mlp_forward, moe_forward, uses_fused_kernel
from services.verifier.parallel import TensorParallel, load_rank_slice
from services.verifier.rope import RotaryTable, apply_rope, softmax_scale

__all__ = [
    "ForwardBatch",
    "ForwardOutput",
    "TargetModel",
    "AttentionWeights",
    "DecoderLayerWeights",
    "rms_norm",
    "expected_tensors",
    "validate_weights",
    "check_tensor_names",
    "load_checkpoint",
]


# ----------------------------------------------------------------------------- checkpoint layout


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_tensors(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape the config implies (INT4 experts as packed/scale/shape triples)."""
    c = config
    H, hid = c.num_attention_heads, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, hid),
        "model.norm.weight": (hid,),
        "lm_head.weight": (c.vocab_size, hid),
    }
    for i in range(c.num_hidden_layers):
        p = _layer_prefix(i)
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (hid,)
        shapes[p + "post_attention_layernorm.weight"] = (hid,)
        if c.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (H * c.qk_head_dim, hid)
        else:
            shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, hid)
            shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (H * c.qk_head_dim, c.q_lora_rank)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (c.kv_dim, hid)
        shapes[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (hid, H * c.v_head_dim)
        m = p + "mlp."
        if not c.is_moe_layer(i):
            I = c.intermediate_size
            shapes.update({m + "gate_proj.weight": (I, hid), m + "up_proj.weight": (I, hid), m + "down_proj.weight": (hid, I)})
            continue
        E, I = c.n_routed_experts or 0, c.moe_intermediate_size
        shapes[m + "gate.weight"] = (E, hid)
        shapes[m + "gate.e_score_correction_bias"] = (E,)
        for j in range(E):
            for proj, (out_f, in_f) in (("gate_proj", (I, hid)), ("up_proj", (I, hid)), ("down_proj", (hid, I))):
                name = f"{m}experts.{j}.{proj}"
                if c.quantization is not None:
                    gs = c.quantization.group_size
                    shapes[name + ".weight_packed"] = (out_f, in_f // 8)
                    shapes[name + ".weight_scale"] = (out_f, in_f // gs)
                    shapes[name + ".weight_shape"] = (2,)
                else:
                    shapes[name + ".weight"] = (out_f, in_f)
        if c.n_shared_experts:
            S = c.shared_intermediate_size
            s = m + "shared_experts."
            shapes.update({s + "gate_proj.weight": (S, hid), s + "up_proj.weight": (S, hid), s + "down_proj.weight": (hid, S)})
    return shapes


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# What each kind of tensor may be stored as; another dtype was converted without a word (an integer
# embedding, FP8 projections without their scales) and served wrong numbers.
_DTYPES = {"weight_packed": (torch.int32,), "weight_shape": (torch.int32, torch.int64), "weight_scale": _FLOATS}
# Tensors of a quantisation this loader does not implement: ignored, they served wrong numbers.
_UNSUPPORTED_SUFFIXES = (".weight_g_idx", ".weight_zero_point")


def dtype_error(name: str, dtype: torch.dtype | str, where: str) -> CheckpointError | None:
    """Why ``name`` cannot be stored as ``dtype`` (a str: a safetensors header's name torch has no
    dtype for), or None."""
    allowed = _DTYPES.get(name.rsplit(".", 1)[-1], _FLOATS)
    if dtype in allowed:
        return None
    names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
    got = str(dtype).removeprefix("torch.")
    return CheckpointError(f"{where}: tensor {name} is {got}; expected {names}")


def check_tensor_names(config: TargetConfig, expected: Mapping[str, tuple[int, ...]], index: Mapping[str, str],
                       where: str) -> None:
    """CheckpointError where the checkpoint's tensor names and the config disagree: a tensor the
    config implies is missing, a tensor of a quantisation the loader does not implement (activation-
    ordered groups, zero points), or one in a served layer that the config does not imply. That last
    one would be left unread: a config without its ``n_shared_experts`` loaded without the shared
    experts and served other numbers than the checkpoint's. MTP layers past ``num_hidden_layers``
    are not served and are skipped (``num_nextn_predict_layers`` of them: any further layer means a
    ``num_hidden_layers`` smaller than the checkpoint's, which served a truncated model).
    ``expected``: ``expected_tensors(config)``."""
    missing = [n for n in expected if n not in index]
    if missing:
        first = missing[0]
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {first}{more}{_missing_hint(config, first, index)}")
    unread = []
    mtp = range(config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers)
    for name in index:
        if name in expected or name.endswith(_IGNORED_SUFFIXES) or _layer_of(name) in mtp:
            continue
        if name.endswith(_UNSUPPORTED_SUFFIXES):
            raise CheckpointError(f"{where}: tensor {name}: {name.rsplit('.', 1)[-1]} is not supported "
                                  "(symmetric INT4 groups in order only)")
        if _layer_of(name) >= 0 or name.startswith(_OUTER_MODULES):   # e.g. an lm_head.bias, never added
            unread.append(name)
    if unread:
        more = f" (+{len(unread) - 1} more)" if len(unread) > 1 else ""
        raise CheckpointError(f"{where}: tensor {unread[0]}{more} is not one config.json implies, and would be left "
                              f"unread (does the config match the checkpoint?{_unread_hint(config, unread[0])})")


_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)   # a buffer older exports saved; recomputed from the config
_OUTER_MODULES = ("lm_head.", "model.norm.", "model.embed_tokens.")   # the served modules outside the layers


def _layer_of(name: str) -> int:
    """The decoder layer ``model.layers.{i}.*`` belongs to, or -1 for a tensor outside the layers."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1


def _missing_hint(config: TargetConfig, name: str, index: Mapping[str, str]) -> str:
    """Which config field most likely disagrees with the checkpoint, where a tensor is missing."""
    if name.endswith(".weight") and name + "_packed" in index:
        if ".mlp.experts." in name:
            return (f": the checkpoint holds the routed experts INT4-quantised ({name}_packed), and config.json "
                    "has no quantization_config (compressed-tensors, pack-quantized) saying so")
        return (f": the checkpoint holds it INT4-quantised ({name}_packed), and this loader reads INT4 for "
                "the routed experts only (quantization_config.ignore must list every other layer)")
    if name.endswith(".weight_packed") and name.removesuffix("_packed") in index:
        return (f": config.json's quantization_config says INT4 routed experts, and the checkpoint holds them "
                f"dense ({name.removesuffix('_packed')})")
    if name.endswith(".self_attn.q_proj.weight") and name.replace(".q_proj.", ".q_a_proj.") in index:
        return ": the checkpoint has a q LoRA (q_a_proj / q_b_proj), and config.json's q_lora_rank is null or missing"
    if name.endswith(".self_attn.q_a_proj.weight") and name.replace(".q_a_proj.", ".q_proj.") in index:
        return f": the checkpoint has no q LoRA (q_proj), and config.json's q_lora_rank is {config.q_lora_rank}"
    return ""


def _unread_hint(config: TargetConfig, name: str) -> str:
    if _layer_of(name) >= config.num_hidden_layers:
        return (f" num_hidden_layers is {config.num_hidden_layers}, num_nextn_predict_layers "
                f"{config.num_nextn_predict_layers}")
    if ".mlp.shared_experts." in name:
        return f" n_shared_experts is {config.n_shared_experts}"
    if ".mlp.experts." in name or ".mlp.gate." in name:
        return (f" n_routed_experts {config.n_routed_experts}, first_k_dense_replace {config.first_k_dense_replace},"
                f" moe_layer_freq {config.moe_layer_freq}")
    return ""


def validate_weights(
    config: TargetConfig, weights: dict[str, Tensor], where: Callable[[str], str] | None = None
) -> None:
    """CheckpointError for a missing tensor, a shape the config contradicts, or a bad INT4 triple.

    ``where(name)`` says where a tensor came from (directory/file) for the message.
    """
    where = where or (lambda name: "weights")
    for name, shape in expected_tensors(config).items():
        if name not in weights:
            raise CheckpointError(f"{where(name)}: missing tensor {name}")
        t = weights[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{where(name)}: tensor {name} has shape {tuple(t.shape)}, config implies {shape}")
        if (bad := dtype_error(name, t.dtype, where(name))) is not None:
            raise bad
        if name.endswith(".weight_shape"):
            dense = tuple(int4_dense_shape(name, config))
            if tuple(int(v) for v in t.tolist()) != dense:
                raise CheckpointError(f"{where(name)}: tensor {name} holds {t.tolist()}, config implies {list(dense)}")


def int4_dense_shape(name: str, config: TargetConfig) -> tuple[int, int]:
    """Dense (out, in) of a routed expert projection named ``...experts.{j}.{proj}.weight_shape``."""
    hid, I = config.hidden_size, config.moe_intermediate_size
    return (hid, I) if ".down_proj." in name else (I, hid)


def load_checkpoint(path: Path) -> tuple[TargetConfig, dict[str, Tensor]]:
    """Read and validate config + the tensors the config needs (extra tensors, e.g. MTP, are skipped).
    Read as one rank of one: every header is checked before any data is read, as the ranks of a
    group check theirs (a last shard missing was found only after all the others had been read)."""
    from services.verifier.parallel import load_rank_slice

    path = Path(path)
    config = read_target_config(path)
    index = tensor_index(path)
    weights = load_rank_slice(path, config, expected_tensors(config), rank=0, size=1)
    validate_weights(config, weights, where=lambda name: str(path / index.get(name, "?")))
    return config, weights


# ----------------------------------------------------------------------------- forward pieces


@dataclass
class ForwardBatch:
    """Flat query tokens of all requests plus the attention metadata describing them."""

    input_ids: Tensor  # [N] int64
    positions: Tensor  # [N] int64
    attn: TreeAttentionMetadata | TreeAttentionDeviceMetadata  # device form: no host sync (graphs)
    # Groups of tokens that tend to share experts, for the fused MoE's launch choice (None: the
    # requests). A forward of several prompts counts as one, so it launches what one prompt of
    # as many tokens does: the kernels the start-up compiled (the prompts' experts differ more,
    # which costs only the choice a group count would have made).
    routing_groups: int | None = None


@dataclass
class ForwardOutput:
    logits: Tensor  # [N, V] float32
    features: Tensor  # [N, len(feature_layers) * hidden]; [N, 0] when none asked
    new_kv: Tensor  # [num_layers, N, kvr + rope] latent kv of every query token, for commit
    # A graph bucket's padded outputs: the trees' rows among the N, in order (None: every row is
    # one). The step reads the few rows it needs through it instead of copying every tree row out.
    rows: Tensor | None = None
    rows_host: np.ndarray | None = None   # the same rows on the host (the commit indexes them there)

    def real(self) -> ForwardOutput:
        """The trees' rows only (a copy where padded)."""
        if self.rows is None:
            return self
        r = self.rows
        return ForwardOutput(logits=self.logits[r], features=self.features[r], new_kv=self.new_kv[:, r])


@dataclass
class AttentionWeights:
    """MLA weights with kv_b split into the absorbed W_UK / W_UV per head. The two projections of
    the normed hidden state, q's (``q_a``, or ``q_proj`` without a q LoRA) and ``kv_a``, are stacked
    in ``q_kv_a``: one GEMM, one launch and one weight stream."""

    q_kv_a: Tensor  # [q_rows + kvr+rope, hidden]: q_a (or q_proj) rows, then kv_a's
    q_rows: int  # q_lora, or H*(nope+rope) without a q LoRA
    q_a_norm: Tensor | None  # [q_lora]; None without a q LoRA
    q_b: Tensor | None  # [H*(nope+rope), q_lora]
    kv_a_norm: Tensor  # [kvr]
    w_uk: Tensor  # [H, nope, kvr]
    w_uv: Tensor  # [H, v, kvr]
    o_proj: Tensor  # [hidden, H*v]


@dataclass
class DecoderLayerWeights:
    input_norm: Tensor  # [hidden]
    post_norm: Tensor  # [hidden]
    attn: AttentionWeights
    mlp: MLPWeights | None  # dense layers
    moe: MoEWeights | None  # MoE layers


class TargetModel(torch.nn.Module):
    """Absorbed-MLA DeepSeek-V3 over a paged latent cache; torch path (CPU reference, any device)."""

    def __init__(
        self,
        config: TargetConfig,
        weights: dict[str, Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp or TensorParallel(0, 1)
        if not self.tp.enabled:
            validate_weights(config, weights)   # a TP slice was checked by load_rank_slice instead
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config

        def w(name: str) -> Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed_weight = w("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head_weight = w("lm_head.weight")  # [V, hidden]
        self.norm_weight = w("model.norm.weight")  # [hidden]
        self.rope = RotaryTable(c, dtype, self.device)
        self.softmax_scale = softmax_scale(c)
        self.attention_backend: str | None = None   # tree_mla's choice (tree_mla.choose_backend); checks force "reference"
        self.moe_configs_run: set[Hashable] = set()   # every ``moe_config`` a forward launched (compiled)
        H, nope, v = c.num_attention_heads // self.tp.size, c.qk_nope_head_dim, c.v_head_dim  # heads of this rank
        self.layers: list[DecoderLayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = _layer_prefix(i)
            a = p + "self_attn."
            kv_b = w(a + "kv_b_proj.weight").view(H, nope + v, c.kv_lora_rank)  # [H, nope+v, kvr]
            lora = c.q_lora_rank is not None
            q_first = w(a + "q_a_proj.weight") if lora else w(a + "q_proj.weight")
            attn = AttentionWeights(
                q_kv_a=torch.cat([q_first, w(a + "kv_a_proj_with_mqa.weight")]),
                q_rows=q_first.shape[0],
                q_a_norm=w(a + "q_a_layernorm.weight") if lora else None,
                q_b=w(a + "q_b_proj.weight") if lora else None,
                kv_a_norm=w(a + "kv_a_layernorm.weight"),
                w_uk=kv_b[:, :nope].contiguous(),
                w_uv=kv_b[:, nope:].contiguous(),
                o_proj=w(a + "o_proj.weight"),
            )
            m = p + "mlp."
            moe = mlp = None
            if c.is_moe_layer(i):
                moe = MoEWeights.from_checkpoint(weights, m, c, dtype, self.device)
            else:
                mlp = MLPWeights.stack(w(m + "gate_proj.weight"), w(m + "up_proj.weight"), w(m + "down_proj.weight"))
            self.layers.append(
                DecoderLayerWeights(w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"), attn, mlp, moe)
            )

    @property
    def capturable(self) -> bool:
        """Whether ``forward`` can be captured in a CUDA graph: on CUDA with every MoE layer on the
        fused INT4 kernel (the torch expert loop reads expert counts on the host)."""
        return self.device.type == "cuda" and all(
            uses_fused_kernel(self.device, self.dtype, layer.moe.int4 is not None)
            for layer in self.layers if layer.moe is not None)

    def moe_config(self, tokens: int, routing_groups: int) -> Hashable | None:
        """The fused MoE's launch config of a forward of ``tokens`` in ``routing_groups`` requests
        (every MoE layer of a model has the same dims), or None where no fused MoE launches: the
        kernels compile once per config, and the warm-up runs a forward of each one that an eager
        prompt or verify step can take (``VerifierEngine._warm_up_moe_prompts``, ``_warm_up_moe_steps``)."""
        layer = next((layer for layer in self.layers if layer.moe is not None), None)
        return None if layer is None else fused_config(tokens, layer.moe, self.config, routing_groups)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             tp: TensorParallel | None = None) -> "TargetModel":
        """The whole model, or with `tp` only this rank's slice of it (see services/verifier/parallel.py)."""
        if tp is None or not tp.enabled:
            config, weights = load_checkpoint(Path(path))
            return cls(config, weights, dtype=dtype, device=device)
        config = read_target_config(Path(path))
        weights = load_rank_slice(Path(path), config, expected_tensors(config), tp.rank, tp.size)
        return cls(config, weights, dtype=dtype, device=device, tp=tp)

    def new_cache(self, num_pages: int, page_size: int, shuffle_seed: int | None = None) -> PagedKVCache:
        """A cache shaped for this model (tests and the CPU engine)."""
        c = self.config
        return PagedKVCache(c.num_hidden_layers, num_pages, page_size, c.kv_dim, self.dtype, self.device, shuffle_seed)

    def _latent_norms(self, a: AttentionWeights, q_kv: Tensor, cos: Tensor, sin: Tensor, new_kv: Tensor) -> Tensor:
        """From the stacked projection ``q_kv``: q's part, normed when there is a q LoRA, and the new
        latent kv written into ``new_kv`` (normed latent, roped key). On CUDA in one launch
        (``kernels.mla_norm_rope``, bit for bit the separate ones); elsewhere a norm and a rope each."""
        c = self.config
        kvr = c.kv_lora_rank
        if q_kv.is_cuda and self.dtype != torch.float64 and (a.q_a_norm is None or mla_fusable(a.q_rows, kvr)):
            q = mla_norm_rope(q_kv, a.q_rows, a.q_a_norm, a.kv_a_norm, cos, sin, c.rms_norm_eps, new_kv)
            return q_kv[:, :a.q_rows] if q is None else q
        q, kv = q_kv[:, :a.q_rows], q_kv[:, a.q_rows:]  # [N, q_rows], [N, kvr+rope] (strided views)
        rms_norm(kv[:, :kvr], a.kv_a_norm, c.rms_norm_eps, out=new_kv[:, :kvr])  # c_kv [N, kvr]
        apply_rope(kv[:, kvr:], cos, sin, out=new_kv[:, kvr:])  # k_pe [N, rope]
        return q if a.q_a_norm is None else rms_norm(q, a.q_a_norm, c.rms_norm_eps)

    def _attention(
        self, a: AttentionWeights, h: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
        meta: TreeAttentionMetadata | TreeAttentionDeviceMetadata, new_kv: Tensor,
    ) -> Tensor:
        """MLA for one layer: returns the output [N, hidden] and writes the tokens' new latent kv
        [N, kvr+rope] into ``new_kv`` (the norm and the rope write their halves in place)."""
        c = self.config
        N = h.shape[0]
        H, nope = a.w_uk.shape[0], c.qk_nope_head_dim  # this rank's heads
        q_kv = skinny_linear(h, a.q_kv_a)  # [N, q_rows + kvr+rope]
        q = self._latent_norms(a, q_kv, cos, sin, new_kv)  # [N, q_rows]; new_kv filled
        if a.q_b is not None:
            q = skinny_linear(q, a.q_b)  # [N, H*(nope+rope)]
        q = q.view(N, H, c.qk_head_dim)  # [N, H, nope+rope]
        q_pe = apply_rope(q[..., nope:], cos, sin)  # [N, H, rope]
        # Per-head products as batched GEMMs over strided views, read and written as they lie: no
        # copy of q_nope, no copy of the output into [N, H*v] (einsum made both).
        q_latent = skinny_linear(q[..., :nope].transpose(0, 1), a.w_uk.transpose(1, 2)).transpose(0, 1)  # [N, H, kvr]
        latent = tree_mla(q_latent, q_pe, kv_cache, new_kv, meta, self.softmax_scale,
                          backend=self.attention_backend)  # [N, H, kvr]
        out = torch.empty(N, H, c.v_head_dim, dtype=latent.dtype, device=latent.device)  # [N, H, v]
        skinny_linear(latent.transpose(0, 1), a.w_uv, out=out.transpose(0, 1))
        return skinny_linear(out.view(N, H * c.v_head_dim), a.o_proj)  # [N, hidden]

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, cache: PagedKVCache, feature_layers: Sequence[int] = (),
        out: ForwardOutput | None = None,
    ) -> ForwardOutput:
        """Logits (and optional layer features) for every query token; the cache is only read.

        ``features`` follow HF ``hidden_states[i + 1]``: the output of decoder layer i, except
        that for the last layer HF (and so this) returns it after the final norm.

        ``out``: tensors to write the outputs into (float32 logits [N, V / tp], features
        [N, F * hidden], new KV [L, N, kvr + rope]), returned; made here when not given. Why:
        every CUDA graph of the verifier writes the same buffers, where outputs it allocated
        itself would stay allocated for each captured graph.
        """
        c = self.config
        L = c.num_hidden_layers
        feature_layers = list(feature_layers)
        for i in feature_layers:
            assert 0 <= i < L, f"feature layer {i} outside 0..{L - 1}"
        ids = batch.input_ids.to(self.device)
        N = ids.numel()
        assert batch.positions.numel() == N, "positions must match input_ids"
        if isinstance(batch.attn, TreeAttentionMetadata):  # the device form is checked by its builder (no sync)
            assert int(batch.attn.query_starts[-1]) == N, "query_starts[-1] must equal the number of tokens"
        x = self.embed_weight[ids]  # [N, hidden]
        cos, sin = self.rope.lookup(batch.positions.to(self.device))  # [N, rope] each
        if out is None:
            out = ForwardOutput(
                logits=torch.empty(N, self.lm_head_weight.shape[0], dtype=torch.float32, device=self.device),
                features=torch.empty(N, len(feature_layers) * c.hidden_size, dtype=self.dtype, device=self.device),
                new_kv=torch.empty(L, N, c.kv_dim, dtype=self.dtype, device=self.device))   # [L, N, kvr+rope]
        kept: dict[int, Tensor] = {}
        # Each residual add is fused with the norm that reads its sum (the next layer's input norm,
        # after the last layer the final norm): ``x`` is the residual stream, ``h`` its normed form.
        h = rms_norm(x, self.layers[0].input_norm, c.rms_norm_eps)  # [N, hidden]
        groups = batch.routing_groups or batch.attn.num_requests
        self.moe_configs_run.add(self.moe_config(N, groups))
        for i, layer in enumerate(self.layers):
            attn_out = self._attention(layer.attn, h, cos, sin, cache.kv[i], batch.attn, out.new_kv[i])
            # A float32 router (no bf16 parts) reads the normed rows upcast: the norm writes that copy too.
            h32 = torch.empty(N, c.hidden_size, dtype=torch.float32, device=self.device) \
                if layer.moe is not None and layer.moe.gate_parts is None \
                and self.dtype in (torch.bfloat16, torch.float16) else None
            x, h = add_rms_norm(x, self.tp.all_reduce(attn_out), layer.post_norm, c.rms_norm_eps, float32_copy=h32)
            if layer.moe is not None:
                mlp_out = moe_forward(h, layer.moe, c, routing_groups=groups, x_float32=h32)
            else:
                mlp_out = mlp_forward(h, layer.mlp)
            next_norm = self.layers[i + 1].input_norm if i + 1 < L else self.norm_weight
            x, h = add_rms_norm(x, self.tp.all_reduce(mlp_out), next_norm, c.rms_norm_eps)
            if i in feature_layers:
                kept[i] = x
        if L - 1 in kept:
            kept[L - 1] = h   # HF's last hidden state is after the final norm
        out.logits.copy_(skinny_linear(h, self.lm_head_weight))  # [N, V / tp] this rank's vocabulary rows
        if feature_layers:
            torch.cat([kept[i] for i in feature_layers], dim=-1, out=out.features)  # [N, F*hidden]
        return out
