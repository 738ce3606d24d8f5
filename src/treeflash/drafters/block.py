"""Block drafting: a backbone that drafts a whole block in one forward (DFlash, DFlash2) plus a tree builder
(builders.py) that grows the round's tree from the backbone's states.

The drafter keeps the injected context K/V of every committed position across rounds and appends only the
positions accepted since the previous round.
"""

from __future__ import annotations

import torch

from ..clock import now
from ..runtime.transfer import upload
from ..models.checkpoint import DrafterError
from ..models.dflash import ContextCache
from ..models.dflash2 import DFlash2Drafter
from ..runtime import native_bf16
from ..tree import DraftTree
from ..verify import Sampling
from .builders import BestFirst, Chain, SelectorChain, SelectorTree, TreeFlash, Weave

CPU = torch.device("cpu")


class BlockDrafter:
    """A block backbone `model` plus a tree `builder`, decoding method `name`."""

    drafts = True

    def __init__(self, model, builder, name: str, plain=None):
        self.model, self.builder, self.name = model.eval(), builder, name
        # the backbone's own best-first tree (DDTree's), which cost-aware speculation builds instead where the
        # builder's adapter (TreeFlash's AR layer, the Weaver) costs more than it adds (`Policy.adapter_pays`)
        self.plain = plain
        self.taps = tuple(model.config.target_layer_ids)
        self.sampling, self.generator = Sampling(), None  # what the drafts are for (see `follow`)
        self.forward_s = 0.0  # cumulative, across sequences: time in the drafter's forward (for `bench`)
        # bench: wait for a GPU around the forward, so that forward_s is its real time (one host sync more a round)
        self.synced_timing = False
        self.adapter_calls = 0  # cumulative: sequential AR-layer / Weaver calls in tree builds
        self.reset()

    def reset(self) -> None:
        self.context = ContextCache(self.model)  # the injected K/V of every committed position, static buffers
        self.last_feature: torch.Tensor | None = None  # fused context feature [H] of the last committed position

    def follow(self, sampling: Sampling, generator: torch.Generator | None = None) -> None:
        """Draft for a sequence sampled with `sampling`, drawing any random drafts from `generator` (dflash2 samples
        its chain at T > 0; the other builders' trees are deterministic). Alone, a drafter drafts for T = 0."""
        self.sampling, self.generator = sampling, generator

    @property
    def adapts(self) -> bool:
        """Whether its builder runs an adapter that a round may skip (`propose(..., adapter=False)`)."""
        return self.plain is not None

    @property
    def ctx_len(self) -> int:
        return len(self.context)

    def observe(self, features: torch.Tensor) -> None:
        """Append the injected K/V of newly committed positions (features [m, n_taps, H])."""
        observe_all([self], [features])

    def catch_up(self, tokens, features: torch.Tensor) -> None:
        self.observe(features)

    def draft(self, tokens, features, depth: int | None = None) -> torch.Tensor:
        """One drafter forward: pre-norm states [depth, H] of the block after the root tokens[-1] (None: all
        γ - 1)."""
        clock = self.model.fc.weight.device if self.synced_timing else CPU  # (the CPU's clock never waits)
        start = now(clock)
        if features is not None and len(features):
            self.observe(features)
        assert self.ctx_len == len(tokens) - 1, "the drafter's context must cover every committed position"
        h = self.model.draft_states(tokens[-1], self.ctx_len, self.context, depth)
        self.forward_s += now(clock) - start
        return h

    @torch.no_grad()
    def propose(self, tokens, features, budget, adapter: bool = True) -> DraftTree:
        # a tree of B nodes is at most B deep: the block's first B drafted positions are all it reads
        return self.tree(tokens, self.draft(tokens, features, max(budget, 1)), budget, adapter)

    @staticmethod
    @torch.no_grad()
    def propose_batch(lanes: list[BlockDrafter], tokens: list[list[int]], features: list[torch.Tensor | None],
                      budgets: list[int], adapter: bool = True) -> list[DraftTree]:
        """`propose` for several sequences, each with its lane (a copy of one drafter: the same model, its own
        context): their new positions in one projection, the drafter's forward over all of them at once."""
        new = [(lane, f) for lane, f in zip(lanes, features) if f is not None and len(f)]
        if new:
            observe_all(*zip(*new))
        for lane, t in zip(lanes, tokens):
            assert lane.ctx_len == len(t) - 1, "the drafter's context must cover every committed position"
        h = lanes[0].model.draft_states_batch([t[-1] for t in tokens], [lane.context for lane in lanes])
        return [lane.tree(t, h[b], budgets[b], adapter) for b, (lane, t) in enumerate(zip(lanes, tokens))]

    @torch.no_grad()
    def tree(self, tokens: list[int], h: torch.Tensor, budget: int, adapter: bool = True) -> DraftTree:
        """The round's tree from the drafter's states h [γ - 1, H] of the block after the root tokens[-1]. A tree of
        B draft nodes is at most B deep, so the builder sees the first B depths only: the same tree, and the
        small trees of cost-aware speculation score, condition and weave a few depths instead of γ - 1.
        `adapter` False: the backbone's own tree, without the builder's adapter (`plain`)."""
        builder = self.builder if adapter or self.plain is None else self.plain
        tree, calls = builder(self, tokens, h[:max(budget, 1)], budget)
        self.adapter_calls += calls
        return tree


