"""The short causal depthwise conv1d (+ SiLU) that runs before GDN, on a tree.

Node i's window is its own input and the inputs of its nearest K-1 ancestors; where the path above i is
shorter, the window continues into the committed conv state (the last K-1 committed inputs, most recent last).
Since the conv runs on the concatenated q|k|v before the split, node i's q, k, v then depend only on path(i).
The deferred commit keeps the last K-1 inputs along the accepted path.

Layouts: inputs x [T, C] (token-major), weight [C, 1, K] as nn.Conv1d(C, C, K, groups=C), bias [C] or None,
conv state [C, K-1]. (HF keeps K columns of state; pass its last K-1.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tree_utils import Parents, PathOrLeaf, as_parent_list, depths, resolve_path, root_to_leaf_paths


def window_index(parents: list[int], K: int) -> torch.Tensor:
    """[T, K] rows into cat(state columns, x): oldest first, node i itself last. State column c is row c,
    node i is row K-1+i."""
    depth = depths(parents)
    idx = []
    for i in range(len(parents)):
        row, node = [], i
        for m in range(K):  # m steps up from i
            if node >= 0:
                row.append(K - 1 + node)
                node = parents[node]
            else:  # above the root: state column K-1-(m - depth), counted back from the most recent
                row.append(K - 1 - (m - depth[i]))
        idx.append(row[::-1])
    return torch.tensor(idx)


def tree_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                parents: Parents, silu: bool = True) -> torch.Tensor:
    """Depthwise causal conv on a tree: x [T, C], weight [C, 1, K], bias [C] | None, conv_state [C, K-1].
    Returns y [T, C] (SiLU applied unless silu=False), in x's dtype."""
    ps = as_parent_list(parents)
    K = weight.shape[-1]
    ext = torch.cat([conv_state.t().to(x.dtype), x], dim=0)  # [K-1+T, C]
    windows = ext[window_index(ps, K).to(x.device)]  # [T, K, C]
    y = torch.einsum("tkc,ck->tc", windows, weight[:, 0].to(x.dtype))
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y) if silu else y


def tree_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor, parents: Parents, silu: bool = True) -> torch.Tensor:
    """The plain sequential conv (F.conv1d) run along every root-to-leaf path, from the committed state."""
    ps = as_parent_list(parents)
    y = torch.empty_like(x)
    for path in root_to_leaf_paths(ps):
        seq = torch.cat([conv_state.to(x.dtype), x[path].t()], dim=1)[None]  # [1, C, K-1+L]
        out = F.conv1d(seq, weight.to(x.dtype), bias, groups=x.shape[1])[0].t()  # [L, C]
        y[path] = F.silu(out) if silu else out
    return y


def commit_conv_state(x: torch.Tensor, conv_state: torch.Tensor, parents: Parents,
                      path_or_leaf: PathOrLeaf) -> torch.Tensor:
    """New conv state [C, K-1]: the last K-1 inputs along the accepted path, topped up from the old state."""
    path = resolve_path(as_parent_list(parents), path_or_leaf)
    seq = torch.cat([conv_state, x[path].t().to(conv_state.dtype)], dim=1)
    return seq[:, seq.shape[1] - conv_state.shape[1]:].clone()
