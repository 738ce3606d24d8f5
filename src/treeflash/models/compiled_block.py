"""The DFlash drafter's inference forwards, compiled ahead of time (`runtime/aoti.py`): its decoder layers for one
block of one sequence (`compile_block`, every drafting round), and the fusion and K/V projection of newly committed
positions (`compile_context`, the context's catch-up before it).

Eager, a round's forward over a 3-layer drafter runs about 40 small ops a layer (norms, q/k norms, RoPE, the
cache write, SDPA) around seven products; compiled, they fuse into a few loops around the products. Ahead of time
rather than through `torch.compile`: dynamo's guards over the drafter's 40 weight tensors, and AOTAutograd's
wrappers, cost about 0.2 ms a call after a target step has pushed them out of the caches (two calls a round). The
weights are plain tensors passed in (q|k|v and gate|up concatenated: one product each), so nothing is frozen into
a package: one package per drafter shape and machine, whatever its weights. Sizes (block positions, context
length, cache capacity, rows) are symbolic, so nothing compiles again while decoding; the context's length and the
rows wanted come in as the lengths of two small tensors, since a package's sizes are its inputs' shapes.

A drafter whose linears are 4-bit (`runtime.int4.quantise_linears`) passes each product as its kernel's (packed
values, scales and zeros) and multiplies on PyTorch's int4 kernel, as the 4-bit target does: after a target step
has streamed through the caches, the twelve products of a 5-position block cost 0.56 ms there against 1.17 ms on
bf16 weights through F.linear (`scripts/drafter_products.py`).

The block attends to the context's cached K/V and to its own K/V as two score blocks under one softmax, so the
cache is read, never written (the eager path writes the block's K/V after the context, as scratch).

`DFlashDrafter.hidden` over a `ContextCache` is the eager reference of the block, `DFlashDrafter.fuse` and
`context_kv` that of the catch-up; tests hold the compiled forwards to them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..runtime import aoti
from ..runtime.int4 import GROUP, Int4Linear, Int4Weight
from .blocks import rope
from .dflash_config import DFlashConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In fp32, as blocks.RMSNorm."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def linear(x: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for one product's tensors (`product`): a dense weight, or a 4-bit one's packed values, scales
    and zeros, multiplied as `Int4Linear` does (in its scales' dtype)."""
    if len(w) == 2:
        packed, scale_zeros = w
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scale_zeros.dtype), packed, GROUP,
                                                          scale_zeros).to(x.dtype)
    return F.linear(x, w[0])


def product(linears, dense: bool = False) -> tuple[torch.Tensor, ...]:
    """The tensors of one product over these bias-free linears on the same input (outputs concatenated): the dense
    weight, or where they are single-part `Int4Linear`s the 4-bit kernel's packed values and its scales and zeros
    (unless `dense`: their kept dense copies). ValueError where they have no compiled form (biases, 4-bit rows that
    do not concatenate, mixed kinds)."""
    if any(getattr(m, "bias", None) is not None for m in linears):
        raise ValueError("the compiled forwards have no biases")
    if not dense and all(isinstance(m, Int4Linear) and len(m.parts) == 1 for m in linears):
        w = Int4Weight.cat([m.parts[0] for m in linears])
        return w.packed, w.scale_zeros
    if any(m.weight is None or (isinstance(m, Int4Linear) and not dense) for m in linears):
        raise ValueError("the compiled forwards multiply single-part 4-bit linears, or dense ones")
    return (torch.cat([m.weight for m in linears]).detach(),)


def product_tensors(model) -> int:
    """Tensors per product of this drafter in the compiled forwards: 2 for 4-bit linears, 1 for dense ones (as
    `product` decides; `block_weights` and `context_weights` hold every product to it)."""
    return len(product([model.fc]))


def _checked(model, products: list[tuple[torch.Tensor, ...]], dense: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """The products, where each has as many tensors as the compiled forwards expect (they index the weights by
    that count): ValueError for a drafter whose linears are partly 4-bit."""
    p = 1 if dense else product_tensors(model)
    if any(len(t) != p for t in products):
        raise ValueError("the compiled forwards need a drafter's linears all 4-bit or all dense")
    return products


def block_weights(model) -> tuple[torch.Tensor, ...]:
    """A DFlash drafter's tensors in the compiled block's order: the (target's) embedding, then per layer its
    norms, q|k|v, q/k norms, o, gate|up and down (each product's `product` tensors). ValueError where it has no
    compiled form (a learned mask embedding instead of a mask token, biases)."""
    if model.config.mask_token_id is None:
        raise ValueError("the compiled block needs a mask token (this drafter has a learned mask embedding)")
    weights = [model.embed.weight.detach()]
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = _checked(model, [product([a.q_proj, a.k_proj, a.v_proj]), product([a.o_proj]),
                                                 product([mlp.gate_proj, mlp.up_proj]), product([mlp.down_proj])])
        weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                    *qkv, a.q_norm.weight.detach(), a.k_norm.weight.detach(), *o, *gate_up, *down]
    return tuple(weights)


