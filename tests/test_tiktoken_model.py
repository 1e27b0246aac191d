"""Kimi-K2's tiktoken.model read as a `tokenizers` tokenizer: the same ids as tiktoken itself."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import string
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Regex, pre_tokenizers

from services.common.settings import SettingsError
from services.common.tokenizer_files import load_tokenizer
from services.common.tiktoken_model import (KIMI_PATTERN, bytes_to_unicode, read_ranks, special_tokens,
                                               tokenizer_from_ranks)

DEMO = Path("models/demo")


def demo_ranks() -> dict[bytes, int]:
    """tiktoken ranks of the demo tokenizer's byte-level BPE: the 256 bytes, then each merge's
    result in merge order (a realistic table: 4K tokens learned on Python source)."""
    model = json.loads((DEMO / "tokenizer.json").read_text())["model"]
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))


def texts(seed: int) -> list[str]:
    """Python source, mixed scripts with special token text in it, and random code points from
    blocks the pattern treats apart (Latin, marks, Han, emoji and joiners, line breaks)."""
    out = [Path(m.__file__).read_text() for m in (json, random, string)]
    out.append("Héllo WORLD's naïve café — 你好，世界！\tTabs\r\n\r\n  spaces   1234567 3.14159 [BOS]x[EOS]"
               "<|im_end|>\n 😀👍🏽 ǅemal ĲSSELMEER they'RE I'LL x'Ve ÉCOLE école")
    rng = random.Random(seed)
    pool = [chr(c) for c in [*range(32, 127), *range(0xA0, 0x250), *range(0x300, 0x370), *range(0x4E00, 0x4E40),
                             0x1F600, 0x1F44D, 0x200D, 0xFE0F, 0x0A, 0x0D, 0x09, 0x3000, 0x2028]]
    out += ["".join(rng.choice(pool) for _ in range(rng.randint(1, 200))) for _ in range(200)]
    return out


def test_a_converted_table_encodes_as_tiktoken_does() -> None:
    """Ids equal tiktoken's (Kimi's pattern, special token text allowed) on every text, and decode
    gives the text back."""
    ranks = demo_ranks()
    specials = {"[BOS]": len(ranks), "[EOS]": len(ranks) + 1, "<|im_end|>": len(ranks) + 2}
    ours = tokenizer_from_ranks(ranks, specials)
    theirs = tiktoken.Encoding("demo", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    assert ours.get_vocab_size(with_added_tokens=True) == len(ranks) + 3
    for text in texts(0):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, allowed_special="all"), text[:60]
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("a[EOS]", add_special_tokens=False).ids[-1] == len(ranks) + 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tokens_with_many_splits_merge_in_tiktokens_order(seed: int) -> None:
    """A table grown from random pairs of a 10-letter alphabet, where most tokens split into two
    ranked tokens several ways: the merge order must still be tiktoken's (lowest rank first)."""
    rng = random.Random(seed)
    letters = "abcde fgh\n"
    ranks = {bytes([b]): b for b in range(256)}
    grown = [c.encode() for c in letters]
    while len(ranks) < 2000:
        token = rng.choice(grown) + rng.choice(grown)
        if token not in ranks and len(token) <= 12:
            ranks[token] = len(ranks)
            grown.append(token)
    # Given in another order than the ranks' (a rank file need not be sorted): merges still go by rank.
    ours = tokenizer_from_ranks(dict(rng.sample(list(ranks.items()), len(ranks))), {})
    theirs = tiktoken.Encoding("grown", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for _ in range(2000):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(1, 60)))
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text), repr(text)


def test_a_piece_with_a_rank_is_one_token_even_where_no_merges_reach_it() -> None:
    """tiktoken takes a pre-tokenized piece whole when it has a rank, before any merge; plain BPE
    cannot reach a token with no two ranked halves ("abc" here, with no "ab" or "bc")."""
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256}
    theirs = tiktoken.Encoding("whole", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    assert tokenizer_from_ranks(ranks, {}).encode("abc", add_special_tokens=False).ids == theirs.encode("abc") == [256]


def test_kimis_pattern_splits_as_its_tokenizer_does() -> None:
    """Both sides of the comparisons above use KIMI_PATTERN: these pieces hold it to Kimi-K2's own
    `pat_str` (numbers in threes, Han runs apart, a word keeps its contraction)."""
    pieces = [p for p, _ in pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated").pre_tokenize_str(
        "x 1234567 你好world THEY'RE ok\n\n")]
    assert pieces == ["x", " ", "123", "456", "7", " ", "你好", "world", " THEY'RE", " ok", "\n\n"]


