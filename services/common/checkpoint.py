"""Reading and writing HF-style safetensors checkpoint directories.

Why a module of its own: the verifier, the drafter and the demo-checkpoint writer all read the
same layout (``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``),
and every failure should say *which directory, which file and which field/tensor* is wrong, so a
bad checkpoint is diagnosed from the error message alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

__all__ = [
    "CheckpointError",
    "require_checkpoint",
    "CONFIG_FILE",
    "SINGLE_FILE",
    "INDEX_FILE",
    "read_config",
    "read_json_object",
    "weight_prefix",
    "with_rope_parameters",
    "tensor_index",
    "load_tensors",
    "save_tensors",
    "save_safetensors_sharded",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
    return read_json_object(path / CONFIG_FILE)


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
    return {**{k: d[k] for k in _WRAPPER_FIELDS if k in d}, **text}


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


def open_safetensors(file_path: Path):
    """``safe_open`` of one file, whose failure (a damaged or foreign file) names the file as a
    ``CheckpointError``, which the services report in one line, instead of safetensors' own error."""
    try:
        return safe_open(str(file_path), framework="pt")
    except (SafetensorError, OSError) as exc:
        try:
            with open(file_path, "rb") as f:
                lfs = _lfs_pointer_error(Path(file_path), f.read(64))
        except OSError:
            lfs = None
        raise (lfs or CheckpointError(f"{file_path}: not a readable safetensors file ({exc})")) from None


def tensor_index(path: Path) -> dict[str, str]:
    """Map every tensor name of the checkpoint in ``path`` to the safetensors file holding it; in a
    multimodal wrapper, the language model's tensors by their names without the prefix (the
    others, a vision tower's, are not this stack's)."""
    path = Path(path)
    every = _stored_index(path)
    prefix = weight_prefix(path) if (path / CONFIG_FILE).is_file() else ""
    if not prefix:
        return every
    return {name[len(prefix):]: file for name, file in every.items() if name.startswith(prefix)}


def _stored_index(path: Path) -> dict[str, str]:
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = read_json_object(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: field 'weight_map' missing or not an object")
        for name, shard in weight_map.items():
            # A shard is a file of this directory: "../x" or "/x" read a file from elsewhere, and
            # null was reported as "shard file None is missing".
            if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard in (".", ".."):
                raise CheckpointError(f"{index_path}: weight_map[{name!r}] = {shard!r} is not a file name of "
                                      "this directory")
        return {str(k): v for k, v in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    with open_safetensors(single) as f:
        return {name: SINGLE_FILE for name in f.keys()}


def load_tensors(
    path: Path, names: Iterable[str] | None = None, prefix: str | None = None
) -> dict[str, Tensor]:
    """Load tensors from ``path`` (memory-mapped through safe_open), only the ones asked for.

    ``names`` selects exact names (each must exist), ``prefix`` selects every name starting with
    it; neither selects everything. Reading per shard keeps a TP rank from touching others' bytes.
    """
    path = Path(path)
    index = tensor_index(path)
    stored = weight_prefix(path) if (path / CONFIG_FILE).is_file() else ""   # the names in the files
    if names is not None:
        wanted = list(names)
        missing = [n for n in wanted if n not in index]
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise CheckpointError(f"{path}: missing tensor(s) {shown}")
    else:
        wanted = list(index)
    if prefix is not None:
        wanted = [n for n in wanted if n.startswith(prefix)]
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(index[name], []).append(name)
    out: dict[str, Tensor] = {}
    for file_name, file_names in by_file.items():
        file_path = path / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{path}: shard file {file_name} (listed in {INDEX_FILE}) is missing")
        with open_safetensors(file_path) as f:
            present = set(f.keys())
            for name in file_names:
                if stored + name not in present:
                    raise CheckpointError(f"{file_path}: missing tensor {stored + name} (listed in {INDEX_FILE})")
                out[name] = f.get_tensor(stored + name)
    return out


def save_tensors(path: Path, tensors: dict[str, Tensor], max_shard_bytes: int = 2**30) -> None:
    """Write ``tensors`` as ``model.safetensors``, or as shards plus an index when larger than one shard."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # safetensors refuses views sharing storage; a private contiguous copy keeps save_file happy.
    items = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in tensors.items()]
    shards: list[dict[str, Tensor]] = [{}]
    used = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    if len(shards) == 1:
        _save_readable(shards[0], path / SINGLE_FILE)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_readable(shard, path / file_name)
        for name, t in shard.items():
            weight_map[name] = file_name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _save_readable(tensors: dict[str, Tensor], file: Path) -> None:
    """safetensors writes mode 0600: a checkpoint made by one user was unreadable to a service
    running as another, unlike the config and tokenizer files beside it (the umask's mode)."""
    save_file(tensors, str(file), metadata={"format": "pt"})
    file.chmod(0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


# Name used in the spec's file list; same function.
save_safetensors_sharded = save_tensors


