"""Block drafting: one drafter forward per round, then a tree from its states.

- `dflash`: the chain of the marginals' argmaxes;
- `ddtree`: DDTree, the best-first tree over the marginals;
- `treeflash`: the two-stage TreeFlash tree (top-M candidates per depth, the AR layer on all M x depth
  (depth, previous token) pairs in one batched call, OPT-Tree over the conditional tables).

The drafter keeps the injected context K/V of every committed position across rounds and appends only the
positions accepted since the previous round.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..clock import now
from ..models.dflash import ContextCache, DFlashDrafter, DrafterError, draft_vocab
from ..models.packed import pack_linears
from ..target import native_bf16
from ..tree import DraftTree
from ..trees import best_first_tree, chain_tree, opt_tree

# drafters that ship with treeflash, by target name and kind
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SHIPPED = {("smollm2-135m-instruct", "dflash"): CHECKPOINTS / "smollm2-135m-instruct-dflash",
           ("smollm2-135m-instruct", "treeflash"): CHECKPOINTS / "smollm2-135m-instruct-treeflash",
           ("smollm2-135m-instruct", "weaver"): CHECKPOINTS / "smollm2-135m-instruct-weaver"}


def shipped_drafter(target_name: str, kind: str) -> Path | None:
    """The folder of the `kind` ("dflash", "treeflash" or "weaver") model shipped for a target, if there is one.
    The shipped TreeFlash AR layer and Weaver were trained on the shipped DFlash drafter, frozen."""
    path = SHIPPED.get((target_name, kind))
    return path if path is not None and (path / "config.json").exists() else None


def default_drafter_path(target_name: str, kind: str) -> Path:
    path = shipped_drafter(target_name, kind)
    if path is None:
        raise FileNotFoundError(f"no shipped {kind} drafter for target {target_name!r}: pass --drafter PATH "
                                f"(a folder written by `treeflash train {kind}`)")
    return path


def marginal_tree(method: str):
    build = {"dflash": chain_tree, "ddtree": best_first_tree}[method]

    def tree(model, tokens, h, budget):
        _, probs, ids = model.top_tokens(h, 1 if method == "dflash" else budget)  # the chain needs the argmax only
        return build(tokens[-1], probs, ids, budget)
    return tree


@torch.no_grad()
def conditional_tables(model: DFlashDrafter, tokens: list[int], h: torch.Tensor, top_m: int, top_n: int = 0):
    """TreeFlash stage 1 and 2: candidates [D, M] and conditionals [D, M, M] from pre-norm states h [D, H] of
    the block after the root tokens[-1].

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
    p = model.ar_layer.prev_tokens
    if p > 1:  # older tokens: known ones from the context, then the most likely candidate of each depth
        known = torch.tensor(tokens[-p:], device=cand.device)
        line = torch.cat([known, cand[:, 0]])  # line[p - 1 + d] is the token at depth d (depth 0: the root)
        older = torch.stack([line[d: d + p - 1] for d in range(D)])  # [D, p-1]
        prev = torch.cat([older[:, None, :].expand(D, M, p - 1), prev[:, :, None]], dim=-1)
    else:
        prev = prev[:, :, None]
    embed = model.embed(prev).to(h.dtype)  # [D, M, p, H]
    states = model.ar_layer(h[:, None, :].expand(D, M, -1), model.norm(h)[:, None, :].expand(D, M, -1),
                            embed)  # [D, M, H]: one batched call
    rows = F.embedding(wide, model.lm_head.weight)  # [D, N, H]: the LM-head rows of each depth's top N (a gather)
    logits = torch.einsum("djh,dnh->djn", model.norm(states).to(rows.dtype), rows).float()
    return cand, torch.softmax(logits, dim=-1)[..., :M] * probs.sum(-1)[:, None, None]


def treeflash_tree(top_m: int, top_n: int):
    def build(model, tokens, h, budget) -> DraftTree:
        # a tree of B nodes holds at most B per depth; fewer candidates, fewer AR-layer pairs: the cost is linear
        cand, cond = conditional_tables(model, tokens, h, min(top_m, budget), top_n)
        return opt_tree(tokens[-1], cand, cond, budget)
    return build


