"""DFlash-TfM: the zero-initialised Weaver, its shared branch cache, w-parallel best-first trees, losslessness."""

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from treeflash import DraftTree, generate
from treeflash.drafters import block_drafter, make_drafter
from treeflash.drafters.builders import WeaverRound
from treeflash.models.checkpoint import DrafterError, weights_digest
from treeflash.models.weaver import Weaver, WeaverConfig
from treeflash.train.dflash import Sequence, sample_anchors, target_view
from treeflash.train.losses import candidate_kl
from treeflash.train.weaver import weaver_loss
from treeflash.trees import opt_tree, parallel_tree, tree_value

from conftest import tiny_target
from test_cli import tiny_folder  # noqa: F401  (fixture)
from test_dflash import tiny_drafter
from test_lossless import repetitive_prompt
from test_train import write_store


def tiny_weaver(drafter, seed=3, random_residual=True, **kw) -> Weaver:
    torch.manual_seed(seed)
    weaver = Weaver(WeaverConfig.for_drafter(drafter.config, **{"top_k": 12, **kw})).attach(drafter)
    if random_residual:  # a Weaver whose residual really changes the distributions
        torch.nn.init.normal_(weaver.out_proj.weight, std=1.0)
    return weaver


def test_fresh_weaver_is_the_marginal_on_its_candidates(tmp_path):
    target = tiny_target("llama")
    weaver = tiny_weaver(tiny_drafter(target), random_residual=False)
    drafter = block_drafter(tiny_drafter(target), "tfm", weaver=weaver, width=2)
    prompt = repetitive_prompt(random.Random(0), 96)
    drafter.observe(torch.randn(len(prompt), 2, 64))
    h = drafter.draft(prompt + [5], None)
    tree = drafter.tree(prompt + [5], h, 6)
    rnd = WeaverRound(weaver, h, drafter.last_feature, capacity=7)
    marginal = torch.softmax(drafter.model.logits(rnd.h).float(), dim=-1).gather(-1, rnd.candidates)  # [D, K]
    probs = rnd(list(range(len(tree))), list(tree.tokens), list(tree.parents), list(tree.depths))
    for n, d in enumerate(tree.depths):
        if d < len(marginal):
            torch.testing.assert_close(probs[n], marginal[d] / marginal[d].sum())
    # the training forward too: zero residual
    w = weaver
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


@pytest.mark.parametrize("w", [2, 4, 8])
def test_fallback_grows_the_last_batch_for_free(w):
    """Marginal tables (one row per depth): the scorer and the fallback agree, so the fallback can only add value
    (each pop of the last batch chooses from more slots), never beyond OPT-Tree's, and costs no call."""
    g = torch.Generator().manual_seed(w)
    tokens = torch.stack([torch.randperm(50, generator=g)[:10] for _ in range(6)])
    probs = torch.softmax(2 * torch.randn(6, 1, 10, generator=g), -1)
    for budget in (1, 5, 16, 33):
        calls, plain_calls = [], []
        tree = parallel_tree(0, tokens, table_scorer(tokens, probs, calls), budget, w, fallback=probs[:, 0])
        plain = parallel_tree(0, tokens, table_scorer(tokens, probs, plain_calls), budget, w)
        assert tree.size == budget and len(calls) == len(plain_calls) == math.ceil(budget / w)
        best = tree_value(opt_tree(0, tokens, probs, budget), tokens, probs)
        assert tree_value(plain, tokens, probs) - 1e-9 <= tree_value(tree, tokens, probs) <= best + 1e-9
    peaked = torch.softmax(torch.tensor([6.0] + [0.0] * 9), -1).expand(6, 1, 10)  # a confident chain
    tree = parallel_tree(0, tokens, table_scorer(tokens, peaked, []), 16, 8, fallback=peaked[:, 0])
    assert max(tree.depths) == 6 > max(parallel_tree(0, tokens, table_scorer(tokens, peaked, []), 16, 8).depths)


@pytest.mark.parametrize("budget,w", [(1, 4), (5, 1), (16, 4), (16, 8), (30, 8)])
def test_tfm_drafter_counts_weaver_calls(budget, w):
    target = tiny_target("llama")
    drafter = block_drafter(tiny_drafter(target), "tfm", weaver=tiny_weaver(tiny_drafter(target)), width=w)
    prompt = repetitive_prompt(random.Random(1), 96)
    drafter.observe(torch.randn(len(prompt), 2, 64))
    tree = drafter.propose(prompt + [5], None, budget)
    assert tree.size == budget and drafter.adapter_calls == math.ceil(budget / w)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tfm_is_lossless(kind):
    target = tiny_target(kind)
    backbone = tiny_drafter(target, seed=1)
    for w in (1, 4):
        drafter = block_drafter(backbone, "tfm", weaver=tiny_weaver(backbone, seed=w), width=w)
        for seed in range(2):
            prompt = repetitive_prompt(random.Random(seed), 96)
            ar = generate(target, make_drafter("ar"), prompt, 30).tokens
            for budget in (1, 5, 16):
                assert generate(target, drafter, prompt, 30, budget=budget).tokens == ar


