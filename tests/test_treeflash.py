"""TreeFlash: the zero-initialised AR layer, the batched conditional tables, OPT-Tree's optimality, losslessness."""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from treeflash import generate
from treeflash.drafters import BlockDrafter, make_drafter
from treeflash.drafters.dflash import conditional_tables
from treeflash.models.dflash import DFlashConfig, DFlashDrafter
from treeflash.trees import opt_tree, tree_value

from conftest import tiny_target
from test_dflash import tiny_drafter
from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_lossless import repetitive_prompt


@pytest.mark.parametrize("kind,prev", [("swiglu", 1), ("linear", 1), ("swiglu", 2)])
def test_fresh_ar_layer_reproduces_the_backbone(kind, prev, tmp_path):
    target = tiny_target("llama")
    backbone = tiny_drafter(target)
    taps = torch.randn(20, 2, 64)
    first, positions = torch.tensor([3, 9]), torch.arange(8).repeat(2) + 10
    prev_tokens = torch.randint(0, 96, (2, 7, prev))
    before = backbone(first, positions, taps, None)
    backbone.add_ar_layer(kind, prev)
    torch.testing.assert_close(backbone(first, positions, taps, None, prev_tokens), before, atol=0, rtol=0)
    backbone.save_pretrained(tmp_path, dtype=torch.float32)  # and the layer survives a round trip
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.ar_layer is not None and loaded.config.ar_layer == backbone.config.ar_layer


def treeflash_drafter(target, seed=2, prev=1):
    drafter = tiny_drafter(target, seed=seed).add_ar_layer("swiglu", prev)
    torch.nn.init.normal_(drafter.ar_layer.out_proj.weight, std=0.5)  # a layer that changes the conditionals
    return drafter


def test_ar_layer_runs_once_on_all_pairs_whatever_the_budget():
    target = tiny_target("qwen3")
    drafter = BlockDrafter(treeflash_drafter(target), "treeflash", top_m=5)
    calls = []
    drafter.model.ar_layer.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    prompt = repetitive_prompt(random.Random(0), 96)
    for budget in (2, 5, 30):
        drafter.reset()
        calls.clear()
        drafter.observe(torch.randn(len(prompt), 2, 64))
        tree = drafter.propose(prompt + [5], None, budget)
        # one call: (γ - 1) depths x M previous tokens, M = min(top_m, budget)
        assert calls == [(7, min(5, budget), 64)]
        assert tree.size == budget


def test_conditionals_depend_on_the_previous_token():
    target = tiny_target("llama")
    model = treeflash_drafter(target)
    h = torch.randn(7, 64)
    cand, cond = conditional_tables(model, [8, 4], h, top_m=6)
    assert cand.shape == (7, 6) and cond.shape == (7, 6, 6)
    assert torch.allclose(cond[0, 0], cond[0, 5])  # depth 1: every row conditions on the root
    assert not torch.allclose(cond[3, 0], cond[3, 1])
    assert (cond.sum(-1) <= 1 + 1e-5).all()


@pytest.mark.parametrize("top_n", [0, 10, 96])
def test_conditional_tables_against_full_vocabulary_softmax(top_n):
    """The plain reference: each pair's AR-conditioned full-vocabulary softmax at the candidates. Normalising over
    the whole vocabulary (N = V) is exact; a fresh AR layer gives the marginals for every N."""
    target = tiny_target("llama")
    model, h, root = treeflash_drafter(target), torch.randn(7, 64), 4
    cand, cond = conditional_tables(model, [8, root], h, top_m=6, top_n=top_n)
    prev = torch.cat([torch.full((1, 6), root), cand[:-1]])  # [D, M]
    states = model.ar_layer(h[:, None].expand(7, 6, 64), model.embed(prev[:, :, None]))
    full = torch.softmax(model.logits(states).float(), dim=-1)  # [D, M prev, V]
    exact = full.gather(-1, cand[:, None, :].expand(7, 6, 6))
    if top_n == 96:
        torch.testing.assert_close(cond, exact, atol=1e-5, rtol=1e-4)
    torch.nn.init.zeros_(model.ar_layer.out_proj.weight)  # fresh: the conditionals are the marginals
    cand, cond = conditional_tables(model, [8, root], h, top_m=6, top_n=top_n)
    marginal = torch.softmax(model.logits(h).float(), dim=-1).gather(-1, cand)
    torch.testing.assert_close(cond, marginal[:, None, :].expand(7, 6, 6), atol=1e-6, rtol=1e-5)


