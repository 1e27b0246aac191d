"""Build the demo corpus and tokenizer from the interpreter's own standard library (.py files).

    python -m train.corpus --out models/demo

Why the standard library: it is Python source that every machine running the project already
has, so the demo pair is reproducible offline. Files are split into train and held-out by a hash
of their path relative to the standard-library root, so the split does not depend on file order,
on which other files exist, or on the machine.

Writes:
    <out>/tokenizer.json        byte-level BPE trained on the train split only (id 0 "<|eos|>",
                                id 1 "<|mask|>": the EOS of the target, the mask of the drafter)
    <out>/corpus.json           Python version, split rule, counts, and the held-out file list
    <data>/train.npy            uint16 token stream of the train files, one EOS after each file
    <data>/heldout.npy          the same for the held-out files
    <data>/heldout_files.json   [{"path", "start", "length"}]: each held-out file's tokens in heldout.npy
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.tokenizer_train import EOS_TOKEN, MASK_TOKEN, train_tokenizer

__all__ = ["SourceFile", "collect_files", "is_heldout", "build_corpus", "DEFAULT_DATA_DIR"]

DEFAULT_DATA_DIR = Path("build/demo-data")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
MAX_FILE_BYTES = 256 * 1024  # a few generated tables (e.g. unicode data) are data, not code


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the standard-library root, '/'-separated
    text: str


def is_heldout(rel: str, percent: int) -> bool:
    """Deterministic split: the first 8 hex digits of sha256(path) mod 100 below ``percent``."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) % 100 < percent


def collect_files(root: Path | None = None) -> list[SourceFile]:
    """Every readable UTF-8 ``.py`` file of the standard library (test suites included), sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out: list[SourceFile] = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if _SKIP_DIRS.intersection(rel.split("/")[:-1]) or not p.is_file():
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append(SourceFile(rel, text))
    return out


def _encode(tok, files: list[SourceFile], eos: int) -> tuple[np.ndarray, list[dict]]:
    """One uint16 stream of all files, EOS after each; and each file's (start, length) in it."""
    encs = tok.encode_batch([f.text for f in files])
    chunks: list[np.ndarray] = []
    index: list[dict] = []
    pos = 0
    for f, e in zip(files, encs):
        ids = np.asarray(e.ids + [eos], dtype=np.uint16)  # [n+1]
        index.append({"path": f.rel, "start": pos, "length": len(e.ids)})
        chunks.append(ids)
        pos += ids.size
    return (np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)), index


def build_corpus(out: Path, data: Path, vocab_size: int = 4096, heldout_percent: int = 4,
                 root: Path | None = None) -> dict:
    """Collect, split, train the tokenizer on the train split, encode both splits; returns corpus.json."""
    t0 = time.time()
    files = collect_files(root)
    train = [f for f in files if not is_heldout(f.rel, heldout_percent)]
    held = [f for f in files if is_heldout(f.rel, heldout_percent)]
    print(f"corpus: {len(files)} files ({len(train)} train, {len(held)} held-out)", flush=True)
    data.mkdir(parents=True, exist_ok=True)
    # The trainer reads files, so hand it the train files' paths; the split decides which.
    stdlib = Path(root or sysconfig.get_paths()["stdlib"])
    tok = train_tokenizer(out, [stdlib / f.rel for f in train], vocab_size)
    eos, mask = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    assert (eos, mask) == (0, 1), f"special tokens must take ids 0 and 1, got {eos}, {mask}"
    assert tok.get_vocab_size() < 2**16, "token ids are stored as uint16"
    train_ids, _ = _encode(tok, train, eos)
    held_ids, held_index = _encode(tok, held, eos)
    np.save(data / "train.npy", train_ids)
    np.save(data / "heldout.npy", held_ids)
    (data / "heldout_files.json").write_text(json.dumps(held_index, indent=1))
    info = {
        "source": "CPython standard library .py files (test suites included, site-packages excluded, "
                  f"files over {MAX_FILE_BYTES} bytes or not UTF-8 skipped)",
        "python_version": platform.python_version(),
        "split": f"held-out when int(sha256(relative path)[:8], 16) % 100 < {heldout_percent}",
        "vocab_size": tok.get_vocab_size(),
        "eos_token_id": eos,
        "mask_token_id": mask,
        "train_files": len(train),
        "heldout_files": len(held),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "heldout_paths": [f.rel for f in held],
    }
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"corpus: vocab {info['vocab_size']}, {info['train_tokens']} train tokens, "
          f"{info['heldout_tokens']} held-out tokens ({time.time() - t0:.1f}s)", flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"), help="model dir (tokenizer.json, corpus.json)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="where the token streams go")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-percent", type=int, default=4)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    build_corpus(args.out, args.data, args.vocab_size, args.heldout_percent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
