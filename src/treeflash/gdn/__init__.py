"""Rollback-free tree verification for Gated DeltaNet (GDN) layers of hybrid targets (Qwen3-Next, Qwen3.5).

Three interchangeable implementations, all `(q, k, v, g, beta, S0, parents) -> (o, stash)`:
  tree_verify_reference  (a) sequential recurrence replayed along every root-to-leaf path;
  tree_verify_recurrent  (b) per-node recurrence from the parent's stored full state;
  tree_verify_solve      (c) one masked triangular solve (torch), and tree_solve_triton, its Triton kernel.
`gdn_tree_verify(..., impl="auto")` picks one (Triton on CUDA when installed, else the torch solve);
`commit_state` rebuilds the accepted state from the stash; `conv` holds the tree form of the short conv.
"""

from .conv import commit_conv_state, tree_conv1d, tree_conv1d_reference
from .recurrent import tree_verify_recurrent
from .reference import tree_verify_reference
from .state import GDNStash, commit_state, normalize_qk
from .tree_solve import tree_verify_solve
from .tree_utils import ancestor_mask, path_to, root_to_leaf_paths
from .triton_tree import HAS_TRITON, tree_solve_triton
from .verify import gdn_tree_verify

__all__ = [
    "GDNStash", "HAS_TRITON", "ancestor_mask", "commit_conv_state", "commit_state", "gdn_tree_verify",
    "normalize_qk", "path_to", "root_to_leaf_paths", "tree_conv1d", "tree_conv1d_reference", "tree_solve_triton",
    "tree_verify_recurrent", "tree_verify_reference", "tree_verify_solve",
]
