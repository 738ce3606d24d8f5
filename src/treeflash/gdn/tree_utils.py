"""Tree structure helpers shared by the GDN implementations: parent lists, paths and the ancestor mask.

Nodes are in topological order (parents[i] < i) and node 0 is the root (parents[0] == -1); the root's parent is
the committed state.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

Parents = Union[torch.Tensor, Sequence[int]]
PathOrLeaf = Union[int, Sequence[int], torch.Tensor]


def as_parent_list(parents: Parents) -> list[int]:
    """Validate a parent list (root first, parents before children) and return it as Python ints."""
    ps = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    if not ps or ps[0] != -1:
        raise ValueError("parents[0] must be -1 (node 0 is the root)")
    for i, p in enumerate(ps[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: need 0 <= parent < node (topological order)")
    return ps


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def leaves(parents: Sequence[int]) -> list[int]:
    has_child = set(parents[1:])
    return [i for i in range(len(parents)) if i not in has_child]


def root_to_leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path; together they cover every node."""
    return [path_to(parents, leaf) for leaf in leaves(parents)]


def depths(parents: Sequence[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def resolve_path(parents: Sequence[int], path_or_leaf: PathOrLeaf) -> list[int]:
    """An accepted path given either as its last node or as the node list from the root (checked)."""
    if isinstance(path_or_leaf, torch.Tensor):
        path_or_leaf = path_or_leaf.tolist()
    if isinstance(path_or_leaf, int):
        return path_to(parents, path_or_leaf)
    path = [int(n) for n in path_or_leaf]
    if path and path != path_to(parents, path[-1]):
        raise ValueError(f"{path} is not a root-to-node path of the tree")
    return path


def ancestor_mask(parents: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """M [T, T] bool with M[i, j] = (j is an ancestor of i or i itself); lower-triangular in topological order."""
    rows, cols, anc = [], [], []
    for i, p in enumerate(parents):
        anc.append((anc[p] if p >= 0 else []) + [i])
        rows += [i] * len(anc[i])
        cols += anc[i]
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    mask[rows, cols] = True
    return mask.to(device)


def path_gates(g: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G [T, H] = g summed along each node's root path (G_i = g_i + G_parent), in fp32, from g [T, H]."""
    return mask.float() @ g.float()
