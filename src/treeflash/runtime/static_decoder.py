"""The target's fast path: a gpt-fast-style decoder over a preallocated KV cache, for attention-only Llama-family
models (Llama, Qwen2, Qwen3). The HF model stays the reference (`Target(runtime="hf")`) and for every other
architecture, hybrids included; tests hold this path to it.

What makes it lean, each against what the generic HF path does:
- one K/V tensor per kind for all layers, [layers, slots, kv_heads, capacity, head_dim], preallocated: a forward
  writes its tokens in place and commit is ONE gather into place for all layers (no per-layer cat or slice); a
  batch of sequences is one forward over several slots, each with its own length;
- q|k|v and gate|up are one matrix each (one GEMM instead of three / two). The HF modules are re-pointed to
  views of the fused matrices and the reference path keeps working; on the CPU every dense product (LM head
  included) runs on a oneDNN-prepacked copy of its weight, which costs a second copy of the weights in memory, and
  a GGUF's 4-bit tensors (`Int4Linear`) fuse and run on PyTorch's int4 kernel (held once by the fused module and
  the HF modules), with a packed dense copy for products of DENSE_ROWS rows or more (by dtype);
- q and k are rotated together (one RoPE over their heads);
- attention is SDPA with an explicit boolean mask (none for one token, and SDPA's causal kernel for a prompt from
  position 0); grouped-query attention folds the query heads of a group into the query axis instead of repeating
  K/V;
- only the tapped layers' outputs are kept, and the LM head runs only at the positions asked for;
- on request (`compile`), forwards of up to DENSE_COMPILED_ROWS rows run each layer compiled ahead of time
  (`compiled_layer.py`: on the int4 kernel for a few rows, on the dense copies from the rows where those are
  faster on this machine), with `decoder_layer` as the eager reference; on CUDA, verification forwards run as CUDA
  graphs in fixed shapes (`graphed.py`: token buckets, attention over the cache's capacity under a mask built on
  the device).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import crossover
from .graphed import CaptureError, FixedShapeForward, bucket
from .int4 import Int4Linear
from .packed import linear, pack, packed_linear
from .transfer import upload

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """Why this HF model cannot take the fast path, or None when it can."""
    c = model.config
    if c.model_type not in SUPPORTED:
        return f"architecture {c.model_type!r} (fast path: {', '.join(SUPPORTED)})"
    if getattr(c, "use_sliding_window", False):
        return "sliding-window attention"
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in ("default", "linear", "llama3"):  # position-independent tables only (no dynamic scaling)
        return f"rope type {rope!r}"
    if getattr(c, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    return None


# From this many rows on, a 4-bit product runs on a dense packed copy of its weights instead: the int4 kernel is
# bound by its dequantisation above 4 rows (SmolLM2's gate|up at 1 / 4 / 6 / 17 rows: 28 / 46 / 89 / 223 us against
# 39 / 39 / 42 / 84 us dense bf16, AVX512-BF16), so prefills and large trees pay for a second layout in memory.
# Where bf16 is not native the copy is fp32 (the activations' dtype there) and pays from more rows on: all of
# SmolLM2's products at 1 / 4 / 17 rows, int4 kernel 19 / 35 / 110 ms, packed fp32 43 / 67 / 88 ms (AVX2)
DENSE_ROWS = {torch.bfloat16: 6, torch.float32: 12}
# The compiled layer keeps the 4-bit kernel one row further: its products at 6 rows cost more than the dense
# copy's, but the dense path is eager and reads 4x the bytes, so a whole 6-row SmolLM2 verify is as cheap or cheaper
# compiled (10.1 / 13.4 / 18.2 ms against 13.1 / 15.4 / 18.0 ms at 200 / 600 / 1200 positions). Beyond, the compiled
# attention's cost grows faster with rows x positions: 12 rows cost 15.6 / 21.7 / 30.7 ms compiled against 15.3 /
# 20.0 / 25.9 (AVX512-BF16, docs/results/rest). Its LM head (not in the layer) takes the dense copy from DENSE_ROWS.
COMPILED_ROWS = 6
# The compiled layer on the dense copies takes forwards from the rows where those are faster (`compiled` measures
# it: 5 on an Intel Xeon with AMX) up to this many (trees, batches, short prompts). A whole SmolLM2 verify of 8 / 17
# / 32 rows after 200 positions: 11.9 / 14.8 / 17.8 ms compiled, 17.3 / 22.6 / 25.6 eager; after 1,200: 17.1 / 20.8
# / 27.0 against 22.4 / 28.2 / 34.0 (docs/results/cpu-amx)
DENSE_COMPILED_ROWS = 32


class _Projection:
    """One or several nn.Linear on the same input as ONE matrix product; the HF modules are re-pointed to views
    of the fused weight. On the CPU the product runs on a copy of the weight prepacked for oneDNN (`packed`).
    4-bit linears (`Int4Linear`, a GGUF's own blocks) fuse into one 4-bit product where their rows are whole
    packed blocks, with a dense packed copy of the same weights for products of DENSE_ROWS rows or more (where
    `pack` has a layout: bf16 on CPUs that multiply it natively, fp32); a group that mixes 4-bit and dense linears
    (Q4_K_M files keep some tensors in Q6_K), or does not fuse, runs them one by one and concatenates."""

    def __init__(self, linears: list[torch.nn.Module], dtype: torch.dtype):
        self.parts: list = []  # the group's modules when they do not fuse
        self.int4 = None
        self.packed = None
        if any(isinstance(m, Int4Linear) for m in linears):
            if all(isinstance(m, Int4Linear) for m in linears):
                self.int4 = Int4Linear.fuse(linears)
            if self.int4 is None:
                self.parts = linears
            else:  # the second layout, for products of many rows: the kernel's own weights, packed (alone), in
                # the activations' dtype (bf16, or fp32 where the kernel multiplies bf16 inputs of fp32 activations)
                self.packed = pack(self.int4.dense_weight().to(dtype))
                self.dense_rows = DENSE_ROWS.get(dtype, 0)
                self.bias = self.int4.bias
            return
        has_bias = linears[0].bias is not None
        if len(linears) == 1:  # as it is: a tied LM head stays tied to the embeddings
            self.weight = linears[0].weight.detach()
            self.bias = linears[0].bias.detach() if has_bias else None
        else:
            self.weight = torch.cat([m.weight.detach() for m in linears])  # [out, in]
            self.bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
            row = 0
            for m in linears:
                n = m.weight.shape[0]
                m.weight = torch.nn.Parameter(self.weight[row:row + n], requires_grad=False)
                if has_bias:
                    m.bias = torch.nn.Parameter(self.bias[row:row + n], requires_grad=False)
                row += n
        self.packed = pack(self.weight)

    def on_int4(self, x: torch.Tensor) -> bool:
        """Whether the product of x runs on the 4-bit kernel (else on the packed dense copy, or dense)."""
        return self.int4 is not None and (self.packed is None or x.numel() < self.dense_rows * x.shape[-1]
                                          or x.dtype != self.packed.dtype or torch.is_grad_enabled())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None:
            return self.int4(x) if self.on_int4(x) else packed_linear(x, self.packed, self.bias)
        if self.parts:
            return torch.cat([m(x) for m in self.parts], dim=-1)
        return linear(x, self.weight, self.packed, self.bias)


class _Layer:
    def __init__(self, hf_layer, dtype: torch.dtype, act):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.act = act
        self.qkv = _Projection([attn.q_proj, attn.k_proj, attn.v_proj], dtype)
        self.o = _Projection([attn.o_proj], dtype)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.gate_up = _Projection([mlp.gate_proj, mlp.up_proj], dtype)
        self.down = _Projection([mlp.down_proj], dtype)
        self.in_norm, self.post_norm = hf_layer.input_layernorm, hf_layer.post_attention_layernorm

    @property
    def projections(self) -> tuple[_Projection, ...]:
        """The layer's four products, in the order it runs them."""
        return self.qkv, self.o, self.gate_up, self.down


def prologue(ids: torch.Tensor, positions: torch.Tensor, first: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's inputs to its layers: the embeddings [B, n, H] of ids [B, n] in the table `embed`; RoPE's cos /
    sin [B, 1, n, head_dim] at `positions` [B, n] from the tables `cos` / `sin`; where the tokens go in the cache,
    [B, n] columns from each sequence's `first` [B] on (`compiled_layer.Prologue` compiles it)."""
    cols = first[:, None] + torch.arange(ids.shape[1], device=ids.device)
    return F.embedding(ids, embed), cos[positions][:, None], sin[positions][:, None], cols


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention: x [..., heads, n, head_dim], cos/sin broadcasting to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def decoder_layer(layer: _Layer, shape: tuple[int, int, int], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, end: int, at: int | None, cols: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer over x [B, n, H]: writes the tokens' K/V into k_cache / v_cache [B, kv_heads, capacity,
    head_dim] (the batch's slots of one layer) at positions `at`.. (every sequence at one start) or at `cols`
    [B, n], attends to [0, end) under `mask` [B, 1, g * n, end] (None: all of it for one token; causal for a prompt
    of n tokens from position 0, end == n), and returns the layer's output.
    The reference of the compiled layer (`compiled_layer.py`)."""
    heads, kv_heads, hd = shape
    B, n, _ = x.shape
    qd, kvd = heads * hd, kv_heads * hd
    h = _rms_norm(x, layer.in_norm)
    qkv = layer.qkv(h)
    qk = qkv[..., :qd + kvd].view(B, n, heads + kv_heads, hd)
    v = qkv[..., qd + kvd:].view(B, n, kv_heads, hd)
    if layer.q_norm is not None:
        qk = torch.cat([layer.q_norm(qk[:, :, :heads]), layer.k_norm(qk[:, :, heads:])], dim=2)
    qk = _rotate(qk.transpose(1, 2), cos, sin)  # q and k heads in one rotation: half the small ops
    q, k = qk[:, :heads], qk[:, heads:]
    if at is not None:
        k_cache[:, :, at:at + n] = k
        v_cache[:, :, at:at + n] = v.transpose(1, 2)
    else:  # [B, n] (sequence, position) pairs
        index = (torch.arange(B, device=x.device)[:, None, None], torch.arange(kv_heads, device=x.device)[:, None],
                 cols[:, None])
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v.transpose(1, 2))
    if mask is None and n > 1:  # a prompt from position 0: SDPA's causal kernel skips the masked half and reads
        # no mask (a 1,500-token SmolLM2 layer 6.3 ms against 16.4 ms folded under a mask, bf16, AMX Xeon)
        if end != n:
            raise ValueError(f"a causal forward of {n} tokens must start at position 0 (it attends to {end})")
        out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], is_causal=True,
                                             enable_gqa=heads != kv_heads)
    else:  # grouped-query attention: the g query heads of a KV head become g x n query rows of that head
        q = q.reshape(B, kv_heads, heads // kv_heads * n, hd)
        out = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask)
    out = out.reshape(B, heads, n, hd).transpose(1, 2).reshape(B, n, qd)
    x = x + layer.o(out)
    h = _rms_norm(x, layer.post_norm)
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return x + layer.down(layer.act(gate) * up)


def attention_mask(first: torch.Tensor, cols: torch.Tensor, inner: torch.Tensor, width: int,
                   group: int) -> torch.Tensor:
    """Which of the cache's first `width` positions each query row sees, [B, 1, group * n, width]: a sequence's
    own cache before its first position `first` [B], and among its n tokens (written at `cols` [B, n]) those
    `inner` [B, n, n] allows. Query rows are (group member, token), as `decoder_layer` folds them."""
    B, n = cols.shape
    mask = torch.arange(width, device=cols.device) < first[:, None, None]
    mask = mask.expand(B, n, width).scatter(2, cols[:, None, :].expand(B, n, n), inner)
    return mask.repeat(1, group, 1)[:, None]


class KVCache:
    """Preallocated K/V of `slots` sequences for all layers: [layers, slots, kv_heads, capacity, head_dim] per kind.
    A forward writes its tokens in place; commit is ONE gather into place for all layers. It doubles when it must
    grow. A single-sequence target holds one slot; a batch one slot per sequence, the batch in slots 0..B-1."""

    def __init__(self, decoder: "StaticDecoder", slots: int, capacity: int):
        self.decoder, self.slots = decoder, slots
        self.k = self.v = torch.empty(0)
        self._allocate(min(capacity, decoder.max_positions), keep=0)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def _allocate(self, capacity: int, keep: int) -> None:
        d = self.decoder
        shape = (len(d.layers), self.slots, d.kv_heads, capacity, d.head_dim)
        k = torch.zeros(shape, dtype=d.dtype, device=d.device)
        v = torch.zeros(shape, dtype=d.dtype, device=d.device)
        if keep:
            k[..., :keep, :] = self.k[..., :keep, :]
            v[..., :keep, :] = self.v[..., :keep, :]
        self.k, self.v = k, v
        self.graphs: dict = {}  # the fixed-shape forwards over these tensors (graphed.py), by shape
        self._views: dict = {}  # each layer's K and V of some slots (`layer_views`), by slots

    def layer_views(self, slots: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V of the slots `slots`, made once per allocation: indexing 60 views anew cost a
        SmolLM2 step 0.09-0.16 ms, 1.5-2.5 % of it (AMX Xeon)."""
        key = (slots.start, slots.stop)
        if key not in self._views:
            self._views[key] = [(self.k[i, slots], self.v[i, slots]) for i in range(len(self.k))]
        return self._views[key]

    def reserve(self, length: int, keep: int) -> None:
        """Room for `length` positions (keeping the first `keep` of every slot)."""
        if length > self.capacity:
            self._allocate(min(max(length, 2 * self.capacity), self.decoder.max_positions), keep)

    @torch.inference_mode()
    def keep(self, slot: int, start: int, nodes: list[int]) -> None:
        """Keep the K/V of `nodes` (indices into the tree verified at `start` in `slot`, a root-to-node path): moved
        to start, start + 1, ..., one copy for all layers; nothing to move where they are there already."""
        k = len(nodes)
        if nodes == list(range(k)):
            return
        index = upload(torch.tensor(nodes), self.k.device) + start
        self.k[:, slot, :, start:start + k] = self.k[:, slot, :, index]
        self.v[:, slot, :, start:start + k] = self.v[:, slot, :, index]

    @torch.inference_mode()
    def move(self, source: int, dest: int, length: int) -> None:
        """Copy the first `length` positions of slot `source` into slot `dest` (a batch stays in slots 0..B-1)."""
        self.k[:, dest, :, :length] = self.k[:, source, :, :length]
        self.v[:, dest, :, :length] = self.v[:, source, :, :length]


class StaticDecoder:
    """The HF model's weights behind a lean forward over preallocated KV caches (`KVCache`).

    `forward` writes the K/V of its tokens at [start, start + n) of their slots; what the caller keeps is its
    business (`KVCache.gather` moves kept entries into place; anything past the caller's length is simply
    overwritten later). `self.cache` is the single-sequence cache; a batch brings its own (`new_cache`).
    """

    def __init__(self, model, capacity: int = 1024):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"no fast path for this model: {reason}")
        c = self.config = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.max_positions = int(c.max_position_embeddings)
        inner = model.model
        self.embed, self.final_norm = inner.embed_tokens, inner.norm
        self.lm_head = _Projection([model.lm_head], model.dtype)
        self.shape = (self.heads, self.kv_heads, self.head_dim)
        self.layers = [_Layer(layer, model.dtype, ACT2FN[c.hidden_act]) for layer in inner.layers]
        self.dtype, self.device = model.dtype, model.device
        self.rotary = inner.rotary_emb
        self.cos = self.sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self._rope_table(capacity)
        self.cache = self.new_cache(1, capacity)
        # compiled layers by sequences traced, on the 4-bit kernel up to int4_rows, then on the dense copies
        self.compiled_layers, self.compiled_weights, self.int4_rows, self.compiled_rows = {}, [], 0, 0
        self.sdpa_layer, self.sdpa_rows = None, 0  # the 4-bit layer of one sequence's trees from sdpa_rows rows
        self.compiled_head = None  # the final norm and a 4-bit LM head, for the rows it runs on the kernel
        self.compiled_prologue = None  # `prologue`, for the compiled layers' forwards
        self.dense_layer, self.dense_weights = None, []
        self.graphs: str | None = None  # "capture": verification forwards as CUDA graphs; "eager": same shapes

    def use_graphs(self, capture: bool = True) -> None:
        """Run verification forwards (all logits, up to 257 tokens a sequence) in fixed shapes (`graphed.py`),
        captured as CUDA graphs, or eagerly in the same shapes (`capture=False`: the CPU's check of the logic)."""
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graphs = "capture" if capture else "eager"

    def compile(self) -> None:
        """Run forwards of few rows through the compiled layer (`compiled_layer.py`) from now on, built here (or
        loaded from its cache): on the 4-bit kernel from one row, and on the packed dense copy (where the products
        have one) from the rows where it is faster on this machine up to DENSE_COMPILED_ROWS (prefills and larger
        forwards stay eager), one sequence's trees of SDPA_ROWS rows and more on the 4-bit layer that attends by
        SDPA's kernel; the LM head on its dense copy from the rows where that is faster, a 4-bit head compiled
        with the final norm below those; the prologue (`prologue`) compiled. Both crossovers are measured once per
        machine (`crossover.py`). Raises ValueError for a model whose layers have no compiled form, or whose
        activation is not SiLU."""
        # (compiled_layer imports this module)
        from .compiled_layer import (SDPA_ROWS, SEQUENCES, compile_head, compile_layer, compile_prologue,
                                     head_weights, layer_weights)

        if self.config.hidden_act != "silu":
            raise ValueError(f"the compiled layer has SiLU gates only, not {self.config.hidden_act}")
        weights = [layer_weights(layer) for layer in self.layers]
        eps = self.layers[0].in_norm.variance_epsilon
        self.compiled_layers = {b: compile_layer(self.shape, eps, self.dtype, weights[0], b) for b in SEQUENCES}
        self.sdpa_layer = compile_layer(self.shape, eps, self.dtype, weights[0], 1, sdpa=True)
        self.compiled_weights, self.int4_rows, self.sdpa_rows = weights, COMPILED_ROWS, SDPA_ROWS
        self.compiled_prologue = compile_prologue(self.embed.weight.detach(), self.cos)
        try:
            head = head_weights(self.lm_head, self.final_norm)
        except ValueError:  # a dense head: eager
            pass
        else:
            self.compiled_head = compile_head(self.final_norm.variance_epsilon, self.dtype, head)
        try:
            dense = [layer_weights(layer, dense=True) for layer in self.layers]
        except ValueError:  # no dense copies: the 4-bit kernel up to COMPILED_ROWS, eager beyond
            self.compiled_rows = COMPILED_ROWS
        else:
            # one package for any batch: its attention and products are extern kernels, which split their own
            # work among threads (traced with one sequence or two, 5-32 row verifies took the same time)
            self.dense_layer = compile_layer(self.shape, eps, self.dtype, dense[0], max(SEQUENCES), dense=True)
            self.dense_weights, self.compiled_rows = dense, DENSE_COMPILED_ROWS
            self.int4_rows = self._measure_layers() - 1
        self._measure_head()

    def _measure_layers(self) -> int:
        """From how many rows the layers' products are faster on their dense copies, up to COMPILED_ROWS + 1
        (`crossover.py`)."""
        projections = [p for layer in self.layers for p in layer.projections]

        def products(rows: int):
            inputs = [torch.randn(rows, p.int4.in_features, dtype=self.dtype) for p in projections]
            return (lambda: [p.int4(x) for p, x in zip(projections, inputs)],
                    lambda: [packed_linear(x, p.packed) for p, x in zip(projections, inputs)])
        key = ("layers", str(self.dtype), [p.int4.parts[0].shape for p in projections[:4]], len(self.layers))
        return crossover.dense_rows("layers", products, COMPILED_ROWS + 1, lambda: None, key)

    def _measure_head(self) -> None:
        """Take the 4-bit LM head's dense copy from the row count where it is faster on this machine
        (`crossover.py`; the fixed DENSE_ROWS rule stays the eager runtime's)."""
        head = self.lm_head
        if head.int4 is None or head.packed is None or not head.dense_rows:
            return
        products = [p.int4 for layer in self.layers for p in layer.projections if p.int4 is not None]
        inputs = [torch.randn(1, m.in_features, dtype=self.dtype) for m in products]

        def step_before_head():  # the layers' products of a decoding step stream through the caches first
            for m, x in zip(products, inputs):
                m(x)

        def runs(rows: int):
            x = torch.randn(rows, head.int4.in_features, dtype=self.dtype)
            return lambda: head.int4(x), lambda: packed_linear(x, head.packed, head.bias)
        key = ("lm_head", str(self.dtype), [p.shape for p in head.int4.parts], head.int4.source)
        head.dense_rows = crossover.dense_rows("lm_head", runs, head.dense_rows, step_before_head, key)

    @torch.no_grad()
    def _rope_table(self, length: int) -> None:
        """cos / sin [positions, head_dim] of positions 0..length-1 at least, from the model's own rotary module,
        in the model's dtype (as HF applies them); grown by doubling, never past the model's context."""
        if length <= len(self.cos):
            return
        length = min(max(length, 2 * len(self.cos)), self.max_positions)
        positions = torch.arange(length, device=self.device)[None]
        cos, sin = self.rotary(torch.zeros(1, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = cos[0], sin[0]

    def new_cache(self, slots: int, capacity: int = 1024) -> KVCache:
        return KVCache(self, slots, capacity)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, allowed: torch.Tensor | None,
                taps: tuple[int, ...] = (), logits_at: slice | torch.Tensor = slice(None)):
        """One sequence in the single-sequence cache: ids, positions [n]; the tokens attend to the cache
        [0, start) and, among themselves, where `allowed` [n, n] (bool; None: causal). Returns (logits [k, V] at
        `logits_at`, taps [n, len(taps), H] or None): the outputs of those decoder layers (HF's
        hidden_states[i + 1]; -1: the embeddings)."""
        logits, hidden = self.forward_batch(self.cache, 0, ids[None], positions[None], [start],
                                            None if allowed is None else allowed[None], taps, logits_at)
        return logits[0], None if hidden is None else hidden[0]

    def _fixed_shape(self, cache: KVCache, first_slot: int, ids, positions, starts, allowed, taps):
        """forward_batch through the fixed-shape forward of this shape (captured at its first use)."""
        B, n = ids.shape
        nb = bucket(n)
        cache.reserve(max(starts) + nb, keep=max(starts))  # the padding writes past the tree too
        self._rope_table(cache.capacity)
        key = (first_slot, B, nb, taps)
        if key not in cache.graphs:
            cache.graphs[key] = FixedShapeForward(self, cache, first_slot, B, nb, taps, self.graphs == "capture")
        try:
            return cache.graphs[key](ids, positions, starts, allowed)
        except CaptureError as err:
            log.warning("CUDA graphs: capture failed, verifying eager from now on: %s", err)
            self.graphs = None
            cache.graphs.clear()
            return self.forward_batch(cache, first_slot, ids, positions, starts, allowed, taps)

    @torch.inference_mode()
    def forward_batch(self, cache: KVCache, first_slot: int, ids: torch.Tensor, positions: torch.Tensor,
                      starts: list[int], allowed: torch.Tensor | None, taps: tuple[int, ...] = (),
                      logits_at: slice | torch.Tensor = slice(None)):
        """B sequences of n tokens each (shorter ones padded by the caller), in slots first_slot.. of `cache`:
        ids, positions [B, n]; sequence b attends to its cache [0, starts[b]) and, within its n tokens, where
        `allowed` [B, n, n] (None: causal). Returns logits [B, k, V] (fp32 from the compiled head, else in the
        model's dtype) and taps [B, n, len(taps), H] or None."""
        B, n = ids.shape
        if self.graphs and isinstance(logits_at, slice) and logits_at == slice(None) and bucket(n):
            return self._fixed_shape(cache, first_slot, ids, positions, starts, allowed, tuple(taps))
        end = max(starts) + n
        cache.reserve(end, keep=max(starts))
        g = self.heads // self.kv_heads
        self._rope_table(end)
        slots = slice(first_slot, first_slot + B)
        even = all(s == starts[0] for s in starts)  # one start: slices; else one indexed write per layer
        first = upload(torch.tensor(starts), ids.device)  # each sequence's first position
        # the compiled layer for the few rows of decoding and small trees; more rows, prefills too, stay eager
        compiled = B * n <= self.compiled_rows
        if compiled and self.compiled_prologue:
            x, cos, sin, cols = self.compiled_prologue(ids, positions, first, self.cos, self.sin)
        else:  # the embeddings, RoPE's cos / sin [B, 1, n, head_dim], and where each sequence's tokens go in its
            # cache: [B, n] positions (the compiled layer always writes by index)
            x, cos, sin, cols = prologue(ids, positions, first, self.cos, self.sin, self.embed.weight)
        mask = None  # (decoder_layer: one token sees all its cache; a prompt from position 0, causal)
        prompt = n > 1 and even and starts[0] == 0 and allowed is None and not compiled
        if n == 1 and even and compiled:  # (the compiled layer always takes a mask: its width is the attended length)
            mask = torch.ones(B, 1, g, end, dtype=torch.bool, device=ids.device)  # one token sees all its cache
        elif not prompt and (n > 1 or not even or compiled):  # each sequence sees its own cache; within the
            # block, causal or its tree's ancestors
            inner = allowed if allowed is not None else torch.ones(B, n, n, dtype=torch.bool,
                                                                   device=ids.device).tril()
            mask = attention_mask(first, cols, inner, end, g)
        x, hidden = self.layers_forward(x, cos, sin, cache, slots, end, starts[0] if even else None, cols, mask,
                                        taps, compiled=compiled)
        x = x[:, logits_at]
        if compiled and self.compiled_head and self.lm_head.on_int4(x):  # fp32 logits
            return self.compiled_head(x), hidden
        return self.lm_head(_rms_norm(x, self.final_norm)), hidden

    def layers_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, slots: slice,
                       end: int, at: int | None, cols: torch.Tensor, mask: torch.Tensor | None,
                       taps: tuple[int, ...], compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embeddings x [B, n, H] through every decoder layer (`decoder_layer`'s arguments; `compiled`: the
        compiled layers instead, the 4-bit kernel's up to int4_rows rows, the dense copies' beyond): the last
        layer's output [B, n, H] and the taps [B, n, len(taps), H] or None."""
        last = len(self.layers) - 1
        if not set(taps) <= set(range(-1, last + 1)):
            raise IndexError(f"taps {taps} name layers the model does not have (-1..{last})")
        kept = {-1: x} if -1 in taps else {}  # layer -1: the embeddings (HF's hidden_states[0])
        compiled_layer = weights = None
        (B, n), one = x.shape[:2], len(x) == 1
        if compiled and B * n > self.int4_rows:
            compiled_layer, weights = self.dense_layer, self.dense_weights
        elif compiled and one and n >= self.sdpa_rows:  # one sequence's tree: SDPA's kernel
            compiled_layer, weights = self.sdpa_layer, self.compiled_weights
        elif compiled:  # the 4-bit kernel's, traced for one sequence or for several
            compiled_layer, weights = self.compiled_layers[min(B, 2)], self.compiled_weights
        for i, (layer, (k, v)) in enumerate(zip(self.layers, cache.layer_views(slots))):
            if compiled_layer:
                x = compiled_layer(x, cos, sin, k, v, cols, mask, *weights[i])
            else:
                x = decoder_layer(layer, self.shape, x, cos, sin, k, v, end, at, cols, mask)
            if i in taps:  # as HF's hidden_states[i + 1], which for the last layer is after the final norm
                kept[i] = _rms_norm(x, self.final_norm) if i == last else x
        return x, torch.stack([kept[i] for i in taps], dim=2) if taps else None