class Block(torch.nn.Module):
    """The block forward of drafters shaped as config `c`, computing in `dtype`, with `p` tensors a product:
    block(tokens, context, rows, k_cache, v_cache, *block_weights(model)) with the block's tokens [γ] (the root,
    then mask tokens), a `ContextCache`'s buffers holding the context in their first len(context) positions, and
    `rows` a tensor as long as the rows wanted. Returns the final states before the final norm of the block's
    first len(rows) positions [rows, H], as `DFlashDrafter.hidden`: every layer but the last runs all γ positions
    (the block attends to itself both ways), the last one only the rows a tree reads (its attention, output product
    and MLP: a quarter of the products when the tree is small)."""

    def __init__(self, c: DFlashConfig, dtype: torch.dtype, p: int):
        super().__init__()
        self.c, self.dtype, self.p = c, dtype, p

    def forward(self, tokens, context, rows, k_cache, v_cache, embed, *weights):
        c, p, dtype = self.c, self.p, self.dtype
        heads, kv_heads, hd, eps, theta = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                           c.rope_theta)
        qd, kvd, groups = heads * hd, kv_heads * hd, heads // kv_heads
        g, ctx_len, per_layer = tokens.shape[0], context.shape[0], 4 + 4 * p
        positions = ctx_len + torch.arange(g, device=tokens.device)
        h = F.embedding(tokens, embed).to(dtype)
        layers = len(weights) // per_layer
        for i in range(layers):
            w = weights[per_layer * i: per_layer * (i + 1)]
            in_norm, post_norm, qkv, q_norm, k_norm = w[0], w[1], w[2:2 + p], w[2 + p], w[3 + p]
            o, gate_up, down = w[4 + p:4 + 2 * p], w[4 + 2 * p:4 + 3 * p], w[4 + 3 * p:]
            x = linear(rms_norm(h, in_norm, eps), *qkv)
            k = rope(rms_norm(x[:, qd:qd + kvd].view(g, kv_heads, hd), k_norm, eps), positions, theta)
            v = x[:, qd + kvd:].view(g, kv_heads, hd)
            n = rows.shape[0] if i == layers - 1 else g  # the queries whose states the next layer (or tree) reads
            h = h[:n]
            q = rope(rms_norm(x[:n, :qd].view(n, heads, hd), q_norm, eps), positions[:n], theta)
            # grouped-query attention: a KV head's query heads become rows; context and block as two score blocks
            q = q.transpose(0, 1).reshape(kv_heads, groups * n, hd).float()
            ctx_k, ctx_v = k_cache[i, :, :ctx_len].float(), v_cache[i, :, :ctx_len].float()
            scores = torch.cat([q @ ctx_k.transpose(1, 2), q @ k.transpose(0, 1).float().transpose(1, 2)], dim=-1)
            probs = (scores * hd ** -0.5).softmax(-1)
            out = probs[..., :ctx_len] @ ctx_v + probs[..., ctx_len:] @ v.transpose(0, 1).float()
            out = out.to(dtype).reshape(heads, n, hd).transpose(0, 1).reshape(n, qd)
            h = h + linear(out, *o)
            gate, up = linear(rms_norm(h, post_norm, eps), *gate_up).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, *down)
        return h


