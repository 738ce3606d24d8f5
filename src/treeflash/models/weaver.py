"""The Weaver: a light autoregressive adapter over a DFlash drafter's marginals (DFlash-TfM, DESIGN section 5).

For a node at depth d-1 of a branch (the root is depth 0), the Weaver predicts the distribution of its child at
depth d over K candidates: the top-K tokens of the DFlash marginal at depth d. Its input per node is

    x = in_proj(norm(h_d) :: norm(c) :: norm(e(t)))

- h_d: the drafter's pre-norm state at depth d (what the marginal at depth d is read from);
- c: the drafter's fused context feature (`drafter.fuse` of the target taps) of the last committed position,
  i.e. the position just before the root: the same vector for every node of a round;
- e(t): the target's input embedding of the node's own token t, the realised parent of the predicted token.

A few pre-norm causal attention + SwiGLU layers run along the branch (root first, RoPE position = node depth).
The output, final norm then `out_proj` (width -> H), is dotted with the K candidates' LM-head rows: residual
logits [K], never a full-vocabulary projection at inference. The node's distribution is

    softmax(marginal logits of the K candidates + residual)

`out_proj` starts at zero, so a fresh Weaver is the DFlash marginal restricted to (renormalised on) its top K.

At inference the tree grows node by node: each expanded node's keys/values are stored once in a `BranchCache`
at the node's index, and a node attends to its ancestors through an ancestor mask. Branches that fork share
their common prefix's K/V; nothing is recomputed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import RMSNorm, rope
from .checkpoint import (DrafterError, load_strict, parse_config, read_config, read_weights, save_checkpoint,
                         weights_digest)
from .dflash import DFlashDrafter
from .dflash_config import DFlashConfig


@dataclass
class WeaverConfig:
    hidden_size: int  # the drafter's (= the target's) width H
    vocab_size: int
    block_size: int  # the drafter's γ: depths 1..γ-1
    width: int  # the adapter's own width
    num_layers: int = 1
    num_heads: int = 4
    intermediate_size: int = 0  # SwiGLU width (0: 2 x width)
    top_k: int = 512  # K candidates per depth (capped at the vocabulary)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # sha256 of the DFlash drafter's weights it was trained on (checkpoint.weights_digest): checked on load, as the
    # TreeFlash adapter checks its backbone
    backbone_sha256: str | None = None

    def __post_init__(self) -> None:
        self.top_k = min(self.top_k, self.vocab_size)
        self.intermediate_size = self.intermediate_size or 2 * self.width
        if self.width % self.num_heads:
            raise ValueError(f"Weaver width {self.width} is not a multiple of its {self.num_heads} heads")

    @classmethod
    def for_drafter(cls, c: DFlashConfig, width: int | None = None, num_layers: int = 1, num_heads: int | None = None,
                    top_k: int = 512) -> "WeaverConfig":
        """Defaults: the drafter's width and head count, one layer, K = 512."""
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size, block_size=c.block_size,
                   width=width or c.hidden_size, num_layers=num_layers,
                   num_heads=num_heads or c.num_attention_heads, top_k=top_k, rms_norm_eps=c.rms_norm_eps)


class BranchCache:
    """The Weaver's state over one round's tree: keys/values of every expanded node, stored once at the node's
    index (k[layer], v[layer]: [capacity, heads, head_dim]), and the ancestor-or-self mask [capacity, capacity]."""

    def __init__(self, c: WeaverConfig, capacity: int, device, dtype):
        shape = (capacity, c.num_heads, c.width // c.num_heads)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_layers)]
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)

    def add(self, nodes: list[int], parents: list[int]) -> None:
        """Register new nodes: each sees its parent's ancestors and itself (parent -1: the root)."""
        for n, p in zip(nodes, parents):
            if p >= 0:
                self.ancestors[n] = self.ancestors[p]
            self.ancestors[n, n] = True


