"""Incremental text of a growing output (``services/scheduler/detokenize.py``) on the demo tokenizer:
at every step a prefix of the whole decode, the whole decode at the end, and a request's stream
(``ActiveRequest``) the same text it had when each step decoded everything."""

from __future__ import annotations

import codecs
import random

from tokenizers import AddedToken, Tokenizer, decoders, models

from ddtree.v1 import scheduler_pb2
from services.common.settings import SchedulerSettings
from services.scheduler.client import build_request
from services.scheduler.detokenize import IncrementalDetokenizer
from services.scheduler.request import ActiveRequest, validate
from services.common.tiktoken_model import bytes_to_unicode
from tests.test_request_rules import LIMITS, TOKENIZER, _byte_token, _request, _steps

TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "naïve café — ünïcödé 😀🚀 中文字符 ∑∫√ \t\n  spaced   out", "🇫🇷👩‍👩‍👧‍👦" * 3]


def _decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=False)


def _whole(ids: list[int]) -> str:
    """The text through the last whole character, from the tokens' bytes: the decode, less the one
    U+FFFD of a character whose first bytes alone have arrived (a U+FFFD written as such stays)."""
    return _whole_of(TOKENIZER, ids)


def _whole_of(tokenizer, ids: list[int]) -> str:
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces = [tokenizer.id_to_token(i) for i in ids]   # an added token's too, if all in the alphabet
    raw = b"".join(bytes(byte_of[c] for c in p) if all(c in byte_of for c in p) else p.encode() for p in pieces)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    text = decoder.decode(raw, final=False)
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    assert whole == text + ("\ufffd" if decoder.getstate()[0] else "")   # the tokenizer decodes the same bytes
    return text


def _streams(ids: list[int], rng: random.Random) -> list[list[int]]:
    """``ids`` cut into steps of 1 to 6 tokens (a verify step accepts several)."""
    steps, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        steps.append(ids[i:i + n])
        i += n
    return steps


def _token_lists(rng: random.Random) -> list[list[int]]:
    vocab = TOKENIZER.get_vocab_size()
    byte_tokens = [TOKENIZER.token_to_id(c) for c in "ÃĤ¢ģĳ" if TOKENIZER.token_to_id(c) is not None]
    lists = [TOKENIZER.encode(t).ids for t in TEXTS]
    lists += [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(40)]
    lists += [[rng.choice(byte_tokens) for _ in range(rng.randint(1, 40))] for _ in range(20)]  # lone UTF-8 bytes
    # U+FFFD written as such (EF BF BD) and bytes no character starts with, among ASCII and lead bytes.
    bytes_ = [_byte_token(b) for b in (0xEF, 0xBF, 0xBD, 0x80, 0xFF, 0xE4, 0xF0, 0x9F)] + [TOKENIZER.token_to_id("x")]
    lists += [[rng.choice(bytes_) for _ in range(rng.randint(1, 120))] for _ in range(20)]
    return lists


def test_text_is_a_prefix_at_every_step_and_whole_at_the_end() -> None:
    rng = random.Random(0)
    for ids in _token_lists(rng):
        detok, seen = IncrementalDetokenizer(TOKENIZER), []
        for step in _streams(ids, rng):
            seen += step
            text = detok.update(seen)
            assert text == _whole(seen), (seen, text)   # everything but a character still arriving
        assert detok.update(seen, final=True) == _decode(ids)


def test_a_request_streams_what_decoding_everything_streamed() -> None:
    """The chunks a request emits, joined, equal the final text, which is the whole decode; and a
    multi-byte character split over two steps is held back until it is whole."""
    rng = random.Random(1)
    for ids in _token_lists(rng)[:20]:
        req = validate(build_request("x", max_tokens=len(ids) + 1), SchedulerSettings(), LIMITS, TOKENIZER)
        assert isinstance(req, ActiveRequest)
        req.eos_ids = frozenset()
        chunks = []
        for step in _streams(ids, rng):
            req.add_tokens(step, len(step))
            chunks.append(req.take().text)
        req.end(scheduler_pb2.FINISH_REASON_LENGTH)
        chunks.append(req.take().text)
        assert "".join(chunks) == req.text == _decode(ids)
        assert all("\ufffd" not in c or c is chunks[-1] or "\ufffd" in _decode(ids) for c in chunks)


def test_decoding_work_grows_with_new_tokens_not_with_the_output() -> None:
    """Each step decodes a window of the newest tokens: with 4000 tokens already out, a step decodes
    tens of tokens, not thousands."""
    class Counting:
        def __init__(self) -> None:
            self.tokens = 0

        def decode(self, ids, skip_special_tokens=False):
            self.tokens += len(ids)
            return TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    detok = IncrementalDetokenizer(counting)
    ids = TOKENIZER.encode(TEXTS[0] * 60).ids[:4000]
    for n in range(0, 3996, 4):
        detok.update(ids[:n + 4])
    before = counting.tokens
    detok.update(ids + [ids[0]] * 4)
    assert counting.tokens - before <= 16
    assert detok.update(ids + [ids[0]] * 4, final=True) == _decode(ids + [ids[0]] * 4)


def test_a_run_of_u_fffd_the_model_wrote_streams_as_it_comes() -> None:
    """A run of U+FFFD the model wrote (EF BF BD, or bytes no character starts with) decodes like a
    character still arriving: judged by the text it was held back whole, its window decoded again
    every step (6000 tokens: 1.4 s of the event loop, nothing streamed before the end). The bytes
    tell them apart: each step shows all of it, from a window of the newest tokens; so too a run of
    lead bytes, each ended by the next (only the last can still become a character)."""
    written = [_byte_token(b) for b in (0xEF, 0xBF, 0xBD)]
    x = TOKENIZER.token_to_id("x")
    for unit in (written, [_byte_token(0x80)], [_byte_token(0xFF)], [_byte_token(0xE4)], [x, _byte_token(0xF0)]):
        ids = unit * 600
        detok = IncrementalDetokenizer(TOKENIZER)
        for n in range(4, len(ids) + 1, 4):
            assert detok.update(ids[:n]) == _whole(ids[:n])
            assert n - detok._prefix <= 16   # a window of the newest steps
        assert len(detok.text) >= 590
        assert detok.update(ids, final=True) == _decode(ids)


