"""(b) Per-node recurrent GDN tree verification: each node reloads its parent's stored full state.

This is what servers do today (SGLang's tree verify): T full dk x dv states per head are kept so that any
accepted node's state can be copied back. Each node is computed once, but the memory is T * H * dk * dv.
"""

from __future__ import annotations

import torch

from .reference import gdn_step
from .state import GDNStash
from .tree_utils import Parents, as_parent_list


def tree_verify_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, S0: torch.Tensor, parents: Parents,
                          states: torch.Tensor | None = None) -> tuple[torch.Tensor, GDNStash]:
    """Same interface as `tree_verify_reference`; the stash also carries `states` [T, H, dk, dv] (fp32), written
    into the given buffer when there is one (servers preallocate this pool)."""
    ps = as_parent_list(parents)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S0 = S0.float()
    T, H, dv = v.shape
    states = S0.new_empty(T, *S0.shape) if states is None else states[:T]
    o, U, G = torch.empty_like(v), torch.empty_like(v), torch.empty_like(g)
    for i, p in enumerate(ps):
        _, o[i], U[i] = gdn_step(S0 if p < 0 else states[p], q[i], k[i], v[i], g[i], beta[i], out=states[i])
        G[i] = g[i] if p < 0 else G[p] + g[i]
    return o, GDNStash(k=k, U=U, G=G, parents=ps, states=states)
