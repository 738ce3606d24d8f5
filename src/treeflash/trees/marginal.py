"""Trees from per-depth marginals: the DFlash chain and DDTree's best-first heap (DESIGN section 3)."""

from __future__ import annotations

import heapq

import torch

from ..tree import DraftTree


def chain_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """The argmax of each depth's marginal, at most `budget` deep. logits [depth, V]."""
    return DraftTree.chain(root, logits[:budget].argmax(-1).tolist())


def best_first_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` highest-scoring prefixes, a prefix scoring the sum of its tokens' log-probs.

    Heap over (depth, rank) prefixes: each pop adds a node and pushes its next sibling (same depth, rank + 1) and
    its first child (depth + 1, rank 0). Scores never increase along a path or across siblings, so the pops are
    the best prefixes and always form a tree. logits [depth, V].
    """
    depth = logits.shape[0]
    k = min(budget, logits.shape[-1])
    logp, tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    logp, tokens = logp.tolist(), tokens.tolist()
    parents, chosen = [-1], [root]
    heap = [(-logp[0][0], 0, 0, 0)]  # (-score, depth index, rank, parent node)
    while heap and len(chosen) - 1 < budget:
        neg, d, r, parent = heapq.heappop(heap)
        node = len(chosen)
        chosen.append(tokens[d][r])
        parents.append(parent)
        if r + 1 < k:
            heapq.heappush(heap, (neg + logp[d][r] - logp[d][r + 1], d, r + 1, parent))
        if d + 1 < depth:
            heapq.heappush(heap, (neg - logp[d + 1][0], d + 1, 0, node))
    return DraftTree.from_parents(chosen, parents)
