"""w-parallel best-first expansion (DFlash-TfM, DESIGN section 5): a tree from an autoregressive scorer.

The scorer gives, for a node already in the tree, the distribution of its child over fixed candidates of the
next depth; it may depend on the node's whole branch (the Weaver does). A node's value is the product of the
probabilities along its path. A best-first heap holds candidate slots (parent node, rank among its children);
each step pops the top w slots, adds them to the tree, and expands all of them in ONE batched scorer call.

Children are pushed lazily: an expansion pushes its w best children, and popping the child of rank r pushes its
sibling of rank r + w (whose value is no larger). So the heap always holds at least w slots while candidates
remain, the tree takes ceil(B / w) sequential scorer calls (the root's expansion is the first; the last batch is
never expanded), and with w = 1 this is exact best-first search: OPT-Tree when the scorer is first-order.

Without more, that last batch also bounds the depth: B = 16, w = 8 gives two calls, so no node below depth 2.
An optional `fallback` (per depth, a child distribution that needs no call: the plain marginals) scores the
children of the last batch's nodes as they are popped, so that batch goes on best-first below them for free.
"""

from __future__ import annotations

import heapq
from typing import Callable

import torch

from ..tree import DraftTree

# expand(nodes, tokens, parents, depths) -> probs [len(nodes), K]: for each node (an index into the growing lists
# tokens / parents / depths, root = 0), its child's distribution over candidates[depths[node]]
Expand = Callable[[list[int], list[int], list[int], list[int]], torch.Tensor]


def parallel_tree(root: int, candidates: torch.Tensor, expand: Expand, budget: int, width: int = 8,
                  fallback: torch.Tensor | None = None) -> DraftTree:
    """candidates [D, K]: distinct tokens per depth 1..D; at most `budget` draft nodes; w = `width`;
    fallback [D, K] (optional): a node's child distribution over candidates[depth] when it gets no call."""
    depth, k = candidates.shape
    cand = candidates.tolist()
    tokens, parents, depths, values = [root], [-1], [0], [1.0]
    # node -> (child probs, candidate indices, best first; step: the slots it holds in the heap at once)
    children: dict[int, tuple[list[float], list[int], int]] = {}
    heap: list[tuple[float, int, int]] = []  # (-value, parent node, rank)

    def push(parent: int, rank: int) -> None:
        heapq.heappush(heap, (-values[parent] * children[parent][0][rank], parent, rank))

    def adopt(node: int, probs: torch.Tensor, step: int) -> None:
        p, i = probs.float().sort(dim=-1, descending=True)
        children[node] = (p.tolist(), i.tolist(), step)
        for rank in range(min(step, k)):
            push(node, rank)

    def grow(nodes: list[int]) -> None:
        for node, probs in zip(nodes, expand(nodes, tokens, parents, depths)):
            adopt(node, probs, width)

    grow([0])
    while heap and len(tokens) - 1 < budget:
        last = fallback is not None and len(tokens) - 1 + width >= budget  # no call after this batch
        batch = []
        while heap and len(batch) < width and len(tokens) - 1 < budget:
            neg, parent, rank = heapq.heappop(heap)
            node = len(tokens)
            batch.append(node)
            tokens.append(cand[depths[parent]][children[parent][1][rank]])
            parents.append(parent)
            depths.append(depths[parent] + 1)
            values.append(-neg)
            step = children[parent][2]
            if rank + step < k:  # the sibling this slot stood in front of
                push(parent, rank + step)
            if last and depths[node] < depth:
                adopt(node, fallback[depths[node]], 1)
        expandable = [n for n in batch if depths[n] < depth]
        if not last and expandable and len(tokens) - 1 < budget:
            grow(expandable)
    conditional = [1.0] + [values[n] / max(values[parents[n]], 1e-30) for n in range(1, len(tokens))]
    return DraftTree.from_parents(tokens, parents, conditional)
