"""The DFlash drafter's inference forwards, compiled: `torch.compile` (inductor, C++ wrapper) over its decoder layers
for one block of one sequence (`compile_block`, every drafting round), and over the fusion and K/V projection of
newly committed positions (`compile_context`, the context's catch-up before it).

Eager, a round's forward over a 3-layer drafter runs about 40 small ops a layer (norms, q/k norms, RoPE, the
cache write, SDPA) around seven products; compiled, they fuse into a few loops around the products. The weights
are plain tensors passed in (q|k|v and gate|up concatenated: one product each), so the guards stay cheap and
nothing is frozen: a drafter whose weights change is compiled again by `DFlashDrafter.compile_block`. A drafter
whose linears are 4-bit (`runtime.int4.quantise_linears`) passes each product as its kernel's (packed values,
scales and zeros) and multiplies on PyTorch's int4 kernel, as the 4-bit target does: after a target step has
streamed through the caches, the twelve products of a 5-position block cost 0.56 ms there against 1.17 ms on
bf16 weights through F.linear (`scripts/drafter_products.py`).

The block attends to the context's cached K/V and to its own K/V as two score blocks under one softmax, so the
cache is read, never written (the eager path writes the block's K/V after the context, as scratch).

`DFlashDrafter.hidden` over a `ContextCache` is the eager reference of the block, `DFlashDrafter.fuse` and
`context_kv` that of the catch-up; tests hold the compiled forwards to them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..runtime.int4 import GROUP, Int4Linear, Int4Weight
from .blocks import rope
from .dflash_config import DFlashConfig

# a product's weight as the compiled forwards take it: dense [N, K], or a 4-bit one's (packed, scales and zeros)
Product = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32, as blocks.RMSNorm."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def linear(x: torch.Tensor, w: Product) -> torch.Tensor:
    """x [M, K] @ w.T, as `Int4Linear` multiplies for a 4-bit weight (in its scales' dtype)."""
    if isinstance(w, tuple):
        packed, scale_zeros = w
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scale_zeros.dtype), packed, GROUP,
                                                          scale_zeros).to(x.dtype)
    return F.linear(x, w)


def product(linears) -> Product:
    """The weight of one product over these bias-free linears on the same input (outputs concatenated): 4-bit
    where they all are single-part `Int4Linear`s that concatenate, else dense."""
    if all(isinstance(m, Int4Linear) and len(m.parts) == 1 for m in linears):
        try:
            w = Int4Weight.cat([m.parts[0] for m in linears])
            return w.packed, w.scale_zeros
        except ValueError:  # rows that are not whole packed blocks: the dense copies
            pass
    if any(m.weight is None for m in linears):
        raise ValueError("the compiled block multiplies these 4-bit linears densely, and they keep no dense copy")
    return torch.cat([m.weight for m in linears]).detach()


def block_weights(model) -> tuple:
    """A DFlash drafter's tensors in the compiled forward's order: the (target's) embedding, then per layer its
    norms, q|k|v, q/k norms, o, gate|up and down (each product a `Product`). ValueError where it has no compiled
    form (a learned mask embedding instead of a mask token, biases)."""
    if model.config.mask_token_id is None:
        raise ValueError("the compiled block needs a mask token (this drafter has a learned mask embedding)")
    weights = [model.embed.weight.detach()]
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(getattr(m, "bias", None) is not None for m in linears):
            raise ValueError("the compiled block has no biases")
        weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                    product([a.q_proj, a.k_proj, a.v_proj]), a.q_norm.weight.detach(), a.k_norm.weight.detach(),
                    product([a.o_proj]), product([mlp.gate_proj, mlp.up_proj]), product([mlp.down_proj])]
    return tuple(weights)


