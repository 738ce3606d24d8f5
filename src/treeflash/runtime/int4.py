"""4-bit weights in groups along the input, multiplied by PyTorch's own CPU kernel (the one torchao's CPU int4
layout and inductor call): `aten._weight_int4pack_mm_for_cpu`.

A weight [N, K] is stored as q in 0..15 with a scale and a zero per row and group of `group` inputs:

    w[n, k] = (q[n, k] - 8) * scale[n, k // group] + zero[n, k // group]

GGUF's 4-bit formats (Q4_0, Q4_1, Q4_K) are exactly of this form (`runtime/gguf_int4.py`), and so is each half of
an 8-bit Q8_0 tensor split into its high and low nibbles: an `Int4Linear` sums the products of its parts.

The kernel computes every row of x on its own (its result for a row does not depend on how many rows come with it,
tested). It is fast with bf16 activations; with fp32 activations it is correct but slow (the tests' exact path on
tiny models). The static runtime runs products of many rows on a dense copy of the same weights instead
(`static_decoder.DENSE_ROWS`), which rounds otherwise: on bf16 a near-tie can flip there, as on the dense path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # GGUF's block of 4-bit and 8-bit formats
# from this many rows on, a rounded linear that keeps a dense copy of its weight (a drafter's: `quantise_linears`)
# multiplies by that copy: the kernel's compute grows with the rows (the DFlash drafter's compiled catch-up of
# 1 / 16 / 31 positions: 0.06 / 0.24 / 0.45 ms 4-bit against 0.14 / 0.20 / 0.29 ms on bf16, AVX512-BF16)
KEPT_DENSE_ROWS = 16
BLOCK_ROWS = 64  # the packed layout's block of rows (a shorter last block is laid out otherwise): concatenation
#                  and row views are exact at multiples of it


def available(device: torch.device | str = "cpu") -> bool:
    """Whether this torch build has the CPU int4 kernel (the only one this module calls)."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def dequantise(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The reference: the dense fp32 weight [N, K] of q [N, K], scale and zero [N, K / group]."""
    return (q.float() - 8) * scale.float().repeat_interleave(group, 1) + zero.float().repeat_interleave(group, 1)


def quantise(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round a dense weight [N, K] to 4 bits per group (minimum and maximum of each group map to 0 and 15).
    Returns (q, scale, zero) for `Int4Weight.from_ints`: the weight changes, and the model with it."""
    w = weight.detach().float().reshape(weight.shape[0], -1, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).reshape(weight.shape)
    return q.to(torch.uint8), scale, low + 8 * scale


@dataclass
class Int4Weight:
    """One [N, K] weight in the kernel's layout: `packed` uint8 [N, K / 2] (rows in blocks of `BLOCK_ROWS`, so
    such blocks concatenate), `scale_zeros` [K / group, N, 2] in the activations' dtype."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    group: int = GROUP

    @classmethod
    def from_ints(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
                  group: int = GROUP) -> "Int4Weight":
        """q [N, K] in 0..15, scale and zero [N, K / group] (fp32); N a multiple of 16, K of `group`."""
        n, k = q.shape
        if n % 16 or k % group or scale.shape != (n, k // group) or zero.shape != scale.shape:
            raise ValueError(f"int4 weight [{n}, {k}] with scales {tuple(scale.shape)}: needs N % 16 == 0, "
                             f"K % {group} == 0 and one scale and zero per row and group")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scale_zeros = torch.stack([scale.float().T, zero.float().T], dim=-1).to(dtype).contiguous()
        return cls(packed, scale_zeros, group)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w.T -> [M, N] in x's dtype."""
        # the kernel refuses a strided x, e.g. HF's last positions of a batch (hidden_states[:, -1:])
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group, self.scale_zeros)

    def rows(self, start: int, stop: int) -> "Int4Weight":
        """Rows start..stop (start a multiple of BLOCK_ROWS, stop too or the end): a view of the packed values,
        a copy of their (small) scales."""
        if start % BLOCK_ROWS or (stop % BLOCK_ROWS and stop != self.shape[0]):
            raise ValueError(f"rows {start}..{stop} cut a packed block of {BLOCK_ROWS} rows")
        return Int4Weight(self.packed[start:stop], self.scale_zeros[:, start:stop].contiguous(), self.group)

    @staticmethod
    def cat(weights: list["Int4Weight"]) -> "Int4Weight":
        """The weights stacked along N (every N but the last a multiple of BLOCK_ROWS); one weight is itself, not a
        copy."""
        if len(weights) == 1:
            return weights[0]
        if len({(w.shape[1], w.group) for w in weights}) != 1:
            raise ValueError("int4 weights of different inputs or groups do not concatenate")
        if any(w.shape[0] % BLOCK_ROWS for w in weights[:-1]):
            raise ValueError(f"int4 weights concatenate at multiples of {BLOCK_ROWS} rows only")
        return Int4Weight(torch.cat([w.packed for w in weights]),
                          torch.cat([w.scale_zeros for w in weights], dim=1), weights[0].group)


