"""Acceptance: which path of a verified draft tree the target would have produced itself.

The rule (DESIGN section 7) works for every deterministic tree: at each accepted node draw y from the target's
processed distribution there (argmax at T = 0); if a child carries y, descend into it; otherwise y is the bonus
token and the round ends. Every emitted token is then an exact target sample, whatever the drafter proposed.

A chain whose drafts were sampled from a drafter distribution q (`DraftTree.proposal`, DFlash2 at T > 0) is accepted
by speculative sampling instead: node x with probability min(1, p(x) / q(x)), and at the first rejection the bonus
is drawn from norm(max(0, p - q)); exact too, and it accepts more than the deterministic rule would (min(p, q)
summed over x instead of p(x) q(x)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree


# A positive temperature below this is refused: one that rounds to 0 in fp32, or makes logits / T overflow, would
# give NaN probabilities; and any T this small samples the argmax anyway, save for exact ties.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                             f"{self.temperature}")
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
            # keep the smallest prefix whose mass reaches top_p (the token that crosses it included): drop a token
            # when the mass from it down is at most 1 - top_p, summed from the least likely up as transformers
            # does, so that a cut at exactly top_p (two tied tokens of 0.5 at top_p 0.5) rounds the same way
            tail = sorted_probs.flip(-1).cumsum(-1).flip(-1)
            drop = tail <= 1 - self.top_p
            drop[..., 0] = False  # the most likely token crosses any top_p, even one that rounds to 0 in fp32
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One token per row of `logits` [..., V]: argmax at T = 0, else an exact sample."""
        if self.greedy:
            return argmax(logits)
        probs = self.probs(logits)
        return sample(probs.reshape(-1, probs.shape[-1]), generator).reshape(probs.shape[:-1])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the first of equal maxima (NaN counting as the largest). On the CPU in fp32 through NumPy,
    whose argmax is vectorised: 4 us against torch's 75 us over SmolLM2's 49,152 logits (AMX Xeon), 1 % of a 4-bit
    AR step."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return torch.as_tensor(logits.numpy().argmax(-1))  # (a NumPy scalar for one row)
    return logits.argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One exact draw per row of probs [R, V] (non-negative, rows need not sum to 1), by inverting the cumulative
    distribution: the first token whose running mass (fp64) exceeds u x total, u uniform in [0, 1). The same law
    as `torch.multinomial`, which on a CPU draws an exponential per token and costs a sizeable share of a 4-bit AR
    step at T > 0 (docs/results/cpu-auto)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(len(probs), 1, dtype=torch.float64, generator=generator, device=probs.device) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    # u x total rounds to total with probability ~2^-53: the clamp may then land on a zero-mass tail token
    if not bool(probs.gather(1, token[:, None]).gt(0).all()):
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return token


def accept(
    tree: DraftTree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Follow the target's own choices from the root. Returns (accepted node indices from the root, bonus token).

    `logits` [n, V] are the target's logits at every node. One choice is drawn per node up front (one batched
    call); only those on the walked path are used, and each is an independent draw, so the result is exact.
    """
    if tree.proposal is not None and not sampling.greedy:
        return _accept_sampled_chain(tree, logits, sampling, generator)
    choices = sampling.choose(logits, generator).tolist()
    children = tree.children()
    path = [0]
    while (nxt := children[path[-1]].get(choices[path[-1]])) is not None:
        path.append(nxt)
    return path, choices[path[-1]]


def _chain_probs(tree: DraftTree, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x) and q(x) [size] of every draft x of a sampled chain, under the target's processed distribution at its
    parent (probs [n, V]) and under the proposal it was drawn from."""
    ids, q = (x.to(probs.device) for x in tree.proposal)
    own = torch.tensor(tree.tokens[1:], dtype=torch.long, device=probs.device)
    return probs[:-1].gather(1, own[:, None])[:, 0], (q.float() * (ids == own[:, None])).sum(-1)


def _accept_sampled_chain(tree: DraftTree, logits: torch.Tensor, sampling: Sampling,
                          generator: torch.Generator | None) -> tuple[list[int], int]:
    probs = sampling.probs(logits)  # [n, V]
    px, qx = _chain_probs(tree, probs)
    u = torch.rand(len(px), generator=generator, device=probs.device)  # one uniform per draft, up front
    rejected = (u * qx >= px).nonzero()  # u < p / q accepts: probability min(1, p / q)
    if len(rejected) == 0:
        return list(range(len(tree))), int(sample(probs[-1:], generator))
    i = int(rejected[0])  # draft i + 1 rejected, at node i
    ids, q = (x.to(probs.device) for x in tree.proposal)
    return list(range(i + 1)), int(sample(residual(probs[i], ids[i], q[i])[None], generator))


def residual(p: torch.Tensor, ids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V], where to draw after a rejection; q [K] on the tokens `ids` [K]."""
    r = p.scatter_add(0, ids, -q.float()).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p  # p == q: a rejection has probability 0


def expected_accepted(tree: DraftTree, logits: torch.Tensor, sampling: Sampling) -> float:
    """E[tokens a round commits | tree]: the bonus token plus, for every draft node, the probability that the
    target's choices walk down to it (the product of its processed probabilities along the path).

    At T = 0 this is the accepted count itself; at T > 0 it has the same mean as the sampled count without its
    acceptance noise, so `bench` can compare methods at T > 0 on fewer prompts. A sampled chain (a proposal) at
    T > 0: the bonus plus the products of min(1, p / q) along it."""
    if tree.proposal is not None and not sampling.greedy:
        px, qx = _chain_probs(tree, sampling.probs(logits))
        return 1.0 + float(torch.cumprod((px / qx).clamp(max=1), 0).sum())
    parents = sorted(set(tree.parents[1:]))  # only their distributions are needed
    row = {p: r for r, p in enumerate(parents)}
    rows = torch.tensor([row[p] for p in tree.parents[1:]], dtype=torch.long, device=logits.device)
    own = torch.tensor(tree.tokens[1:], dtype=torch.long, device=logits.device)
    if sampling.greedy:
        step = (argmax(logits[parents])[rows] == own).float()
    else:
        step = sampling.probs(logits[parents])[rows, own]  # each node's probability given its parent
    reach = [1.0]
    for node, p in enumerate(step.tolist(), start=1):
        reach.append(reach[tree.parents[node]] * p)
    return sum(reach)
