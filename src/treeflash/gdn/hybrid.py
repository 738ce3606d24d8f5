"""Tree verification on the Gated DeltaNet layers of hybrid Hugging Face models (Qwen3.5, Qwen3-Next).

`HybridGDN.install(model)` wraps the forward of every GDN module of the model. Outside a tree verification the
wrapped forward is HF's own (prefill, plain decoding). Inside `with hybrid.tree(parents):` each GDN layer instead
computes its output for all tree nodes at once from the committed conv and recurrent states in the cache:

    projections -> tree conv1d (each node's window runs up its own path) -> q/k/v split, GQA repeat of q/k
    -> gates g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) -> masked tree solve -> gated RMSNorm
    -> out_proj

and writes nothing to the cache: it keeps the tree's conv inputs and the solve's stash per layer. `commit(cache,
path)` then writes the accepted path's recurrent state (`commit_state`) and conv state (`commit_conv_state`).

HF's cache layout (transformers 5.x, `LinearAttentionLayer`): conv state [B, C, K] (the last K conv inputs, most
recent last; the conv itself reads only the last K-1), recurrent state [B, HV, dk, dv] (fp32 from HF's kernels).
Only batch 1 is supported, as in `Target`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .conv import commit_conv_state, tree_conv1d
from .state import GDNStash, commit_state, normalize_qk
from .verify import gdn_tree_verify


def is_gdn_module(module: nn.Module) -> bool:
    """HF's GDN token mixers: Qwen3_5GatedDeltaNet (separate projections) and Qwen3NextGatedDeltaNet (fused)."""
    return (all(hasattr(module, name) for name in ("A_log", "dt_bias", "conv1d", "norm", "out_proj", "layer_idx"))
            and (hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz")))


def _projections(m: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """h [T, hidden] -> conv input x [T, 2 key_dim + value_dim] (q|k|v), z [T, HV, dv], b [T, HV], a [T, HV]."""
    T = h.shape[0]
    if hasattr(m, "in_proj_qkv"):  # Qwen3.5: separate projections
        return m.in_proj_qkv(h), m.in_proj_z(h).view(T, -1, m.head_v_dim), m.in_proj_b(h), m.in_proj_a(h)
    # Qwen3-Next: fused projections grouped per key head; HF's own method ungroups them
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h[None]), m.in_proj_ba(h[None]))
    x = torch.cat([t.reshape(1, T, -1) for t in (q, k, v)], dim=-1)
    return x[0], z[0], b[0], a[0]


def _activation(name: str):
    from transformers.activations import ACT2FN  # imported late: it pulls in much of transformers

    return ACT2FN[name]


@dataclass
class _Pending:
    """What one GDN layer keeps from a verification until commit: its conv inputs and the solve's stash."""

    x: torch.Tensor  # [T, C]
    stash: GDNStash


class HybridGDN:
    """The tree path for a model's GDN layers; one per model (`install` returns the existing one)."""

    def __init__(self, modules: Sequence[nn.Module], impl: str = "auto"):
        self.modules = {int(m.layer_idx): m for m in modules}
        self.impl = impl
        self.parents: list[int] | None = None  # set while a tree verification runs
        self.pending: dict[int, _Pending] = {}
        for m in modules:
            self._wrap(m)

    @classmethod
    def install(cls, model: nn.Module, impl: str = "auto") -> "HybridGDN | None":
        """Wrap the GDN layers of `model`; None when it has none (a plain transformer)."""
        existing = getattr(model, "_treeflash_gdn", None)
        if existing is not None:
            return existing
        modules = [m for m in model.modules() if is_gdn_module(m)]
        if not modules:
            return None
        hybrid = cls(modules, impl)
        model._treeflash_gdn = hybrid
        return hybrid

    def _wrap(self, module: nn.Module) -> None:
        original = module.forward

        def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
            if self.parents is None:
                return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
            return self._tree_forward(module, hidden_states, cache)

        module.forward = forward

    # ---- verification ----------------------------------------------------------------------------------------
    @contextmanager
    def tree(self, parents: Sequence[int]) -> Iterator[None]:
        """Route the GDN layers through the tree path for the forwards inside the block."""
        self.parents, self.pending = list(parents), {}
        try:
            yield
        finally:
            self.parents = None

    @staticmethod
    def _committed(cache, m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's committed conv state [C, K] and recurrent state [HV, dk, dv] (views into the cache)."""
        conv = cache.get_conv_state(m.layer_idx) if cache is not None else None
        state = cache.get_recurrent_state(m.layer_idx) if cache is not None else None
        if conv is None or state is None:
            raise RuntimeError("tree verification on a GDN layer needs a prefilled cache")
        if conv.shape[0] != 1:
            raise ValueError("tree verification supports batch 1 only")
        return conv[0], state[0]

    def _tree_forward(self, m: nn.Module, hidden_states: torch.Tensor, cache) -> torch.Tensor:
        if hidden_states.shape[0] != 1:
            raise ValueError("tree verification supports batch 1 only")
        h = hidden_states[0]
        T = h.shape[0]
        if T != len(self.parents):
            raise ValueError(f"the forward has {T} tokens but the tree {len(self.parents)} nodes")
        conv_state, S0 = self._committed(cache, m)

        x, z, b, a = _projections(m, h)
        K = m.conv1d.weight.shape[-1]
        y = tree_conv1d(x, m.conv1d.weight, m.conv1d.bias, conv_state[:, conv_state.shape[1] - (K - 1):],
                        self.parents, silu=False)
        y = F.silu(y) if m.activation in ("silu", "swish") else _activation(m.activation)(y)
        q, k, v = torch.split(y, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.reshape(T, -1, m.head_k_dim), k.reshape(T, -1, m.head_k_dim)
        v = v.reshape(T, -1, m.head_v_dim)
        if m.num_v_heads != m.num_k_heads:  # each q/k head serves num_v_heads / num_k_heads consecutive v heads
            q = q.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=1)
            k = k.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=1)
        q, k = normalize_qk(q, k)
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)

        o, stash = gdn_tree_verify(q, k, v, g, beta, S0, self.parents, impl=self.impl)
        self.pending[int(m.layer_idx)] = _Pending(x, stash)

        o = m.norm(o.to(h.dtype).reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(o.reshape(1, T, -1))

    # ---- deferred commit -------------------------------------------------------------------------------------
    def commit(self, cache, path: Sequence[int]) -> None:
        """Write the accepted root-to-node `path`'s conv and recurrent states into the cache, in place."""
        if self.pending and len(self.pending) != len(self.modules):
            raise RuntimeError("the last verification did not run every GDN layer")
        for idx, p in self.pending.items():
            conv_state, S0 = self._committed(cache, self.modules[idx])
            new_conv = commit_conv_state(p.x, conv_state, p.stash.parents, list(path))
            new_state = commit_state(p.stash, S0, list(path))
            conv_state.copy_(new_conv)
            S0.copy_(new_state)
        self.pending = {}

    def discard(self) -> None:
        self.pending = {}