@pytest.mark.parametrize("body, needle", [
    ("YQ== 0\nYg==\n", ":2: not a tiktoken rank line"),
    ("YQ== 0\n!!!! 1\n", ":2: not a tiktoken rank line"),
    ("YQ== 0\nYQ== 1\n", ":2: token b'a' listed twice"),
    ("YQ== 0\nYg== 2\n", "ranks are not 0..1"),
    ("YQ== 0\nYg== 1\n", "254 single bytes have no rank (first: 0x00)"),
])
def test_a_bad_rank_file_is_refused_by_line(tmp_path, body: str, needle: str) -> None:
    path = tmp_path / "tiktoken.model"
    path.write_text(body)
    with pytest.raises(ValueError) as err:
        read_ranks(path)
    assert needle in str(err.value)


def test_blank_lines_in_a_rank_file_are_skipped(tmp_path) -> None:
    """tiktoken's own loader skips them; a reader that did not would refuse such a file as "not a
    tiktoken rank line"."""
    ranks = demo_ranks()
    path = tmp_path / "tiktoken.model"
    write_ranks(path, ranks)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:100]) + "\n\n   \n" + "\n".join(lines[100:]) + "\n\n")
    assert read_ranks(path) == ranks


def test_a_special_token_that_is_also_a_ranked_token_is_refused() -> None:
    """Its text would encode to the rank's id, not to the special id the model was trained with."""
    ranks = {bytes([b]): b for b in range(256)} | {b"[X": 256, b"[X]": 257}
    with pytest.raises(ValueError, match=re.escape("special token '[X]' (id 258) is also token 257")):
        tokenizer_from_ranks(ranks, {"[X]": 258})