class Int4Linear(nn.Module):
    """An nn.Linear on 4-bit weights: the sum of its parts' products (one part for 4-bit formats, two for Q8_0),
    plus the bias. `weight` (optional) is a dense copy kept for readers of rows, e.g. a tied LM head whose rows
    are the embedding table a drafter gathers from, or a drafter's rounded weight. With `dense_rows`, products of
    that many rows or more multiply by it instead (F.linear)."""

    def __init__(self, parts: list[Int4Weight], bias: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, source: str = "int4", dense_rows: int | None = None):
        super().__init__()
        self.parts, self.source = parts, source  # source: the format the weights came in (Q4_1, Q8_0, ...)
        self.out_features, self.in_features = parts[0].shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight = None if weight is None else nn.Parameter(weight.detach(), requires_grad=False)
        self.dense_rows = dense_rows

    @property
    def kernel_dtype(self) -> torch.dtype:
        """The dtype the kernel multiplies in (its scales'); other activations are cast to it and back."""
        return self.parts[0].scale_zeros.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_rows is not None and x.numel() >= self.dense_rows * self.in_features:
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        flat = x.reshape(-1, x.shape[-1]).to(self.kernel_dtype)
        y = self.parts[0].matmul(flat).to(x.dtype)
        for part in self.parts[1:]:  # Q8_0's halves: summed in the activations' dtype
            y = y + part.matmul(flat).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight [N, K] these parts multiply by, in fp32 (through the kernel itself: x = identity)."""
        eye = torch.eye(self.in_features, dtype=self.parts[0].scale_zeros.dtype)
        return sum(part.matmul(eye) for part in self.parts).float().T.contiguous()

    @staticmethod
    def fuse(linears: list["Int4Linear"]) -> "Int4Linear | None":
        """One module for several on the same input (outputs concatenated), or None where they do not fuse
        (different numbers of parts, or rows that are not whole packed blocks); the given modules are re-pointed
        to row views of it, so the 4-bit values are held once."""
        if len(linears) == 1:
            return linears[0]
        if len({len(m.parts) for m in linears}) != 1 or any(m.out_features % BLOCK_ROWS for m in linears[:-1]):
            return None
        parts = [Int4Weight.cat([m.parts[i] for m in linears]) for i in range(len(linears[0].parts))]
        biases = [m.bias for m in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        fused = Int4Linear(parts, bias, source="+".join(sorted({m.source for m in linears})))
        row = 0
        for m in linears:
            m.parts = [p.rows(row, row + m.out_features) for p in parts]
            row += m.out_features
        return fused

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, source={self.source}"


def quantise_linears(module: nn.Module, dtype: torch.dtype, group: int = GROUP,
                     skip: tuple[nn.Module, ...] = (), keep_weight: bool = False) -> int:
    """Round every nn.Linear inside `module` but those in `skip` to 4 bits per group (`quantise`), in place, for
    products in `dtype`. With `keep_weight`, each keeps its rounded weight as a dense copy (`Int4Linear.weight`)
    for readers of its dtype, device or rows, and multiplies products of KEPT_DENSE_ROWS rows or more by it. The
    module changes: the model that runs is the rounded one. Linears whose shape the kernel cannot take stay dense.
    Returns the number swapped."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            n, k = getattr(child, "out_features", 0), getattr(child, "in_features", 0)
            if type(child) is not nn.Linear or any(child is m for m in skip) or n % 16 or k % group:
                continue
            q, scale, zero = quantise(child.weight, group)
            rounded = dequantise(q, scale, zero, group).to(child.weight) if keep_weight else None
            setattr(parent, name, Int4Linear([Int4Weight.from_ints(q, scale, zero, dtype, group)], child.bias,
                                             weight=rounded, source=f"int4 g{group}",
                                             dense_rows=KEPT_DENSE_ROWS if keep_weight else None))
            swapped += 1
    return swapped


def quantise_model(model: nn.Module, dtype: torch.dtype, group: int = GROUP) -> int:
    """Round every nn.Linear of a Hugging Face model but its LM head to 4 bits (`quantise_linears`): what
    `--quantize int4` does to a dense target (the model changes; speculation stays exact with respect to the one
    that runs). Returns the number swapped. (torchao 0.18 has no CPU int4 layout left; its older one called this
    same kernel.)"""
    return quantise_linears(model, dtype, group, skip=(model.get_output_embeddings(),))
