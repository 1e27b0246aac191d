"""Incremental text of a growing output (``services/scheduler/detokenize.py``) on the demo tokenizer:
at every step a prefix of the whole decode, the whole decode at the end, and a request's stream
(``ActiveRequest``) the same text it had when each step decoded everything."""

from __future__ import annotations

import random

from ddtree.v1 import scheduler_pb2
from services.common.settings import SchedulerSettings
from services.scheduler.client import build_request
from services.scheduler.detokenize import IncrementalDetokenizer
from services.scheduler.request import ActiveRequest, validate
from tests.test_request_rules import LIMITS, TOKENIZER

TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "naïve café — ünïcödé 😀🚀 中文字符 ∑∫√ \t\n  spaced   out", "🇫🇷👩‍👩‍👧‍👦" * 3]


def _decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=False)


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
    return lists


def test_text_is_a_prefix_at_every_step_and_whole_at_the_end() -> None:
    rng = random.Random(0)
    for ids in _token_lists(rng):
        detok, seen = IncrementalDetokenizer(TOKENIZER), []
        for step in _streams(ids, rng):
            seen += step
            text = detok.update(seen)
            assert _decode(seen).startswith(text), (seen, text)
            assert not text.endswith("\ufffd") or _decode(seen) == text
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
            chunks.append(req.events.get_nowait().text)
        req.end(scheduler_pb2.FINISH_REASON_LENGTH)
        chunks.append(req.events.get_nowait().text)
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
