"""Trees from per-depth marginals: the DFlash chain and DDTree's best-first tree (DESIGN section 3)."""

from __future__ import annotations

import torch

from ..runtime.transfer import download
from ..tree import DraftTree
from .opt_tree import opt_tree


def top_marginals(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables the builders take: the k most likely tokens of each depth's marginal, most likely first:
    (probabilities [depth, k], tokens [depth, k]) from logits [depth, V]. (Drafters get the same tables more
    cheaply from `DFlashDrafter.top_tokens`.)"""
    return torch.softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)


def chain_tree(root: int, probs: torch.Tensor, tokens: torch.Tensor, budget: int) -> DraftTree:
    """The argmax of each depth's marginal, at most `budget` deep (tables of top_marginals, k >= 1)."""
    drafts, chances = download(tokens[:budget, 0], probs[:budget, 0])  # one wait for a GPU
    return DraftTree.chain(root, drafts.tolist(), chances.tolist())


def best_first_tree(root: int, probs: torch.Tensor, tokens: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` most likely prefixes under the marginals (a prefix's score is the product of its
    tokens' marginal probabilities; tables of top_marginals, k >= budget). It is OPT-Tree with one table row per
    depth."""
    return opt_tree(root, tokens, probs[:, None, :], budget)
