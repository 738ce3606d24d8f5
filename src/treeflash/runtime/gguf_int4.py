"""A GGUF file's own quantised tensors, kept quantised: its 4-bit and 8-bit blocks in `Int4Linear`'s form.

Formats that map exactly onto (q - 8) * scale + zero with a scale and zero per 32 inputs (`runtime/int4.py`):

| GGUF | block | as int4 |
|---|---|---|
| Q4_0 | w = d (q - 8) | scale d, zero 0 |
| Q4_1 | w = d q + m | scale d, zero m + 8 d |
| Q4_K | 256 values, 8 sub-blocks: w = d sc_j q - dmin m_j | scale d sc_j, zero 8 d sc_j - dmin m_j |
| Q8_0 | w = d q, q int8 | two parts: q = 16 hi + lo; hi + 8 with scale 16 d, lo with scale d and zero 8 d |

Every other format (F16, BF16, Q5_*, Q6_K, Q2_K, Q3_K, IQ*) stays dense: transformers' dequantised copy, which
`Target.load` has already loaded. Scales are fp16 in the file and fp32 here; the kernel takes them in the
activations' dtype (bf16 rounds them to 8 significant bits: within the named tolerance of the tests).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf.quants import Q4_K
from torch import nn

from .int4 import GROUP, Int4Linear, Int4Weight

EXACT = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block, as fp32 [blocks, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] values: the low nibbles are values 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def int4_parts(data: np.ndarray, kind: Q) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A quantised tensor's bytes [N, row bytes] as (q [N, K] uint8 in 0..15, scale, zero [N, K / 32] fp32)
    parts whose dequantised weights sum to the tensor's. Raises KeyError for formats that do not map exactly."""
    n = data.shape[0]
    if kind == Q.Q4_K:  # 144-byte super-blocks of 256 values in 8 groups of 32
        b = data.reshape(-1, 144)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())  # the 6-bit scales and mins, unpacked by gguf-py itself
        scale = _f16(b, 0) * sc.astype(np.float32)
        zero = 8 * scale - _f16(b, 2) * mn.astype(np.float32)
        qs = b[:, 16:].reshape(-1, 4, 1, 32)  # group 2c: low nibbles of bytes 32c.., group 2c + 1: their high ones
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        return [(q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1))]
    if kind == Q.Q4_0:
        b = data.reshape(-1, 18)
        d = _f16(b, 0)
        return [(_nibbles(b[:, 2:]).reshape(n, -1), d.reshape(n, -1), np.zeros_like(d).reshape(n, -1))]
    if kind == Q.Q4_1:
        b = data.reshape(-1, 20)
        d, m = _f16(b, 0), _f16(b, 2)
        return [(_nibbles(b[:, 4:]).reshape(n, -1), d.reshape(n, -1), (m + 8 * d).reshape(n, -1))]
    if kind == Q.Q8_0:
        b = data.reshape(-1, 34)
        d, q = _f16(b, 0), b[:, 2:].view(np.int8).astype(np.int16)
        hi, lo = (q >> 4) + 8, q & 0x0F  # q = 16 (hi - 8) + lo, hi - 8 in -8..7
        return [(hi.astype(np.uint8).reshape(n, -1), (16 * d).reshape(n, -1), np.zeros_like(d).reshape(n, -1)),
                (lo.astype(np.uint8).reshape(n, -1), d.reshape(n, -1), (8 * d).reshape(n, -1))]
    raise KeyError(kind.name)


def int4_linear(data: np.ndarray, kind: Q, dtype: torch.dtype, rows: np.ndarray | None = None,
                bias: torch.Tensor | None = None, weight: torch.Tensor | None = None) -> Int4Linear:
    """An Int4Linear of a GGUF tensor's bytes; `rows`: the order transformers puts the rows in (Llama's q and k)."""
    parts = []
    for q, scale, zero in int4_parts(data, kind):
        if rows is not None:
            q, scale, zero = q[rows], scale[rows], zero[rows]
        parts.append(Int4Weight.from_ints(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(scale),
                                          torch.from_numpy(zero), dtype, GROUP))
    return Int4Linear(parts, bias, weight, source=kind.name)


@dataclass
class GGUFWeights:
    """What `install` did: tensors kept quantised and those left dense, by GGUF format."""

    quantised: Counter = field(default_factory=Counter)
    dense: Counter = field(default_factory=Counter)
    int4_bytes: int = 0
    kernel_dtype: str = "bfloat16"  # what the 4-bit products multiply in (the activations may be fp32 around them)

    def __str__(self) -> str:
        kept = ", ".join(f"{n} {k}" for k, n in sorted(self.quantised.items())) or "none"
        dense = ", ".join(f"{n} {k}" for k, n in sorted(self.dense.items())) or "none"
        return f"int4 kernels ({self.kernel_dtype}) for {kept} ({self.int4_bytes / 2**20:.1f} MiB); dense: {dense}"

    def as_dict(self) -> dict:
        return {"quantised": dict(self.quantised), "dense": dict(self.dense), "int4_mib": self.int4_bytes / 2**20,
                "kernel_dtype": self.kernel_dtype}


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The permutation transformers' tensor processor applies to this tensor's rows (None: none), found by passing
    row numbers through it. Raises ValueError where it does more than reorder rows."""
    rows = np.arange(n, dtype=np.float64)[:, None]
    out = np.asarray(processor.process(weights=rows, name=name).weights)
    order = out.reshape(-1).astype(np.int64)
    if out.shape != rows.shape or not np.array_equal(np.sort(order), np.arange(n)):
        raise ValueError(f"{name}: transformers transforms this tensor beyond a row order")
    return None if np.array_equal(order, np.arange(n)) else order


def install(model: nn.Module, gguf: Path | str, dtype: torch.dtype) -> GGUFWeights:
    """Swap every nn.Linear of `model` (loaded from this GGUF's dequantised copy) whose tensor is in an exact
    format for an Int4Linear of the file's own blocks, its products in `dtype`; a tied LM head too (it keeps the
    embedding table as its `weight` for row readers). In place; returns what was kept and what stayed dense."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, read_field)

    reader = GGUFReader(str(gguf))
    arch = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)  # GGUF tensor name -> HF parameter name
    modules = dict(model.named_modules())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    report = GGUFWeights(kernel_dtype=str(dtype).removeprefix("torch."))
    for tensor in reader.tensors:
        hf = names.get(tensor.name, "")
        owner = modules.get(hf.removesuffix(".weight"))
        kind = tensor.tensor_type
        is_head = tied and owner is embed
        if not hf.endswith(".weight") or not (isinstance(owner, nn.Linear) or is_head):
            continue  # norms, biases, an untied embedding: not products
        if kind not in EXACT or tensor.data.shape[0] % 16:
            report.dense[kind.name] += 1
            continue
        rows = _row_order(processor, tensor.name, tensor.data.shape[0])
        if is_head:
            model.set_output_embeddings(int4_linear(tensor.data, kind, dtype, rows, head.bias, weight=embed.weight))
        else:
            parent, _, child = hf.removesuffix(".weight").rpartition(".")
            setattr(modules[parent], child, int4_linear(tensor.data, kind, dtype, rows, owner.bias))
        report.quantised[kind.name] += 1
        report.int4_bytes += tensor.data.nbytes
    return report
