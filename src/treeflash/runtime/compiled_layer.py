"""The static runtime's decoder layer for 4-bit targets, compiled: `torch.compile` (inductor, C++ wrapper) over one
layer, the graph every layer shares.

Eager, a decoding step of SmolLM2 spends about as long dispatching the small ops around its 4-bit products (norms,
RoPE, cache writes, attention) as in the products. Compiled, those ops fuse into a few C++ loops around the
products and no Python runs between them; attention is two fused reductions around a softmax (SDPA's CPU
kernel costs more at decoding's sizes). The layer takes its weights as plain tensors, so dynamo's guards are few and
cheap (they run on every call). Shapes (rows, context length, batch) become symbolic after their first change, so
it compiles a handful of graphs; inductor caches them on disk (TORCHINDUCTOR_CACHE_DIR).

`static_decoder.decoder_layer` is the eager reference; tests hold this one to it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .int4 import GROUP
from .static_decoder import _rotate


def layer_weights(layer) -> tuple[torch.Tensor, ...]:
    """A static-decoder layer's tensors in the compiled layer's order; ValueError where it has no compiled form:
    products that are not single 4-bit parts (dense, Q8_0's two halves), biases, or q/k norms (Qwen3)."""
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    if any(p.int4 is None or len(p.int4.parts) != 1 or p.int4.bias is not None for p in projections):
        raise ValueError("the compiled layer runs single-part 4-bit products without biases (Q4_0, Q4_1, Q4_K)")
    if layer.q_norm is not None:
        raise ValueError("the compiled layer has no q/k norms (Qwen3)")
    weights = [layer.in_norm.weight.detach(), layer.post_norm.weight.detach()]
    for p in projections:
        weights += [p.int4.parts[0].packed, p.int4.parts[0].scale_zeros]
    return tuple(weights)


def compile_layer(shape: tuple[int, int, int], eps: float) -> Callable:
    """The compiled layer of a model with (heads, kv_heads, head_dim) = `shape`, RMSNorm epsilon `eps` and SiLU
    gates; called as layer(x, cos, sin, k_cache, v_cache, end, cols, mask, *layer_weights(layer)), with the
    arguments of `static_decoder.decoder_layer` (the K/V always written at `cols`)."""
    heads, kv_heads, hd = shape
    qd, kvd = heads * hd, kv_heads * hd

    def product(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(scale_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scale_zeros).to(x.dtype)
        return y.reshape(*x.shape[:-1], -1)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def layer(x, cos, sin, k_cache, v_cache, end: int, cols, mask, in_norm, post_norm, qkv, qkv_sz, o, o_sz,
              gate_up, gate_up_sz, down, down_sz):
        B, n, _ = x.shape
        h = product(norm(x, in_norm), qkv, qkv_sz)
        qk = _rotate(h[..., :qd + kvd].view(B, n, heads + kv_heads, hd).transpose(1, 2), cos, sin)
        v = h[..., qd + kvd:].view(B, n, kv_heads, hd).transpose(1, 2)
        q, k = qk[:, :heads], qk[:, heads:]
        # in place: a slice write of a graph input would copy the whole cache
        index = (torch.arange(B, device=x.device)[:, None, None], torch.arange(kv_heads, device=x.device)[:, None],
                 cols[:, None])
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        q = q.reshape(B, kv_heads, heads // kv_heads * n, hd)  # grouped-query attention, as decoder_layer
        # attention as two fused reductions: no matrix-product call, and no pattern inductor would turn back
        # into its SDPA call (which costs more than the whole attention at decoding's sizes)
        scores = (q.float()[:, :, :, None] * k_cache[:, :, None, :end].float()).sum(-1) * hd ** -0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = (scores.softmax(-1)[..., None] * v_cache[:, :, None, :end].float()).sum(-2).to(x.dtype)
        out = out.reshape(B, heads, n, hd).transpose(1, 2).reshape(B, n, qd)
        x = x + product(out, o, o_sz)
        gate, up = product(norm(x, post_norm), gate_up, gate_up_sz).chunk(2, dim=-1)
        return x + product(F.silu(gate) * up, down, down_sz)

    # a few graphs per model (one row or several, with or without a mask, batches), each layer the same graph
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    return torch.compile(layer, options={"cpp_wrapper": True}, dynamic=None)
