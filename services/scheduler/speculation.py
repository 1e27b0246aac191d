"""When to speculate: a request falls back to plain decoding while its drafts are not accepted.

Why: a DDTree step costs more than an autoregressive one (the draft, and a verify of budget + 1
nodes instead of one). On the demo model it is 1.2-1.35x an AR step, so a request accepting ~1.2
tokens a step (the demo drafter on 1024-token contexts, bench/results/matrix-demo.json) decodes
slower with speculation than without it, and more so under load. Speculation must not lose: after
``window`` DDTree steps averaging below ``min_acceptance`` tokens, the request takes ``backoff``
autoregressive steps (budget 0: a root-only tree), then probes with DDTree again. Each failed
probe doubles the backoff, up to ``max_backoff``; a window at or above the bar resets it. Greedy
output is the same either way: every step's tokens are the target's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["SpeculationGate"]


@dataclass
class SpeculationGate:
    min_acceptance: float          # tokens per DDTree step below which speculation does not pay
    backoff: int = 16              # autoregressive steps after the first failed window
    max_backoff: int = 256
    window: int = 4                # DDTree steps averaged before deciding
    _recent: deque = field(default_factory=deque)
    _ar_left: int = 0
    _next_backoff: int = 0
    fallbacks: int = 0             # times this request fell back (for logs)

    def __post_init__(self) -> None:
        self._next_backoff = self.backoff

    def budget(self, budget: int) -> int:
        """The budget to send this step: ``budget``, or 0 while backing off."""
        if self._ar_left > 0:
            self._ar_left -= 1
            return 0
        return budget

    def observe(self, sent_budget: int, acceptance: int) -> None:
        """One step's accepted tokens (bonus included) for the budget that step was sent with."""
        if sent_budget == 0 or acceptance <= 0 or self.min_acceptance <= 0:
            return   # an autoregressive step or a prefill says nothing about the drafts
        self._recent.append(acceptance)
        if len(self._recent) < self.window:
            return
        mean = sum(self._recent) / len(self._recent)
        self._recent.popleft()
        if mean >= self.min_acceptance:
            self._next_backoff = self.backoff
            return
        self._ar_left = self._next_backoff
        self._next_backoff = min(2 * self._next_backoff, self.max_backoff)
        self._recent.clear()
        self.fallbacks += 1
