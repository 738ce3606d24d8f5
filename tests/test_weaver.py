"""DFlash-TfM: the zero-initialised Weaver, its shared branch cache, w-parallel best-first trees, losslessness."""

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from treeflash import DraftTree, generate
from treeflash.drafters import WeaverDrafter, make_drafter
from treeflash.models.weaver import Weaver, WeaverConfig
from treeflash.trees import opt_tree, parallel_tree, tree_value

from conftest import tiny_target
from test_dflash import tiny_drafter
from test_lossless import repetitive_prompt


def tiny_weaver(drafter, seed=3, random_residual=True, **kw) -> Weaver:
    torch.manual_seed(seed)
    weaver = Weaver(WeaverConfig.for_drafter(drafter.config, **{"top_k": 12, **kw})).attach(drafter)
    if random_residual:  # a Weaver whose residual really changes the distributions
        torch.nn.init.normal_(weaver.out_proj.weight, std=1.0)
    return weaver


def test_fresh_weaver_is_the_marginal_on_its_candidates(tmp_path):
    target = tiny_target("llama")
    drafter = WeaverDrafter(tiny_drafter(target), tiny_weaver(tiny_drafter(target), random_residual=False), width=2)
    prompt = repetitive_prompt(random.Random(0), 96)
    drafter.observe(torch.randn(len(prompt), 2, 64))
    tree = drafter.propose(prompt + [5], None, 6)
    rnd = drafter.last_round
    marginal = torch.softmax(drafter.model.logits(rnd.h).float(), dim=-1).gather(-1, rnd.candidates)  # [D, K]
    probs = rnd(list(range(len(tree))), list(tree.tokens), list(tree.parents), list(tree.depths))
    for n, d in enumerate(tree.depths):
        if d < len(marginal):
            torch.testing.assert_close(probs[n], marginal[d] / marginal[d].sum())
    # the training forward too: zero residual
    w = drafter.weaver
    out = w(torch.randn(2, 7, 64), torch.randn(2, 64), torch.randint(0, 96, (2, 7)))
    assert out.abs().max() == 0
    w.save_pretrained(tmp_path, dtype=torch.float32)  # round trip
    loaded = Weaver.from_pretrained(tmp_path)
    assert loaded.config == w.config
    for k, v in w.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


def test_branch_cache_equals_each_branch_on_its_own():
    """Nodes stepped in batches over a shared cache get what a fresh causal pass over their own branch gives."""
    target = tiny_target("qwen3")
    weaver = tiny_weaver(tiny_drafter(target), num_layers=2)
    tree = DraftTree.from_paths(7, [[1, 2, 3], [1, 4], [5, 6, 8, 9], [1, 2, 10]])
    h, ctx = torch.randn(8, 64), torch.randn(64)
    cache = weaver.new_cache(len(tree))
    outs = {}
    for depth in range(max(tree.depths) + 1):  # one batched call per depth: siblings and cousins together
        nodes = [n for n, d in enumerate(tree.depths) if d == depth]
        d = torch.tensor([depth] * len(nodes))
        out = weaver.step(cache, nodes, [tree.parents[n] for n in nodes], d, h[d], ctx,
                          torch.tensor([tree.tokens[n] for n in nodes]))
        outs.update(zip(nodes, out))
    for n in range(len(tree)):
        path = tree.path_to(n)
        branch = weaver(h[None, :len(path)], ctx[None], torch.tensor([tree.tokens[i] for i in path])[None])
        torch.testing.assert_close(outs[n], branch[0, -1], atol=1e-5, rtol=1e-5)


def table_scorer(tokens, probs, calls):
    """A first-order scorer from OPT-Tree tables: the child distribution depends on the node's token only."""
    index = [{t: i for i, t in enumerate(row)} for row in tokens.tolist()]

    def expand(nodes, tree_tokens, parents, depths):
        calls.append(len(nodes))
        rows = [0 if depths[n] == 0 or probs.shape[1] == 1 else index[depths[n] - 1][tree_tokens[n]] for n in nodes]
        return torch.stack([probs[depths[n], r] for n, r in zip(nodes, rows)])
    return expand


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 4), width=st.integers(1, 4), budget=st.integers(1, 12))
def test_one_wide_expansion_is_opt_tree(seed, depth, width, budget):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randperm(30, generator=g)[:width] for _ in range(depth)])
    probs = torch.softmax(3 * torch.randn(depth, width, width, generator=g), -1)
    calls = []
    tree = parallel_tree(0, tokens, table_scorer(tokens, probs, calls), budget, width=1)
    reference = opt_tree(0, tokens, probs, budget)
    assert tree == reference
    assert abs(tree_value(tree, tokens, probs) - tree_value(reference, tokens, probs)) < 1e-12
    assert all(c == 1 for c in calls) and len(calls) <= budget


@pytest.mark.parametrize("w", [2, 4, 8])
def test_w_wide_expansion_takes_ceil_b_over_w_calls(w):
    g = torch.Generator().manual_seed(w)
    tokens = torch.stack([torch.randperm(50, generator=g)[:10] for _ in range(6)])
    probs = torch.softmax(torch.randn(6, 10, 10, generator=g), -1)
    for budget in (1, 5, 16, 33):
        calls = []
        tree = parallel_tree(0, tokens, table_scorer(tokens, probs, calls), budget, width=w)
        assert tree.size == budget and len(calls) == math.ceil(budget / w)
        assert calls[0] == 1 and all(c <= w for c in calls)
        # a batched tree can only trail the exact best-first one
        assert tree_value(tree, tokens, probs) <= tree_value(opt_tree(0, tokens, probs, budget), tokens, probs) + 1e-9


@pytest.mark.parametrize("budget,w", [(1, 4), (5, 1), (16, 4), (16, 8), (30, 8)])
def test_tfm_drafter_counts_weaver_calls(budget, w):
    target = tiny_target("llama")
    drafter = WeaverDrafter(tiny_drafter(target), tiny_weaver(tiny_drafter(target)), width=w)
    prompt = repetitive_prompt(random.Random(1), 96)
    drafter.observe(torch.randn(len(prompt), 2, 64))
    tree = drafter.propose(prompt + [5], None, budget)
    assert tree.size == budget and drafter.last_round.calls == math.ceil(budget / w)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tfm_is_lossless(kind):
    target = tiny_target(kind)
    backbone = tiny_drafter(target, seed=1)
    for w in (1, 4):
        drafter = WeaverDrafter(backbone, tiny_weaver(backbone, seed=w), width=w)
        for seed in range(2):
            prompt = repetitive_prompt(random.Random(seed), 96)
            ar = generate(target, make_drafter("ar"), prompt, 30).tokens
            for budget in (1, 5, 16):
                assert generate(target, drafter, prompt, 30, budget=budget).tokens == ar


def test_make_drafter_tfm(tmp_path):
    target = tiny_target("qwen3")
    backbone = tiny_drafter(target)
    backbone.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    tiny_weaver(backbone).save_pretrained(tmp_path / "weaver")
    with pytest.raises(FileNotFoundError, match="--weaver"):
        make_drafter("tfm", target, str(tmp_path / "dflash"))
    drafter = make_drafter("tfm", target, str(tmp_path / "dflash"), str(tmp_path / "weaver"), width=3)
    assert drafter.name == "tfm" and drafter.width == 3
    prompt = repetitive_prompt(random.Random(2), 96)
    assert generate(target, drafter, prompt, 20, budget=8).tokens == generate(target, make_drafter("ar"), prompt,
                                                                               20).tokens
