"""Tree acceptance: walk the draft tree along the target's own choices.

Starting at the root, the target's posterior token at the current node is what it would emit
next. If a child of the node carries that token, the drafter guessed right: move there and keep
going. Otherwise stop; the posterior token at the last node is the free "bonus" token. At T=0 this
is exact greedy decoding; at T>0 with one independent posterior draw per node it is exact
sampling, since each emitted token is the target's draw given the accepted prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

__all__ = ["Acceptance", "accept"]


@dataclass(frozen=True)
class Acceptance:
    """Result of one tree walk.

    path: node indices from the root (0) down the accepted path.
    tokens: the accepted nodes' tokens (path[1:]) followed by the bonus token; len == len(path).
    """

    path: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the bonus token excluded)."""
        return len(self.path) - 1


def accept(tokens: Tensor | Sequence[int], parents: Tensor | Sequence[int],
           posterior: Tensor | Sequence[int]) -> Acceptance:
    """Accepted path and emitted tokens of one tree.

    Args:
        tokens: [n] node tokens (node 0 is the root).
        parents: [n] parent index per node; -1 for the root and padding nodes.
        posterior: [n] the target's token at each node (see ``posterior_tokens``).

    Returns:
        :class:`Acceptance`. Always emits at least the bonus token at the root.

    A plain walk over host lists: a tree is at most a few hundred nodes, for which one pass in
    Python is several times faster than a dozen tensor ops on tensors that small. A child c
    matches when tokens[c] == posterior[parents[c]] and its parent precedes it (which also rules
    out cycles); the lowest index wins if a malformed tree has duplicate siblings.
    """
    tok, par, post = _as_list(tokens), _as_list(parents), _as_list(posterior)
    n = len(tok)
    nxt = [n] * n            # each node's matching child; n = none
    for c in range(n - 1, 0, -1):   # downwards, so the lowest matching index is written last
        p = par[c]
        if 0 <= p < c and tok[c] == post[p]:
            nxt[p] = c
    path = [0]
    out: list[int] = []
    cur = 0
    while nxt[cur] < n:
        cur = nxt[cur]
        path.append(cur)
        out.append(tok[cur])
    out.append(post[cur])
    return Acceptance(path=path, tokens=out)


def _as_list(x: Tensor | Sequence[int]) -> list[int]:
    """A list is taken as it is (the engine's come from ``tolist()``: Python ints already; copying
    three a tree cost as much as the walk itself); a tensor or another sequence is converted."""
    if isinstance(x, list):
        return x
    return x.tolist() if isinstance(x, Tensor) else [int(v) for v in x]
