"""Acceptance: which path of a verified draft tree the target would have produced itself.

The rule (DESIGN section 7) works for every deterministic tree: at each accepted node draw y from the target's
processed distribution there (argmax at T = 0); if a child carries y, descend into it; otherwise y is the bonus
token and the round ends. Every emitted token is then an exact target sample, whatever the drafter proposed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution (temperature, then top-k, then top-p) over the last axis, in fp32."""
        logits = logits.float() / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= self.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One token per row of `logits` [..., V]: argmax at T = 0, else an exact sample."""
        if self.greedy:
            return logits.argmax(-1)
        probs = self.probs(logits)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def accept(
    tree: DraftTree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Follow the target's own choices from the root. Returns (accepted node indices from the root, bonus token).

    `logits` [n, V] are the target's logits at every node. One choice is drawn per node up front (one batched
    call); only those on the walked path are used, and each is an independent draw, so the result is exact.
    """
    choices = sampling.choose(logits, generator).tolist()
    children = tree.children()
    path = [0]
    while (nxt := children[path[-1]].get(choices[path[-1]])) is not None:
        path.append(nxt)
    return path, choices[path[-1]]


def expected_accepted(tree: DraftTree, logits: torch.Tensor, sampling: Sampling) -> float:
    """E[tokens a round commits | tree]: the bonus token plus, for every draft node, the probability that the
    target's choices walk down to it (the product of its processed probabilities along the path).

    At T = 0 this is the accepted count itself; at T > 0 it has the same mean as the sampled count without its
    acceptance noise, so `bench` can compare methods at T > 0 on fewer prompts."""
    parents = sorted(set(tree.parents[1:]))  # only their distributions are needed
    row = {p: r for r, p in enumerate(parents)}
    rows = torch.tensor([row[p] for p in tree.parents[1:]], dtype=torch.long, device=logits.device)
    own = torch.tensor(tree.tokens[1:], dtype=torch.long, device=logits.device)
    if sampling.greedy:
        step = (logits[parents].argmax(-1)[rows] == own).float()
    else:
        step = sampling.probs(logits[parents])[rows, own]  # each node's probability given its parent
    reach = [1.0]
    for node, p in enumerate(step.tolist(), start=1):
        reach.append(reach[tree.parents[node]] * p)
    return sum(reach)
