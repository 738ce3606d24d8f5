"""What the three GDN tree verifiers share: q/k normalisation, the stash they return, and the deferred commit.

Nothing is written to the committed state during verification. Once the accepted leaf l is known,

    S_l = e^{G_l} S0 + sum_{j on path(l)} e^{G_l - G_j} k_j U_j^T

rebuilds the state from a stash of (k, U, G) per node: O(T (dk + dv)) numbers instead of T full dk x dv states.
U_j is the delta-rule update of node j, beta_j (v_j - e^{g_j} S_parent^T k_j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree_utils import PathOrLeaf, resolve_path


def normalize_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k over their last dim (x * rsqrt(sum x^2 + eps), as HF's torch fallback) and scale q
    by dk^-1/2. Shapes [..., dk]; computed in fp32."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k


@dataclass
class GDNStash:
    """Per-node data for the deferred commit, all fp32.

    k [T, H, dk] (normalised keys), U [T, H, dv] (solved updates), G [T, H] (path gates), parents (T ints).
    `states` [T, H, dk, dv] is set only by the per-node recurrent baseline, which keeps every full state.
    """

    k: torch.Tensor
    U: torch.Tensor
    G: torch.Tensor
    parents: list[int]
    states: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes needed for the commit (k, U, G); excludes the optional full states."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.U, self.G))


def commit_state(stash: GDNStash, S0: torch.Tensor, path_or_leaf: PathOrLeaf) -> torch.Tensor:
    """State [H, dk, dv] (fp32) after the accepted path: a leaf index, or the node list from the root.
    An empty path returns S0 unchanged."""
    path = resolve_path(stash.parents, path_or_leaf)
    S0 = S0.float()
    if not path:
        return S0.clone()
    idx = torch.tensor(path, device=S0.device)
    G_l = stash.G[path[-1]]  # [H]
    decay = torch.exp(G_l[None] - stash.G[idx])  # [L, H], each <= 1
    folded = torch.einsum("lh,lhk,lhv->hkv", decay, stash.k[idx], stash.U[idx])
    return torch.exp(G_l)[:, None, None] * S0 + folded