def test_an_added_token_decodes_through_the_byte_alphabet_where_it_can() -> None:
    """The byte-level decoder reads an added token whose characters are all in GPT-2's alphabet as
    those bytes ("<café" ends in the lead byte E9, which the next tokens can complete), and any
    other as its text."""
    tokenizer = Tokenizer.from_str(TOKENIZER.to_str())
    tokenizer.add_tokens([AddedToken("<café", special=False), AddedToken("‹中", special=False)])
    x, a9 = tokenizer.token_to_id("x"), _byte_token(0xA9)
    for ids in ([x, tokenizer.token_to_id("<café"), a9, a9, x], [x, tokenizer.token_to_id("‹中"), a9, x]):
        detok = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            assert detok.update(ids[:n]) == _whole_of(tokenizer, ids[:n])
        assert detok.update(ids, final=True) == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_byte_fallback_tokenizer_keeps_the_texts_judgement() -> None:
    """SentencePiece's byte fallback writes a U+FFFD a byte of an unfinished character, so a cut
    inside one cannot be told from the text: such a tokenizer's window waits for the character."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "x": 257, "y": 258}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    e4, b8, ad = (vocab[f"<0x{b:02X}>"] for b in (0xE4, 0xB8, 0xAD))
    ids = [257, 257, 257, e4, b8] * 14 + [ad, 258]
    detok = IncrementalDetokenizer(tokenizer)
    for n in range(5, len(ids) + 1, 5):
        text = detok.update(ids[:n])
        assert tokenizer.decode(ids, skip_special_tokens=False).startswith(text)
    assert detok.update(ids, final=True) == tokenizer.decode(ids, skip_special_tokens=False)


def test_a_byte_fallback_run_that_is_no_valid_utf8_streams_its_whole_decode() -> None:
    """ByteFallback decodes a run of byte tokens as a whole: one that is no valid UTF-8 is a U+FFFD a
    byte, its valid characters included ("؋" D8 8B, a stray BE, "#" 23). Cut inside the run, the
    stream had sent "؋" and then sliced the run's U+FFFDs at its length: "؋���x", neither the
    decode "����x" nor the bytes' "؋�#x". Every stream of every step cut is the decode's prefix."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "x": 257, "y": 258}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    B = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    rng = random.Random(7)
    lists = [[B[0xD8], B[0x8B], B[0xBE], B[0x23], 257]]
    lists += [[rng.choice([257, 258] + [B[b] for b in (0xD8, 0x8B, 0xBE, 0x23, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F)])
               for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for ids in lists:
        whole = tokenizer.decode(ids, skip_special_tokens=False)
        detok, n = IncrementalDetokenizer(tokenizer), 0
        for step in _streams(ids, rng):
            n += len(step)
            assert whole.startswith(detok.update(ids[:n])), ids
        assert detok.update(ids, final=True) == whole, ids


def test_a_stop_string_of_u_fffd_ends_on_the_token_that_wrote_it() -> None:
    """A stop string holding U+FFFD matches one the model wrote, not a character's first bytes:
    the tokens kept end with the one that completed it (or showed that a character's first bytes
    stay one), and a character cut short at the end (max_tokens, an abort) leaves the reason as it
    was."""
    x, y = TOKENIZER.token_to_id("x"), TOKENIZER.token_to_id("y")
    ef, bf, bd, e4, b8 = (_byte_token(b) for b in (0xEF, 0xBF, 0xBD, 0xE4, 0xB8))
    for steps in ([[x], [ef, bf, bd], [y, y]], [[x], [ef, bf, bd, y, y]], [[x], [ef], [bf], [bd, y]], [[x, ef, bf, bd, y]]):
        req = _request(stop=("\ufffd",))
        text, ids, _ = _steps(req, steps)
        assert (text, ids, req.finish) == ("x", [x, ef, bf, bd], scheduler_pb2.FINISH_REASON_STOP), steps
    # A lead byte the next token does not continue (C3, then "y") is a U+FFFD from then on: the
    # stop is known with that token, which is kept, however the tokens came in steps.
    fd, c3 = _byte_token(0xFD), _byte_token(0xC3)
    for steps in ([[x], [fd, c3], [y, y]], [[x, fd, c3, y, y]], [[x], [fd], [c3], [y]], [[x, fd], [c3, y]]):
        req = _request(stop=("\ufffd\ufffd",))
        text, ids, _ = _steps(req, steps)
        assert (text, ids, req.finish) == ("x", [x, fd, c3, y], scheduler_pb2.FINISH_REASON_STOP), steps
    req = _request(stop=("\ufffd",), max_tokens=3)
    assert _steps(req, [[x], [e4, b8]])[:2] == ("x\ufffd", [x, e4, b8])
    assert req.finish == scheduler_pb2.FINISH_REASON_LENGTH
    req = _request(stop=("\ufffd",))
    req.add_tokens([x], 0)
    req.add_tokens([e4], 1)
    req.end(scheduler_pb2.FINISH_REASON_ABORTED)
    assert req.finish == scheduler_pb2.FINISH_REASON_ABORTED and req.out_ids == [x, e4] and req.text == "x\ufffd"