def test_special_tokens_follow_the_ranks_and_stop_at_the_vocabulary(tmp_path) -> None:
    """tokenization_kimi.py reserves 258 ids after the ranks; Kimi-K2's embedding has 256 of them,
    and a special token past it would be an id the model cannot take."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"1000": {"content": "[BOS]"}, "1002": {"content": "<|im_end|>"}}}))
    every = special_tokens(tmp_path, 1000)
    assert len(every) == 258 and every["[BOS]"] == 1000 and every["<|im_end|>"] == 1002
    assert every["<|reserved_token_1001|>"] == 1001 and max(every.values()) == 1257
    capped = special_tokens(tmp_path, 1000, vocab_size=1256)
    assert len(capped) == 256 and max(capped.values()) == 1255
    assert special_tokens(tmp_path, 10, vocab_size=12) == {"<|reserved_token_10|>": 10, "<|reserved_token_11|>": 11}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": None}))   # none named
    assert special_tokens(tmp_path, 10, vocab_size=12) == {"<|reserved_token_10|>": 10, "<|reserved_token_11|>": 11}
    with pytest.raises(ValueError, match="tokenizer_config.json is missing"):   # "[BOS]" would be plain text
        special_tokens(tmp_path / "none", 10)


@pytest.mark.parametrize("config, needle", [
    ({"added_tokens_decoder": ["x"]}, "added_tokens_decoder must be an object"),
    ({"added_tokens_decoder": {"10": "x"}}, "added_tokens_decoder['10'] is not an id with a content string"),
    ({"added_tokens_decoder": {"ten": {"content": "x"}}}, "added_tokens_decoder['ten'] is not an id"),
    ({"added_tokens_decoder": {"\u00b2": {"content": "x"}}}, "added_tokens_decoder['\u00b2'] is not an id"),   # isdigit()
    ({"added_tokens_decoder": {"10": {"content": ""}}}, "added_tokens_decoder['10'] is not an id with a content"),
    ({"added_tokens_decoder": {"10": {"content": "[A]"}, "11": {"content": "[A]"}}}, "'[A]' names ids 10 and 11"),
])
def test_a_bad_tokenizer_config_is_named(tmp_path, config, needle) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        special_tokens(tmp_path, 10)
    assert needle in str(err.value)


def kimi_dir(tmp_path: Path) -> tuple[Path, dict[bytes, int]]:
    """A model directory as Kimi-K2 ships its tokenizer: tiktoken.model, tokenizer_config.json,
    config.json with the vocabulary 2 ids short of the reserved range."""
    ranks = demo_ranks()
    write_ranks(tmp_path / "tiktoken.model", ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        str(len(ranks)): {"content": "[BOS]", "special": True}, str(len(ranks) + 1): {"content": "[EOS]", "special": True}}}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": len(ranks) + 256}))
    return tmp_path, ranks


def test_the_scheduler_reads_a_kimi_model_directory(tmp_path) -> None:
    """`scheduler.tokenizer_path` = a directory with tiktoken.model and no tokenizer.json: text
    prompts are served, special tokens as the model's vocabulary holds them, and long texts in the
    worker process get the same ids as inline."""
    from services.scheduler.tokenizing import PromptEncoder

    model, ranks = kimi_dir(tmp_path)
    tokenizer = load_tokenizer(str(model))
    assert tokenizer is not None and tokenizer.get_vocab_size(with_added_tokens=True) == len(ranks) + 256
    text = "[BOS]def f(x):\n    return x  # 你好\n" * 300
    n = len(ranks)
    names = {"[BOS]": n, "[EOS]": n + 1, **{f"<|reserved_token_{i}|>": i for i in range(n + 2, n + 256)}}
    want = tiktoken.Encoding("k", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=names).encode(
        text, allowed_special="all")
    encoder = PromptEncoder(tokenizer, apart=True, inline_chars=100)
    try:
        assert asyncio.run(encoder.encode(text)) == want
        assert encoder._pool is not None  # it went to the worker
    finally:
        encoder.close()
    assert want[0] == len(ranks)


def test_the_scheduler_reads_a_tiktoken_file_given_by_itself(tmp_path) -> None:
    """`scheduler.tokenizer_path` = the tiktoken.model file was read as a tokenizer.json ("is not a
    tokenizer: expected value at line 1 column 1"); it converts as its directory does, also where a
    tokenizer.json lies beside it (the file asked for is the one read)."""
    model, ranks = kimi_dir(tmp_path)
    whole = load_tokenizer(str(model)).get_vocab(with_added_tokens=True)
    assert load_tokenizer(str(model / "tiktoken.model")).get_vocab(with_added_tokens=True) == whole
    (model / "tokenizer.json").write_text(Path("models/demo/tokenizer.json").read_text())
    assert load_tokenizer(str(model / "tiktoken.model")).get_vocab(with_added_tokens=True) == whole
    assert load_tokenizer(str(model)).get_vocab_size() != len(whole)   # the directory's tokenizer.json


def test_a_broken_tiktoken_model_fails_start_up_by_name(tmp_path) -> None:
    (tmp_path / "tiktoken.model").write_text("YQ== 0\n")
    with pytest.raises(SettingsError, match=r"scheduler.tokenizer_path: .*tiktoken.model: .*255 single bytes"):
        load_tokenizer(str(tmp_path))


def test_up_points_the_scheduler_at_a_kimi_model(tmp_path) -> None:
    """`ddtree up` set the tokenizer path only where tokenizer.json was, so a Kimi-K2 checkpoint
    served token ids only."""
    from services.common.launcher import Stack, StackSpec

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tiktoken.model").write_text("x")
    plan = Stack(StackSpec(model_path=str(tmp_path), scheduler_port=0))._plan()
    assert plan[-1].env["DDTREE_SCHEDULER_TOKENIZER_PATH"] == str(tmp_path)


def test_a_wrapped_models_vocabulary_caps_the_special_tokens(tmp_path) -> None:
    """Kimi-K2.5 keeps `vocab_size` in `text_config`: read at the top, there was none, and the two
    reserved ids past the embedding stayed (the scheduler then refused the tokenizer as larger
    than the model)."""
    model, ranks = kimi_dir(tmp_path)
    (model / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {"vocab_size": len(ranks) + 256}}))
    assert load_tokenizer(str(model)).get_vocab_size(with_added_tokens=True) == len(ranks) + 256


def test_tokenizer_json_wins_where_a_model_has_both(tmp_path) -> None:
    model, _ = kimi_dir(tmp_path)
    (model / "tokenizer.json").write_text((DEMO / "tokenizer.json").read_text())
    assert load_tokenizer(str(model)).get_vocab_size(with_added_tokens=True) == 4096   # the demo's, not converted


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer.json"])
def test_a_tokenizer_left_as_a_git_lfs_pointer_is_named(tmp_path, name) -> None:
    """A clone without git-lfs leaves pointer files: they read as "not a tiktoken rank line" or
    "is not a tokenizer"."""
    model, _ = kimi_dir(tmp_path)
    (model / name).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 9\n")
    with pytest.raises(SettingsError, match=rf"scheduler.tokenizer_path: .*{name}: a Git LFS pointer"):
        load_tokenizer(str(model if name == "tiktoken.model" else model / name))


def test_a_tiktoken_model_without_its_config_is_refused_by_name(tmp_path) -> None:
    """Without config.json no vocabulary bounds the 258 reserved ids, and the scheduler refused the
    tokenizer later as "more than the model's vocabulary (another model's tokenizer?)"."""
    model, _ = kimi_dir(tmp_path)
    (model / "config.json").unlink()
    with pytest.raises(SettingsError, match="config.json is missing: its vocab_size bounds the special tokens"):
        load_tokenizer(str(model))
    (model / "config.json").write_text(json.dumps({"vocab_size": "many"}))
    with pytest.raises(SettingsError, match="vocab_size 'many' is not a vocabulary"):
        load_tokenizer(str(model))
    ranks = len(demo_ranks())   # a vocabulary of the ranks alone is one (no special tokens); one short is not
    (model / "config.json").write_text(json.dumps({"vocab_size": ranks}))
    assert load_tokenizer(str(model)).get_vocab_size(with_added_tokens=True) == ranks
    (model / "config.json").write_text(json.dumps({"vocab_size": ranks - 1}))
    with pytest.raises(SettingsError, match=f"vocab_size {ranks - 1} is not a vocabulary of the {ranks} ranks"):
        load_tokenizer(str(model))
