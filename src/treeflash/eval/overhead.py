"""`treeflash overhead`: what the engine costs on top of the bare target forward, measured in one run.

Two ratios: an AR round (propose + verify + accept + commit through the engine's code) against one bare
1-token forward on the same cache length; and the verification of a 17-node tree (ancestor mask, acceptance, KV
compaction) against one bare causal forward of 17 tokens. Both should be close to 1.
"""

from __future__ import annotations

import statistics

import torch
from transformers import DynamicCache

from ..clock import now
from ..drafters import make_drafter
from ..engine import generate
from ..runtime import Target
from ..tree import DraftTree
from ..verify import Sampling, accept


def _bare_forward_s(target: Target, prefix: list[int], n: int) -> float:
    """One plain HF forward of n tokens on a cache holding `prefix` (the cache is built outside the timing)."""
    cache, device = DynamicCache(), target.device
    with torch.inference_mode():
        target.model(torch.tensor([prefix], device=device), cache=cache, use_cache=True)
        ids = torch.tensor([prefix[-n:]], device=device)
        start = now(device)
        target.model(ids, cache=cache, use_cache=True)
        return now(device) - start


def _tree_round_s(target: Target, prefix: list[int], tree: DraftTree) -> float:
    target.prefill(prefix)
    start = now(target.device)
    out = target.verify(tree)
    path, _ = accept(tree, out.logits, Sampling())
    target.commit(path)
    return now(target.device) - start


def wide_tree(root: int, vocab: int, size: int = 16) -> DraftTree:
    """A 17-node tree shaped like a DDTree: a main branch with side branches near the root."""
    paths = [[(7 * d + 1) % vocab for d in range(10)], [11 % vocab, 12 % vocab, 13 % vocab],
             [14 % vocab, 15 % vocab], [(7 + 1) % vocab, 16 % vocab], [17 % vocab]]
    return DraftTree.from_paths(root, paths, budget=size)


def measure_overhead(target: Target, context: int = 200, repeats: int = 20) -> dict:
    prompt = [(17 * i + 3) % target.config.vocab_size for i in range(context)]
    tree = wide_tree(prompt[-1], target.config.vocab_size)
    assert tree.size == 16 and not tree.is_chain
    ar_rounds, bare1, bare17, tree17 = [], [], [], []
    ar = make_drafter("ar")
    generate(target, ar, prompt, 4)  # warm-up
    for _ in range(repeats):  # interleaved: noise hits all four alike
        result = generate(target, ar, prompt, 9)
        ar_rounds += [r.draft_s + r.verify_s for r in result.rounds]
        bare1.append(_bare_forward_s(target, prompt, 1))
        bare17.append(_bare_forward_s(target, prompt + prompt[:17], 17))
        tree17.append(_tree_round_s(target, prompt, tree))
    med = statistics.median
    return {
        "context": context, "repeats": repeats, "threads": torch.get_num_threads(),
        "ar_round_ms": 1e3 * med(ar_rounds), "bare_forward_1_ms": 1e3 * med(bare1),
        "ar_overhead": med(ar_rounds) / med(bare1),
        "tree_verify_17_ms": 1e3 * med(tree17), "bare_forward_17_ms": 1e3 * med(bare17),
        "tree_overhead": med(tree17) / med(bare17),
    }
