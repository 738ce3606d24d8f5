"""OPT-Tree over conditional tables: the tree of B nodes with the largest expected accepted length.

Candidates are fixed per depth: tokens[d] holds M distinct tokens for depth d + 1. probs[d, j, i] is the
probability of candidate i at depth d + 1 given that candidate j was chosen at depth d (for d = 0, the root;
a table with one row, P = 1, is the same for every parent, which is DDTree's marginal case). A node's value is
the product of the conditionals along its path, its probability of being accepted; the objective is the sum of
the values. Values never increase down a path, so the B largest values form a tree, and a best-first heap that
pushes a node's children only once it is popped finds exactly them (ties aside).
"""

from __future__ import annotations

import heapq

import torch

from ..runtime.transfer import download
from ..tree import DraftTree


def opt_tree(root: int, tokens: torch.Tensor, probs: torch.Tensor, budget: int) -> DraftTree:
    """tokens [D, M] candidates per depth; probs [D, P, M] conditionals with P in {1, M}; at most `budget` nodes."""
    depth, width = tokens.shape
    # children by probability, per (depth, parent); the three tables read back with one wait for a GPU
    order, p, tok = (t.tolist() for t in download(probs.argsort(dim=-1, descending=True), probs, tokens))

    def row(d: int, j: int) -> int:
        return j if len(p[d]) > 1 else 0

    chosen, parents, conditional = [root], [-1], [1.0]
    # heap entries: (-value, depth, parent's candidate index, rank among the children, parent node, parent value)
    heap = [(-p[0][0][order[0][0][0]], 0, 0, 0, 0, 1.0)]
    while heap and len(chosen) - 1 < budget:
        neg, d, j, rank, parent, parent_value = heapq.heappop(heap)
        i = order[d][row(d, j)][rank]  # this node's candidate index at depth d
        node = len(chosen)
        chosen.append(tok[d][i])
        parents.append(parent)
        conditional.append(-neg / max(parent_value, 1e-30))
        if rank + 1 < width:  # the next sibling
            sib = order[d][row(d, j)][rank + 1]
            heapq.heappush(heap, (-parent_value * p[d][row(d, j)][sib], d, j, rank + 1, parent, parent_value))
        if d + 1 < depth:  # the first child
            child = order[d + 1][row(d + 1, i)][0]
            heapq.heappush(heap, (neg * p[d + 1][row(d + 1, i)][child], d + 1, i, 0, node, -neg))
    return DraftTree.from_parents(chosen, parents, conditional)


def tree_value(tree: DraftTree, tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """The objective: sum over draft nodes of the product of conditionals along the path."""
    index = [{t: i for i, t in enumerate(row)} for row in tokens.tolist()]
    value, cand = [1.0], [0]
    for n in range(1, len(tree)):
        d, parent = tree.depths[n] - 1, tree.parents[n]
        i = index[d][tree.tokens[n]]
        r = cand[parent] if probs.shape[1] > 1 else 0
        value.append(value[parent] * float(probs[d, r, i]))
        cand.append(i)
    return sum(value[1:])
