"""(c) GDN tree verification as one masked triangular solve (the chunked WY form with an ancestor mask).

With path gates G_i = g_i + G_parent and j < i meaning "j is a strict ancestor of i":

    A_ij = beta_i (k_i . k_j) e^{G_i - G_j}   for j < i, else 0     (strictly lower triangular)
    (I + A) U = r,   r_i = beta_i (v_i - e^{G_i} S0^T k_i)
    o_i = e^{G_i} S0^T q_i + sum_{j <= i} e^{G_i - G_j} (q_i . k_j) U_j

It is exact: (I + A)^-1 has no entry across branches, so the rows of each path equal that path's chain solve.
The decay is masked before the exponential, so every e^{G_i - G_j} is <= 1 and nothing overflows.
"""

from __future__ import annotations

import torch

from .state import GDNStash
from .tree_utils import Parents, ancestor_mask, as_parent_list, path_gates


def masked_decay(G: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[H, T, T] e^{G_i - G_j} where mask[i, j], else 0, from G [T, H] and mask [T, T] bool."""
    Gh = G.t()
    diff = (Gh[:, :, None] - Gh[:, None, :]).masked_fill(~mask, float("-inf"))
    return torch.exp(diff)


def block_forward_solve(A: torch.Tensor, r: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Solve (I + A) U = r for strictly lower-triangular A [H, T, T] and r [H, T, dv], one block of rows at a
    time: U_b = (I + A_bb)^-1 (r_b - sum_{c<b} A_bc U_c). Same blocking as the Triton kernel."""
    U = torch.empty_like(r)
    for s in range(0, r.shape[1], block):
        e = min(s + block, r.shape[1])
        rhs = r[:, s:e] - A[:, s:e, :s] @ U[:, :s]
        # unitriangular: the (zero) diagonal of A is not read and taken as 1
        U[:, s:e] = torch.linalg.solve_triangular(A[:, s:e, s:e], rhs, upper=False, unitriangular=True)
    return U


def tree_verify_solve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      S0: torch.Tensor, parents: Parents, block: int = 64) -> tuple[torch.Tensor, GDNStash]:
    """q, k [T, H, dk] (normalised, q scaled); v [T, H, dv]; g, beta [T, H]; S0 [H, dk, dv].
    Returns o [T, H, dv] (fp32) and the stash. Works for any T (blocks of `block` rows)."""
    ps = as_parent_list(parents)
    q, k, v, g, beta, S0 = (t.float() for t in (q, k, v, g, beta, S0))
    mask = ancestor_mask(ps, device=q.device)  # j <= i
    strict = mask & ~torch.eye(len(ps), dtype=torch.bool, device=q.device)
    G = path_gates(g, mask)  # [T, H]
    eG = torch.exp(G).t()[:, :, None]  # [H, T, 1]
    qh, kh, vh, bh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), beta.t()[:, :, None]

    A = bh * (kh @ kh.transpose(1, 2)) * masked_decay(G, strict)  # [H, T, T]
    r = bh * (vh - eG * (kh @ S0))  # [H, T, dv]
    U = block_forward_solve(A, r, block)
    o = eG * (qh @ S0) + ((qh @ kh.transpose(1, 2)) * masked_decay(G, mask)) @ U
    return o.transpose(0, 1), GDNStash(k=k, U=U.transpose(0, 1), G=G, parents=ps)
