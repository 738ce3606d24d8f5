"""Method `eagle3`: an EAGLE-3 drafter (models/eagle3.py) growing EAGLE-2's dynamic tree, one layer call a depth.

Each round the drafter first runs its layer over the positions committed since its last call (the target's taps
fused, and the token each produced), keeping their K/V: the last one's output predicts depth 1. The tree then grows
depth by depth: the `top_k` most likely children of each frontier node, scored by the path's summed log-probability,
and the `top_k` best of them become the next frontier, each expanded by one layer call that sees the context and its
own ancestors. The nodes of every depth are then reranked by path score and the best `budget` kept, best first
(a path's score never grows, so the kept nodes form a tree and every prefix of it is the tree of a smaller budget).
The tree is deterministic: at T > 0 verification accepts it by the target's own samples (verify.accept).
"""

from __future__ import annotations

import torch

from ..clock import now
from ..models.eagle3 import Eagle3Drafter, attend, attend_rows
from ..tree import DraftTree

CPU = torch.device("cpu")
TOP_K = 8  # children per frontier node and frontier width (EAGLE-2's top_k 10, at this project's smaller budgets)
MAX_DEPTH = 6  # EAGLE-2's depth for its 60-token trees


class Eagle3Decoder:
    """The `eagle3` method over an Eagle3Drafter `model`: frontiers of at most `top_k` nodes, trees at most `depth`
    deep (and, for a budget B, at most B wide and B deep); K/V buffers for `capacity` positions to start with."""

    drafts = True
    name = "eagle3"

    def __init__(self, model: Eagle3Drafter, top_k: int = TOP_K, depth: int = MAX_DEPTH, capacity: int = 512):
        self.model, self.top_k, self.depth, self.capacity = model.eval(), top_k, depth, capacity
        self.taps = tuple(model.config.target_layer_ids)
        self.forward_s = 0.0  # cumulative: the layer calls (the catch-up and every depth), bench's split
        self.adapter_calls = 0  # cumulative: the sequential layer calls of tree growth
        self.reset()

    def reset(self) -> None:
        c = self.model.config
        # K/V [capacity, kv_heads, head_dim]: the context's first, then a round's tree nodes' as scratch, so that
        # nothing as long as the context is copied per round or per depth (the buffers double when they must grow)
        self._k = self.model.fc.weight.new_zeros(self.capacity, c.num_key_value_heads, c.head_dim)
        self._v = torch.zeros_like(self._k)
        self.ctx_len = 0
        self.state: torch.Tensor | None = None  # the layer's output at the last committed position [H]

    @property
    def k(self) -> torch.Tensor:
        """The context's keys [C, kv_heads, head_dim] (a view)."""
        return self._k[:self.ctx_len]

    def _write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the K/V of positions start.. (the context's, or a round's tree nodes' after it)."""
        end = start + len(k)
        if end > len(self._k):
            grown = max(end, 2 * len(self._k))
            self._k = torch.cat([self._k[:start], self._k.new_zeros(grown - start, *self._k.shape[1:])])
            self._v = torch.cat([self._v[:start], self._v.new_zeros(grown - start, *self._v.shape[1:])])
        self._k[start:end], self._v[start:end] = k, v

    def follow(self, sampling, generator=None) -> None:
        """The tree is deterministic whatever the sampling (see the module's docstring)."""

    @torch.no_grad()
    def observe(self, tokens: list[int], features: torch.Tensor) -> None:
        """Run the layer over the m newly committed positions t (features [m, 3, H]: the target's taps at t), each
        with the token x_{t+1} it produced, causally after the cached context."""
        m, start = len(features), self.ctx_len
        device = self.model.fc.weight.device
        positions = torch.arange(start, start + m, device=device)
        emb = self.model.embed(torch.tensor(tokens[start + 1:start + m + 1], device=device))
        state = self.model.fuse(features.to(device))
        q, k, v = self.model.midlayer.qkv(emb, state, positions)
        self._write(start, k, v)
        self.ctx_len = start + m
        k, v = self._k[:start + m], self._v[:start + m]
        if start == 0:  # the prompt: plainly causal (SDPA's fused kernel)
            out = attend(q, k, v, None, causal=True)
        else:  # later ones see the whole cached context before them
            out = attend_rows(q, k, v, torch.arange(start + m, device=device)[None, :] <= positions[:, None])
        self.state = self.model.midlayer.finish(state, out)[-1]

    catch_up = observe

    @torch.no_grad()
    def propose(self, tokens: list[int], features: torch.Tensor | None, budget: int) -> DraftTree:
        start = now(CPU)
        if features is not None and len(features):
            self.observe(tokens, features)
        assert self.ctx_len == len(tokens) - 1, "the drafter's context must cover every committed position"
        tree = self.grow(tokens[-1], max(budget, 1))
        self.forward_s += now(CPU) - start
        return tree

    def grow(self, root: int, budget: int) -> DraftTree:
        """EAGLE-2's tree of at most `budget` draft nodes below `root` (see the module's docstring)."""
        model, width, depth = self.model, min(self.top_k, budget), min(self.depth, budget)
        vocab, device = model.vocab_ids, self._k.device
        # nodes: token, parent, path score, probability given the parent; node 0 is the root
        tokens, parents, scores, probs = [root], [-1], [0.0], [1.0]
        ancestors = [[]]  # per node, the expanded nodes (rows of the tree's K/V below) on its path, itself included
        context, expanded = self.ctx_len, 0  # the expanded nodes' K/V follow the context's in the buffers
        frontier, states = [0], self.state[None]  # the nodes to expand, and the outputs that predict their children
        for d in range(1, depth + 1):
            logp = torch.log_softmax(model.scores(states).float(), dim=-1)  # [f, V']
            top, idx = logp.topk(min(width, logp.shape[-1]), dim=-1)
            path = (torch.tensor([scores[n] for n in frontier], device=device)[:, None] + top).flatten()  # [f k]
            children = []
            for i in path.topk(min(width, len(path))).indices.tolist():
                row, j = divmod(i, top.shape[1])
                children.append(len(tokens))
                tokens.append(int(vocab[idx[row, j]]))
                parents.append(frontier[row])
                scores.append(float(path[i]))
                probs.append(float(top[row, j].exp()))
                ancestors.append(ancestors[frontier[row]])
            if d == depth:
                break
            # expand the new frontier: [its tokens' embeddings ; its parents' outputs] at position C - 1 + d
            emb = model.embed(torch.tensor([tokens[n] for n in children], device=device))
            state = states[torch.tensor([frontier.index(parents[n]) for n in children], device=device)]
            positions = torch.full((len(children),), context - 1 + d, device=device)
            q, k, v = model.midlayer.qkv(emb, state, positions)
            self._write(context + expanded, k, v)
            for i, n in enumerate(children):
                ancestors[n] = ancestors[n] + [expanded + i]
            expanded += len(children)
            sees = torch.zeros(len(children), context + expanded, dtype=torch.bool, device=device)
            sees[:, :context] = True
            for i, n in enumerate(children):
                sees[i, [context + a for a in ancestors[n]]] = True
            out = attend_rows(q, self._k[:context + expanded], self._v[:context + expanded], sees)
            frontier, states = children, model.midlayer.finish(state, out)
            self.adapter_calls += 1
        # the best `budget` nodes by path score, parents first among equals
        kept = sorted(range(1, len(tokens)), key=lambda n: (-scores[n], n))[:budget]
        order = {0: 0, **{n: i + 1 for i, n in enumerate(kept)}}
        return DraftTree.from_parents([root] + [tokens[n] for n in kept], [-1] + [order[parents[n]] for n in kept],
                                      [1.0] + [probs[n] for n in kept])
