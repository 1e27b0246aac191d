"""Train the byte-level BPE tokenizer of the bundled demo model pair.

Byte-level BPE covers every input byte, so any prompt round-trips exactly through
encode/decode; the two special tokens give the models an end-of-sequence id and the DFlash
drafter its mask id. The corpus is the interpreter's own standard library, available offline
everywhere the project runs.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|eos|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def default_corpus_files(limit: int | None = None) -> list[Path]:
    """Standard-library .py files (no test suites or installed packages), sorted for determinism."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    return files if limit is None else files[:limit]


def _read_texts(files: Iterable[Path]) -> Iterator[str]:
    """Yield each file's text; files that are not valid UTF-8 are skipped rather than mangled."""
    for f in files:
        try:
            yield Path(f).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def train_tokenizer(out_dir: Path, files: Sequence[Path], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on `files`, write `out_dir/tokenizer.json`, and return the tokenizer.

    Special tokens take ids 0 ("<|eos|>") and 1 ("<|mask|>"). The resulting vocabulary may be
    smaller than `vocab_size` when the corpus runs out of merges; size models by
    `tokenizer.get_vocab_size()`.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (byte alphabet + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_read_texts(files), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return tok