def compile_block(c: DFlashConfig, dtype: torch.dtype, weights: tuple[torch.Tensor, ...], p: int) -> Callable:
    """The compiled `Block` of drafters shaped as config `c` with tensors shaped as `weights` (`block_weights`, p
    a product), loaded or built; called as forward(tokens, ctx_len, rows, k_cache, v_cache, *weights)."""
    key = ("block", _shape(c), str(dtype), p, aoti.shapes(weights), Path(__file__).read_bytes())
    auto = torch.export.Dim.AUTO  # block positions, context length, rows, cache capacity: symbolic
    dims = ({0: auto}, {0: auto}, {0: auto}, {2: auto}, {2: auto}, None, (None,) * (len(weights) - 1))

    def export() -> torch.export.ExportedProgram:  # traced on a 5-position block after 7 positions, 3 rows
        k = torch.zeros(c.num_hidden_layers, c.num_key_value_heads, 16, c.head_dim, dtype=dtype)
        args = (torch.zeros(5, dtype=torch.long), _sized(7), _sized(3), k, k.clone(), *weights)
        return aoti.export_sized(Block(c, dtype, p), args, dims)
    run = aoti.package("drafter-block", key, export)

    def forward(tokens, ctx_len: int, rows: int, k_cache, v_cache, *weights):
        return run(tokens, _sized(ctx_len), _sized(rows), k_cache, v_cache, *weights)[0]
    return forward


def context_weights(model, dense: bool = False) -> tuple[torch.Tensor, ...]:
    """A DFlash drafter's tensors in the compiled catch-up's order: `fc`, the hidden norm, then per layer its
    k|v rows (one product) and k norm; with `dense`, the dense copies that 4-bit linears keep."""
    (fc,) = _checked(model, [product([model.fc], dense)], dense)
    weights = [*fc, model.hidden_norm.weight.detach()]
    for layer in model.layers:
        a = layer.self_attn
        (kv,) = _checked(model, [product([a.k_proj, a.v_proj], dense)], dense)
        weights += [*kv, a.k_norm.weight.detach()]
    return tuple(weights)


class CatchUp(torch.nn.Module):
    """The catch-up of drafters shaped as config `c`, computing in `dtype`, with `p` tensors a product:
    catch_up(taps, positions, *context_weights(model)) with the target's taps [m, n_taps, H] of m committed
    positions at `positions` [m]. Returns their fused features [m, H] and injected keys and values, each
    [layers, kv_heads, m, head_dim] (a `ContextCache`'s layout): `DFlashDrafter.context_states`. Eager, it is about
    30 small ops around four products, 0.4 ms a round on a 2-core CPU for a position or two."""

    def __init__(self, c: DFlashConfig, dtype: torch.dtype, p: int):
        super().__init__()
        self.c, self.dtype, self.p = c, dtype, p

    def forward(self, taps, positions, *weights):
        c, p = self.c, self.p
        kv_heads, hd, eps, theta = c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta
        m = taps.shape[0]
        fused = rms_norm(linear(taps.flatten(-2).to(self.dtype), *weights[:p]), weights[p], eps)
        keys, values = [], []
        for i in range(p + 1, len(weights), p + 1):
            kv, k_norm = weights[i:i + p], weights[i + p]
            x = linear(fused, *kv)
            k = rope(rms_norm(x[:, :kv_heads * hd].view(m, kv_heads, hd), k_norm, eps), positions, theta)
            keys.append(k.transpose(0, 1))
            values.append(x[:, kv_heads * hd:].view(m, kv_heads, hd).transpose(0, 1))
        return fused, torch.stack(keys), torch.stack(values)


def compile_context(c: DFlashConfig, dtype: torch.dtype, weights: tuple[torch.Tensor, ...], p: int) -> Callable:
    """The compiled `CatchUp` of drafters shaped as config `c` with tensors shaped as `weights`
    (`context_weights`, p a product), loaded or built; called as `CatchUp.forward`, returning its three tensors.
    (A 4-bit drafter has two: a long prompt's catch-up runs on the dense copies, `DFlashDrafter.compile_block`.)"""
    key = ("catch-up", _shape(c), str(dtype), p, aoti.shapes(weights), Path(__file__).read_bytes())
    auto = torch.export.Dim.AUTO  # positions: symbolic

    def export() -> torch.export.ExportedProgram:  # traced on 3 positions
        taps = torch.zeros(3, len(c.target_layer_ids), c.hidden_size, dtype=dtype)
        args = (taps, torch.arange(3), *weights)
        return aoti.export_sized(CatchUp(c, dtype, p), args, ({0: auto}, {0: auto}, (None,) * len(weights)))
    run = aoti.package("drafter-catch-up", key, export)
    return lambda taps, positions, *weights: tuple(run(taps, positions, *weights))


def _shape(c: DFlashConfig) -> tuple:
    """What the compiled code depends on in a drafter's config."""
    return (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.rms_norm_eps, c.rope_theta, len(c.target_layer_ids))


def _sized(n: int) -> torch.Tensor:
    """A tensor whose length is n: how a size reaches a package (its sizes are its inputs' shapes)."""
    return torch.empty(n, dtype=torch.bool)
