"""Tree acceptance: walk the draft tree along the target's own choices.

Starting at the root, the target's posterior token at the current node is what it would emit
next. If a child of the node carries that token, the drafter guessed right: move there and keep
going. Otherwise stop; the posterior token at the last node is the free "bonus" token. At T=0 this
is exact greedy decoding; at T>0 with one independent posterior draw per node it is exact
sampling, since each emitted token is the target's draw given the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


def accept(tokens: Tensor, parents: Tensor, posterior: Tensor) -> Acceptance:
    """Accepted path and emitted tokens of one tree.

    Args:
        tokens: [n] int64 node tokens (node 0 is the root).
        parents: [n] int64 parent index per node; -1 for the root and padding nodes.
        posterior: [n] int64 the target's token at each node (see ``posterior_tokens``).

    Returns:
        :class:`Acceptance`. Always emits at least the bonus token at the root.

    The matching child of every node is found in one vectorised pass (a child c matches when
    tokens[c] == posterior[parents[c]]; the lowest index wins if a malformed tree has duplicate
    siblings), then the walk is a short host loop over a list.
    """
    n = tokens.shape[0]
    tokens = tokens.cpu()
    parents = parents.cpu()
    posterior = posterior.cpu()
    index = torch.arange(n)  # [n]
    has_parent = (parents >= 0) & (parents < index)  # [n]; parent < child also rules out cycles
    safe_parents = parents.clamp(min=0)  # [n]
    matches = has_parent & (tokens == posterior[safe_parents])  # [n]
    child_idx = torch.where(matches, index, n)  # [n]
    next_node = torch.full((n,), n, dtype=torch.int64)  # [n]; n = no matching child
    next_node.scatter_reduce_(0, safe_parents, child_idx, reduce="amin")

    nxt = next_node.tolist()
    tok = tokens.tolist()
    post = posterior.tolist()
    path = [0]
    out: list[int] = []
    cur = 0
    while nxt[cur] < n:
        cur = nxt[cur]
        path.append(cur)
        out.append(tok[cur])
    out.append(post[cur])
    return Acceptance(path=path, tokens=out)
