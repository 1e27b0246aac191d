"""Reading and writing HF-style safetensors checkpoint directories.

Why a module of its own: the verifier, the drafter and the demo-checkpoint writer all read the
same layout (``config.json`` + ``model.safetensors`` or a sharded ``model.safetensors.index.json``),
and every failure should say *which directory, which file and which field/tensor* is wrong, so a
bad checkpoint is diagnosed from the error message alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from services.common.config_files import (CONFIG_FILE, CheckpointError, _lfs_pointer_error, read_config,
                                          read_json_object, refuse_lfs_pointer, require_checkpoint, weight_prefix,
                                          with_rope_parameters)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

__all__ = [
    "CheckpointError",
    "require_checkpoint",
    "CONFIG_FILE",
    "SINGLE_FILE",
    "INDEX_FILE",
    "read_config",
    "read_json_object",
    "refuse_lfs_pointer",
    "weight_prefix",
    "with_rope_parameters",
    "tensor_index",
    "header_dtype",
    "stored_tensors",
    "load_tensors",
    "shared_weights_digest",
    "save_tensors",
    "save_safetensors_sharded",
]


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
    return _index_and_prefix(Path(path))[0]


def _index_and_prefix(path: Path) -> tuple[dict[str, str], str]:
    """`tensor_index`, and the prefix the files' own names carry ("" but in a multimodal wrapper)."""
    every = _stored_index(path)
    prefix = weight_prefix(path) if (path / CONFIG_FILE).is_file() else ""
    if not prefix:
        return every, ""
    ours = {name[len(prefix):]: file for name, file in every.items() if name.startswith(prefix)}
    if not ours:   # else: "missing tensor model.embed_tokens.weight (+804 more)", the prefix unsaid
        raise CheckpointError(f"{path}: no tensor's name starts with {prefix!r}, where its {CONFIG_FILE} (a "
                              "multimodal wrapper) keeps the language model")
    return ours, prefix


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


# The target's tensors a drafter reads (DFlashDrafter.load), and how much of each the digest reads.
_SHARED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
_DIGEST_BYTES = 1 << 16


def shared_weights_digest(path: Path) -> str:
    """A digest of the target tensors a drafter shares (embedding, lm_head: their first 64 KB,
    shapes and dtypes), "" where the checkpoint has neither. The draft and the verifier each read
    the target from a path of their own (compose sets the two apart): a draft reading another
    model of the same shapes, a fine-tune beside its base, passed every check and drafted for
    the wrong model, at an acceptance of 1 and without a word."""
    path = Path(path)
    index, stored = _index_and_prefix(path)
    digest = hashlib.sha256()
    found = False
    for name in _SHARED_NAMES:
        if name not in index:
            continue
        with open_safetensors(path / index[name]) as f:
            part = f.get_slice(stored + name)
            shape = part.get_shape()
            row_bytes = (shape[1] if len(shape) > 1 else 1) * 2   # (bf16's; a wider dtype reads more)
            head = part[:max(1, _DIGEST_BYTES // row_bytes)].contiguous()
        digest.update(f"{name}:{part.get_dtype()}:{list(shape)}:".encode())
        digest.update(head.view(-1).view(torch.uint8).numpy().tobytes())
        found = True
    return digest.hexdigest()[:16] if found else ""


# safetensors' header dtypes as torch's
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                  "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                  "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def header_dtype(name: str) -> torch.dtype | str:
    """A safetensors header's dtype as torch's, or its own name where this table has none (the
    message then names what the file holds, not "another dtype")."""
    return _HEADER_DTYPES.get(name, name)


def stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype | str]]:
    """Every tensor's (shape, dtype) from the files' headers alone: what a check before loading
    reads (a drafter's weights were checked only once the service loaded them, after the verifier
    had loaded and warmed up). A shard missing, or a tensor its index lists and its file lacks,
    is a ``CheckpointError``."""
    path = Path(path)
    index, stored = _index_and_prefix(path)
    out: dict[str, tuple[tuple[int, ...], torch.dtype | str]] = {}
    for name, f in _each_in_its_file(path, index, stored, index):
        part = f.get_slice(stored + name)
        out[name] = (tuple(part.get_shape()), header_dtype(part.get_dtype()))
    return out


def _each_in_its_file(path: Path, index: dict[str, str], stored: str,
                      names: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """(name, its open file) for each of ``names``, a file at a time: a shard missing, or a tensor
    its index lists and its file lacks, is a ``CheckpointError`` naming the file."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name], []).append(name)
    for file_name, file_names in by_file.items():
        file_path = path / file_name
        if not file_path.is_file():
            raise CheckpointError(f"{path}: shard file {file_name} (listed in {INDEX_FILE}) is missing")
        with open_safetensors(file_path) as f:
            present = set(f.keys())
            for name in file_names:
                if stored + name not in present:
                    raise CheckpointError(f"{file_path}: missing tensor {stored + name} (listed in {INDEX_FILE})")
                yield name, f


def load_tensors(
    path: Path, names: Iterable[str] | None = None, prefix: str | None = None
) -> dict[str, Tensor]:
    """Load tensors from ``path`` (memory-mapped through safe_open), only the ones asked for.

    ``names`` selects exact names (each must exist), ``prefix`` selects every name starting with
    it; neither selects everything. Reading per shard keeps a TP rank from touching others' bytes.
    """
    path = Path(path)
    index, stored = _index_and_prefix(path)   # stored: the prefix of the names in the files
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
    return {name: f.get_tensor(stored + name) for name, f in _each_in_its_file(path, index, stored, wanted)}


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
    names = [SINGLE_FILE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    # An earlier save's other layout goes: a stale index (read before model.safetensors) or shards
    # kept the old weights loaded after a save over them (make-checkpoint --force, a training run
    # writing into its last output).
    stale = [f for f in (path / INDEX_FILE, path / SINGLE_FILE, *path.glob("model-*-of-*.safetensors"))
             if f.name not in names]
    for f in stale:
        f.unlink(missing_ok=True)
    if len(shards) == 1:
        _save_readable(shards[0], path / SINGLE_FILE)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for file_name, shard in zip(names, shards):
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


