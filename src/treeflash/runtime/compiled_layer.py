"""The static runtime's decoder layer for 4-bit targets, compiled ahead of time: `torch.export` over one layer, the
graph every layer shares, built by AOTInductor into a package cached on disk; and what runs before and after the
layers (`Prologue`, `Head`: the final norm and a 4-bit LM head).

Eager, a decoding step of SmolLM2 spends about as long dispatching the small ops around its 4-bit products (norms,
RoPE, cache writes, attention) as in the products. Compiled, those ops fuse into a few C++ loops around the
products; attention is two fused reductions around a softmax for one or two rows (SDPA's CPU kernel costs more
there), SDPA's kernel for more (`SDPA_ROWS`).
Ahead of time rather than `torch.compile` (`aoti.py`), because a step calls the layer once per layer (30 calls for
SmolLM2): dynamo's guards and AOTAutograd's wrappers cost ~25 us a call there, about 12 % of a step, and an
AOTInductor runner costs almost nothing above its kernels. One graph takes every batch, row count and length (sizes are
symbolic from 0 up: `backed_size_oblivious`), so it compiles once per model shape (~15 s, and as much for the
batches' package, `SEQUENCES`) and a second start loads them in milliseconds.

The layer takes its weights as plain tensors (nothing frozen into the package) and finds the attended length in
the mask's width. `static_decoder.decoder_layer` is the eager reference; tests hold this one to it.

A second form of the layer multiplies on the packed dense copy the runtime keeps of the same weights, for the rows
where the 4-bit kernel's compute costs more than reading the dense bytes: trees and batches of about 5 rows and
more (on an Intel Xeon with AMX, SmolLM2's products at 5-8 rows take 10.4 ms on the kernel and 6.4 ms dense). Its
products are oneDNN's packed linear (`packed.packed_linear`), an op inductor's own freezing pass emits: here it
takes the packed weights as inputs, through `treeflash::packed_linear` and a lowering to the same extern call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import aoti
from .int4 import GROUP
from .packed import packed_linear
from .static_decoder import _rotate, prologue


def layer_weights(layer, dense: bool = False) -> tuple[torch.Tensor, ...]:
    """A static-decoder layer's tensors in the compiled layer's order (`dense`: its products' packed dense copies
    instead of their 4-bit blocks); ValueError where it has no compiled form: products that are not single 4-bit
    parts (dense, Q8_0's two halves), biases, dense copies missing, or q/k norms (Qwen3)."""
    projections = layer.projections
    if any(p.int4 is None or len(p.int4.parts) != 1 or p.int4.bias is not None for p in projections):
        raise ValueError("the compiled layer runs single-part 4-bit products without biases (Q4_0, Q4_1, Q4_K)")
    if dense and any(p.packed is None for p in projections):
        raise ValueError("the products have no packed dense copy (a CPU without native bf16, or no oneDNN)")
    if layer.q_norm is not None:
        raise ValueError("the compiled layer has no q/k norms (Qwen3)")
    weights = [layer.in_norm.weight.detach(), layer.post_norm.weight.detach()]
    for p in projections:
        weights += [p.packed] if dense else [p.int4.parts[0].packed, p.int4.parts[0].scale_zeros]
    return tuple(weights)


class Layer(torch.nn.Module):
    """One decoder layer of a model with (heads, kv_heads, head_dim) = `shape`, RMSNorm epsilon `eps` and SiLU
    gates, as exported: layer(x, cos, sin, k_cache, v_cache, cols, mask, *layer_weights(layer, dense)) with the
    arguments of `static_decoder.decoder_layer` (the K/V always written at `cols`; the tokens attend to the cache's
    first mask.shape[-1] positions under `mask`). `sdpa`: attention by SDPA's kernel (the dense form always)."""

    def __init__(self, shape: tuple[int, int, int], eps: float, dense: bool = False, sdpa: bool = False):
        super().__init__()
        self.shape, self.eps, self.dense, self.sdpa = shape, eps, dense, sdpa or dense

    def forward(self, x, cos, sin, k_cache, v_cache, cols, mask, in_norm, post_norm, *products):
        # each product's tensors: a packed dense weight, or the 4-bit blocks and their scales and zeros
        per = 1 if self.dense else 2
        qkv, o, gate_up, down = (products[i:i + per] for i in range(0, 4 * per, per))
        heads, kv_heads, hd = self.shape
        qd, kvd = heads * hd, kv_heads * hd
        B, n, _ = x.shape
        end = mask.shape[-1]
        h = _product(F.rms_norm(x, in_norm.shape, in_norm, self.eps), *qkv)
        qk = _rotate(h[..., :qd + kvd].view(B, n, heads + kv_heads, hd).transpose(1, 2), cos, sin)
        v = h[..., qd + kvd:].view(B, n, kv_heads, hd).transpose(1, 2)
        q, k = qk[:, :heads], qk[:, heads:]
        # in place: the package writes into the caller's cache
        index = (torch.arange(B, device=x.device)[:, None, None], torch.arange(kv_heads, device=x.device)[:, None],
                 cols[:, None])
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v)
        q = q.reshape(B, kv_heads, heads // kv_heads * n, hd)  # grouped-query attention, as decoder_layer
        if self.sdpa:  # trees and batches: SDPA's kernel, whose cost grows least with rows x positions (one SmolLM2
            # layer at 8 / 17 rows after 600 positions: 0.30 / 0.40 ms, 0.51 / 0.90 as below)
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
        else:  # attention as two fused reductions: no matrix-product call, and no pattern inductor would turn back
            # into its SDPA call (which costs more than the whole attention at decoding's few rows)
            scores = (q.float()[:, :, :, None] * k_cache[:, :, None, :end].float()).sum(-1) * hd ** -0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            # the softmax's division after the weighted sum: once a row, not once a position (3-5 % of a 2-4 row
            # layer)
            e = (scores - scores.amax(-1, keepdim=True)).exp()
            out = ((e[..., None] * v_cache[:, :, None, :end].float()).sum(-2) / e.sum(-1, keepdim=True)).to(x.dtype)
        out = out.reshape(B, heads, n, hd).transpose(1, 2).reshape(B, n, qd)
        x = x + _product(out, *o)
        gate, up = _product(F.rms_norm(x, post_norm.shape, post_norm, self.eps), *gate_up).chunk(2, -1)
        return x + _product(F.silu(gate) * up, *down)


def _product(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T on the 4-bit blocks `packed` and their `scale_zeros`, or on W's packed dense copy (no scales)."""
    flat = x.reshape(-1, x.shape[-1])
    if scale_zeros is None:
        y = torch.ops.treeflash.packed_linear(flat.to(packed.dtype).contiguous(), packed)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(scale_zeros.dtype), packed, GROUP, scale_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


@torch.library.custom_op("treeflash::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`packed.packed_linear` as an op that export keeps whole: inductor's own lowering of oneDNN's packed linear
    wants the weight frozen into the graph (a constant), this one takes it as an input."""
    return packed_linear(x, packed)


@_packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _lower_packed_linear(x, packed):
    """The op's inductor lowering: oneDNN's packed-linear extern kernel (`mkldnn_ir.LinearUnary`, as freezing emits
    it) on the weight as given. Inductor's `create` would first copy the weight into a contiguous buffer, which
    for an input in oneDNN's opaque layout reads garbage: constants of that layout alone are exempt."""
    from torch._inductor import ir, mkldnn_ir

    x = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(x))
    packed = ir.ExternKernel.realize_input(packed)
    *rows, _ = x.get_size()
    layout = ir.FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=[*rows, packed.get_size()[0]])
    node = mkldnn_ir.LinearUnary(layout=layout, inputs=[x, packed], constant_args=[None, "none", [-1], ""])
    return ir.TensorBox.create(mkldnn_ir._create_output_node(node))


def _register_lowering() -> None:
    from torch._inductor.lowering import lowerings, register_lowering

    if torch.ops.treeflash.packed_linear.default not in lowerings:
        register_lowering(torch.ops.treeflash.packed_linear)(_lower_packed_linear)


def example_inputs(shape: tuple[int, int, int], weights: tuple[torch.Tensor, ...], dtype: torch.dtype,
                   sequences: int) -> tuple:
    """Inputs to trace the layer with: `sequences` sequences of 2 tokens after 4 cached positions, in a cache of 8.
    Inductor splits each loop nest among threads by these sizes: traced with 2 sequences, attention split over the
    batch alone and ran on one thread for one sequence (an AR step 5.5 % slower at 200 positions, 12 % at 800;
    4-row trees 10 % and 19 %); traced with 4 tokens, steps at 200 positions were 25 % slower (alternating A/B,
    one process, SmolLM2, 2 cores). Traced with one sequence, the code is wrong for several: `SEQUENCES`."""
    heads, kv_heads, hd = shape
    B, n, start, capacity = sequences, 2, 4, 8
    device = weights[0].device
    cols = torch.arange(start, start + n, device=device).expand(B, n).contiguous()
    mask = torch.ones(B, 1, heads // kv_heads * n, start + n, dtype=torch.bool, device=device)
    hidden = weights[0].shape[0]  # the input norm's weight
    return (torch.randn(B, n, hidden, dtype=dtype, device=device),
            torch.randn(B, 1, n, hd, dtype=dtype, device=device), torch.randn(B, 1, n, hd, dtype=dtype, device=device),
            torch.zeros(B, kv_heads, capacity, hd, dtype=dtype, device=device),
            torch.zeros(B, kv_heads, capacity, hd, dtype=dtype, device=device), cols, mask, *weights)


# the packages of a layer: traced with one sequence (for forwards of exactly one) and with two (for batches)
SEQUENCES = (1, 2)
# From this many rows of one sequence on, the 4-bit layer attends by SDPA's kernel (a package of its own): the two
# fused reductions read the cache once a row. SmolLM2's 30 layers on the 4-bit kernel, SDPA against the reductions
# (AMD EPYC, AVX512-BF16): 1 row 1.07-1.11x the time after 100-1,000 positions, 2 rows 0.99-1.04x, 3 rows
# 0.84-0.99x, 4 rows 0.85-0.98x, 6 rows 0.82-0.96x (the more positions, the less; docs/results/compiled-step)
SDPA_ROWS = 3


def compile_layer(shape: tuple[int, int, int], eps: float, dtype: torch.dtype, weights: tuple[torch.Tensor, ...],
                  sequences: int, dense: bool = False, sdpa: bool = False) -> Callable:
    """The compiled layer of a model with (heads, kv_heads, head_dim) = `shape`, RMSNorm epsilon `eps`, activations
    of `dtype` and layer tensors shaped as `weights` (one layer's `layer_weights(layer, dense)`), for forwards of one
    sequence (`sequences` 1) or of any number (2), attending by SDPA's kernel (`sdpa`) or not: loaded from the
    cache, or built first (`aoti.package`: one per model shape, form and machine). Called as `Layer.forward`."""
    key = (shape, eps, str(dtype), aoti.shapes(weights), sequences, dense, sdpa, Path(__file__).read_bytes())
    auto = torch.export.Dim.AUTO  # batch, rows, positions and capacity: symbolic
    dims = ({0: auto, 1: auto}, {0: auto, 2: auto}, {0: auto, 2: auto}, {0: auto, 2: auto}, {0: auto, 2: auto},
            {0: auto, 1: auto}, {0: auto, 2: auto, 3: auto}, None, None,
            (None,) * (len(weights) - 2))  # the two norms, then the products' tensors

    def export() -> torch.export.ExportedProgram:
        _register_lowering()  # only to build a package: importing inductor's lowerings takes 1-2 s of a start
        return aoti.export_sized(Layer(shape, eps, dense, sdpa), example_inputs(shape, weights, dtype, sequences),
                                 dims)
    # realize the rotated q|k once: below inductor's default threshold (4 reads) q's rotation was inlined into the
    # scores' reduction and computed again for every attended position (a 2-4 row layer 5-10 % slower at 256
    # positions, 10-15 % at 512)
    run = aoti.package("layer", key, export, inductor={"realize_reads_threshold": 3})

    def layer(*args: torch.Tensor) -> torch.Tensor:
        return run(*args)[0]
    return layer


class Head(torch.nn.Module):
    """The forward's end on a 4-bit LM head, as exported: head(x, norm, *parts) = fp32 logits of the final RMSNorm of
    x [B, n, H], the sum of the head's parts' products (`Int4Linear`'s, in the activations' dtype: Q8_0's two
    halves). Eager, the few ops around the head cost an AR step of SmolLM2 about 0.3 ms: they run right after the
    weights streamed through the caches, which hold none of their code and data then (docs/results/compiled-step)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x, norm, *parts):
        h = F.rms_norm(x, norm.shape, norm, self.eps)
        y = _product(h, *parts[:2])
        for i in range(2, len(parts), 2):
            y = y + _product(h, *parts[i:i + 2])
        return y.float()


def head_weights(head, norm) -> tuple[torch.Tensor, ...]:
    """The static decoder's final norm and LM head (a `_Projection`) as the compiled head takes them; ValueError
    where it has none (a dense head, a bias)."""
    if head.int4 is None or head.int4.bias is not None:
        raise ValueError("the compiled head runs 4-bit LM heads without biases")
    return (norm.weight.detach(), *(t for part in head.int4.parts for t in (part.packed, part.scale_zeros)))


def compile_head(eps: float, dtype: torch.dtype, weights: tuple[torch.Tensor, ...]) -> Callable:
    """The compiled head of a model with final-norm epsilon `eps`, activations of `dtype` and `weights` shaped as
    these (`head_weights`), loaded from the cache or built first; called as head(x) -> fp32 logits [B, n, V]."""
    key = (eps, str(dtype), aoti.shapes(weights), Path(__file__).read_bytes())
    x = torch.randn(2, 2, weights[0].shape[0], dtype=dtype, device=weights[0].device)
    auto = torch.export.Dim.AUTO

    def export() -> torch.export.ExportedProgram:
        return aoti.export_sized(Head(eps), (x, *weights), ({0: auto, 1: auto}, None, (None,) * (len(weights) - 1)))
    # round the parts' sum to the activations' dtype before widening it, as the eager head does
    run = aoti.package("head", key, export, inductor={"emulate_precision_casts": True})

    def head(x: torch.Tensor) -> torch.Tensor:
        return run(x.contiguous(), *weights)[0]
    return head


class Prologue(torch.nn.Module):
    """`static_decoder.prologue` as exported: prologue(ids, positions, first, cos, sin, embed). Eager, its few small
    ops cost an AR step of SmolLM2 0.13 ms more, for the same reason as the head's."""

    def forward(self, ids, positions, first, cos, sin, embed):
        return prologue(ids, positions, first, cos, sin, embed)


def compile_prologue(embed: torch.Tensor, cos: torch.Tensor) -> Callable:
    """The compiled prologue of a model with embeddings `embed` and RoPE tables shaped as `cos` (any length), loaded
    from the cache or built first; called as prologue(ids, positions, first, cos, sin) -> (x, cos, sin, cols)."""
    key = (aoti.shapes((embed,)), cos.shape[1], str(cos.dtype), Path(__file__).read_bytes())
    # distinct tensors: export takes one tensor passed twice for one input
    ids, positions = (torch.zeros(2, 2, dtype=torch.long, device=embed.device) for _ in range(2))
    first = torch.zeros(2, dtype=torch.long, device=embed.device)
    auto = torch.export.Dim.AUTO

    def export() -> torch.export.ExportedProgram:
        return aoti.export_sized(Prologue(), (ids, positions, first, cos, cos.clone(), embed),
                                 ({0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto}, {0: auto}, {0: auto}, None))
    run = aoti.package("prologue", key, export)

    def compiled(ids, positions, first, cos, sin) -> tuple[torch.Tensor, ...]:
        return tuple(run(ids, positions, first, cos, sin, embed))
    return compiled
