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

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf.quants import Q4_K
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from . import int4
from .int4 import GROUP, Int4Linear, Int4Weight

log = logging.getLogger(__name__)

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


def install(model: nn.Module, gguf: Path | str, dtype: torch.dtype, cache: Path | None = None) -> GGUFWeights:
    """Swap every nn.Linear of `model` (loaded from this GGUF's dequantised copy) whose tensor is in an exact
    format for an Int4Linear of the file's own blocks, its products in `dtype`; a tied LM head too (it keeps the
    embedding table as its `weight` for row readers). In place; returns what was kept and what stayed dense.

    `cache`: a file of the 4-bit weights this makes, read instead of the GGUF where it is valid, else written (the
    kernel's packed layout may change with torch: the caller names the file by its version; `cache_format`).
    Parsing the GGUF and mapping its tensor names onto the model's took 9-10 of a 22 s start of `treeflash
    generate` on 2 cores; the cache loads in a fraction of a second."""
    found = read_cache(cache, model, dtype) if cache is not None and Path(cache).exists() else None
    linears, report = found or read_gguf(model, gguf, dtype)
    if cache is not None and found is None:
        write_cache(cache, linears, report)
    modules = dict(model.named_modules())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    for name, (kind, parts) in linears.items():
        owner = modules[name]
        if owner is embed:  # a tied LM head: the embedding's tensor
            model.set_output_embeddings(Int4Linear(parts, head.bias, embed.weight, source=kind))
        else:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, Int4Linear(parts, owner.bias, source=kind))
    return report


Linears = dict[str, tuple[str, list[Int4Weight]]]  # module name -> (GGUF format, the 4-bit parts of its weight)


def read_gguf(model: nn.Module, gguf: Path | str, dtype: torch.dtype) -> tuple[Linears, GGUFWeights]:
    """The 4-bit parts of every product of `model` whose GGUF tensor is in an exact format, by module name (a
    tied LM head under the embedding's name), and the report of what was kept and what stays dense."""
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
    linears: Linears = {}
    for tensor in reader.tensors:
        hf = names.get(tensor.name, "")
        owner = modules.get(hf.removesuffix(".weight"))
        kind = tensor.tensor_type
        if not hf.endswith(".weight") or not (isinstance(owner, nn.Linear) or (tied and owner is embed)):
            continue  # norms, biases, an untied embedding: not products
        if kind not in EXACT or tensor.data.shape[0] % 16:
            report.dense[kind.name] += 1
            continue
        rows = _row_order(processor, tensor.name, tensor.data.shape[0])
        linears[hf.removesuffix(".weight")] = (kind.name, int4_linear(tensor.data, kind, dtype, rows).parts)
        report.quantised[kind.name] += 1
        report.int4_bytes += tensor.data.nbytes
    return linears, report


def cache_format() -> str:
    """What a cache file was made by: this module's source and int4.py's (which packs the blocks), hashed. A file
    made by other code is made again, as a compiled package is (`aoti.py`)."""
    sources = Path(__file__).read_bytes() + Path(int4.__file__).read_bytes()
    return hashlib.sha256(sources).hexdigest()[:16]


def write_cache(path: Path | str, linears: Linears, report: GGUFWeights) -> None:
    """Save `read_gguf`'s result as safetensors (each part's packed values and scales, the formats and the
    report in the metadata), atomically: a half-written file is never read."""
    tensors, layout = {}, {}
    for name, (kind, parts) in linears.items():
        layout[name] = [kind, len(parts), parts[0].group]
        for i, part in enumerate(parts):
            tensors[f"{name}/{i}/packed"], tensors[f"{name}/{i}/scale_zeros"] = part.packed, part.scale_zeros
    meta = {"format": cache_format(), "linears": json.dumps(layout), "kernel_dtype": report.kernel_dtype,
            "report": json.dumps({"quantised": report.quantised, "dense": report.dense,
                                  "int4_bytes": report.int4_bytes})}
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except OSError as err:  # a read-only cache costs the next start its time, nothing else
        log.warning("cannot cache the 4-bit weights at %s: %s", path, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def read_cache(path: Path | str, model: nn.Module, dtype: torch.dtype) -> tuple[Linears, GGUFWeights] | None:
    """`write_cache`'s file, or None where it does not fit this model and dtype (or cannot be read): then the
    GGUF is read again."""
    try:
        with safe_open(str(path), "pt") as f:  # the metadata first: a file that does not fit is not loaded
            meta = f.metadata() or {}
            if meta.get("format") != cache_format() or meta.get("kernel_dtype") != str(dtype).removeprefix("torch."):
                return None
            modules = dict(model.named_modules())
            linears = {}
            for name, (kind, count, group) in json.loads(meta["linears"]).items():
                if name not in modules:
                    return None
                linears[name] = (kind, [Int4Weight(f.get_tensor(f"{name}/{i}/packed"),
                                                   f.get_tensor(f"{name}/{i}/scale_zeros"), group)
                                        for i in range(count)])
        counts = json.loads(meta["report"])
    except (OSError, KeyError, ValueError, SafetensorError) as err:
        log.warning("ignoring the cached 4-bit weights at %s (%s): reading the GGUF again", path, err)
        return None
    return linears, GGUFWeights(Counter(counts["quantised"]), Counter(counts["dense"]), counts["int4_bytes"],
                                meta["kernel_dtype"])