def block_drafter(model, method: str, *, top_m: int = 32, top_n: int = 512, weaver=None,
                  width: int = 8) -> BlockDrafter:
    """The drafter of `method` over backbone `model`: a DFlash model for dflash / ddtree, one with an AR layer for
    treeflash (`top_m`, `top_n`: builders.TreeFlash), a DFlash model and a `weaver` for tfm (`width` nodes per
    Weaver call), a DFlash2 model for dflash2 / dflash2-tree."""
    dflash2 = isinstance(model, DFlash2Drafter)
    if method in ("dflash2", "dflash2-tree") and not dflash2:
        raise DrafterError(f"method {method} needs a DFlash2 drafter (a folder in the published DFlash2 format)")
    if dflash2 and method not in ("dflash2", "dflash2-tree"):
        raise DrafterError(f"a DFlash2 drafter decodes dflash2 or dflash2-tree, not {method!r}")
    if method == "treeflash":
        if model.ar_layer is None:
            raise DrafterError("method treeflash needs a TreeFlash drafter (with an AR layer): "
                               "train one with `treeflash train treeflash`")
        return BlockDrafter(model, TreeFlash(model.ar_layer, top_m, top_n), method, plain=BestFirst())
    if method == "tfm":
        if weaver is None:
            raise DrafterError("method tfm needs a Weaver trained on this drafter (`treeflash train weaver`)")
        return BlockDrafter(model, Weave(weaver.attach(model), width), method, plain=BestFirst())
    builders = {"dflash": Chain, "ddtree": BestFirst, "dflash2": SelectorChain, "dflash2-tree": SelectorTree}
    if method not in builders:
        raise KeyError(f"{method!r} is not a block drafting method")
    return BlockDrafter(model, builders[method](), method)


@torch.no_grad()
def observe_all(drafters: list[BlockDrafter], features: list[torch.Tensor]) -> None:
    """`BlockDrafter.observe` for several drafters on one model (a batch's sequences): one fuse and one K/V
    projection over all their new positions (features[i] [m_i, n_taps, H], m_i >= 1), split among their contexts."""
    model = drafters[0].model
    positions = torch.cat([torch.arange(d.ctx_len, d.ctx_len + len(f)) for d, f in zip(drafters, features)])
    fused, k, v = model.context_states(torch.cat(features), upload(positions, model.fc.weight.device))
    at = 0
    for d, f in zip(drafters, features):
        m = len(f)
        d.last_feature = fused[at + m - 1]
        d.context.append(k[:, :, at:at + m], v[:, :, at:at + m])
        at += m


def drafting_dtype(device: torch.device) -> torch.dtype:
    """Drafts need no exactness (the target verifies every token), so drafters run in bf16 (their storage dtype)
    where the hardware multiplies bf16 natively: 3-4x faster than fp32 on such CPUs. fp32 elsewhere."""
    return torch.bfloat16 if native_bf16(device) else torch.float32
