"""Kimi-K2's `tiktoken.model` read as a `tokenizers` tokenizer.

Why: Kimi-K2 checkpoints ship their tokenizer as tiktoken ranks (`tiktoken.model`), the special
tokens in `tokenizer_config.json`, and the pre-tokenizer pattern in code (`tokenization_kimi.py`),
with no `tokenizer.json`; the scheduler served such a model token ids only. Byte-level BPE in
tiktoken's form converts to the Hugging Face form without loss: each rank is a vocabulary id, the
merges are every split of a token into two shorter ones (ordered by the rank they make), and the
whole-piece lookup tiktoken does first is the BPE model's `ignore_merges`. The rest of the scheduler
(detokenising, stop strings, the tokenizing worker) then works on it unchanged.

One difference from tokenization_kimi.py's own `encode`: it cuts a text at every 400K characters
and inside runs of more than 25K whitespace or non-whitespace characters (a guard against a crash
in tiktoken), so such a text can get other ids at a cut than here, where nothing is cut.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from services.common.config_files import CONFIG_FILE, read_config, read_json_object, refuse_lfs_pointer

__all__ = ["KIMI_PATTERN", "RESERVED_SPECIAL_TOKENS", "TIKTOKEN_FILE", "bytes_to_unicode", "kimi_tokenizer",
           "read_ranks", "special_tokens", "tokenizer_from_ranks"]

TIKTOKEN_FILE = "tiktoken.model"
# Kimi-K2's pre-tokenizer (`TikTokenTokenizer.pat_str` of its tokenization_kimi.py): Han runs, words
# with their case pattern and English contractions, numbers in threes, punctuation, whitespace.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Ids after the ranks that tokenization_kimi.py gives special tokens, named by tokenizer_config.json.
RESERVED_SPECIAL_TOKENS = 256 + 2


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, which the `ByteLevel` pre-tokenizer and decoder use: printable
    bytes stand for themselves, the others for the code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_ranks(path: Path) -> dict[bytes, int]:
    """`path`'s lines, "<base64 token> <rank>"; the ranks must be 0..n-1, each once, since they are
    the vocabulary's ids and the special tokens follow them."""
    refuse_lfs_pointer(path)   # a clone without git-lfs: "not a rank line" sent users to the file's format
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"{path}:{number}: not a tiktoken rank line ({exc})") from None
        if token in ranks:
            raise ValueError(f"{path}:{number}: token {token!r} listed twice")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # a text holding such a byte could not be encoded at all
        raise ValueError(f"{path}: {len(missing)} single bytes have no rank (first: {missing[0]:#04x})")
    return ranks


def special_tokens(model_dir: Path, first_id: int, vocab_size: int | None = None) -> dict[str, int]:
    """tokenization_kimi.py's special tokens: ids `first_id` on, named by tokenizer_config.json's
    `added_tokens_decoder` or `<|reserved_token_ID|>`. Ids past the model's `vocab_size` go: the
    code reserves 258 ids where Kimi-K2's embedding has 256, and a text naming one of the two would
    be encoded to an id the model cannot take."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():   # every special token would be "reserved", and "[BOS]" in a text plain text
        raise ValueError(f"{config} is missing: its added_tokens_decoder names the special tokens")
    added = read_json_object(config).get("added_tokens_decoder") or {}
    if not isinstance(added, dict):
        raise ValueError(f"{config}: added_tokens_decoder must be an object of id: {{content: ...}}")
    names: dict[int, str] = {}
    for key, entry in added.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (str(key).isascii() and str(key).isdigit()) or not isinstance(content, str) or not content:
            raise ValueError(f"{config}: added_tokens_decoder[{key!r}] is not an id with a content string")
        names[int(key)] = content
    end = first_id + RESERVED_SPECIAL_TOKENS
    if vocab_size is not None:
        end = min(end, vocab_size)
    out: dict[str, int] = {}
    for i in range(first_id, end):
        name = names.get(i, f"<|reserved_token_{i}|>")
        if name in out:
            raise ValueError(f"{config}: special token {name!r} names ids {out[name]} and {i}")
        out[name] = i
    return out


def tokenizer_from_ranks(ranks: dict[bytes, int], specials: dict[str, int],
                         pattern: str = KIMI_PATTERN) -> Tokenizer:
    """A `tokenizers` tokenizer that encodes as tiktoken does with these ranks, this pattern and
    `allowed_special="all"` (special token text becomes its id), and decodes to the same text."""
    alphabet = bytes_to_unicode()
    words = {token: "".join(alphabet[b] for b in token) for token in ranks}   # each token's byte-level string
    vocab = {words[token]: rank for token, rank in ranks.items()}
    found: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], words[left], words[right]))
    found.sort()
    model = models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in found], ignore_merges=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    ordered = sorted(specials.items(), key=lambda item: item[1])
    if ordered and [i for _, i in ordered] != list(range(len(ranks), len(ranks) + len(ordered))):
        raise ValueError(f"special token ids must follow the {len(ranks)} ranks without gaps")
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in ordered])
    for name, i in ordered:  # a name that is also a ranked token keeps that token's id
        if tokenizer.token_to_id(name) != i:
            raise ValueError(f"special token {name!r} (id {i}) is also token {tokenizer.token_to_id(name)} of the ranks")
    return tokenizer


def kimi_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of a checkpoint that ships `tiktoken.model` (Kimi-K2), its special tokens
    capped at config.json's `vocab_size`."""
    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    if not (model_dir / CONFIG_FILE).is_file():
        raise ValueError(f"{model_dir / CONFIG_FILE} is missing: its vocab_size bounds the special tokens "
                         "(point the setting at the model's directory)")
    vocab_size = read_config(model_dir).get("vocab_size")   # a multimodal wrapper's (Kimi-K2.5): its text_config's
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < len(ranks):
        raise ValueError(f"{model_dir / CONFIG_FILE}: vocab_size {vocab_size!r} is not a vocabulary of the "
                         f"{len(ranks)} ranks and their special tokens")
    return tokenizer_from_ranks(ranks, special_tokens(model_dir, len(ranks), vocab_size))
