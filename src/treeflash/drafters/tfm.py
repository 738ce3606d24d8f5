"""`tfm`: DFlash-TfM, trees from marginals grown by the Weaver (DESIGN section 5).

Each round: one DFlash forward gives the marginals of depths 1..γ-1 (the drafter's context K/V is cached across
rounds, as for the other block methods); their top-K tokens are the candidates of each depth; then the tree grows
by w-parallel best-first expansion (trees/parallel.py), each step one batched Weaver call over the w nodes just
added, whose K/V go into the round's BranchCache once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.dflash import DFlashDrafter
from ..models.packed import pack_linears
from ..models.weaver import BranchCache, Weaver
from ..tree import DraftTree
from ..trees import parallel_tree
from .dflash import BlockDrafter, default_drafter_path, drafting_dtype, load_drafter_model, shipped_drafter


class WeaverRound:
    """The scorer of one round for `parallel_tree`: the child distributions of newly added nodes.

    h [D, H] the drafter's pre-norm states of depths 1..D, ctx [H] the fused context feature of the last committed
    position. Candidates [D, K] are the top-K tokens of each depth's marginal; `calls` counts Weaver calls."""

    def __init__(self, weaver: Weaver, h: torch.Tensor, ctx: torch.Tensor, capacity: int):
        self.weaver, self.h, self.ctx = weaver, h, ctx
        self.cand_logits, _, self.candidates = weaver.drafter.top_tokens(h, weaver.config.top_k)
        self.marginals = torch.softmax(self.cand_logits, dim=-1)  # a fresh Weaver's output, for nodes it won't expand
        self.cache: BranchCache = weaver.new_cache(capacity)
        self.calls = 0

    @torch.no_grad()
    def __call__(self, nodes: list[int], tokens: list[int], parents: list[int], depths: list[int]) -> torch.Tensor:
        self.calls += 1
        device = self.h.device
        d = torch.tensor([depths[n] for n in nodes], device=device)  # the child is at depth d + 1: row d
        own = torch.tensor([tokens[n] for n in nodes], device=device)
        out = self.weaver.step(self.cache, nodes, [parents[n] for n in nodes], d, self.h[d], self.ctx, own)
        return torch.softmax(self.cand_logits[d] + self.weaver.residual(out, self.candidates[d]), dim=-1)


class WeaverDrafter(BlockDrafter):
    """A DFlash drafter (`model`, the backbone) plus a Weaver; w = `width` nodes expanded per Weaver call."""

    def __init__(self, model: DFlashDrafter, weaver: Weaver, width: int = 8):
        super().__init__(model, "ddtree")
        self.name, self.weaver, self.width = "tfm", weaver.attach(model).eval(), width
        self.last_round: WeaverRound | None = None

    @torch.no_grad()
    def tree(self, tokens, h, budget) -> DraftTree:
        r = self.last_round = WeaverRound(self.weaver, h, self.last_feature, capacity=budget + 1)
        # the last batch of nodes grows on below them by the marginals: deeper trees, no more Weaver calls
        tree = parallel_tree(tokens[-1], r.candidates, r, budget, self.width, fallback=r.marginals)
        self.adapter_calls += r.calls
        return tree


def default_weaver_path(target_name: str, drafter_path: str | Path | None) -> Path | None:
    """The Weaver shipped for the target, which fits only the shipped drafter: None when another is named."""
    return shipped_drafter(target_name, "weaver") if drafter_path is None else None


def load_weaver_drafter(target, drafter_path: str | Path | None, weaver_path: str | Path | None,
                        width: int = 8, draft_vocab_size: int | None = None) -> WeaverDrafter:
    weaver_path = weaver_path or default_weaver_path(target.name, drafter_path)
    if weaver_path is None:
        raise FileNotFoundError("method tfm needs a Weaver: pass --weaver PATH (a folder written by "
                                "`treeflash train weaver` on this drafter)")
    drafter_path = drafter_path or default_drafter_path(target.name, "dflash")
    model = load_drafter_model(target, drafter_path, draft_vocab_size)
    weaver = Weaver.from_pretrained(weaver_path, drafting_dtype(target.device),
                                    backbone=model.dflash_folder(drafter_path)).to(target.device)
    pack_linears(weaver)
    return WeaverDrafter(model, weaver, width)
