"""The drafters' building blocks: RMSNorm, rotary embedding, and a Qwen3-style decoder layer whose attention
also sees injected context keys/values (DFlash's KV injection). Parameter names follow the published DFlash layout
(`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`), so those checkpoints load as they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dflash_config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 whatever the storage dtype, one fused op (a hand-written norm costs 8 dispatches)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, as Llama/Qwen3) on x [..., T, heads, head_dim]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * freqs  # [..., T, half]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@dataclass
class BlocksOverContext:
    """Training's attention pattern: N blocks, each over the context before its anchor and over its own γ positions
    (DFlash: a block sees the committed context and itself, never another block). Passed as a layer's mask."""

    anchors: torch.Tensor  # [N]
    # [N] or None: block n is its first lengths[n] positions only (a drafter trained for short blocks); the
    # positions after them exist in the tensors but no query of the block sees them
    lengths: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor,
               ctx_v: torch.Tensor) -> torch.Tensor:
        """q [N, γ, heads, d], the blocks' own k/v [N, γ, kv_heads, d], the context's ctx_k/v [S, kv_heads, d] ->
        [N, heads, γ, d]. The context's K/V are multiplied once for all blocks, never copied per block: what SDPA
        over the flat layout with `block_mask` computes (the reference, tested), with S + γ keys a query instead of
        S + N γ."""
        n, g, heads, d = q.shape
        kv_heads, S = k.shape[-2], ctx_k.shape[0]
        q = q.unflatten(2, (kv_heads, heads // kv_heads)).permute(2, 0, 3, 1, 4)  # [kv_heads, N, groups, γ, d]
        k, v, ctx_k, ctx_v = (x.to(q.dtype) for x in (k, v, ctx_k, ctx_v))
        on_context = torch.einsum("hngtd,shd->hngts", q, ctx_k)
        on_context = on_context.masked_fill(~(torch.arange(S, device=q.device) < self.anchors[:, None])[
            None, :, None, None, :], float("-inf"))
        on_block = torch.einsum("hngtd,nuhd->hngtu", q, k)
        if self.lengths is not None:
            on_block = on_block.masked_fill(~(torch.arange(g, device=q.device) < self.lengths[:, None])[
                None, :, None, None, :], float("-inf"))
        p = torch.softmax(torch.cat([on_context, on_block], dim=-1).float() * d ** -0.5, dim=-1).to(q.dtype)
        out = torch.einsum("hngts,shd->hngtd", p[..., :S], ctx_v) + torch.einsum("hngtu,nuhd->hngtd", p[..., S:], v)
        return out.permute(1, 0, 2, 3, 4).flatten(1, 2)  # query head i reads kv head i // groups, as SDPA's GQA


def block_mask(anchors: torch.Tensor, context: int, block_size: int,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The reference layout of `BlocksOverContext`: the N blocks flattened after the context, [N γ, S + N γ] bool: a
    block sees context positions before its anchor, and its own block (its first lengths[n] positions)."""
    block = torch.arange(len(anchors)).repeat_interleave(block_size)
    sees_context = torch.arange(context)[None, :] < anchors.cpu()[block][:, None]
    sees_block = block[:, None] == block[None, :]
    if lengths is not None:
        sees_block &= (torch.arange(block_size).repeat(len(anchors)) < lengths.cpu()[block])[None, :]
    return torch.cat([sees_context, sees_block], dim=1)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [T, kv_heads, head_dim] of states x [T, H] at `positions` [T]."""
        c = self.c
        k = self.k_norm(self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        return rope(k, positions, c.rope_theta), v

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None, ctx_len: int | None = None) -> torch.Tensor:
        """h [..., T, H] block states; ctx_k/v [..., C, kv_heads, head_dim]; mask [T, C + T] bool, or
        [B, 1, T, C + T] for a batch (None: see all), or BlocksOverContext (training: h [N, γ, H], ctx_k/v
        [C, kv_heads, head_dim]). With `ctx_len` (one sequence), ctx_k/v are static buffers
        [kv_heads, capacity, head_dim] (ContextCache) holding the context in their first ctx_len rows: the block's
        K/V are written after it, in place, instead of concatenated to a copy of the context."""
        c = self.c
        q = rope(self.q_norm(self.q_proj(h).unflatten(-1, (c.num_attention_heads, c.head_dim))), positions,
                 c.rope_theta)
        k, v = self.kv(h, positions)
        if isinstance(mask, BlocksOverContext):
            return self.o_proj(mask.attend(q, k, v, ctx_k, ctx_v).transpose(-3, -2).flatten(-2))
        q = q.transpose(-3, -2)  # [..., heads, T, head_dim]
        if ctx_len is None:
            k, v = (torch.cat([ctx, new], dim=-3).transpose(-3, -2) for ctx, new in ((ctx_k, k), (ctx_v, v)))
        else:
            end = ctx_len + len(h)
            ctx_k[:, ctx_len:end], ctx_v[:, ctx_len:end] = k.transpose(0, 1), v.transpose(0, 1)
            k, v = ctx_k[:, :end], ctx_v[:, :end]
        k, v = k.to(q.dtype), v.to(q.dtype)
        groups = c.num_attention_heads // c.num_key_value_heads
        if mask is None and q.dim() == 3:
            # one unmasked block: the query heads of a KV head become rows of that head (no K/V repeat), the
            # layout CPU SDPA runs fastest (the GQA path copies the context's K/V every call)
            out = F.scaled_dot_product_attention(q.reshape(c.num_key_value_heads, groups * len(h), c.head_dim),
                                                 k, v).view(q.shape)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, positions, ctx_k, ctx_v, mask, ctx_len=None):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, mask, ctx_len)
        return h + self.mlp(self.post_attention_layernorm(h))
