"""Prompt-lookup decoding: training-free drafts copied from earlier occurrences of the last n-gram.

Each earlier occurrence of the sequence's last n tokens (longest n first, most recent first) proposes the tokens
that followed it. When several matches disagree, their continuations are merged into one tree, so the target
picks whichever continuation is right in a single verification.
"""

from __future__ import annotations

from ..tree import DraftTree


class PromptLookupDrafter:
    name = "pld"
    taps: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 8, max_matches: int = 8):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_matches = max_depth, max_matches

    def reset(self) -> None:
        pass

    def continuations(self, tokens: list[int]) -> list[list[int]]:
        paths: list[list[int]] = []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            key = tokens[-n:]
            for i in range(len(tokens) - n - 1, -1, -1):  # most recent first; the key itself is excluded
                if tokens[i:i + n] == key:
                    paths.append(tokens[i + n:i + n + self.max_depth])
                    if len(paths) == self.max_matches:
                        return paths
        return paths

    def propose(self, tokens, features, budget) -> DraftTree:
        return DraftTree.from_paths(tokens[-1], self.continuations(tokens), budget=budget)