def test_make_drafter_tfm(tmp_path):
    target = tiny_target("qwen3")
    backbone = tiny_drafter(target)
    backbone.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    weaver = tiny_weaver(backbone)
    weaver.config.backbone_sha256 = weights_digest(tmp_path / "dflash")  # as `train weaver` records it
    weaver.save_pretrained(tmp_path / "weaver")
    tiny_drafter(target, seed=1).save_pretrained(tmp_path / "other", dtype=torch.float32)
    with pytest.raises(DrafterError, match="trained on another DFlash drafter"):
        make_drafter("tfm", target, str(tmp_path / "other"), str(tmp_path / "weaver"))
    with pytest.raises(FileNotFoundError, match="--weaver"):
        make_drafter("tfm", target, str(tmp_path / "dflash"))
    drafter = make_drafter("tfm", target, str(tmp_path / "dflash"), str(tmp_path / "weaver"), width=3)
    assert drafter.name == "tfm" and drafter.builder.width == 3
    prompt = repetitive_prompt(random.Random(2), 96)
    assert generate(target, drafter, prompt, 20, budget=8).tokens == generate(target, make_drafter("ar"), prompt,
                                                                               20).tokens


def test_candidate_kl_is_a_proper_kl():
    p = torch.log_softmax(torch.randn(4, 10), -1)
    q = torch.log_softmax(torch.randn(4, 10), -1)
    everything = torch.arange(10).expand(4, 10)
    torch.testing.assert_close(candidate_kl(p, everything, q), (p.exp() * (p - q)).sum(-1))
    cand = torch.randperm(10)[:3].expand(4, 3)
    assert (candidate_kl(p, cand, q.gather(-1, cand)) >= -1e-6).all()
    assert candidate_kl(p, cand, p.gather(-1, cand)).abs().max() < 1e-6


