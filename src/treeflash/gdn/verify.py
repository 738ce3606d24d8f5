"""One entry point for GDN tree verification that picks an implementation."""

from __future__ import annotations

import torch

from .recurrent import tree_verify_recurrent
from .reference import tree_verify_reference
from .state import GDNStash
from .tree_solve import tree_verify_solve
from .tree_utils import Parents
from .triton_tree import HAS_TRITON, tree_solve_triton

IMPLS = {"reference": tree_verify_reference, "recurrent": tree_verify_recurrent, "torch": tree_verify_solve,
         "triton": tree_solve_triton}


def gdn_tree_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    S0: torch.Tensor, parents: Parents, impl: str = "auto") -> tuple[torch.Tensor, GDNStash]:
    """Verify a draft tree on one GDN layer: o [T, H, dv] and the stash for `commit_state`.
    impl: "auto" (the Triton kernel on CUDA tensors when triton is installed, else "torch"), "triton",
    "torch" (masked triangular solve), "recurrent" or "reference"."""
    if impl == "auto":
        impl = "triton" if HAS_TRITON and q.is_cuda else "torch"
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose auto or one of {sorted(IMPLS)}")
    return IMPLS[impl](q, k, v, g, beta, S0, parents)
