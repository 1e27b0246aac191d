"""The target model's configuration (DeepSeek-V3 / Kimi-K2 ``config.json``), validated once.

Why validate here: every later shape assumption (head splits, expert groups, INT4 groups) is
checked at load time with an error that names the config field, instead of failing deep inside
a matmul.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from services.common.checkpoint import (CONFIG_FILE, CheckpointError, read_config, read_json_object, weight_prefix,
                                       with_rope_parameters)

__all__ = ["TargetConfig", "YarnScaling", "Int4Quantization", "SUPPORTED_MODEL_TYPES", "read_target_config"]

GENERATION_CONFIG_FILE = "generation_config.json"

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


@dataclass(frozen=True)
class YarnScaling:
    """Yarn rope-scaling parameters (HF ``rope_scaling`` with type ``yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class Int4Quantization:
    """compressed-tensors ``pack-quantized`` INT4 (symmetric, group-wise) on the routed experts."""

    group_size: int
    ignore: tuple[str, ...]


@dataclass(frozen=True)
class TargetConfig:
    """All architecture fields of a DeepSeek-V3-style target that the verifier uses."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: YarnScaling | None
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    max_position_embeddings: int
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    eos_token_id: tuple[int, ...] = ()
    quantization: Int4Quantization | None = None
    num_nextn_predict_layers: int = 0   # MTP layers stored after the decoder's (DeepSeek-V3: 1): not served

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one cached latent token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def int4_experts(self) -> bool:
        return self.quantization is not None

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts is not None
            and self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> "TargetConfig":
        """Build from an HF config dict; CheckpointError naming ``source`` and the bad field."""
        return _parse(d, source)


# Routing fields whose defaults differ between the two readers of these configs (transformers'
# DeepseekV3Config: 8 groups, 4 kept, 3 dense layers, x2.5, normalised, 1 shared expert; the
# configuration_deepseek.py that DeepSeek-V3 and Kimi-K2 ship: none, none, 0, x1.0, not normalised,
# none). A MoE config without one was read with this loader's guess and served other routing than
# the checkpoint's authors meant (without n_shared_experts: the shared experts left unread).
ROUTING_FIELDS = ("num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                  "first_k_dense_replace", "n_shared_experts")
# The yarn fields this model implements; another (transformers' attention_factor, truncate) would
# change the rope or its scale and was dropped without a word.
_YARN_FIELDS = frozenset({"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim"})


def _fail(source: str, field: str, why: str) -> CheckpointError:
    return CheckpointError(f"{source}: field '{field}' {why}")


def _get(d: dict, source: str, field: str, kind: type, default: Any = ..., positive: bool = False) -> Any:
    if field not in d or (d[field] is None and default is not ...):
        if default is ...:
            raise _fail(source, field, "is missing")
        return default
    value = d[field]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise _fail(source, field, f"must be {kind.__name__}, got {value!r}")
    if positive and value <= 0:
        raise _fail(source, field, f"must be > 0, got {value!r}")
    return value


def _parse_yarn(d: dict, source: str) -> YarnScaling | None:
    rs = d.get("rope_scaling")
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise _fail(source, "rope_scaling", f"must be null or an object, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind == "default":   # transformers 5 writes no scaling so, beside its rope_parameters
        return None
    if kind != "yarn":
        raise _fail(source, "rope_scaling.type", f"unsupported rope scaling {kind!r} (only 'yarn')")
    # transformers' own defaults for these two are what this model does: refused only when set otherwise
    extra = sorted(k for k, v in rs.items() if k not in _YARN_FIELDS
                   and not (k == "attention_factor" and v is None) and not (k == "truncate" and v in (None, True)))
    if extra:
        raise _fail(source, f"rope_scaling.{extra[0]}", f"is not supported (yarn here takes {', '.join(sorted(_YARN_FIELDS))}; "
                                                        "the cos/sin scale comes from mscale / mscale_all_dim)")
    src = f"{source} rope_scaling"
    return YarnScaling(
        factor=_get(rs, src, "factor", float, positive=True),
        original_max_position_embeddings=_get(rs, src, "original_max_position_embeddings", int, positive=True),
        beta_fast=_get(rs, src, "beta_fast", float, 32.0),
        beta_slow=_get(rs, src, "beta_slow", float, 1.0),
        mscale=_get(rs, src, "mscale", float, 1.0),
        mscale_all_dim=_get(rs, src, "mscale_all_dim", float, 0.0),
    )


def _parse_quant(d: dict, source: str) -> Int4Quantization | None:
    qc = d.get("quantization_config")
    if qc is None:
        return None
    f = "quantization_config"
    if not isinstance(qc, dict):
        raise _fail(source, f, "must be an object")
    if qc.get("quant_method") != "compressed-tensors":
        raise _fail(source, f"{f}.quant_method", f"must be 'compressed-tensors', got {qc.get('quant_method')!r}")
    if qc.get("format") != "pack-quantized":
        raise _fail(source, f"{f}.format", f"must be 'pack-quantized', got {qc.get('format')!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _fail(source, f"{f}.config_groups", "must hold exactly one group")
    (gname, group), = groups.items()
    w = group.get("weights") if isinstance(group, dict) else None
    wf = f"{f}.config_groups.{gname}.weights"
    if not isinstance(w, dict):
        raise _fail(source, wf, "is missing")
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, want in expected.items():
        if w.get(key) != want:
            raise _fail(source, f"{wf}.{key}", f"must be {want!r}, got {w.get(key)!r}")
    group_size = w.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
        raise _fail(source, f"{wf}.group_size", f"must be a positive multiple of 8, got {group_size!r}")
    # What this loader does not implement, refused by name: it read such experts with the wrong
    # groups (activation order's g_idx) or as weight-only (quantised activations), and served.
    if w.get("actorder") not in (None, False):
        raise _fail(source, f"{wf}.actorder", f"must be null (groups in order), got {w.get('actorder')!r}")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise _fail(source, f"{f}.config_groups.{gname}.{key}", "must be null (weight-only INT4)")
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _fail(source, f"{f}.ignore", "must be a list of strings")
    return Int4Quantization(group_size=group_size, ignore=tuple(ignore))


def _eos_ids(d: dict[str, Any], source: str) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos) if isinstance(eos, list) else None)
    if eos_ids is None or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids):
        raise _fail(source, "eos_token_id", f"must be a token id or a list of them, got {eos!r}")
    return eos_ids


def read_target_config(path: Path) -> TargetConfig:
    """The target's config from ``path/config.json``, with the end-of-sequence ids of
    ``generation_config.json`` added where the checkpoint has one: chat models often list their
    end-of-turn ids only there, and generation must stop at any of them, as HF ``generate`` does."""
    path = Path(path)
    source = str(path / CONFIG_FILE) + (" text_config" if weight_prefix(path) else "")   # where its fields are
    config = TargetConfig.from_hf(read_config(path), source=source)
    gen_path = path / GENERATION_CONFIG_FILE
    if not gen_path.is_file():
        return config
    extra = [e for e in _eos_ids(read_json_object(gen_path), str(gen_path)) if e not in config.eos_token_id]
    _check_eos(extra, config.vocab_size, str(gen_path))
    return replace(config, eos_token_id=config.eos_token_id + tuple(extra)) if extra else config


def _check_eos(eos_ids, vocab_size: int, source: str) -> None:
    """Ids past the vocabulary (another model's generation_config.json) are none the model emits:
    generation would never stop at its end of turn."""
    past = [e for e in eos_ids if e >= vocab_size]
    if past:
        raise _fail(source, "eos_token_id", f"{past[0]} is past the vocabulary of {vocab_size} tokens "
                                            "(a config of another model?)")


def _parse(d: dict[str, Any], source: str) -> TargetConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"{source}: expected a JSON object")
    d = with_rope_parameters(d, source)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail(source, "model_type", f"unsupported {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    # Fields a checkpoint may set that this model would ignore, and serve other numbers than HF's.
    if d.get("tie_word_embeddings"):
        raise _fail(source, "tie_word_embeddings", "must be false (the output projection is lm_head.weight)")
    if d.get("hidden_act", "silu") != "silu":
        raise _fail(source, "hidden_act", f"unsupported {d.get('hidden_act')!r} (only 'silu')")
    if d.get("attention_bias"):
        raise _fail(source, "attention_bias", "must be false (the attention projections have no bias)")
    if d.get("rope_interleave", True) is not True:   # transformers' key: the q/k rope weights' layout
        raise _fail(source, "rope_interleave", f"must be true (DeepSeek's interleaved rope layout), got {d['rope_interleave']!r}")
    if "compression_config" in d and "quantization_config" not in d:
        raise _fail(source, "compression_config", "is the older name: this loader reads quantization_config")
    g = lambda field, kind, default=..., positive=False: _get(d, source, field, kind, default, positive)  # noqa: E731
    eos_ids = _eos_ids(d, source)
    q_lora = d.get("q_lora_rank")
    if q_lora is not None and (isinstance(q_lora, bool) or not isinstance(q_lora, int) or q_lora <= 0):
        raise _fail(source, "q_lora_rank", f"must be null or a positive int, got {q_lora!r}")
    n_routed = d.get("n_routed_experts")
    if n_routed is not None and (isinstance(n_routed, bool) or not isinstance(n_routed, int) or n_routed < 0):
        raise _fail(source, "n_routed_experts", f"must be null or a non-negative int, got {n_routed!r}")
    if n_routed:
        for field in ROUTING_FIELDS:
            if d.get(field) is None:
                raise _fail(source, field, "is missing: a MoE config must set it (transformers' DeepseekV3Config "
                                           "and the checkpoints' own configuration_deepseek.py default it differently)")
    cfg = TargetConfig(
        model_type=model_type,
        vocab_size=g("vocab_size", int, positive=True),
        hidden_size=g("hidden_size", int, positive=True),
        intermediate_size=g("intermediate_size", int, positive=True),
        moe_intermediate_size=g("moe_intermediate_size", int, 0),
        num_hidden_layers=g("num_hidden_layers", int, positive=True),
        num_attention_heads=g("num_attention_heads", int, positive=True),
        q_lora_rank=q_lora,
        kv_lora_rank=g("kv_lora_rank", int, positive=True),
        qk_nope_head_dim=g("qk_nope_head_dim", int, positive=True),
        qk_rope_head_dim=g("qk_rope_head_dim", int, positive=True),
        v_head_dim=g("v_head_dim", int, positive=True),
        rope_theta=g("rope_theta", float, 10000.0),
        rope_scaling=_parse_yarn(d, source),
        n_routed_experts=n_routed,
        n_shared_experts=g("n_shared_experts", int, 0),
        num_experts_per_tok=g("num_experts_per_tok", int, 0),
        n_group=g("n_group", int, 1),
        topk_group=g("topk_group", int, 1),
        routed_scaling_factor=g("routed_scaling_factor", float, 1.0),
        norm_topk_prob=g("norm_topk_prob", bool, True),
        first_k_dense_replace=g("first_k_dense_replace", int, 0),
        moe_layer_freq=g("moe_layer_freq", int, 1, positive=True),
        rms_norm_eps=g("rms_norm_eps", float, 1e-6),
        max_position_embeddings=g("max_position_embeddings", int, positive=True),
        scoring_func=g("scoring_func", str, "sigmoid"),
        topk_method=g("topk_method", str, "noaux_tc"),
        eos_token_id=eos_ids,
        quantization=_parse_quant(d, source),
        num_nextn_predict_layers=g("num_nextn_predict_layers", int, 0),
    )
    _check_consistency(cfg, source)
    return cfg


def _check_consistency(cfg: TargetConfig, source: str) -> None:
    _check_eos(cfg.eos_token_id, cfg.vocab_size, source)
    if cfg.num_nextn_predict_layers < 0:
        raise _fail(source, "num_nextn_predict_layers", f"must be >= 0, got {cfg.num_nextn_predict_layers}")
    if cfg.qk_rope_head_dim % 2:
        raise _fail(source, "qk_rope_head_dim", f"must be even, got {cfg.qk_rope_head_dim}")
    for field in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):   # 0: infinite frequencies, a 0/0 norm
        if not getattr(cfg, field) > 0:
            raise _fail(source, field, f"must be > 0, got {getattr(cfg, field)!r}")
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        raise _fail(source, "first_k_dense_replace",
                    f"must be in 0..num_hidden_layers={cfg.num_hidden_layers}, got {cfg.first_k_dense_replace}")
    if cfg.rope_scaling is not None and not cfg.rope_scaling.factor >= 1:
        raise _fail(source, "rope_scaling.factor", f"must be >= 1, got {cfg.rope_scaling.factor!r}")
    if cfg.n_routed_experts:
        if cfg.scoring_func != "sigmoid":
            raise _fail(source, "scoring_func", f"unsupported {cfg.scoring_func!r} (only 'sigmoid')")
        if cfg.topk_method != "noaux_tc":
            raise _fail(source, "topk_method", f"unsupported {cfg.topk_method!r} (only 'noaux_tc')")
        if cfg.moe_intermediate_size <= 0:
            raise _fail(source, "moe_intermediate_size", "must be > 0 for a MoE model")
        if cfg.n_group <= 0 or cfg.n_routed_experts % cfg.n_group:
            raise _fail(source, "n_group", f"{cfg.n_group} must divide n_routed_experts={cfg.n_routed_experts}")
        if cfg.n_routed_experts // cfg.n_group < 2:
            raise _fail(source, "n_group", "each expert group needs >= 2 experts (group score = top-2 sum)")
        if not 0 < cfg.topk_group <= cfg.n_group:
            raise _fail(source, "topk_group", f"must be in 1..n_group={cfg.n_group}, got {cfg.topk_group}")
        per_group = cfg.n_routed_experts // cfg.n_group
        if not 0 < cfg.num_experts_per_tok <= cfg.topk_group * per_group:
            raise _fail(source, "num_experts_per_tok", f"must be in 1..{cfg.topk_group * per_group}, got {cfg.num_experts_per_tok}")
    if cfg.quantization is not None:
        gs = cfg.quantization.group_size
        for field in ("hidden_size", "moe_intermediate_size"):
            if getattr(cfg, field) % gs:
                raise _fail(source, field, f"{getattr(cfg, field)} is not a multiple of the INT4 group_size {gs}")
