"""Plain autoregressive decoding as a drafter that proposes nothing: the fair speed reference.

It runs through the same engine, runtime and cache code as every other method, so a speedup over `ar` measures
the drafting and nothing else.
"""

from __future__ import annotations

from ..tree import DraftTree


class AutoregressiveDrafter:
    name = "ar"
    taps: tuple[int, ...] = ()
    drafts = False
    forward_s, adapter_calls = 0.0, 0

    def reset(self) -> None:
        pass

    def follow(self, sampling, generator=None) -> None:
        pass

    def propose(self, tokens, features, budget) -> DraftTree:
        return DraftTree.chain(tokens[-1])
