"""The decoding loop shared by every method: draft -> tree -> verify -> commit.

`step` is one round, `generate` the loop around it (as gpt-fast's generate.py splits them).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Callable

import torch

from .clock import now as _now
from .drafters.base import Drafter
from .speculation import Policy, policy_for
from .target import Target
from .tree import DraftTree
from .verify import Sampling, accept, expected_accepted

AUTO = "auto"
# the largest tree `--budget auto` drafts: on 2-core CPUs 16 beat 32 (prompt lookup 1.50x vs 1.30x of AR at
# T = 0, bf16): larger trees cost more to build than they add
DEFAULT_MAX_BUDGET = 16


@dataclass
class Round:
    accepted: int  # tokens this round committed to the output: accepted drafts + the bonus token, cut at EOS / limit
    tree_size: int  # draft nodes verified (root excluded); 0: a plain AR step
    draft_s: float
    verify_s: float  # verification, acceptance, commit and the round's bookkeeping
    expected: float  # E[accepted | tree] (verify.expected_accepted): equal to `accepted` at T = 0
    drafted: bool  # False: a plain AR step (method `ar`, or cost-aware speculation skipped the drafter)


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    prefill_s: float
    rounds: list[Round] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens committed per target forward in the decode rounds (AR: 1.0); the prefill is not counted."""
        return sum(r.accepted for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def expected_tau(self) -> float:
        """τ with every round's sampled count replaced by its expectation given the tree (same mean at T > 0)."""
        return sum(r.expected for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def seconds(self) -> float:
        return self.prefill_s + sum(r.draft_s + r.verify_s for r in self.rounds)


@dataclass
class Sequence:
    tokens: list[int]  # prompt and committed tokens; the last one is the next root (not yet seen by the target)
    prefill_features: InitVar[torch.Tensor | None]  # the prompt's target taps (None: the drafter takes none)
    emitted: list[int] = field(default_factory=list)  # the new tokens (after the prompt)
    # target taps of the committed positions the drafter has not seen yet, one tensor per round: joined only when
    # the drafter reads them, so that a plain AR round never copies everything since the last drafting round
    chunks: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self, prefill_features: torch.Tensor | None) -> None:
        self.features = prefill_features

    @property
    def features(self) -> torch.Tensor | None:
        if len(self.chunks) > 1:
            self.chunks[:] = [torch.cat(self.chunks)]
        return self.chunks[0] if self.chunks else None

    @features.setter
    def features(self, value: torch.Tensor | None) -> None:
        self.chunks = [] if value is None else [value]

    def done(self, max_new_tokens: int, eos_ids) -> bool:
        return len(self.emitted) >= max_new_tokens or self.tokens[-1] in eos_ids

    def add_features(self, hidden: torch.Tensor | None, path: list[int]) -> None:
        """Keep the target's taps of a round's accepted path (hidden: the verified tree's), for the drafter."""
        if hidden is not None:
            self.chunks.append(hidden[path])

    def extend(self, new: list[int], max_new_tokens: int, eos_ids) -> list[int]:
        """Append a round's new tokens, stopping exactly where sequential decoding would (after an EOS token, or
        at the limit). Returns the tokens kept."""
        kept = []
        for token in new:
            if self.done(max_new_tokens, eos_ids):
                break
            self.tokens.append(token)
            self.emitted.append(token)
            kept.append(token)
        return kept


def step(target: Target, drafter: Drafter, seq: Sequence, sampling: Sampling, budget: int | Policy,
         generator: torch.Generator | None = None) -> tuple[list[int], DraftTree, torch.Tensor, Round]:
    """One round: draft a tree (with a Policy: the prefix that pays, or no drafting at all), verify it, commit
    the accepted path. Returns the round's new tokens (the caller cuts them at EOS or its limit), the verified
    tree, the target's logits on it, and the round's record (its `accepted` counts every new token)."""
    policy = budget if isinstance(budget, Policy) else None
    room = target.context_length - target.length - 1  # the tree (root + drafts) must fit in the context
    t0 = _now(target.device)
    drafted = drafter.drafts and (policy is None or policy.should_draft())  # as BatchEngine.step decides
    if drafted:
        tree = drafter.propose(seq.tokens, seq.features, min(policy.max_budget if policy else budget, room))
        seq.features = None
        if policy:
            tree = policy.choose([tree])[0]
    else:  # a plain AR step: the drafter's context catches up at its next call
        tree = DraftTree.chain(seq.tokens[-1])
    t1 = _now(target.device)
    out = target.verify(tree)
    path, bonus = accept(tree, out.logits, sampling, generator)
    target.commit(path)
    t2 = _now(target.device)
    seq.add_features(out.hidden, path)
    new = [tree.tokens[i] for i in path[1:]] + [bonus]
    if policy:
        policy.observe([tree], [path], len(new), t1 - t0, t2 - t1, drafted)
    t3 = _now(target.device)  # the round's bookkeeping is part of its time (what bench's tokens per second count)
    expected = len(new) if sampling.greedy else expected_accepted(tree, out.logits, sampling)  # a measure: not timed
    return new, tree, out.logits, Round(len(new), tree.size, t1 - t0, t3 - t1, expected, drafted)


def generate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int = 128,
    sampling: Sampling = Sampling(),
    budget: int | str = AUTO,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
    max_budget: int = DEFAULT_MAX_BUDGET,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt`, stopping after an EOS token. Lossless for every drafter.

    `budget`: draft nodes per tree, or "auto": each round the tree prefix (up to `max_budget` nodes) that
    maximises expected tokens per second, or a plain AR step when no tree pays (speculation.Policy).
    `should_stop`, asked before every round, ends the generation early when it returns True (a server's client
    that left, a stop string seen, a deadline passed)."""
    if budget != AUTO and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be 'auto' or an integer >= 1, got {budget!r}")
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    max_new_tokens = min(max_new_tokens, target.context_length - len(prompt))
    if budget != AUTO:
        plan = budget
    elif not drafter.drafts:  # AR proposes nothing to choose from: no policy (nor the cost measurement behind one)
        plan = 1
    else:
        plan = policy_for(target, drafter, max_budget)
    drafter.reset()
    drafter.follow(sampling, generator)

    t0 = _now(target.device)
    out = target.prefill(prompt, taps=drafter.taps)
    first = int(sampling.choose(out.logits[-1], generator))
    seq = Sequence(prompt + [first], out.hidden, [first])
    result = GenerationResult(seq.emitted, prefill_s=_now(target.device) - t0)
    if on_token:
        on_token(first)
    while not seq.done(max_new_tokens, target.eos_ids) and not (should_stop and should_stop()):
        new, _, _, round_ = step(target, drafter, seq, sampling, plan, generator)
        kept = seq.extend(new, max_new_tokens, target.eos_ids)
        for token in kept if on_token else ():
            on_token(token)
        round_.accepted, round_.expected = len(kept), min(round_.expected, len(kept))  # τ: committed tokens only
        result.rounds.append(round_)
    return result
