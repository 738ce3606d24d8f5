"""The target's fast path: a gpt-fast-style decoder over a preallocated KV cache, for attention-only Llama-family
models (Llama, Qwen2, Qwen3). The HF model stays the reference (`Target(runtime="hf")`) and for every other
architecture, hybrids included; tests hold this path to it.

What makes it lean, each against what the generic HF path does:
- one K/V tensor per kind for all layers, [layers, kv_heads, capacity, head_dim], preallocated: a forward writes
  its tokens in place and commit is ONE gather into place for all layers (no per-layer cat or slice);
- q|k|v and gate|up are one matrix each (one GEMM instead of three / two). The HF modules are re-pointed to
  views of the fused matrices, so nothing is stored twice and the reference path keeps working;
- attention is SDPA with an explicit boolean mask (none for one token); grouped-query attention folds the query
  heads of a group into the query axis instead of repeating K/V;
- only the tapped layers' outputs are kept, and the LM head runs only at the positions asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

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


class _Projection:
    """One or several nn.Linear on the same input as ONE matrix product; the HF modules are re-pointed to views
    of the fused weight, so nothing is stored twice. On the CPU in fp32 the weight is stored transposed
    ([in, out]): MKL's skinny fp32 GEMMs ran 1.1-1.5x faster that way (1-17 rows); bf16 is faster as [out, in]."""

    def __init__(self, linears: list[torch.nn.Linear]):
        weight = torch.cat([m.weight.detach() for m in linears])  # [out, in]
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        self.transposed = weight.dtype == torch.float32 and weight.device.type == "cpu"
        if self.transposed:
            self.weight = weight.t().contiguous()
            weight = self.weight.t()
        else:
            self.weight = weight
        self.bias, row = bias, 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class _Layer:
    def __init__(self, hf_layer):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.qkv, self.o = _Projection([attn.q_proj, attn.k_proj, attn.v_proj]), _Projection([attn.o_proj])
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.gate_up, self.down = _Projection([mlp.gate_proj, mlp.up_proj]), _Projection([mlp.down_proj])
        self.in_norm, self.post_norm = hf_layer.input_layernorm, hf_layer.post_attention_layernorm


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention: x [heads, n, head_dim], cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class StaticDecoder:
    """The HF model's weights behind a lean forward over one sequence's preallocated KV cache.

    `forward` writes the K/V of its n tokens at [start, start + n); what the caller keeps is its business
    (`gather` moves kept entries into place; anything past the caller's length is simply overwritten later).
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
        self.embed, self.final_norm, self.lm_head = inner.embed_tokens, inner.norm, model.lm_head
        self.act = ACT2FN[c.hidden_act]
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.dtype, self.device = model.dtype, model.device
        with torch.no_grad():  # the RoPE table of every position, from the model's own rotary module
            positions = torch.arange(self.max_positions, device=self.device)[None]
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(dummy, positions)
        self.cos, self.sin = cos[0], sin[0]  # [positions, head_dim], in the model's dtype (as HF applies them)
        self.k_cache = self.v_cache = torch.empty(0)
        self._allocate(min(capacity, self.max_positions), keep=0)

    @property
    def capacity(self) -> int:
        return self.k_cache.shape[2]

    def _allocate(self, capacity: int, keep: int) -> None:
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if keep:
            k[:, :, :keep] = self.k_cache[:, :, :keep]
            v[:, :, :keep] = self.v_cache[:, :, :keep]
        self.k_cache, self.v_cache = k, v

    def reserve(self, length: int, keep: int) -> None:
        """Room for `length` positions (keeping the first `keep`): the cache doubles when it must grow."""
        if length > self.capacity:
            self._allocate(min(max(length, 2 * self.capacity), self.max_positions), keep)

    @torch.inference_mode()
    def gather(self, start: int, index: torch.Tensor) -> None:
        """Move the K/V at positions `index` to start, start + 1, ...: one copy for all layers."""
        k = len(index)
        self.k_cache[:, :, start:start + k] = self.k_cache[:, :, index]
        self.v_cache[:, :, start:start + k] = self.v_cache[:, :, index]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, allowed: torch.Tensor | None,
                taps: tuple[int, ...] = (), logits_at: slice | torch.Tensor = slice(None)):
        """ids, positions [n]; the tokens attend to the cache [0, start) and, among themselves, where
        `allowed` [n, n] (bool; None: causal). Returns (logits [k, V] at `logits_at`, taps [n, len(taps), H] or
        None): the taps are the outputs of those decoder layers (HF's hidden_states[i + 1]; -1: the embeddings)."""
        n, end = len(ids), start + len(ids)
        self.reserve(end, keep=start)
        g = self.heads // self.kv_heads
        hd, qd, kvd = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        mask = None
        if n > 1:  # the cache is visible to all; within the block, causal or the tree's ancestors
            inner = allowed if allowed is not None else torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=ids.device), inner], dim=1)
            mask = mask.repeat(g, 1)  # query rows are (group member, token)
        x = self.embed(ids)
        kept = {-1: x} if -1 in taps else {}  # layer -1: the embeddings (HF's hidden_states[0])
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.in_norm)
            qkv = layer.qkv(h)
            q = qkv[:, :qd].view(n, self.heads, hd)
            k = qkv[:, qd:qd + kvd].view(n, self.kv_heads, hd)
            v = qkv[:, qd + kvd:].view(n, self.kv_heads, hd)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = _rotate(q.transpose(0, 1), cos, sin), _rotate(k.transpose(0, 1), cos, sin)
            self.k_cache[i, :, start:end] = k
            self.v_cache[i, :, start:end] = v.transpose(0, 1)
            # grouped-query attention: the g query heads of a KV head become g x n query rows of that head
            q = q.reshape(self.kv_heads, g * n, hd)
            out = F.scaled_dot_product_attention(q[None], self.k_cache[i, :, :end][None],
                                                 self.v_cache[i, :, :end][None], attn_mask=mask)
            out = out[0].reshape(self.heads, n, hd).transpose(0, 1).reshape(n, qd)
            x = x + layer.o(out)
            h = _rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(self.act(gate) * up)
            if i in taps:  # as HF's hidden_states[i + 1], which for the last layer is after the final norm
                kept[i] = _rms_norm(x, self.final_norm) if i == len(self.layers) - 1 else x
        if len(kept) != len(set(taps)):
            raise IndexError(f"taps {taps} name layers the model does not have (-1..{len(self.layers) - 1})")
        hidden = torch.stack([kept[i] for i in taps], dim=1) if taps else None
        logits = self.lm_head(_rms_norm(x[logits_at], self.final_norm))
        return logits, hidden
