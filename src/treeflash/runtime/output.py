"""What a target forward returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, V] fp32
    hidden: torch.Tensor | None  # [n, len(taps), H]: outputs of the tapped decoder layers, or None without taps
