"""Linear products on weights prepacked for oneDNN, as inductor's freezing pass runs them on the CPU, without
compiling anything: faster than F.linear for the few rows of decoding, with equal results in bf16 and another
summation order in fp32 (docs/results/speed).

Inference only: the packed copy is made once and does not follow later changes to the weight, and it has no
gradient (with autograd on, the plain weight is used)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's layout, or None where that gains nothing: off the CPU, in dtypes other than
    fp32 and bf16, and for bf16 on CPUs without bf16 instructions (there it is emulated)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                         and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on `packed` (from `pack(weight)`) when there is one and no gradient is wanted."""
    if packed is None or x.dtype != weight.dtype or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias on `packed` alone (inference, x in the packed weight's dtype)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear's parameters (the same tensors: a state dict is unchanged) plus their packed copy."""

    def __init__(self, module: nn.Linear):
        super().__init__()
        self.weight, self.bias = module.weight, module.bias
        self.packed = pack(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias)


def pack_linears(module: nn.Module) -> nn.Module:
    """Swap every nn.Linear inside `module` whose weight packs for a PackedLinear, in place. Call it last, once the
    module has its final dtype and device."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            packed = PackedLinear(child)
            if packed.packed is not None:
                setattr(module, name, packed)
        else:
            pack_linears(child)
    return module
