"""When to speculate: a batch falls back to plain decoding while its drafts are not accepted.

Why: a DDTree step costs more than an autoregressive one (the draft, and a verify of budget + 1
nodes instead of one). On the demo model it is 1.2-1.35x an AR step, so requests accepting ~1.2
tokens a step (the demo drafter on 1024-token contexts before it was trained on long ones,
BENCHMARKS.md) decode slower with speculation than without it. Speculation must not lose: after ``window`` DDTree steps
whose requests averaged below ``min_acceptance`` tokens a step, the batch takes ``backoff``
autoregressive steps (budget 0: root-only trees), then probes with DDTree again. Each failed probe
doubles the pause, up to ``max_backoff``; a window at or above the bar resets it.

The decision is the batch's, not each request's: a verify pads every tree of a step to the
largest, so one request probing alone makes the whole step a DDTree step. Per-request pauses did
exactly that at C=128 (bench/results/matrix-demo-gate.json: 0.85-0.92x AR where speculating
throughout had won 1.14x). A request's output is the same either way: every greedy token is the
target's argmax, and a sampled token is drawn with noise keyed to its index in the sequence,
not to its tree (``services/verifier/sampling.py``). So sampled requests pause with the batch,
and their acceptance counts in the window's mean like the greedy ones'.

When the batch empties, its evidence goes with it (``forget``): the next requests are other
prompts, so they start speculating with the backoff at its shortest. A pause kept across an idle
spell judged a new batch by the last one's drafts (in ``ddtree bench``, one budget's cell by the
cell before it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.common.settings import MAX_SPEC_BACKOFF_STEPS

__all__ = ["SpeculationGate"]


@dataclass
class SpeculationGate:
    min_acceptance: float          # tokens per DDTree step below which speculation does not pay (0 = always)
    backoff: int = 16              # autoregressive steps after the first failed window
    max_backoff: int = MAX_SPEC_BACKOFF_STEPS
    window: int = 4                # DDTree steps averaged before deciding
    _recent: deque = field(default_factory=deque)
    _ar_left: int = 0
    _next_backoff: int = 0
    fallbacks: int = 0
    window_mean: float = 0.0       # the last full window's mean acceptance (what a pause was decided on)

    def __post_init__(self) -> None:
        self._next_backoff = self.backoff

    def speculate(self) -> bool:
        """Whether this step drafts trees (False while pausing; each call is one step)."""
        if self._ar_left > 0:
            self._ar_left -= 1
            return False
        return True

    def observe(self, speculated: bool, acceptance: float) -> bool:
        """One step's mean accepted tokens (bonus included) over its DDTree requests; returns True
        when this observation starts a pause."""
        if not speculated or acceptance <= 0 or self.min_acceptance <= 0:
            return False   # an autoregressive step or a prefill-only step says nothing about drafts
        self._recent.append(acceptance)
        if len(self._recent) < self.window:
            return False
        mean = sum(self._recent) / len(self._recent)
        self.window_mean = mean
        self._recent.popleft()
        if mean >= self.min_acceptance:
            self._next_backoff = self.backoff
            return False
        self._ar_left = self._next_backoff
        self._next_backoff = min(2 * self._next_backoff, self.max_backoff)
        self._recent.clear()
        self.fallbacks += 1
        return True

    def forget(self) -> None:
        """The batch emptied: its pause, backoff and window go (``fallbacks`` keeps counting)."""
        self._ar_left = 0
        self._next_backoff = self.backoff
        self._recent.clear()

    @property
    def pause_left(self) -> int:
        return self._ar_left
