"""Text of a request's growing output, decoding only its newest tokens each step.

Why: decoding a request's whole output every step costs O(tokens) a step, O(tokens^2) a request:
at 4000 output tokens one decode of the demo tokenizer takes ~1 ms, so a batch of 32 long
generations spent ~30 ms of the scheduler's event loop a step on text alone. Byte-level BPE decodes
a token list as its bytes concatenated, so the text of the newest tokens can be had from a short
window that starts where the text last ended on a whole character.

Whether it ended on one is read from the bytes of the last tokens where the tokenizer is byte-level
(the demo's, DeepSeek-V3's, Kimi-K2's): a U+FFFD the model wrote (its bytes EF BF BD, or a byte no
character can start with) decodes the same as a character still arriving, and judged by the text a
run of them was held back whole, its window decoded again every step (6000 such tokens: 1.4 s of
the event loop, nothing streamed before the end). Other tokenizers (SentencePiece's byte fallback
writes a U+FFFD a byte, so a cut inside a character cannot be told from the text) keep that
judgement, and a run of U+FFFD in their output still grows the window. Their byte tokens
(``<0xNN>``) decode a run at a time: a run that is no valid UTF-8 as a whole is a U+FFFD a byte,
the characters in it that were valid included, so a run's text is held until the run ends (a
window cut inside one streamed characters its whole decode then replaced).
"""

from __future__ import annotations

import codecs
import re
import weakref

from tokenizers import Tokenizer, decoders

from services.common.tiktoken_model import bytes_to_unicode

__all__ = ["IncrementalDetokenizer"]

_PARTIAL = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
_BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}


class _ByteTails:
    """The bytes a byte-level tokenizer's tokens decode from. Its decoder turns a token whose
    characters are all in GPT-2's byte alphabet into those bytes (an added token's too: "<café"
    ends in the lead byte E9), any other token into its UTF-8 text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def token_bytes(self, i: int) -> bytes | None:
        piece = self.tokenizer.id_to_token(i)
        if piece is None:
            return None
        return bytes(_BYTE_OF[c] for c in piece) if all(c in _BYTE_OF for c in piece) else piece.encode()

    def pending(self, ids: list[int]) -> int | None:
        """How many of the last tokens hold a character still arriving (its first bytes, which more
        bytes can complete): 0 where ``ids`` end on a whole one; None where a token is unknown."""
        tail, sizes = b"", []
        for i in reversed(ids[-3:]):   # a character still arriving has at most 3 bytes, a token at least 1
            raw = self.token_bytes(i)
            if raw is None:
                return None
            tail, sizes = raw + tail, sizes + [len(raw)]
            if len(tail) >= 3:
                break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(tail, final=False)   # what cannot start a character is replaced, not kept
        left = len(decoder.getstate()[0])
        tokens = 0
        while left > 0:
            left -= sizes[tokens]
            tokens += 1
        return tokens


_TAILS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> _ByteTails


def _byte_tails(tokenizer: Tokenizer) -> _ByteTails | None:
    """One per tokenizer (a request's detokenizer is made per request); None where it is not byte-level."""
    if not isinstance(tokenizer, Tokenizer) or not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    if tokenizer not in _TAILS:
        _TAILS[tokenizer] = _ByteTails(tokenizer)
    return _TAILS[tokenizer]


_BYTE_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> its byte token ids
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_run_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the ``<0xNN>`` tokens a ByteFallback decoder decodes a run at a time; empty for
    any other decoder."""
    if not isinstance(tokenizer, Tokenizer) or tokenizer.decoder is None:
        return frozenset()
    if tokenizer not in _BYTE_RUNS:
        ids: frozenset[int] = frozenset()
        if b'"ByteFallback"' in tokenizer.decoder.__getstate__():
            ids = frozenset(i for piece, i in tokenizer.get_vocab(with_added_tokens=False).items()
                            if _BYTE_TOKEN.fullmatch(piece))
        _BYTE_RUNS[tokenizer] = ids
    return _BYTE_RUNS[tokenizer]


class IncrementalDetokenizer:
    """The text of a growing token list. ``text`` is ``tokenizer.decode(ids[:read])``, where ``read``
    is the last point at which the text ended on a whole character; ``update`` returns it plus the
    whole characters decoded since, so a step that ends inside a character still shows (and lets
    stop strings see) everything before it."""

    MAX_WINDOW = 64  # tokens a window may grow to while its end stays partial (then it is cut shorter)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.unfinished = 0  # after a final update: 1 where the text ends in a character cut short
        self._prefix = 0  # first token of the window: where the text before ended on a whole character
        self._read = 0    # tokens whose text is in ``text``
        self._tails = _byte_tails(tokenizer)
        self._byte_run = _byte_run_ids(tokenizer)

    def update(self, ids: list[int], final: bool = False) -> str:
        """Takes the output so far (the previous ids, possibly more) and returns the text through its
        last whole character; ``final``: through its end, partial characters included."""
        if len(ids) <= self._read:
            return self.text
        if not final and ids[-1] in self._byte_run:   # a byte run still open: the text before it only
            start = len(ids)
            while start > self._read and ids[start - 1] in self._byte_run:
                start -= 1
            return self.update(ids[:start]) if start > self._read else self.text
        before = self._decode(ids[self._prefix:self._read])
        new = self._decode(ids[self._prefix:])[len(before):]
        pending = self._pending(ids)
        partial = new.endswith(_PARTIAL) if pending is None else bool(pending) and new.endswith(_PARTIAL)
        if final or (new and not partial):
            self.unfinished = int(final and bool(pending) and new.endswith(_PARTIAL))
            self._commit(new, len(ids))
            return self.text
        if pending is not None:   # the bytes say what is still arriving: one character, its U+FFFD
            cut = len(ids) - pending
            if partial and cut > self._read:   # what comes before it is final: the window moves on
                head = self._decode(ids[self._prefix:cut])[len(before):]
                self._commit(head, cut)
                return self.update(ids)
            return self.text + new[:-1] if partial else self.text
        if len(ids) - self._prefix > self.MAX_WINDOW:  # a run of partial ends: move the window on
            for end in range(len(ids) - 1, max(self._read, len(ids) - 4), -1):
                if ids[end - 1] in self._byte_run and ids[end] in self._byte_run:   # not inside a byte run
                    continue
                head = self._decode(ids[self._prefix:end])[len(before):]
                if head and not head.endswith(_PARTIAL):
                    self._commit(head, end)
                    return self.update(ids)
        return self.text + new.rstrip(_PARTIAL)

    def ends_inside_a_character(self, ids: list[int]) -> bool:
        """Whether the text of ``ids`` ends in a character still arriving (its U+FFFD is no output
        character yet); where the tokenizer's bytes are not known, whether it ends in a U+FFFD."""
        pending = self._pending(ids)
        return self._decode(ids[-1:]).endswith(_PARTIAL) if pending is None else bool(pending)

    def _pending(self, ids: list[int]) -> int | None:
        """``_ByteTails.pending`` where the tokenizer's bytes are known, else None."""
        return self._tails.pending(ids) if self._tails is not None else None

    def anchor(self, ids: list[int]) -> tuple[int, str]:
        """A token index of ``ids`` (the list ``update`` took, possibly longer) and the text of the
        tokens before it, ending on a whole character: the text of ``ids[:k]`` for k past it is
        that text and the decode of ``ids[index:k]``."""
        return self._prefix, self.text[:len(self.text) - len(self._decode(ids[self._prefix:self._read]))]

    def _commit(self, new: str, read: int) -> None:
        self.text += new
        self._prefix, self._read = self._read, read

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