def brute_force_best(tokens, probs, budget):
    """Every set of `budget` nodes of the full candidate tree that is closed under parents; the best value."""
    depth, width = tokens.shape
    nodes = [path for d in range(1, depth + 1) for path in itertools.product(range(width), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(nodes, budget):
        chosen = set(subset)
        if all(len(n) == 1 or n[:-1] in chosen for n in subset):
            total = 0.0
            for n in subset:
                value, prev = 1.0, 0
                for d, i in enumerate(n):
                    value *= float(probs[d, prev if probs.shape[1] > 1 else 0, i])
                    prev = i
                total += value
            best = max(best, total)
    return best


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 3), width=st.integers(1, 3), budget=st.integers(1, 5),
       shared=st.booleans())
def test_opt_tree_is_optimal(seed, depth, width, budget, shared):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.stack([torch.randperm(20, generator=g)[:width] for _ in range(depth)])
    rows = 1 if shared else width
    probs = torch.softmax(3 * torch.randn(depth, rows, width + 1, generator=g), -1)[..., :width]
    n_nodes = sum(width ** d for d in range(1, depth + 1))
    budget = min(budget, n_nodes)
    tree = opt_tree(0, tokens, probs, budget)
    assert tree.size == budget
    assert abs(tree_value(tree, tokens, probs) - brute_force_best(tokens, probs, budget)) < 1e-9


@pytest.mark.parametrize("prev", [1, 2])
def test_treeflash_is_lossless(prev):
    target = tiny_target("llama")
    drafter = BlockDrafter(treeflash_drafter(target, prev=prev), "treeflash", top_m=4)
    for seed in range(3):
        prompt = repetitive_prompt(random.Random(seed), 96)
        ar = generate(target, make_drafter("ar"), prompt, 40).tokens
        for budget in (1, 6, 16):
            assert generate(target, drafter, prompt, 40, budget=budget).tokens == ar


def test_treeflash_needs_an_ar_layer():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="AR layer"):
        BlockDrafter(tiny_drafter(target), "treeflash")


def test_dist_command_reports_both_kinds(tmp_path, tiny_folder, capsys):  # noqa: F811
    """TVD and coverage per depth, DFlash marginals vs TreeFlash conditionals, as JSON and a plot."""
    import json

    from transformers import AutoModelForCausalLM

    from treeflash.cli import main

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    drafter = DFlashDrafter(DFlashConfig.for_target(model.config, num_layers=1, num_taps=2, block_size=4))
    drafter.add_ar_layer("swiglu", 1)
    drafter.save_pretrained(tmp_path / "tf", dtype=torch.float32)
    out, png = tmp_path / "dist.json", tmp_path / "dist.png"
    assert main(["dist", "--target", tiny_folder, "--drafter", str(tmp_path / "tf"), "--limit", "2",
                 "--max-new-tokens", "6", "--out", str(out), "--plot", str(png), "--no-progress"]) == 0
    report = json.loads(out.read_text())["methods"]
    assert set(report) == {"dflash", "treeflash"}
    for r in report.values():
        assert r["depth"] == [1, 2, 3] and all(0 <= x <= 1 for x in r["tvd"] + r["top1_coverage"])
        assert all(a <= b for a, b in zip(r["top1_coverage"], r["top5_coverage"]))
    # a fresh AR layer is the identity: both kinds measure the same distributions
    assert report["dflash"]["tvd"] == pytest.approx(report["treeflash"]["tvd"], abs=1e-6)
    assert png.stat().st_size > 1000
    # T = 1: sampled continuations; coverage is the target's mass on the drafter's top k, so rarely 0 or 1 exactly
    assert main(["dist", "--target", tiny_folder, "--drafter", str(tmp_path / "tf"), "--limit", "2", "--temperature",
                 "1", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    sampled = json.loads(out.read_text())
    assert sampled["temperature"] == 1.0
    r = sampled["methods"]["dflash"]
    assert all(0 < c < 1 for c in r["top1_coverage"] + r["top5_coverage"])
    assert all(a < b for a, b in zip(r["top1_coverage"], r["top5_coverage"]))
    assert sampled["methods"]["treeflash"]["top5_coverage"] == pytest.approx(r["top5_coverage"], abs=1e-6)