def test_a_few_weaver_steps_learn_and_the_backbone_stays():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4).requires_grad_(False)
    frozen = {k: v.clone() for k, v in drafter.state_dict().items()}
    weaver = tiny_weaver(drafter, random_residual=False, top_k=16)
    seq = Sequence(torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)), prompt_len=5)
    view = target_view(target.model, seq.tokens, drafter.config.target_layer_ids)
    anchors = sample_anchors(seq, 16, torch.Generator().manual_seed(0))
    optim = torch.optim.AdamW(weaver.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, stats = weaver_loss(weaver, drafter, seq, view, anchors)
        optim.zero_grad()
        loss.backward()
        optim.step()
        first = first or stats["loss"]
    assert stats["loss"] < 0.7 * first and stats["acc"] > stats["acc_dflash"]
    assert stats["acc_depth1"] >= stats["acc_dflash_depth1"] and 0 <= stats["acc_dflash_depth1"] <= 1
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(v, frozen[k], atol=0, rtol=0)


def test_the_weaver_learns_on_short_blocks_as_it_drafts_from_them():
    """On a backbone trained for short blocks, a block of length L teaches its first L - 1 depths only (whole blocks:
    the plain loss)."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=4)
    weaver = tiny_weaver(drafter, top_k=16)
    seq = Sequence(torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)), prompt_len=5)
    view = target_view(target.model, seq.tokens, drafter.config.target_layer_ids)
    anchors = torch.tensor([5, 9, 20, 38])
    with torch.no_grad():
        plain = weaver_loss(weaver, drafter, seq, view, anchors)
        whole = weaver_loss(weaver, drafter, seq, view, anchors, lengths=torch.full((4,), 4))
        short = weaver_loss(weaver, drafter, seq, view, anchors, lengths=torch.tensor([2, 4, 3, 4]))
    assert whole[1] == plain[1] and short[1]["tokens"] == 1 + 3 + 2 + 1  # the last anchor: one position left
    assert short[1]["loss"] != plain[1]["loss"]


def test_train_weaver_cli_and_dist(tmp_path, tiny_folder):  # noqa: F811
    """A 2-step `train weaver` run on a frozen backbone, then `dist` with the three kinds in one report."""
    import json

    from transformers import AutoModelForCausalLM

    from treeflash.cli import main
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash_config import DFlashConfig

    assert main(["generate", "hi", "--method", "tfm", "--target", tiny_folder]) == 2  # no --weaver: one-line error
    write_store(tmp_path, tiny_folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    torch.manual_seed(0)
    backbone = DFlashDrafter(DFlashConfig.for_target(model.config, num_layers=1, num_taps=2, block_size=4,
                                                     mask_token_id=16))
    backbone.add_ar_layer("swiglu", 1)
    backbone.save_pretrained(tmp_path / "tf", dtype=torch.float32)
    out = tmp_path / "run"
    args = ["train", "weaver", "--backbone", str(tmp_path / "tf"), "--target", tiny_folder, "--data",
            str(tmp_path / "regen"), "--data-dir", str(tmp_path / "data"), "--out", str(out), "--steps", "2", "--batch-size", "2", "--num-anchors", "4",
            "--top-k", "64", "--lr", "1e-2", "--target-dtype", "float32", "--save-every", "2", "--log-every", "1"]
    assert main(args) == 0
    weaver = Weaver.from_pretrained(out / "weaver")
    assert weaver.config.top_k == 64 and weaver.out_proj.weight.abs().sum() > 0
    assert weaver.config.backbone_sha256 == weights_digest(tmp_path / "tf")
    assert len(open(out / "log.jsonl").readlines()) == 2
    for k, v in DFlashDrafter.from_pretrained(tmp_path / "tf").state_dict().items():  # the backbone is untouched
        torch.testing.assert_close(v, backbone.state_dict()[k], atol=0, rtol=0)
    more = [*args, "--init", str(out / "weaver")]  # go on training it: starts from its weights, keeps its K
    more[more.index("--out") + 1], more[more.index("--top-k") + 1] = str(tmp_path / "more"), "32"
    more[more.index("--steps") + 1] = "1"
    assert main(more) == 0
    further = Weaver.from_pretrained(tmp_path / "more" / "weaver")
    assert further.config.top_k == 64
    step = (further.out_proj.weight - weaver.out_proj.weight).abs().max()
    assert 0 < step < weaver.out_proj.weight.abs().max()  # one small step from the init, not a fresh start

    report_path, png = tmp_path / "dist.json", tmp_path / "dist.png"
    assert main(["dist", "--target", tiny_folder, "--drafter", str(tmp_path / "tf"), "--weaver", str(out / "weaver"),
                 "--limit", "1", "--max-new-tokens", "5", "--out", str(report_path), "--plot", str(png),
                 "--no-progress"]) == 0
    report = json.loads(report_path.read_text())["methods"]
    assert set(report) == {"dflash", "treeflash", "weaver"}

    bench = tmp_path / "bench.json"  # a width sweep in one run: exact, ceil(B / w) Weaver calls per round
    assert main(["bench", "--target", tiny_folder, "--methods", "ddtree,tfm", "--drafter", str(tmp_path / "tf"),
                 "--weaver", str(out / "weaver"), "--budget", "4", "--tfm-width", "1,3", "--limit", "1",
                 "--max-new-tokens", "6", "--out", str(bench), "--no-progress"]) == 0
    methods = json.loads(bench.read_text())["methods"]
    assert set(methods) == {"ar", "ddtree", "tfm/w1", "tfm/w3"} and all(m["matches_ar"] for m in methods.values())
    assert methods["tfm/w1"]["adapter_calls_per_round"] == 4 and methods["tfm/w3"]["adapter_calls_per_round"] == 2

    paired = tmp_path / "paired.json"  # two Weaver checkpoints on one continuation: each tfm variant once per Weaver
    common = ["paired", "--target", tiny_folder, "--methods", "ddtree,tfm", "--drafter", str(tmp_path / "tf"),
              "--budget", "4", "--tfm-width", "2", "--limit", "1", "--max-new-tokens", "6", "--no-progress"]
    assert main([*common, "--weaver", f"{out / 'weaver'},{tmp_path / 'more' / 'weaver'}", "--out", str(paired)]) == 0
    both = json.loads(paired.read_text())
    assert set(both["methods"]) == {"ddtree", "tfm#1", "tfm#2"}
    assert both["weavers"] == [str(out / "weaver"), str(tmp_path / "more" / "weaver")]
    assert main([*common, "--weaver", str(tmp_path / "more" / "weaver"), "--out", str(paired)]) == 0
    alone = json.loads(paired.read_text())["methods"]
    assert alone["tfm"]["expected_tau"] == pytest.approx(both["methods"]["tfm#2"]["expected_tau"])

    r = report["weaver"]
    assert r["depth"] == [1, 2, 3] and all(0 <= x <= 1 for x in r["tvd"] + r["top1_coverage"])
    assert png.stat().st_size > 1000