def compile_block(c: DFlashConfig, dtype: torch.dtype) -> Callable:
    """The compiled block forward of drafters shaped as config `c`, computing in `dtype`; called as
    forward(tokens, ctx_len, rows, k_cache, v_cache, *block_weights(model)) with the block's tokens [γ] (the root,
    then mask tokens) and a `ContextCache`'s buffers holding the context in their first ctx_len positions. Returns
    the final states before the final norm of the block's first `rows` positions [rows, H], as
    `DFlashDrafter.hidden`: every layer but the last runs all γ positions (the block attends to itself both ways),
    the last one only the rows a tree reads (its attention, output product and MLP: a quarter of the products when
    the tree is small)."""
    heads, kv_heads, hd, eps, theta = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                       c.rope_theta)
    qd, kvd, groups = heads * hd, kv_heads * hd, heads // kv_heads

    def forward(tokens, ctx_len: int, rows: int, k_cache, v_cache, embed, *weights):
        g = tokens.shape[0]
        positions = ctx_len + torch.arange(g, device=tokens.device)
        h = F.embedding(tokens, embed).to(dtype)
        layers = len(weights) // 8
        for i in range(layers):
            in_norm, post_norm, qkv, q_norm, k_norm, o, gate_up, down = weights[8 * i: 8 * i + 8]
            x = linear(rms_norm(h, in_norm, eps), qkv)
            k = rope(rms_norm(x[:, qd:qd + kvd].view(g, kv_heads, hd), k_norm, eps), positions, theta)
            v = x[:, qd + kvd:].view(g, kv_heads, hd)
            n = rows if i == layers - 1 else g  # the queries whose states the next layer (or the tree) reads
            h = h[:n]
            q = rope(rms_norm(x[:n, :qd].view(n, heads, hd), q_norm, eps), positions[:n], theta)
            # grouped-query attention: a KV head's query heads become rows; context and block as two score blocks
            q = q.transpose(0, 1).reshape(kv_heads, groups * n, hd).float()
            ctx_k, ctx_v = k_cache[i, :, :ctx_len].float(), v_cache[i, :, :ctx_len].float()
            scores = torch.cat([q @ ctx_k.transpose(1, 2), q @ k.transpose(0, 1).float().transpose(1, 2)], dim=-1)
            p = (scores * hd ** -0.5).softmax(-1)
            out = p[..., :ctx_len] @ ctx_v + p[..., ctx_len:] @ v.transpose(0, 1).float()
            out = out.to(dtype).reshape(heads, n, hd).transpose(0, 1).reshape(n, qd)
            h = h + linear(out, o)
            gate, up = linear(rms_norm(h, post_norm, eps), gate_up).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, down)
        return h

    return torch.compile(forward, options={"cpp_wrapper": True}, dynamic=None)


def context_weights(model) -> tuple:
    """A DFlash drafter's tensors in the compiled context forward's order: `fc`, the hidden norm, then per layer its
    k|v rows (one product) and k norm."""
    weights = [product([model.fc]), model.hidden_norm.weight.detach()]
    for layer in model.layers:
        a = layer.self_attn
        weights += [product([a.k_proj, a.v_proj]), a.k_norm.weight.detach()]
    return tuple(weights)


def compile_context(c: DFlashConfig, dtype: torch.dtype) -> Callable:
    """The compiled catch-up of drafters shaped as config `c`, computing in `dtype`; called as
    forward(taps, positions, *context_weights(model)) with the target's taps [m, n_taps, H] of m committed
    positions at `positions` [m]. Returns their fused features [m, H] and injected keys and values, each
    [layers, kv_heads, m, head_dim] (a `ContextCache`'s layout): `DFlashDrafter.context_states`. Eager, it is about
    30 small ops around four products, 0.4 ms a round on a 2-core CPU for a position or two."""
    kv_heads, hd, eps, theta = c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta

    def forward(taps, positions, fc, hidden_norm, *weights):
        m = taps.shape[0]
        fused = rms_norm(linear(taps.flatten(-2).to(dtype), fc), hidden_norm, eps)
        keys, values = [], []
        for kv, k_norm in zip(weights[0::2], weights[1::2]):
            x = linear(fused, kv)
            k = rope(rms_norm(x[:, :kv_heads * hd].view(m, kv_heads, hd), k_norm, eps), positions, theta)
            keys.append(k.transpose(0, 1))
            values.append(x[:, kv_heads * hd:].view(m, kv_heads, hd).transpose(0, 1))
        return fused, torch.stack(keys), torch.stack(values)

    return torch.compile(forward, options={"cpp_wrapper": True}, dynamic=None)
