"""`ddtree make-checkpoint`: a small random target, its DFlash drafter and a tokenizer, in the real formats.

Random weights are for tests and timing only (never for acceptance figures): the layout, names,
INT4 packing and configs are exactly what the loaders read from real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.common.tokenizer_train import EOS_TOKEN, MASK_TOKEN, default_corpus_files, train_tokenizer
from services.draft.make_drafter import write_random_drafter
from services.verifier.make_target import write_random_target

__all__ = ["make_random_checkpoint"]

CORPUS_FILES = 120  # enough standard-library source for a few hundred merges, trains in seconds


def make_random_checkpoint(out: Path, vocab_size: int = 512, seed: int = 0, int4: bool = True,
                           target_overrides: dict | None = None, block_size: int = 16) -> Path:
    """Writes <out>/config.json + weights + tokenizer.json, and <out>/drafter/; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out, default_corpus_files(CORPUS_FILES), vocab_size)
    eos, mask = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    overrides = {"eos_token_id": eos, "bos_token_id": eos, **(target_overrides or {})}
    write_random_target(out, vocab_size=vocab_size, int4=int4, seed=seed, overrides=overrides)
    target_cfg = json.loads((out / "config.json").read_text())
    write_random_drafter(out / "drafter", target_cfg, block_size=block_size, seed=seed + 1, mask_token_id=mask)
    return out
