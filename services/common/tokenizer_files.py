"""A model's tokenizer from its files, and a digest that says whether two tokenizers are one.

Why shared: the scheduler tokenizes with the tokenizer its `tokenizer_path` names, and the draft
knows which model it serves (`draft.target_path`). A scheduler given another model's tokenizer
(compose's `scheduler.tokenizer_path` left at the demo's while the other paths moved) served
every text prompt as other tokens, without a word; the draft now tells the scheduler its target's
tokenizer digest, and the scheduler refuses to start with another.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from tokenizers import Tokenizer

from services.common.config_files import CheckpointError, refuse_lfs_pointer
from services.common.logging import get_logger
from services.common.settings import SettingsError
from services.common.tiktoken_model import TIKTOKEN_FILE, kimi_tokenizer

__all__ = ["TOKENIZER_FILE", "load_tokenizer", "model_tokenizer_digest", "vocab_digest"]

TOKENIZER_FILE = "tokenizer.json"

log = get_logger(__name__)


def load_tokenizer(path: str, setting: str = "scheduler.tokenizer_path") -> Tokenizer | None:
    """`path` is a tokenizer.json, Kimi-K2's tiktoken.model (converted here, about 2 s at its 164K
    tokens, with the files beside it), or a model directory holding either; "" serves token-id
    prompts only (None). A path with no tokenizer fails start-up (``SettingsError`` naming
    ``setting``): before, it was taken silently, and every text prompt then failed with a message
    that did not name the setting."""
    if not path:
        return None
    p = Path(path)
    # The tiktoken file itself (it was read as a tokenizer.json, "expected value at line 1") is
    # converted as its directory's: with the files beside it that name its special tokens.
    given_tiktoken = p.name == TIKTOKEN_FILE and p.is_file()
    p = p.parent if given_tiktoken else p
    if given_tiktoken or (p.is_dir() and not (p / TOKENIZER_FILE).is_file() and (p / TIKTOKEN_FILE).is_file()):
        started = time.perf_counter()
        try:
            tokenizer = kimi_tokenizer(p)
        except (ValueError, OSError, KeyError) as exc:
            raise SettingsError(f"{setting}: {p} (tiktoken.model): {exc}") from None
        log.info("tokenizer_converted", source=str(p / TIKTOKEN_FILE), tokens=tokenizer.get_vocab_size(),
                 seconds=round(time.perf_counter() - started, 2))
        return tokenizer
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise SettingsError(f"{setting}: no tokenizer at {p} (set it to \"\" to serve token-id prompts only)")
    try:
        refuse_lfs_pointer(p)
        return Tokenizer.from_file(str(p))
    except CheckpointError as exc:
        raise SettingsError(f"{setting}: {exc}") from None
    except Exception as exc:  # the tokenizers library raises its own exception type
        raise SettingsError(f"{setting}: {p} is not a tokenizer: {exc}") from None


def vocab_digest(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's vocabulary (every token and its id, added ones included): equal
    for the same tokenizer however its file is written (a copy, a re-save, tiktoken converted
    twice), other for another model's."""
    digest = hashlib.sha256()
    for token, token_id in sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]):
        digest.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


def model_tokenizer_digest(model_dir: str, setting: str) -> str:
    """`vocab_digest` of the tokenizer in ``model_dir``, "" where it holds none (a checkpoint of
    weights alone: nothing to compare with)."""
    d = Path(model_dir)
    if not d.is_dir() or not ((d / TOKENIZER_FILE).is_file() or (d / TIKTOKEN_FILE).is_file()):
        return ""
    tokenizer = load_tokenizer(str(d), setting)
    return vocab_digest(tokenizer) if tokenizer is not None else ""
