"""DraftTree: the one tree type that drafters produce and the target verifies.

Node 0 is the root: the last committed token, which the target has not seen yet (the previous round's bonus
token). Nodes are in topological order (every parent index is smaller than its child's), so a tree can be
flattened and fed to the target as one sequence with an ancestor attention mask and positions start + depth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch


class TreeError(ValueError):
    """A draft tree that breaks an invariant (single root, parents before children, distinct siblings)."""


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1
    # the drafter's probability of each node given its parent (root: 1.0), when it has one: cost-aware
    # speculation calibrates these against the target's acceptances and keeps the prefix that pays
    probs: tuple[float, ...] | None = field(default=None, compare=False)
    # a chain whose drafts were sampled: (candidate ids [size, K], their probabilities q [size, K]), row i - 1 the
    # distribution node i was drawn from (given its parent). Acceptance then runs rejection sampling against q
    # (verify.accept), which needs exactly these numbers; None: a deterministic tree
    proposal: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False)
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        tokens, parents = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if not tokens:
            raise TreeError("a draft tree needs at least its root")
        if len(parents) != len(tokens):
            raise TreeError(f"{len(tokens)} tokens but {len(parents)} parents")
        if self.probs is not None and len(self.probs) != len(tokens):
            raise TreeError(f"{len(tokens)} tokens but {len(self.probs)} probabilities")
        if parents[0] != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        depths = [0]
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(tokens)):
            p = parents[i]
            if not 0 <= p < i:
                raise TreeError(f"node {i} has parent {p}: parents must come before their children (single root)")
            if (p, tokens[i]) in seen:
                raise TreeError(f"node {p} has two children carrying token {tokens[i]}")
            seen.add((p, tokens[i]))
            depths.append(depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        if self.proposal is not None:
            ids, q = self.proposal
            if not self.is_chain or ids.shape != q.shape or len(ids) != len(tokens) - 1:
                raise TreeError("a proposal is one row of (ids, q) per node of a chain")

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int],
                     probs: Sequence[float] | None = None) -> "DraftTree":
        return cls(tuple(tokens), tuple(parents), None if probs is None else tuple(float(p) for p in probs))

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int] = (), probs: Sequence[float] | None = None,
              proposal: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DraftTree":
        tokens = (root, *drafts)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)), None if probs is None else (1.0, *probs), proposal)

    @classmethod
    def from_paths(cls, root: int, paths: Iterable[Sequence[int]], budget: int | None = None) -> "DraftTree":
        """Merge token paths (each starting below the root) into a trie; stop adding nodes at `budget`."""
        tokens, parents = [root], [-1]
        child: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for token in path:
                key = (node, int(token))
                if key not in child:
                    if budget is not None and len(tokens) - 1 >= budget:
                        break
                    child[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(node)
                node = child[key]
        return cls(tuple(tokens), tuple(parents))

    def prefix(self, size: int) -> "DraftTree":
        """The first `size` draft nodes (with the root): a tree, since parents come before their children.
        Builders emit nodes best first, so this is the tree a smaller budget would have given (or close to it)."""
        n = size + 1
        proposal = None if self.proposal is None else tuple(x[:size] for x in self.proposal)
        return DraftTree(self.tokens[:n], self.parents[:n], None if self.probs is None else self.probs[:n], proposal)

    # ---- views --------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def size(self) -> int:
        """Number of draft nodes (the budget B counts these; the root is not counted)."""
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self) -> list[dict[int, int]]:
        """For each node, a map token -> child index."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            out[self.parents[i]][self.tokens[i]] = i
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`, inclusive."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: entry (i, j) is True when j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def positions(self, start: int) -> torch.Tensor:
        return start + torch.tensor(self.depths, dtype=torch.long)


def random_tree(rng: random.Random, vocab: int, size: int, root: int | None = None) -> DraftTree:
    """A tree of `size` nodes (root included) of random shape and tokens, each parent's children distinct: what
    tests and benchmarks verify when no drafter is needed."""
    tokens, parents, used = [rng.randrange(vocab) if root is None else root], [-1], set()
    while len(tokens) < size:
        parent, token = rng.randrange(len(tokens)), rng.randrange(vocab)
        if (parent, token) not in used:
            used.add((parent, token))
            tokens.append(token)
            parents.append(parent)
    return DraftTree.from_parents(tokens, parents)
