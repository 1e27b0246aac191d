"""Write a randomly initialised DFlash drafter checkpoint in the real on-disk format.

Used for tests, for timing at large shapes and as the starting point of the bundled demo
drafter; it goes through the same config.json + safetensors path as a downloaded checkpoint so
that loading code is exercised for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from services.common.checkpoint import save_tensors
from services.draft.config import ARCHITECTURE, DraftConfig


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` distinct layer ids spread evenly over the target, first and last included."""
    count = max(1, min(count, num_target_layers))
    if count == 1:
        return [num_target_layers // 2]
    return sorted({round(i * (num_target_layers - 1) / (count - 1)) for i in range(count)})


def write_random_drafter(
    path: Path,
    target_config: dict[str, Any],
    block_size: int = 16,
    num_layers: int = 2,
    seed: int = 0,
    target_layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    *,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Write config.json + safetensors for a random drafter paired with `target_config`.

    hidden/vocab/positions come from the target (the drafter reads its features, embedding and
    lm_head); mask_token_id defaults to the last vocabulary id; target_layer_ids default to
    `num_layers` ids spread over the target. Returns the config dict written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = int(target_config["hidden_size"])
    vocab = int(target_config["vocab_size"])
    n_target = int(target_config["num_hidden_layers"])
    hd = head_dim or min(128, max(8, hidden // 4))
    heads = num_attention_heads or max(2, hidden // hd)
    kv_heads = num_key_value_heads or max(1, heads // 2)
    inter = intermediate_size or 3 * hidden
    ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(n_target, num_layers)
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "intermediate_size": inter,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": float(target_config.get("rope_theta", 10000.0)),
        "rope_scaling": None,
        "vocab_size": vocab,
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": vocab - 1 if mask_token_id is None else int(mask_token_id),
            "target_layer_ids": ids,
        },
    }
    cfg = DraftConfig.from_hf(config, source=str(path / "config.json"))  # fail before writing anything bad

    gen = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)  # [out, in]

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)  # [n]

    tensors: dict[str, torch.Tensor] = {
        "fc.weight": linear(hidden, cfg.num_features),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(hidden),
                p + "post_attention_layernorm.weight": norm(hidden),
                p + "self_attn.q_proj.weight": linear(heads * hd, hidden),
                p + "self_attn.k_proj.weight": linear(kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": linear(kv_heads * hd, hidden),
                p + "self_attn.o_proj.weight": linear(hidden, heads * hd),
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "mlp.gate_proj.weight": linear(inter, hidden),
                p + "mlp.up_proj.weight": linear(inter, hidden),
                p + "mlp.down_proj.weight": linear(hidden, inter),
            }
        )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tensors(path, tensors)
    return config
