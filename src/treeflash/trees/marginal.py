"""Trees from per-depth marginals: the DFlash chain and DDTree's best-first tree (DESIGN section 3)."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .opt_tree import opt_tree


def chain_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """The argmax of each depth's marginal, at most `budget` deep. logits [depth, V]."""
    probs, tokens = torch.softmax(logits[:budget].float(), dim=-1).max(-1)
    return DraftTree.chain(root, tokens.tolist(), probs.tolist())


def best_first_tree(root: int, logits: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` most likely prefixes under the marginals (a prefix's score is the product of its
    tokens' marginal probabilities). It is OPT-Tree with one table row per depth. logits [depth, V]."""
    probs, tokens = torch.softmax(logits.float(), dim=-1).topk(min(budget, logits.shape[-1]), dim=-1)
    return opt_tree(root, tokens, probs[:, None, :], budget)
