"""Tree builders: how a block drafter's states become the round's tree. One per method:

- `Chain` (dflash): the chain of the marginals' argmaxes;
- `BestFirst` (ddtree): DDTree, the best-first tree over the marginals;
- `TreeFlash` (treeflash): top-M candidates per depth, the AR layer on all M x depth (depth, previous token) pairs
  in one batched call, OPT-Tree over the conditional tables;
- `Weave` (tfm): DFlash-TfM, w-parallel best-first expansion, each step one batched Weaver call (DESIGN section 5);
- `SelectorChain` (dflash2) and `SelectorTree` (dflash2-tree): the DFlash2 selector's conditional tables (DESIGN
  section 5a), walked as the reference does, or grown by OPT-Tree.

A builder is called as `builder(drafter, tokens, h, budget)` with the drafter (its backbone `model`, the fused
feature of its last committed position, the sampling it drafts for), the sequence's tokens (the last one is the
root), the backbone's pre-norm states h [γ - 1, H] of the block after the root, and the budget. It returns the tree
and how many sequential adapter (AR-layer / Weaver) calls it made. Builders keep no per-sequence state, so the
lanes of a batch share one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.dflash import DFlashDrafter
from ..models.dflash2 import walk
from ..models.weaver import BranchCache, Weaver
from ..tree import DraftTree
from ..trees import best_first_tree, chain_tree, opt_tree, parallel_tree


class Chain:
    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        _, probs, ids = drafter.model.top_tokens(h, 1)  # the chain needs the argmax only
        return chain_tree(tokens[-1], probs, ids, budget), 0


class BestFirst:
    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        _, probs, ids = drafter.model.top_tokens(h, budget)
        return best_first_tree(tokens[-1], probs, ids, budget), 0


@torch.no_grad()
def conditional_tables(model: DFlashDrafter, ar_layer, tokens: list[int], h: torch.Tensor, top_m: int,
                       top_n: int = 0):
    """TreeFlash stage 1 and 2: candidates [D, M] and conditionals [D, M, M] from the backbone's pre-norm states
    h [D, H] of the block after the root tokens[-1], through the AR layer `ar_layer`.

    The AR layer runs once on all D x M (depth, previous candidate) pairs, whatever the budget. Each pair's
    conditional is a softmax of the AR-conditioned logits over the depth's top-N marginal tokens (N = `top_n` >= M;
    0: N = M), scaled by the marginal mass of those N: only N LM-head rows per depth are computed, never the full
    vocabulary per pair. The table keeps its top-M columns, the tree's candidates. A wider normaliser matters
    because conditioning sharpens: given its parent, a token can take more mass than any marginal gives the M.
    """
    D, M = h.shape[0], top_m
    _, probs, wide = model.top_tokens(h, max(M, top_n))  # [D, N]
    cand = wide[:, :M]
    prev = torch.cat([torch.full((1, M), tokens[-1], device=cand.device), cand[:-1]])  # [D, M] previous tokens
    p = ar_layer.prev_tokens
    if p > 1:  # older tokens: known ones from the context, then the most likely candidate of each depth
        known = torch.tensor(tokens[-p:], device=cand.device)
        line = torch.cat([known, cand[:, 0]])  # line[p - 1 + d] is the token at depth d (depth 0: the root)
        older = torch.stack([line[d: d + p - 1] for d in range(D)])  # [D, p-1]
        prev = torch.cat([older[:, None, :].expand(D, M, p - 1), prev[:, :, None]], dim=-1)
    else:
        prev = prev[:, :, None]
    embed = model.embed(prev).to(h.dtype)  # [D, M, p, H]
    states = ar_layer(h[:, None, :].expand(D, M, -1), model.norm(h)[:, None, :].expand(D, M, -1),
                      embed)  # [D, M, H]: one batched call
    rows = F.embedding(wide, model.lm_head.weight)  # [D, N, H]: the LM-head rows of each depth's top N (a gather)
    logits = torch.einsum("djh,dnh->djn", model.norm(states).to(rows.dtype), rows).float()
    return cand, torch.softmax(logits, dim=-1)[..., :M] * probs.sum(-1)[:, None, None]


class TreeFlash:
    """`top_m`: candidates per depth (the AR layer runs on (γ-1) x M pairs), at most the budget. 32 rather than 16
    raised τ at B = 64 by 6.5 % (5 GSM8K prompts); at B = 16, M = 16 builds the tree 2.3 ms faster (bf16,
    AVX512-BF16) for 5 % less τ and was 3 % faster overall, so M = min(32, B).
    `top_n`: the marginal's top N that normalise each conditional (`conditional_tables`); 512 rather than M raised
    τ at T = 0 by 1 % (B 16) and 1.4 % (B 64) on 5 GSM8K prompts; against 64 on a CPU, docs/results/treeflash-top-n."""

    def __init__(self, ar_layer, top_m: int = 32, top_n: int = 512):
        self.ar_layer, self.top_m, self.top_n = ar_layer, top_m, top_n

    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        # a tree of B nodes holds at most B per depth; fewer candidates, fewer AR-layer pairs: the cost is linear
        cand, cond = conditional_tables(drafter.model, self.ar_layer, tokens, h, min(self.top_m, budget), self.top_n)
        return opt_tree(tokens[-1], cand, cond, budget), 1  # the AR layer: one batched call whatever the budget


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


class Weave:
    """A Weaver attached to the backbone; w = `width` nodes expanded per Weaver call."""

    def __init__(self, weaver: Weaver, width: int = 8):
        self.weaver, self.width = weaver.eval(), width

    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        r = WeaverRound(self.weaver, h, drafter.last_feature, capacity=budget + 1)
        # the last batch of nodes grows on below them by the marginals: deeper trees, no more Weaver calls
        return parallel_tree(tokens[-1], r.candidates, r, budget, self.width, fallback=r.marginals), r.calls


class SelectorChain:
    """The reference's chain, a walk slot by slot. T = 0: the argmax chain, a deterministic tree. T > 0: drafts
    sampled from q_d = softmax(s_d / T) over the slot's K candidates, drawn from the drafter's generator (the
    sequence's: the acceptance's uniforms come later in the same stream, so a seed reproduces the output); the tree
    carries those q rows, so that acceptance is speculative sampling against them (verify.accept)."""

    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        n = min(budget, len(h))
        if n < 1:
            return DraftTree.chain(tokens[-1]), 0
        cand, scores = drafter.model.selector_tables(tokens[-1], h[:n])
        drafts, picks, q = walk(cand, scores, drafter.sampling.temperature, drafter.generator)
        at, picked = torch.arange(n, device=scores.device), torch.tensor(picks, device=scores.device)
        if q is None:  # the argmax chain, with each pick's probability at T = 1 (for cost-aware speculation)
            rows = torch.tensor([0] + picks[:-1], device=at.device)
            return DraftTree.chain(tokens[-1], drafts, torch.softmax(scores, dim=-1)[at, rows, picked].tolist()), 0
        return DraftTree.chain(tokens[-1], drafts, q[at, picked].tolist(), proposal=(cand, q)), 0


class SelectorTree:
    """OPT-Tree over the selector's tables, softmax(s_d(. | p)) as the conditional of each candidate given its
    parent (the shape of TreeFlash's tables): a deterministic tree, exact under every sampling."""

    def __call__(self, drafter, tokens, h, budget) -> tuple[DraftTree, int]:
        n = min(budget, len(h))
        if n < 1:
            return DraftTree.chain(tokens[-1]), 0
        cand, scores = drafter.model.selector_tables(tokens[-1], h[:n])
        return opt_tree(tokens[-1], cand, torch.softmax(scores, dim=-1), budget), 0
