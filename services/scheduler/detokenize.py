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
    """The text of a growing token list. ``text`` is ``tokenizer.decode(ids[:read])``, where ``read``
    is the last point at which the text ended on a whole character; ``update`` returns it plus the
    whole characters decoded since, so a step that ends inside a character still shows (and lets
    stop strings see) everything before it."""

    MAX_WINDOW = 64  # tokens a window may grow to while its end stays partial (then it is cut shorter)

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
        before = self._decode(ids[self._prefix:self._read])
        new = self._decode(ids[self._prefix:])[len(before):]
        if final or (new and not new.endswith(_PARTIAL)):
            self._commit(new, len(ids))
            return self.text
        if len(ids) - self._prefix > self.MAX_WINDOW:  # a run of partial ends: move the window on
            for end in range(len(ids) - 1, max(self._read, len(ids) - 4), -1):
                head = self._decode(ids[self._prefix:end])[len(before):]
                if head and not head.endswith(_PARTIAL):
                    self._commit(head, end)
                    return self.update(ids)
        return self.text + new.rstrip(_PARTIAL)

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
