"""Tiny random DeepSeek-V3 targets written in the real HF layout (tests, timing, demo scaffolding).

Why random-but-structured: tests need the full architecture (q_lora, yarn, grouped routing,
INT4 experts) at a size that runs in milliseconds on a CPU, with logits whose greedy argmax
margins sit far above fp32 rounding so fp32 and float64 paths agree token for token.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from torch import Tensor

from services.common.checkpoint import save_tensors
from services.common.int4 import pack_int4
from services.verifier.config import TargetConfig
from services.verifier.model import expected_tensors

__all__ = ["TINY_TARGET_CONFIG", "int4_quantization_config", "random_target_weights", "write_random_target"]

TINY_TARGET_CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Init std per tensor kind. Projections at ~1/sqrt(fan_in) scale keep every sublayer's
# contribution O(0.3-1) of the residual so attention and experts visibly matter; the lm_head is
# larger so logits spread over several units and greedy margins dwarf fp32 noise (~1e-6).
_LINEAR_GAIN = 1.0
_LM_HEAD_STD = 0.5
_EMBED_STD = 1.0


def int4_quantization_config(config: TargetConfig, group_size: int = 32) -> dict:
    """compressed-tensors pack-quantized config whose ``ignore`` lists every non-routed-expert linear."""
    ignore = ["lm_head"]
    for name in expected_tensors(config):
        if name.endswith(".weight") and ".experts." not in name and "norm" not in name and "embed" not in name:
            module = name[: -len(".weight")]
            if module != "lm_head" and module not in ignore:
                ignore.append(module)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size},
            }
        },
        "ignore": ignore,
    }


def random_target_weights(config: TargetConfig, seed: int = 0, int4: bool = True) -> dict[str, Tensor]:
    """Random weights under the HF names (bf16 like real checkpoints; INT4 routed experts when asked)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name, shape in _dense_shapes(config).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            out[name] = (0.05 * torch.randn(shape, generator=g)).float()  # kept float32 like real checkpoints
            continue
        elif name == "model.embed_tokens.weight":
            t = _EMBED_STD * torch.randn(shape, generator=g)
        elif name == "lm_head.weight":
            t = _LM_HEAD_STD * torch.randn(shape, generator=g)
        else:
            t = (_LINEAR_GAIN / math.sqrt(shape[-1])) * torch.randn(shape, generator=g)
        if int4 and ".experts." in name:
            q = pack_int4(t, group_size=32, scale_dtype=torch.bfloat16)
            base = name[: -len(".weight")]
            out[base + ".weight_packed"] = q.packed
            out[base + ".weight_scale"] = q.scale
            out[base + ".weight_shape"] = torch.tensor(q.shape, dtype=torch.int64)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def _dense_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Expected tensors with INT4 triples folded back to their dense ``.weight`` (for drawing)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_tensors(config).items():
        if name.endswith(".weight_packed"):
            shapes[name[: -len("_packed")]] = (shape[0], shape[1] * 8)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            shapes[name] = shape
    return shapes


def write_random_target(
    path: Path, vocab_size: int, int4: bool = True, seed: int = 0, overrides: dict | None = None
) -> None:
    """Write ``config.json`` (+ quantization_config when ``int4``) and random safetensors to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = copy.deepcopy(TINY_TARGET_CONFIG)
    hf["vocab_size"] = vocab_size
    hf.update(copy.deepcopy(overrides or {}))
    hf.pop("quantization_config", None)
    config = TargetConfig.from_hf(hf)
    if int4:
        hf["quantization_config"] = int4_quantization_config(config)
        config = TargetConfig.from_hf(hf)
    weights = random_target_weights(config, seed=seed, int4=int4)
    save_tensors(path, weights)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
