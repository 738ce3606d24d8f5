"""A datastore for retrieval drafting (REST, He et al. 2024): the target's own earlier answers, indexed by n-gram.

Prompt lookup copies from the sequence's own context; a datastore adds what the target wrote for other prompts. The
target's answers repeat themselves across prompts of a kind (a GSM8K answer's "<<48/2=24>>24 clips in May.\n"), so
the tokens that followed the same n-gram elsewhere are good drafts where the context has none: on answers held out
from the answer store (after their prompts), a one-node draft is right 0.63 of the time on GSM8K with the datastore
where the context's match is short, against 0.52 with the context alone (docs/results/rest).

The index is one sorted array, no trie: every position's next `ngram` tokens packed into one uint64 key (`bits`
per token, big-endian), sorted. Sorting by the longest n-gram sorts by every shorter prefix too, so the occurrences
of any n-gram up to that length are one contiguous range, found by two binary searches. Answers are joined with a
separator that no token equals, so no match or continuation crosses from one answer into the next.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FILE = "datastore.npz"
INFO = "datastore.json"


class Datastore:
    """Token sequences (e.g. answers) searchable by their n-grams of up to `ngram` tokens."""

    def __init__(self, tokens: np.ndarray, lengths: np.ndarray, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.bits = max(int(self.vocab_size).bit_length(), 1)  # one value more than any token: the separator
        self.ngram = min(4, 64 // self.bits)  # as many tokens as fit one uint64 key
        self.separator = (1 << self.bits) - 1
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if len(tokens) != lengths.sum() or (len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size)):
            raise ValueError(f"a datastore needs token ids in 0..{self.vocab_size - 1} and lengths that sum to them")
        self.tokens, self.lengths = tokens, lengths
        # the sequences joined, each followed by a separator; `ngram` more at the end, so every position has a key
        ends = np.cumsum(lengths)
        flat = np.full(len(tokens) + len(lengths) + self.ngram, self.separator, dtype=np.uint32)
        keep = np.ones(len(flat) - self.ngram, dtype=bool)
        keep[ends + np.arange(len(lengths))] = False  # where the separators go
        flat[:len(keep)][keep] = tokens
        self.flat = flat
        keys = np.zeros(len(flat) - self.ngram, dtype=np.uint64)
        for j in range(self.ngram):
            keys = (keys << np.uint64(self.bits)) | flat[j:j + len(keys)].astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.order = order.astype(np.int32) if len(order) < 2**31 else order  # (half the memory)

    def __len__(self) -> int:
        return len(self.tokens)

    def continuations(self, context: list[int], max_depth: int = 8, max_matches: int = 16,
                      min_ngram: int = 1) -> tuple[int, list[list[int]]]:
        """(n, paths): the longest n (up to `ngram`) whose last n tokens of `context` occur in the datastore, and
        the tokens that followed up to `max_matches` of those occurrences (at most `max_depth` each, none past
        the end of its sequence). Occurrences are sorted by what follows them, so an even spread over them keeps
        the continuations' shares: the paths' votes estimate how often each continuation follows."""
        for n in range(min(self.ngram, len(context)), min_ngram - 1, -1):
            gram = context[-n:]
            if max(gram) >= self.vocab_size or min(gram) < 0:
                return 0, []  # a token the datastore cannot hold
            key = 0
            for token in gram:
                key = (key << self.bits) | token
            shift = self.bits * (self.ngram - n)
            lo = int(np.searchsorted(self.keys, np.uint64(key << shift), side="left"))
            hi = int(np.searchsorted(self.keys, np.uint64(((key + 1) << shift) - 1), side="right"))
            if hi > lo:
                count = hi - lo
                picks = range(lo, hi) if count <= max_matches else \
                    [lo + i * count // max_matches for i in range(max_matches)]
                paths = []
                for i in picks:
                    start = int(self.order[i]) + n
                    path = self.flat[start:start + max_depth].tolist()
                    if self.separator in path:
                        path = path[:path.index(self.separator)]
                    if path:
                        paths.append(path)
                if paths:
                    return n, paths
        return 0, []

    # ---- files -------------------------------------------------------------------------------------------------
    def save(self, folder: str | Path, info: dict) -> Path:
        """DATASTORE folder: the sequences (uint16 where the vocabulary fits it) and `info` (where they came from)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        np.savez_compressed(folder / FILE, tokens=self.tokens.astype(dtype), lengths=self.lengths.astype(np.uint32),
                            vocab_size=np.asarray(self.vocab_size))
        info = {**info, "sequences": len(self.lengths), "tokens": int(len(self.tokens)), "vocab_size": self.vocab_size}
        (folder / INFO).write_text(json.dumps(info, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "Datastore":
        path = Path(folder) / FILE
        if not path.is_file():
            raise FileNotFoundError(f"no datastore at {folder} ({FILE} missing): build one with "
                                    "`treeflash data datastore --out FOLDER`")
        with np.load(path, allow_pickle=False) as z:
            return cls(z["tokens"], z["lengths"], int(z["vocab_size"]))

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], vocab_size: int) -> "Datastore":
        lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
        tokens = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if sequences else \
            np.zeros(0, dtype=np.int64)
        return cls(tokens, lengths, vocab_size)
