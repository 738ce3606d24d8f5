"""The drafter interface: every decoding method is a drafter that proposes a DraftTree each round."""

from __future__ import annotations

from typing import Protocol

import torch

from ..tree import DraftTree


class Drafter(Protocol):
    name: str
    #: decoder layers of the target whose hidden states the drafter reads (empty: none)
    taps: tuple[int, ...]

    def reset(self) -> None:
        """Forget the previous sequence."""

    def propose(self, tokens: list[int], features: torch.Tensor | None, budget: int) -> DraftTree:
        """A tree of at most `budget` draft nodes below the root `tokens[-1]`.

        `tokens` are all the sequence's tokens so far (prompt, emitted tokens; the last one is the root, not yet
        seen by the target). `features` [m, len(taps), H] are the target's tapped hidden states at the m positions
        committed since the previous call (the whole prompt on the first call), or None when taps is empty.
        """
        ...
