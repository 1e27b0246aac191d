"""A checkpoint's JSON files (config.json, the shard index, a tokenizer's config), read without torch.

Why a module of its own: the scheduler reads a model directory's config too (Kimi-K2's tokenizer
is bounded by the model's vocabulary), and its process must not import torch (a second or more of
start-up and hundreds of MB for a process that runs no model). `services.common.checkpoint`
re-exports all of it.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CONFIG_FILE", "CheckpointError", "LFS_POINTER", "TEXT_WRAPPERS", "read_config", "read_json_object",
           "refuse_lfs_pointer", "require_checkpoint", "weight_prefix", "with_rope_parameters"]

CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory is missing something or holds something inconsistent."""


def require_checkpoint(path: str | Path, setting: str) -> None:
    """A checkpoint directory named by ``setting``, checked before anything loads, so the error
    names the setting and not only the path."""
    if not (Path(path) / CONFIG_FILE).is_file():
        raise CheckpointError(f"{setting}: no checkpoint at {path} ({CONFIG_FILE} missing)")


# Multimodal checkpoints whose language model is a DeepSeek-V3 / Kimi-K2 one: the config wraps it
# in `text_config` and its tensors sit under a prefix (vision tower and projector beside them).
TEXT_WRAPPERS = {"kimi_k25": "language_model."}
# Fields a wrapper may set at its top level only, which its language model then has.
_WRAPPER_FIELDS = ("quantization_config", "eos_token_id", "bos_token_id", "tie_word_embeddings")


def _raw_config(path: Path) -> dict:
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path}: missing {CONFIG_FILE}")
    d = read_json_object(path / CONFIG_FILE)
    if not isinstance(d.get("model_type", ""), str):   # looked up in dicts: a TypeError traceback, before
        raise CheckpointError(f"{path / CONFIG_FILE}: field 'model_type' must be a string, got {d['model_type']!r}")
    return d


def read_config(path: Path) -> dict:
    """Read ``path/config.json`` as a dict; CheckpointError when missing or not a JSON object. A
    multimodal wrapper (Kimi-K2.5 / K2.6: `kimi_k25`) gives its language model's config, the text
    this stack serves: it was refused as an unsupported model type."""
    path = Path(path)
    d = _raw_config(path)
    if d.get("model_type") not in TEXT_WRAPPERS:
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path / CONFIG_FILE}: field 'text_config' of a {d['model_type']} config must be an object")
    out = dict(text)
    for field in _WRAPPER_FIELDS:   # set in both places (K2.5 repeats its quantisation): they must agree
        outer, inner = d.get(field), text.get(field)
        if outer is not None and inner is not None and outer != inner:
            raise CheckpointError(f"{path / CONFIG_FILE}: field '{field}' differs between the top level and "
                                  "text_config")
        if inner is None and outer is not None:
            out[field] = outer
    return out


def weight_prefix(path: Path) -> str:
    """The prefix of the language model's tensors in ``path``: "" but for a multimodal wrapper."""
    return TEXT_WRAPPERS.get(_raw_config(Path(path)).get("model_type"), "")


def with_rope_parameters(d: dict, source: str) -> dict:
    """``d`` with transformers 5's ``rope_parameters`` (``rope_theta`` and the scaling in one
    object, ``rope_type`` "default" for none) read into the older ``rope_theta`` / ``rope_scaling``
    fields this loader parses. Without it, a config re-saved by transformers 5 read as unscaled
    rope with theta 10000: a Kimi-K2 target lost its yarn frequencies and half its softmax scale,
    and served without a word. Both forms at once must agree."""
    rp = d.get("rope_parameters")
    if rp is None:
        return d
    if not isinstance(rp, dict):
        raise CheckpointError(f"{source}: field 'rope_parameters' must be an object, got {rp!r}")
    theta = rp.get("rope_theta")
    kind = rp.get("rope_type", rp.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in rp.items() if k != "rope_theta"}
    old = d.get("rope_scaling")
    if scaling is None and old is not None and _rope_values(old)[0] != "default":
        raise CheckpointError(f"{source}: field 'rope_scaling' {old!r} disagrees with 'rope_parameters' "
                              f"(rope_type 'default': no scaling)")
    out = dict(d)
    for field, value in (("rope_theta", theta), ("rope_scaling", scaling)):
        if value is None:
            continue
        if d.get(field) is not None and _rope_values(d[field]) != _rope_values(value):
            raise CheckpointError(f"{source}: field '{field}' {d[field]!r} disagrees with "
                                  f"'rope_parameters' ({value!r})")
        out[field] = value
    return out


def _rope_values(value: object) -> object:
    """What a rope field says, whichever spelling of its kind it uses ("type", "rope_type", both):
    the configs transformers 5 writes keep both forms, spelled differently."""
    if not isinstance(value, dict):
        return value
    kind = value.get("rope_type", value.get("type"))
    return kind, {k: v for k, v in value.items() if k not in ("type", "rope_type", "rope_theta")}


def _read_text(file: Path) -> str:
    """A checkpoint's text file; one that cannot be read or is not UTF-8 is a CheckpointError
    naming it (a traceback otherwise)."""
    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _lfs_pointer_error(file: Path, head: bytes) -> CheckpointError | None:
    """A Git LFS pointer in the file's place: a clone made without git-lfs leaves these (Kimi-K2's
    repositories keep even model.safetensors.index.json in LFS), and they read as "invalid JSON"
    or "not a safetensors file", which sent users looking at the checkpoint instead of the clone."""
    if not head.startswith(LFS_POINTER):
        return None
    return CheckpointError(f"{file}: a Git LFS pointer, not the file itself (fetch the files: git lfs pull)")


def refuse_lfs_pointer(file: Path) -> None:
    """CheckpointError where ``file`` is a Git LFS pointer (for files read by other libraries)."""
    try:
        with open(file, "rb") as f:
            head = f.read(64)
    except OSError:
        return
    if (lfs := _lfs_pointer_error(Path(file), head)) is not None:
        raise lfs


def read_json_object(file: Path) -> dict:
    """A JSON file holding one object; CheckpointError naming the file otherwise."""
    text = _read_text(file)
    if (lfs := _lfs_pointer_error(file, text[:64].encode())) is not None:
        raise lfs
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object at top level, got {type(data).__name__}")
    return data
