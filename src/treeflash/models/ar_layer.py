"""TreeFlash's AR approximation layer (DESIGN section 4), in the published TreeFlash layout (ETH-DISCO/TreeFlash):

    h'_d = h_d + d(silu(g) * u),   u, g = ug(norm(e_{d-1}) :: final_norm(h_d))

where e_{d-1} is the target's input embedding of the previous token, final_norm the drafter's own final norm (the
one before the LM head: the caller passes final_norm(h_d)), `ug` a Linear(2H -> 2I) with bias and `d` a
Linear(I -> H) without. `d` starts at zero, so a fresh layer is the identity: training starts from the DFlash
drafter. Two extensions the published layout cannot express (such drafters save in treeflash's own layout):
`prev_tokens = 2` (the two previous tokens' embeddings, oldest first, before the state) and, for the ablation,
`kind = "linear"` (one map d on the concatenation).
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
        self.norm = RMSNorm(hidden_size, eps)  # of the previous tokens' embeddings
        width = (prev_tokens + 1) * hidden_size
        if kind == "swiglu":
            self.ug = nn.Linear(width, 2 * intermediate_size)
            self.d = nn.Linear(intermediate_size, hidden_size, bias=False)
            nn.init.normal_(self.ug.weight, std=0.02)
            nn.init.zeros_(self.ug.bias)
        else:
            self.d = nn.Linear(width, hidden_size, bias=False)
        nn.init.zeros_(self.d.weight)  # identity at start: exactly the DFlash backbone

    def forward(self, h: torch.Tensor, normed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., H] pre-norm states, `normed` their final norm; prev [..., prev_tokens, H] embeddings of the
        previous token(s), oldest first."""
        x = torch.cat([self.norm(prev).flatten(-2), normed], dim=-1)
        if self.kind == "swiglu":
            u, g = self.ug(x).chunk(2, dim=-1)
            x = F.silu(g) * u
        return h + self.d(x)


def from_legacy(state: dict[str, torch.Tensor], final_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weights of an AR layer saved before the published layout (`state_norm`, `token_norm`, `in_proj`
    without bias, `out_proj`; input [state_norm(h) :: token_norm(e)]) in this layout. The old layer normed the
    state with its own weight w_s, this one takes the drafter's final norm w_f: the state columns of the input
    map are scaled by w_s / w_f, the same function up to rounding."""
    H = final_norm.shape[0]
    if final_norm.abs().min() < 1e-6:  # cannot happen in a trained norm, but a division by it must not blow up
        raise ValueError("cannot convert a legacy AR layer: the drafter's final norm has a zero weight")
    first = "in_proj.weight" if "in_proj.weight" in state else "out_proj.weight"
    w = state[first].float()
    scaled_state = w[:, :H] * (state["state_norm.weight"].float() / final_norm.float())
    converted = {"norm.weight": state["token_norm.weight"],
                 # new input order: the previous tokens first, then the state
                 first.replace("in_proj", "ug").replace("out_proj", "d"): torch.cat([w[:, H:], scaled_state], 1)}
    if first == "in_proj.weight":
        converted["ug.bias"] = torch.zeros(w.shape[0])
        converted["d.weight"] = state["out_proj.weight"]
    return converted
