"""DFlash drafter configuration, parsed from the checkpoint's HF-style config.json.

The DFlash format puts some fields at the top level and some inside `dflash_config`
(`block_size` may be in either); parsing them in one place keeps the drafter code free of
dict lookups and lets a malformed checkpoint fail at load with a message naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.checkpoint import CheckpointError, read_config, with_rope_parameters

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DraftConfig:
    """Shapes and hyper-parameters of a DFlash block-diffusion drafter (Qwen3-style layers)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None

    @property
    def num_features(self) -> int:
        """Width of the concatenated target features one context token contributes."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> "DraftConfig":
        """Validate and parse a DFlash config dict; `source` names the file in error messages."""
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        d = with_rope_parameters(d, source)
        archs = d.get("architectures")
        if archs is not None and (not isinstance(archs, list) or ARCHITECTURE not in archs):
            raise CheckpointError(
                f"{source}: field 'architectures' is {archs!r}, expected it to contain {ARCHITECTURE!r}"
            )
        dflash = d.get("dflash_config")
        if dflash is None:
            dflash = {}
        if not isinstance(dflash, dict):
            raise CheckpointError(f"{source}: field 'dflash_config' must be an object")

        def pos_int(name: str, value: Any = None, where: str = "") -> int:
            v = d.get(name) if value is None else value
            label = where or name
            if v is None:
                raise CheckpointError(f"{source}: missing field '{label}'")
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"{source}: field '{label}' must be a positive integer, got {v!r}")
            return v

        def or_default(name: str, default: Any) -> Any:
            v = d.get(name)
            return default if v is None else v   # null reads as left out, as the target's reader has it

        def pos_float(name: str, default: float | None = None) -> float:
            v = or_default(name, default)
            if v is None:
                raise CheckpointError(f"{source}: missing field '{name}'")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise CheckpointError(f"{source}: field '{name}' must be a positive number, got {v!r}")
            return float(v)

        hidden = pos_int("hidden_size")
        layers = pos_int("num_hidden_layers")
        heads = pos_int("num_attention_heads")
        kv_heads = pos_int("num_key_value_heads", or_default("num_key_value_heads", heads))
        if heads % kv_heads != 0:
            raise CheckpointError(
                f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide "
                f"'num_attention_heads' ({heads})"
            )
        head_dim_raw = d.get("head_dim")
        if head_dim_raw is None:
            if hidden % heads != 0:
                raise CheckpointError(f"{source}: missing field 'head_dim' and hidden_size % heads != 0")
            head_dim_raw = hidden // heads
        head_dim = pos_int("head_dim", head_dim_raw)
        if head_dim % 2 != 0:
            raise CheckpointError(f"{source}: field 'head_dim' must be even for rotary embeddings")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type")) if isinstance(rope_scaling, dict) else None
            if kind != "default":
                raise CheckpointError(f"{source}: field 'rope_scaling' {rope_scaling!r} is not supported (only null)")

        _refuse_unimplemented(d, source)
        top_block, dflash_block = d.get("block_size"), dflash.get("block_size")
        if top_block is not None and dflash_block is not None and top_block != dflash_block:
            raise CheckpointError(f"{source}: field 'block_size' is {top_block!r} and 'dflash_config.block_size' "
                                  f"{dflash_block!r}: which one the drafter was trained with is unclear")
        block_raw = top_block if top_block is not None else dflash_block
        block = pos_int("block_size", block_raw if block_raw is not None else None)
        if block < 2:
            raise CheckpointError(f"{source}: field 'block_size' must be >= 2, got {block}")

        vocab = pos_int("vocab_size")
        ids = dflash.get("target_layer_ids")
        if not isinstance(ids, list) or not ids:
            raise CheckpointError(
                f"{source}: field 'dflash_config.target_layer_ids' must be a non-empty list, got {ids!r}"
            )
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise CheckpointError(
                    f"{source}: field 'dflash_config.target_layer_ids' has invalid entry {i!r}"
                )
        mask = dflash.get("mask_token_id")
        if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
            raise CheckpointError(
                f"{source}: field 'dflash_config.mask_token_id' must be an integer in [0, vocab_size={vocab}), "
                f"got {mask!r}"
            )
        n_target = d.get("num_target_layers", dflash.get("num_target_layers"))
        if n_target is not None:
            n_target = pos_int("num_target_layers", n_target)
            if max(ids) >= n_target:
                raise CheckpointError(
                    f"{source}: field 'dflash_config.target_layer_ids' {ids} out of range for "
                    f"num_target_layers={n_target}"
                )
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=pos_int("intermediate_size"),
            rms_norm_eps=pos_float("rms_norm_eps", 1e-6),
            rope_theta=pos_float("rope_theta", 10000.0),
            vocab_size=vocab,
            max_position_embeddings=pos_int("max_position_embeddings", or_default("max_position_embeddings", 32768)),
            block_size=block,
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=n_target,
        )


def _refuse_unimplemented(d: dict[str, Any], source: str) -> None:
    """CheckpointError for a field of the reference drafter's decoder (a Qwen3 / Llama / gpt-oss
    layer) that changes its math and that this drafter does not implement: such a checkpoint
    loaded, and drafted other logits than its training's without a word (biases dropped,
    windows widened to the whole context, soft caps skipped)."""
    for name in ("attention_bias", "mlp_bias"):
        if d.get(name):
            raise CheckpointError(f"{source}: field '{name}' must be false (the projections here have no bias)")
    if d.get("use_sliding_window"):
        raise CheckpointError(f"{source}: field 'use_sliding_window' must be false (every layer here attends "
                              "to the whole context)")
    kinds = d.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or any(k != "full_attention" for k in kinds)):
        raise CheckpointError(f"{source}: field 'layer_types' {kinds!r} is not supported (only full_attention "
                              "layers)")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(name) is not None:
            raise CheckpointError(f"{source}: field '{name}' must be null (no soft cap here), got {d[name]!r}")
    if d.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: field 'hidden_act' {d['hidden_act']!r} is not supported (only 'silu')")


def least_context(block_size: int) -> int:
    """The shortest context that holds one prompt token beside one tree of a ``block_size`` drafter
    (the scheduler's prompt limit, `request.validate`, leaves room for a tree)."""
    return block_size + 2


def check_pairing(drafter_dir: Path, target_dir: Path) -> DraftConfig:
    """The drafter's config, checked against its target's config field by field (hidden size,
    vocabulary, mask id, target layers). From the two config files alone, so `ddtree up` can check
    a pair before the verifier spends minutes loading a target the draft would then refuse; a
    wrong pair would otherwise draft garbage (zero acceptance)."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    dsrc, tsrc = drafter_dir / "config.json", target_dir / "config.json"
    config = DraftConfig.from_hf(read_config(drafter_dir), source=str(dsrc))
    tcfg = read_config(target_dir)
    t_hidden, t_vocab, t_layers = (tcfg.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    for name, value in (("hidden_size", t_hidden), ("vocab_size", t_vocab), ("num_hidden_layers", t_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{tsrc}: field '{name}' missing or not a positive integer: {value!r}")
    if config.hidden_size != t_hidden:
        raise CheckpointError(
            f"{dsrc}: field 'hidden_size' = {config.hidden_size} does not match the target's "
            f"hidden_size = {t_hidden} ({tsrc})"
        )
    if config.vocab_size != t_vocab:
        raise CheckpointError(
            f"{dsrc}: field 'vocab_size' = {config.vocab_size} does not match the target's "
            f"vocab_size = {t_vocab} ({tsrc})"
        )
    if config.mask_token_id >= t_vocab:
        raise CheckpointError(
            f"{dsrc}: field 'dflash_config.mask_token_id' = {config.mask_token_id} is outside the "
            f"target vocabulary ({t_vocab})"
        )
    bad = [i for i in config.target_layer_ids if i >= t_layers]
    if bad:
        raise CheckpointError(
            f"{dsrc}: field 'dflash_config.target_layer_ids' has {bad} out of range for the target's "
            f"num_hidden_layers = {t_layers} ({tsrc})"
        )
    t_context = tcfg.get("max_position_embeddings")
    if isinstance(t_context, int) and not isinstance(t_context, bool) and t_context < least_context(config.block_size):
        # No prompt fits beside one tree: the stack served, and refused every request.
        raise CheckpointError(
            f"{dsrc}: field 'block_size' = {config.block_size} leaves no room for a prompt in the target's "
            f"max_position_embeddings = {t_context} ({tsrc}): a tree of a block and one prompt token need "
            f"{least_context(config.block_size)}"
        )
    if config.num_target_layers is not None and config.num_target_layers != t_layers:
        raise CheckpointError(
            f"{dsrc}: field 'num_target_layers' = {config.num_target_layers} does not match the "
            f"target's num_hidden_layers = {t_layers} ({tsrc})"
        )
    return config
