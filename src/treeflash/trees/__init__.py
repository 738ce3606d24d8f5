"""Tree builders: from a drafter's per-depth scores to a DraftTree under a budget."""

from .marginal import best_first_tree, chain_tree, top_marginals
from .opt_tree import opt_tree, tree_value
from .parallel import parallel_tree

__all__ = ["best_first_tree", "chain_tree", "opt_tree", "parallel_tree", "top_marginals", "tree_value"]
