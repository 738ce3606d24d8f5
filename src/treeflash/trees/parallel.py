"""w-parallel best-first expansion (DFlash-TfM, DESIGN section 5): a tree from an autoregressive scorer.

The scorer gives, for a node already in the tree, the distribution of its child over fixed candidates of the
next depth; it may depend on the node's whole branch (the Weaver does). A node's value is the product of the
probabilities along its path. A best-first heap holds candidate slots (parent node, rank among its children);
each step pops the top w slots, adds them to the tree, and expands all of them in ONE batched scorer call.

Children are pushed lazily: an expansion pushes its w best children, and popping the child of rank r pushes its
sibling of rank r + w (whose value is no larger). So the heap always holds at least w slots while candidates
remain, the tree takes ceil(B / w) sequential scorer calls (the root's expansion is the first; the last batch is
never expanded), and with w = 1 this is exact best-first search: OPT-Tree when the scorer is first-order.
"""

from __future__ import annotations

import heapq
from typing import Callable

import torch

from ..tree import DraftTree

# expand(nodes, tokens, parents, depths) -> probs [len(nodes), K]: for each node (an index into the growing lists
# tokens / parents / depths, root = 0), its child's distribution over candidates[depths[node]]
Expand = Callable[[list[int], list[int], list[int], list[int]], torch.Tensor]


def parallel_tree(root: int, candidates: torch.Tensor, expand: Expand, budget: int, width: int = 8) -> DraftTree:
    """candidates [D, K]: distinct tokens per depth 1..D; at most `budget` draft nodes; w = `width`."""
    depth, k = candidates.shape
    cand = candidates.tolist()
    tokens, parents, depths, values = [root], [-1], [0], [1.0]
    children: dict[int, tuple[list[float], list[int]]] = {}  # node -> (child probs, candidate indices), best first
    heap: list[tuple[float, int, int]] = []  # (-value, parent node, rank)

    def push(parent: int, rank: int) -> None:
        heapq.heappush(heap, (-values[parent] * children[parent][0][rank], parent, rank))

    def grow(nodes: list[int]) -> None:
        probs, order = expand(nodes, tokens, parents, depths).float().sort(dim=-1, descending=True)
        for node, p, i in zip(nodes, probs.tolist(), order.tolist()):
            children[node] = (p, i)
            for rank in range(min(width, k)):
                push(node, rank)

    grow([0])
    while heap and len(tokens) - 1 < budget:
        batch = []
        while heap and len(batch) < width and len(tokens) - 1 < budget:
            neg, parent, rank = heapq.heappop(heap)
            batch.append(len(tokens))
            tokens.append(cand[depths[parent]][children[parent][1][rank]])
            parents.append(parent)
            depths.append(depths[parent] + 1)
            values.append(-neg)
            if rank + width < k:  # the sibling this slot stood in front of
                push(parent, rank + width)
        expandable = [n for n in batch if depths[n] < depth]
        if expandable and len(tokens) - 1 < budget:
            grow(expandable)
    return DraftTree.from_parents(tokens, parents)
