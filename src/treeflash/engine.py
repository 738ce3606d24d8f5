"""The decoding loop shared by every method: draft -> tree -> verify -> commit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .clock import now as _now
from .drafters.base import Drafter
from .target import Target
from .verify import Sampling, accept, expected_accepted


@dataclass
class Round:
    accepted: int  # tokens committed by this round: accepted drafts + the bonus token
    tree_size: int  # draft nodes verified (root excluded)
    draft_s: float
    verify_s: float
    expected: float  # E[accepted | tree] (verify.expected_accepted): equal to `accepted` at T = 0


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


def generate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int = 128,
    sampling: Sampling = Sampling(),
    budget: int = 16,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt`, stopping after an EOS token. Lossless for every drafter."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    max_new_tokens = min(max_new_tokens, target.context_length - len(prompt))
    target.taps = drafter.taps
    drafter.reset()

    t0 = _now(target.device)
    out = target.prefill(prompt)
    first = int(sampling.choose(out.logits[-1], generator))
    result = GenerationResult([first], prefill_s=_now(target.device) - t0)
    if on_token:
        on_token(first)
    tokens, features = prompt + [first], out.hidden
    # room left in the context: the tree (root + drafts) must fit after the committed positions
    while len(result.tokens) < max_new_tokens and tokens[-1] not in target.eos_ids:
        t0 = _now(target.device)
        room = target.context_length - target.length - 1
        tree = drafter.propose(tokens, features, min(budget, room))
        t1 = _now(target.device)
        out = target.verify(tree)
        path, bonus = accept(tree, out.logits, sampling, generator)
        target.commit(path)
        t2 = _now(target.device)
        features = None if out.hidden is None else out.hidden[path]
        new = [tree.tokens[i] for i in path[1:]] + [bonus]
        expected = len(new) if sampling.greedy else expected_accepted(tree, out.logits, sampling)  # not timed
        result.rounds.append(Round(len(new), tree.size, t1 - t0, t2 - t1, expected))
        for token in new:  # stop exactly where sequential decoding would
            if len(result.tokens) == max_new_tokens or tokens[-1] in target.eos_ids:
                break
            tokens.append(token)
            result.tokens.append(token)
            if on_token:
                on_token(token)
    return result