class BlockDrafter:
    """`top_m`: TreeFlash's candidates per depth (the AR layer runs on (γ-1) x M pairs), at most the budget. 32
    rather than 16 raised τ at B = 64 by 6.5 % (5 GSM8K prompts); at B = 16, M = 16 builds the tree 2.3 ms faster
    (bf16, AVX512-BF16) for 5 % less τ and was 3 % faster overall, so M = min(32, B).
    `top_n`: the marginal's top N that normalise each conditional (`conditional_tables`); 512 rather than M
    raised τ at T = 0 by 1 % (B 16) and 1.4 % (B 64) on 5 GSM8K prompts, for 7 ms per round on this CPU."""

    def __init__(self, model: DFlashDrafter, method: str = "ddtree", top_m: int = 32, top_n: int = 512):
        if method == "treeflash" and model.ar_layer is None:
            raise DrafterError("method treeflash needs a TreeFlash drafter (with an AR layer): "
                               "train one with `treeflash train treeflash`")
        self.model, self.name = model.eval(), method
        self.build = treeflash_tree(top_m, top_n) if method == "treeflash" else marginal_tree(method)
        self.taps = tuple(model.config.target_layer_ids)
        self.forward_s = 0.0  # cumulative, across sequences: time in the drafter's forward (for `bench`)
        self.adapter_calls = 0  # cumulative: sequential AR-layer / Weaver calls in tree builds
        self.reset()

    def reset(self) -> None:
        self.context = ContextCache(self.model)  # the injected K/V of every committed position, static buffers
        self.last_feature: torch.Tensor | None = None  # fused context feature [H] of the last committed position

    @property
    def ctx_len(self) -> int:
        return len(self.context)

    def observe(self, features: torch.Tensor) -> None:
        """Append the injected K/V of newly committed positions (features [m, n_taps, H])."""
        observe_all([self], [features])

    def draft(self, tokens, features) -> torch.Tensor:
        """One drafter forward: pre-norm states [γ - 1, H] of the block after the root tokens[-1]."""
        start = now(self.model.fc.weight.device)
        if features is not None and len(features):
            self.observe(features)
        assert self.ctx_len == len(tokens) - 1, "the drafter's context must cover every committed position"
        h = self.model.draft_states(tokens[-1], self.ctx_len, self.context)
        self.forward_s += now(h.device) - start
        return h

    @torch.no_grad()
    def propose(self, tokens, features, budget) -> DraftTree:
        return self.tree(tokens, self.draft(tokens, features), budget)

    @torch.no_grad()
    def tree(self, tokens: list[int], h: torch.Tensor, budget: int) -> DraftTree:
        """The round's tree from the drafter's states h [γ - 1, H] of the block after the root tokens[-1]."""
        if self.name == "treeflash":
            self.adapter_calls += 1  # its AR layer: one batched call whatever the budget
        return self.build(self.model, tokens, h, budget)


@torch.no_grad()
def observe_all(drafters: list[BlockDrafter], features: list[torch.Tensor]) -> None:
    """`BlockDrafter.observe` for several drafters on one model (a batch's sequences): one fuse and one K/V
    projection over all their new positions (features[i] [m_i, n_taps, H], m_i >= 1), split among their contexts."""
    model = drafters[0].model
    fused = model.fuse(torch.cat(features))
    positions = torch.cat([torch.arange(d.ctx_len, d.ctx_len + len(f)) for d, f in zip(drafters, features)])
    kv = model.context_kv(fused, positions.to(fused.device))
    at = 0
    for d, f in zip(drafters, features):
        m = len(f)
        d.last_feature = fused[at + m - 1]
        d.context.append([(k[at:at + m], v[at:at + m]) for k, v in kv])
        at += m


def drafting_dtype(device: torch.device) -> torch.dtype:
    """Drafts need no exactness (the target verifies every token), so drafters run in bf16 (their storage dtype)
    where the hardware multiplies bf16 natively: 3-4x faster than fp32 on such CPUs. fp32 elsewhere."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def load_drafter_model(target, path: str | Path, draft_vocab_size: int | None = None) -> DFlashDrafter:
    """A drafter checkpoint attached to `target`, in the drafting dtype, scoring its draft vocabulary
    (`draft_vocab_size`: None: the config's, 0: every token), its products on packed weights (inference only)."""
    model = DFlashDrafter.from_pretrained(path, dtype=drafting_dtype(target.device))
    model = model.attach(target.model).to(target.device)
    return pack_linears(model.use_draft_vocab(draft_vocab(model, path, draft_vocab_size)))


def load_block_drafter(method: str, target, path: str | Path | None = None,
                       draft_vocab_size: int | None = None) -> BlockDrafter:
    kind = "treeflash" if method == "treeflash" else "dflash"
    model = load_drafter_model(target, path or default_drafter_path(target.name, kind), draft_vocab_size)
    return BlockDrafter(model, method)