class Attention(nn.Module):
    def __init__(self, c: WeaverConfig):
        super().__init__()
        self.c, self.head_dim = c, c.width // c.num_heads
        self.qkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.o_proj = nn.Linear(c.width, c.width, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None, slots: list[int] | None = None):
        """x [B, T, W] at `positions` [T]. Without a cache: causal over T. With one (B = 1): write this call's K/V
        at `slots`, then attend over the cache's first `mask.shape[-1]` slots where mask [T, S] allows."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.c.num_heads, self.head_dim)).unbind(2)  # [B, T, heads, hd]
        q, k = rope(q, positions, self.c.rope_theta), rope(k, positions, self.c.rope_theta)
        if cache is not None:
            cache[0][slots], cache[1][slots] = k[0], v[0]
            k, v = cache[0][None, :mask.shape[-1]], cache[1][None, :mask.shape[-1]]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class Layer(nn.Module):
    def __init__(self, c: WeaverConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.width, c.rms_norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.width, c.rms_norm_eps)
        self.gate_up = nn.Linear(c.width, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.width, bias=False)

    def forward(self, x, positions, mask=None, cache=None, slots=None):
        x = x + self.attn(self.attn_norm(x), positions, mask, cache, slots)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Weaver(nn.Module):
    """The adapter. The drafter (for the target's embedding and LM head) is attached, not owned (not saved)."""

    def __init__(self, config: WeaverConfig):
        super().__init__()
        c = self.config = config
        self.state_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.token_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.in_proj = nn.Linear(3 * c.hidden_size, c.width, bias=False)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.width, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.width, c.hidden_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.out_proj.weight)  # a fresh Weaver adds nothing: exactly the DFlash marginal
        self._drafter: tuple[DFlashDrafter, ...] = ()

    def attach(self, drafter: DFlashDrafter) -> "Weaver":
        c, d = self.config, drafter.config
        if (c.hidden_size, c.vocab_size, c.block_size) != (d.hidden_size, d.vocab_size, d.block_size):
            raise DrafterError(f"this Weaver (hidden {c.hidden_size}, vocabulary {c.vocab_size}, block "
                               f"{c.block_size}) does not fit the drafter (hidden {d.hidden_size}, vocabulary "
                               f"{d.vocab_size}, block {d.block_size})")
        self._drafter = (drafter,)
        return self

    @property
    def drafter(self) -> DFlashDrafter:
        if not self._drafter:
            raise RuntimeError("attach(drafter) first: the Weaver uses the drafter's embedding and LM head")
        return self._drafter[0]

    def inputs(self, h: torch.Tensor, ctx: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        """h [..., H] states of the predicted depth, ctx [..., H] (broadcast), parent_tokens [...] -> [..., W]."""
        dtype = self.in_proj.weight.dtype
        e = self.drafter.embed(parent_tokens)
        parts = [self.state_norm(h), self.context_norm(ctx).expand_as(h), self.token_norm(e.to(h.dtype))]
        return self.in_proj(torch.cat(parts, dim=-1).to(dtype))

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        """Training, N whole branches: h [N, T, H] (depths 1..T), ctx [N, H], parent_tokens [N, T] (the tokens at
        depths 0..T-1) -> outputs [N, T, H]; each node sees its branch up to itself."""
        x = self.inputs(h, ctx[:, None], parent_tokens)
        positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers:
            x = layer(x, positions)
        return self.out_proj(self.norm(x))

    def new_cache(self, capacity: int) -> BranchCache:
        w = self.in_proj.weight
        return BranchCache(self.config, capacity, w.device, w.dtype)

    @torch.no_grad()
    def step(self, cache: BranchCache, nodes: list[int], parents: list[int], depths: torch.Tensor,
             h: torch.Tensor, ctx: torch.Tensor, parent_tokens: torch.Tensor) -> torch.Tensor:
        """Inference, n new tree nodes in one batched call: node indices `nodes`, their parents' indices, depths
        [n] (0 = root), h [n, H] the drafter's states at depth + 1, ctx [H], their own tokens [n] -> [n, H].
        Every ancestor must have been stepped before (its K/V is read from the cache)."""
        cache.add(nodes, parents)
        mask = cache.ancestors[nodes, :max(nodes) + 1]  # [n, S]: ancestors and self
        x = self.inputs(h, ctx, parent_tokens)[None]
        for layer, k, v in zip(self.layers, cache.k, cache.v):
            x = layer(x, depths, mask, (k, v), nodes)
        return self.out_proj(self.norm(x[0]))

    def residual(self, out: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """Residual logits [..., K]: outputs [..., H] dotted with the LM-head rows of candidates [..., K].

        Few rows (inference): gather the K rows per output. Many rows (training): one matmul with the head, then
        pick the candidates; the same numbers without materialising [rows, K, H]."""
        head = self.drafter.lm_head.weight
        out = out.to(head.dtype)
        if out[..., 0].numel() * cand.shape[-1] <= head.shape[0]:
            return torch.einsum("...h,...kh->...k", out, head[cand]).float()
        return (out @ head.T).gather(-1, cand).float()

    # ---- save / load -------------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        save_checkpoint(self.state_dict(), {"architectures": ["Weaver"], **asdict(self.config)}, folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                        backbone: str | Path | None = None) -> "Weaver":
        """With `backbone` (the DFlash drafter folder it will run on), refuse a drafter it was not trained on."""
        folder = Path(folder)
        config = read_config(folder, "Weaver")
        if config.pop("architectures", None) != ["Weaver"]:
            raise DrafterError(f"{folder} holds no Weaver (a DFlash drafter? pass it as --drafter)")
        model = cls(parse_config(lambda raw: WeaverConfig(**raw), config, folder))
        expected = model.config.backbone_sha256
        if backbone is not None and expected and expected != weights_digest(backbone):
            raise DrafterError(f"the Weaver in {folder} was trained on another DFlash drafter than {backbone}: train "
                               "one on it with `treeflash train weaver --backbone` (or pass the drafter it was "
                               "trained on)")
        load_strict(model, read_weights(folder), str(folder))
        return model.to(dtype).eval()
