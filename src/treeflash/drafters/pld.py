"""Prompt-lookup decoding: training-free drafts copied from earlier occurrences of the last n-gram.

Each earlier occurrence of the sequence's last n tokens (longest n first, most recent first) proposes the tokens
that followed it. When several matches disagree, their continuations are merged into one tree, so the target
picks whichever continuation is right in a single verification. Nodes come best first: most votes, then the
earliest match, then the shallowest. A node's probability given its parent is the share of the parent's matches that
go on with it (the votes), scaled by the strength of its longest match (n / max_ngram): a copy after one repeated
token is a weaker guess than one after three. Cost-aware speculation calibrates these numbers against what the
target accepts, and leans on them while it has few observations: as plain vote shares, a lone match after one
repeated token claimed certainty, and the policy verified large trees that cost more than they gave
(docs/results/cpu-auto).

With a `Datastore` (method `rest`), the drafts come from the target's own earlier answers wherever the context's
longest match is shorter than `TRUST_NGRAM` tokens: a copy after one repeated token of the context is a weaker
guess than the continuation that most often followed the last few tokens in the datastore. The datastore drafts
after a match of DATASTORE_MIN_NGRAM tokens or more: what followed one token somewhere in 2.4 M tokens is little
more than the commonest bigram (docs/results/rest).
"""

from __future__ import annotations

from ..tree import DraftTree
from .datastore import Datastore

# a context match of this many tokens is trusted over the datastore: on held-out answers, copying after 2-3
# repeated tokens of the context beat the datastore's continuation, copying after one did not (docs/results/rest)
TRUST_NGRAM = 2
# the shortest datastore match drafted from: with 1, rest decoded chat-dev at 1.00-1.05x ar against prompt lookup's
# 1.07-1.14x (same tokens per round, larger trees); with 2, at 1.06x against 1.05x, and code and math gained too
# (MBPP 1.46x against 1.34x ar; docs/results/rest)
DATASTORE_MIN_NGRAM = 2


class PromptLookupDrafter:
    taps: tuple[int, ...] = ()
    drafts = True
    forward_s, adapter_calls = 0.0, 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_depth: int = 8, max_matches: int = 8,
                 datastore: Datastore | None = None, datastore_matches: int = 16, trust_ngram: int = TRUST_NGRAM,
                 datastore_min_ngram: int = DATASTORE_MIN_NGRAM):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_matches = max_depth, max_matches
        self.datastore, self.datastore_matches, self.trust_ngram = datastore, datastore_matches, trust_ngram
        self.datastore_min_ngram = datastore_min_ngram
        self.name = "pld" if datastore is None else "rest"

    def reset(self) -> None:
        pass

    def follow(self, sampling, generator=None) -> None:
        pass  # its drafts are copies, whatever the sampling

    def continuations(self, tokens: list[int]) -> list[tuple[int, list[int]]]:
        """(n, the tokens that followed) for each earlier occurrence of the last n tokens, longest n first."""
        paths: list[tuple[int, list[int]]] = []
        # where an occurrence could end: the earlier positions of the last token, most recent first (the key itself
        # excluded); one pass over the context, then slices compared at those positions only
        last = tokens[-1]
        ends = [j for j in range(len(tokens) - 2, -1, -1) if tokens[j] == last]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) <= n:
                continue
            key = tokens[-n:]
            for j in ends:
                if j >= n - 1 and tokens[j - n + 1:j + 1] == key:
                    paths.append((n, tokens[j + 1:j + 1 + self.max_depth]))
                    if len(paths) == self.max_matches:
                        return paths
        return paths

    def propose(self, tokens, features, budget) -> DraftTree:
        matches = self.continuations(tokens)  # longest n first
        paths, strengths = [path for _, path in matches], [n / self.max_ngram for n, _ in matches]
        if self.datastore is not None and (not matches or matches[0][0] < self.trust_ngram):
            n, found = self.datastore.continuations(tokens, self.max_depth, self.datastore_matches,
                                                    self.datastore_min_ngram)
            paths, strengths = found + paths, [n / self.datastore.ngram] * len(found) + strengths
        return vote_tree(tokens[-1], paths, budget, strengths)


def vote_tree(root: int, paths: list[list[int]], budget: int, strengths: list[float] | None = None) -> DraftTree:
    """The trie of `paths` (the earliest first), best first, cut to `budget` nodes, with vote-share probabilities,
    each scaled by the largest strength (default 1) among the paths through the node. A node never has more votes
    than its parent, nor an earlier first path, so the order keeps parents first and every prefix of it is a tree."""
    strengths = strengths or [1.0] * len(paths)
    votes: dict[tuple[int, ...], int] = {(): len(paths)}
    first: dict[tuple[int, ...], int] = {}
    strength: dict[tuple[int, ...], float] = {}
    for i, path in enumerate(paths):
        for depth in range(1, len(path) + 1):
            key = tuple(path[:depth])
            votes[key] = votes.get(key, 0) + 1
            first.setdefault(key, i)
            strength[key] = max(strength.get(key, 0.0), strengths[i])
    order = sorted(first, key=lambda key: (-votes[key], first[key], len(key)))[:budget]
    index = {(): 0}
    tokens, parents, probs = [root], [-1], [1.0]
    for key in order:
        index[key] = len(tokens)
        tokens.append(key[-1])
        parents.append(index[key[:-1]])
        probs.append(strength[key] * votes[key] / votes[key[:-1]])
    return DraftTree.from_parents(tokens, parents, probs)
