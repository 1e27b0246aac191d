"""Text of a request's growing output, decoding only its newest tokens each step.

Why: decoding a request's whole output every step costs O(tokens) a step, O(tokens^2) a request:
at 4000 output tokens one decode of the demo tokenizer takes ~1 ms, so a batch of 32 long
generations spent ~30 ms of the scheduler's event loop a step on text alone. Byte-level BPE decodes
a token list as its bytes concatenated, so the text of the newest tokens can be had from a short
window that starts where the text last ended on a whole character.
"""

from __future__ import annotations

from tokenizers import Tokenizer

__all__ = ["IncrementalDetokenizer"]

_PARTIAL = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class IncrementalDetokenizer:
    """``text`` is ``tokenizer.decode(ids[:read])`` for the ids given so far, where ``read`` stops
    short of a trailing incomplete character until more tokens complete it (or ``final``)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # first token of the window: where the text before ended on a whole character
        self._read = 0    # tokens whose text is in ``text``

    def update(self, ids: list[int], final: bool = False) -> str:
        """Takes the output so far (the previous ids, possibly more) and returns the text through its
        last whole character; ``final``: through its end, partial characters included."""
        if len(ids) <= self._read:
            return self.text
        window = self._decode(ids[self._prefix:])
        before = self._decode(ids[self._prefix:self._read])
        if final or (len(window) > len(before) and not window.endswith(_PARTIAL)):
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
