"""The drafter interface: every decoding method is a drafter that proposes a DraftTree each round."""

from __future__ import annotations

from typing import Protocol

import torch

from ..tree import DraftTree
from ..verify import Sampling


class Drafter(Protocol):
    name: str
    #: decoder layers of the target whose hidden states the drafter reads (empty: none)
    taps: tuple[int, ...]
    #: False for plain decoding, which proposes nothing: no drafting round, no policy to weigh trees
    drafts: bool
    #: cumulative, across sequences (bench's split of a drafting round): seconds in a neural drafter's forward,
    #: and its sequential adapter calls (TreeFlash's AR layer, the Weaver) in tree builds; 0 for the others
    forward_s: float
    adapter_calls: int

    def reset(self) -> None:
        """Forget the previous sequence."""

    def follow(self, sampling: Sampling, generator: torch.Generator | None = None) -> None:
        """Draft for a sequence sampled with `sampling`, drawing any random drafts from `generator` (the
        sequence's). Drafters whose trees are deterministic ignore it."""

    def catch_up(self, tokens: list[int], features: torch.Tensor) -> None:
        """Read the taps `features` [m, len(taps), H] of the m positions committed since the previous call now
        rather than at the next `propose` (the engine passes the prompt's at prefill, so that no round pays for
        reading the prompt). Only drafters with taps are asked."""

    def propose(self, tokens: list[int], features: torch.Tensor | None, budget: int) -> DraftTree:
        """A tree of at most `budget` draft nodes below the root `tokens[-1]`.

        `tokens` are all the sequence's tokens so far (prompt, emitted tokens; the last one is the root, not yet
        seen by the target). `features` [m, len(taps), H] are the target's tapped hidden states at the m positions
        committed since the previous call (the whole prompt on the first call), or None when taps is empty.
        """
        ...
