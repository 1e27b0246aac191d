"""`make_random_checkpoint` (`ddtree make-checkpoint`, the benches' random pair): each argument reaches
the file it is for, and the target and drafter agree on the tokenizer's special ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.common.checkpoint import tensor_index
from services.common.make_checkpoint import make_random_checkpoint
from services.common.tokenizer_train import EOS_TOKEN, MASK_TOKEN
from services.draft.config import DraftConfig


def _read(ckpt: Path) -> tuple[dict, DraftConfig, Tokenizer]:
    return (json.loads((ckpt / "config.json").read_text()),
            DraftConfig.from_hf(json.loads((ckpt / "drafter" / "config.json").read_text())),
            Tokenizer.from_file(str(ckpt / "tokenizer.json")))


def test_a_random_checkpoint_by_default_is_the_documented_pair(tmp_path: Path) -> None:
    """Vocabulary 512, INT4 experts, 16-token blocks; the tokenizer fills the vocabulary, the target
    ends (and begins) on the tokenizer's <|eos|>, and the drafter masks with <|mask|>: swapped, the
    target never stopped and the drafter masked with the end of sequence."""
    target, drafter, tok = _read(make_random_checkpoint(tmp_path / "ckpt"))
    assert target["vocab_size"] == drafter.vocab_size == tok.get_vocab_size() == 512
    assert "quantization_config" in target
    assert any(name.endswith("weight_packed") for name in tensor_index(tmp_path / "ckpt"))
    assert drafter.block_size == 16
    eos, mask = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    assert eos != mask
    assert target["eos_token_id"] == eos and target["bos_token_id"] == eos
    assert drafter.mask_token_id == mask


def test_a_random_checkpoint_takes_each_argument(tmp_path: Path) -> None:
    """`ddtree make-checkpoint --bf16-experts` passes int4=False; benches pass the vocabulary, the
    drafter's block and overrides of the target's config, which win over the tokenizer's ids."""
    target, drafter, tok = _read(make_random_checkpoint(tmp_path / "ckpt", vocab_size=600, int4=False, block_size=8,
                                                        target_overrides={"bos_token_id": 1}))
    assert target["vocab_size"] == drafter.vocab_size == tok.get_vocab_size() == 600
    assert "quantization_config" not in target
    assert not any(name.endswith("weight_packed") for name in tensor_index(tmp_path / "ckpt"))
    assert drafter.block_size == 8
    assert target["bos_token_id"] == 1 and target["eos_token_id"] == tok.token_to_id(EOS_TOKEN)
