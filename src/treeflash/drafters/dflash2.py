"""DFlash2 (DESIGN section 5a) as a block drafter: one DFlash2 forward over the block after the root (the context
K/V cached across rounds, as for the other block methods), the selector's conditional tables, then

- `dflash2`: the reference's chain, a walk slot by slot. T = 0: the argmax chain, a deterministic tree. T > 0:
  drafts sampled from q_d = softmax(s_d / T) over the slot's K candidates; the tree carries those q rows, so that
  acceptance is speculative sampling against them (verify.accept);
- `dflash2-tree`: OPT-Tree over the same tables, softmax(s_d(. | p)) as the conditional of each candidate given
  its parent (the shape of TreeFlash's tables), accepted by the deterministic-tree rule at every temperature.

The drafter follows the sampling of the sequence it drafts for (`follow`, called by the engines); alone it drafts
the argmax chain, which is exact under every sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.checkpoint import DrafterError
from ..models.dflash2 import DFlash2Drafter, is_dflash2, walk
from ..models.packed import pack_linears
from ..tree import DraftTree
from ..trees import opt_tree
from ..verify import Sampling
from .dflash import BlockDrafter, drafting_dtype


class DFlash2BlockDrafter(BlockDrafter):
    """BlockDrafter's context cache and forwards (single and batched) over a DFlash2 model; its own tree."""

    def __init__(self, model: DFlash2Drafter, method: str = "dflash2"):
        if method not in ("dflash2", "dflash2-tree"):
            raise ValueError(f"a DFlash2 drafter decodes dflash2 or dflash2-tree, not {method!r}")
        self.temperature = 0.0  # of the chain's proposal q (set by `follow`); 0: the argmax chain
        self.generator: torch.Generator | None = None  # the drafts' randomness (None: torch's global one)
        super().__init__(model, "dflash")
        self.name = method

    def follow(self, sampling: Sampling, generator: torch.Generator | None = None) -> None:
        """Draft for a sequence sampled with `sampling` (q_d at its temperature; top-k / top-p are the target's),
        drawing from `generator` (the sequence's: the acceptance's uniforms come later in the same stream, so a
        seed reproduces the output; None: torch's global one)."""
        self.temperature, self.generator = sampling.temperature, generator

    @torch.no_grad()
    def tree(self, tokens: list[int], h: torch.Tensor, budget: int) -> DraftTree:
        n = min(budget, len(h))
        if n < 1:
            return DraftTree.chain(tokens[-1])
        cand, scores = self.model.selector_tables(tokens[-1], h[:n])
        if self.name == "dflash2-tree":  # a deterministic tree: exact under every sampling, no proposal to carry
            return opt_tree(tokens[-1], cand, torch.softmax(scores, dim=-1), budget)
        drafts, picks, q = walk(cand, scores, self.temperature, self.generator)
        at = torch.arange(n, device=scores.device)
        if q is None:  # the argmax chain, with each pick's probability at T = 1 (for cost-aware speculation)
            rows = torch.tensor([0] + picks[:-1], device=at.device)
            probs = torch.softmax(scores, dim=-1)[at, rows, torch.tensor(picks, device=at.device)]
            return DraftTree.chain(tokens[-1], drafts, probs.tolist())
        probs = q[at, torch.tensor(picks, device=at.device)]
        return DraftTree.chain(tokens[-1], drafts, probs.tolist(), proposal=(cand, q))


def load_dflash2_drafter(target, path: str | Path | None, method: str = "dflash2") -> DFlash2BlockDrafter:
    if path is None:
        raise FileNotFoundError("no DFlash2 drafter ships with treeflash: pass --drafter PATH (a folder in the "
                                "published DFlash2 format)")
    if not is_dflash2(path):
        raise DrafterError(f"{path} is not a DFlash2 drafter (config.json's architectures lack DFlash2DraftModel)")
    model = DFlash2Drafter.from_pretrained(path, dtype=drafting_dtype(target.device))
    model = pack_linears(model.attach(target.model).to(target.device))
    return DFlash2BlockDrafter(model, method)
