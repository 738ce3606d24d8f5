"""TreeFlash's AR approximation layer (DESIGN section 4).

    h'_d = h_d + F(norm(h_d) :: norm(e_{d-1}))

where e_{d-1} is the target's input embedding of the previous token (or of the previous two), and F is a SwiGLU
(`Linear(2H -> 2I)` split into u, g; `Linear(I -> H)` on silu(g) * u) or, for the ablation, one linear map. F's
output projection starts at zero, so a fresh layer is the identity: training starts from the DFlash drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import RMSNorm


class ARApproximation(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, kind: str = "swiglu", prev_tokens: int = 1,
                 eps: float = 1e-6):
        super().__init__()
        if kind not in ("swiglu", "linear"):
            raise ValueError(f"AR layer kind must be swiglu or linear, got {kind!r}")
        self.kind, self.prev_tokens = kind, prev_tokens
        self.state_norm = RMSNorm(hidden_size, eps)
        self.token_norm = RMSNorm(hidden_size, eps)
        width = (1 + prev_tokens) * hidden_size
        if kind == "swiglu":
            self.in_proj = nn.Linear(width, 2 * intermediate_size, bias=False)
            self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
            nn.init.normal_(self.in_proj.weight, std=0.02)
        else:
            self.out_proj = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.out_proj.weight)  # identity at start: exactly the DFlash backbone

    def forward(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., H]; prev [..., prev_tokens, H] embeddings of the previous token(s), most recent last."""
        x = torch.cat([self.state_norm(h), self.token_norm(prev).flatten(-2)], dim=-1)
        if self.kind == "swiglu":
            u, g = self.in_proj(x).chunk(2, dim=-1)
            x = F.silu(g) * u
        return h + self.out_proj(x)
