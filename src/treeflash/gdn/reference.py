"""(a) Reference GDN tree verification: replay the plain sequential recurrence along every root-to-leaf path.

Obviously correct and slow (shared prefixes are recomputed once per leaf below them). Per step:
S <- e^g S;  U = beta (v - S^T k);  S <- S + k U^T;  o = S^T q.
"""

from __future__ import annotations

import torch

from .state import GDNStash
from .tree_utils import Parents, as_parent_list, root_to_leaf_paths


def gdn_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for all heads. S [H, dk, dv]; q, k [H, dk]; v [H, dv]; g, beta [H].
    Returns (new S, o [H, dv], U [H, dv]); the new S is written into `out` if given (S itself is not changed)."""
    S = torch.mul(S, torch.exp(g)[:, None, None], out=out)
    U = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S.baddbmm_(k[:, :, None], U[:, None, :])  # S += k U^T, in place: no dk x dv temporary
    return S, torch.einsum("hkv,hk->hv", S, q), U


def tree_verify_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, S0: torch.Tensor, parents: Parents) -> tuple[torch.Tensor, GDNStash]:
    """q, k [T, H, dk] (normalised, q scaled); v [T, H, dv]; g, beta [T, H]; S0 [H, dk, dv].
    Returns o [T, H, dv] (fp32) and the stash."""
    ps = as_parent_list(parents)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    o, U, G = torch.zeros_like(v), torch.zeros_like(v), torch.zeros_like(g)
    for path in root_to_leaf_paths(ps):
        S, G_path = S0.float(), torch.zeros_like(g[0])
        for i in path:  # nodes shared with an earlier path are recomputed to the same values
            S, o[i], U[i] = gdn_step(S, q[i], k[i], v[i], g[i], beta[i])
            G_path = G_path + g[i]
            G[i] = G_path
    return o, GDNStash(k=k, U=U, G=G, parents=ps)
