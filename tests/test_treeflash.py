"""TreeFlash: the zero-initialised AR layer, the batched conditional tables, OPT-Tree's optimality, losslessness."""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from treeflash import generate
from treeflash.drafters import block_drafter, make_drafter
from treeflash.drafters.builders import conditional_tables
from treeflash.models.dflash import DFlashDrafter
from treeflash.models.dflash_config import DFlashConfig
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
    tokens, anchors = torch.randint(0, 96, (20,)), torch.tensor([5, 11])
    prev_tokens = torch.randint(0, 96, (2, 7, prev))
    before = backbone(anchors, tokens, taps)
    backbone.add_ar_layer(kind, prev)
    torch.testing.assert_close(backbone(anchors, tokens, taps, prev_tokens), before, atol=0, rtol=0)
    backbone.save_pretrained(tmp_path, dtype=torch.float32)  # and the layer survives a round trip
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.ar_layer is not None and loaded.config.ar_layer == backbone.config.ar_layer


def treeflash_drafter(target, seed=2, prev=1):
    drafter = tiny_drafter(target, seed=seed).add_ar_layer("swiglu", prev)
    torch.nn.init.normal_(drafter.ar_layer.d.weight, std=0.5)  # a layer that changes the conditionals
    return drafter


def test_ar_layer_runs_once_on_all_pairs_whatever_the_budget():
    target = tiny_target("qwen3")
    drafter = block_drafter(treeflash_drafter(target), "treeflash", top_m=5)
    calls = []
    drafter.model.ar_layer.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    prompt = repetitive_prompt(random.Random(0), 96)
    for budget in (2, 5, 30):
        drafter.reset()
        calls.clear()
        drafter.observe(torch.randn(len(prompt), 2, 64))
        tree = drafter.propose(prompt + [5], None, budget)
        # one call: the depths a tree of this budget can reach x M previous tokens, M = min(top_m, budget)
        assert calls == [(min(7, budget), min(5, budget), 64)]
        assert tree.size == budget


def test_without_its_adapter_a_treeflash_drafter_drafts_ddtree_s_tree():
    """`propose(..., adapter=False)` (cost-aware speculation's choice where the AR layer does not pay): the
    backbone's best-first tree, the one ddtree drafts from the same block, and no AR-layer call."""
    target = tiny_target("qwen3")
    model = treeflash_drafter(target)
    treeflash, ddtree = block_drafter(model, "treeflash"), block_drafter(model, "ddtree")
    prompt = repetitive_prompt(random.Random(0), 96)
    features = torch.randn(len(prompt), 2, 64)
    for budget in (2, 6, 16):
        trees = []
        for drafter, adapter in ((treeflash, False), (ddtree, True), (treeflash, True)):
            drafter.reset()
            trees.append(drafter.propose(prompt + [5], features, budget, adapter=adapter))
        assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents
        assert trees[0].tokens != trees[2].tokens or trees[0].parents != trees[2].parents  # the AR layer's tree
    assert treeflash.adapter_calls == 3 and treeflash.adapts and not ddtree.adapts


@pytest.mark.parametrize("method", ["dflash", "ddtree", "treeflash", "tfm"])
def test_builders_see_only_the_depths_a_tree_of_the_budget_reaches(method):
    """`BlockDrafter.tree` hands the builder the first B depths of a B-node tree: the tree it would grow from all."""
    from test_weaver import tiny_weaver

    target = tiny_target("qwen3")
    model = treeflash_drafter(target) if method == "treeflash" else tiny_drafter(target)
    weaver = tiny_weaver(model) if method == "tfm" else None
    drafter = block_drafter(model, method, top_m=4, weaver=weaver, width=2)
    prompt = repetitive_prompt(random.Random(1), 96)
    drafter.observe(torch.randn(len(prompt) - 1, 2, 64))
    h = drafter.draft(prompt, None)
    for budget in (1, 2, 3, 5, 12):
        full, _ = drafter.builder(drafter, prompt, h, budget)
        tree = drafter.tree(prompt, h, budget)
        assert (tree.tokens, tree.parents) == (full.tokens, full.parents)


def test_conditionals_depend_on_the_previous_token():
    target = tiny_target("llama")
    model = treeflash_drafter(target)
    h = torch.randn(7, 64)
    cand, cond = conditional_tables(model, model.ar_layer, [8, 4], h, top_m=6)
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
    cand, cond = conditional_tables(model, model.ar_layer, [8, root], h, top_m=6, top_n=top_n)
    prev = torch.cat([torch.full((1, 6), root), cand[:-1]])  # [D, M]
    hx = h[:, None].expand(7, 6, 64)
    states = model.ar_layer(hx, model.norm(hx), model.embed(prev[:, :, None]))
    full = torch.softmax(model.logits(states).float(), dim=-1)  # [D, M prev, V]
    exact = full.gather(-1, cand[:, None, :].expand(7, 6, 6))
    if top_n == 96:
        torch.testing.assert_close(cond, exact, atol=1e-5, rtol=1e-4)
    torch.nn.init.zeros_(model.ar_layer.d.weight)  # fresh: the conditionals are the marginals
    cand, cond = conditional_tables(model, model.ar_layer, [8, root], h, top_m=6, top_n=top_n)
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
    drafter = block_drafter(treeflash_drafter(target, prev=prev), "treeflash", top_m=4)
    for seed in range(3):
        prompt = repetitive_prompt(random.Random(seed), 96)
        ar = generate(target, make_drafter("ar"), prompt, 40).tokens
        for budget in (1, 6, 16):
            assert generate(target, drafter, prompt, 40, budget=budget).tokens == ar


def test_treeflash_needs_an_ar_layer():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="AR layer"):
        block_drafter(tiny_drafter(target), "treeflash")


def test_dist_command_reports_both_kinds(tmp_path, tiny_folder, capsys):  # noqa: F811
    """TVD and coverage per depth, DFlash marginals vs TreeFlash conditionals, as JSON and a plot."""
    import json

    from transformers import AutoModelForCausalLM

    from treeflash.cli import main

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    drafter = DFlashDrafter(DFlashConfig.for_target(model.config, num_layers=1, num_taps=2, block_size=4,
                                                     mask_token_id=16))
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


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_published_treeflash_checkpoints_load(tmp_path):
    """A checkpoint written in the layout of the public TreeFlash code (ETH-DISCO/TreeFlash): Qwen3 config with
    dflash_config and treeflash_config = {ar_approximation: "swiglu"}, the backbone under `model.`, the AR layer as
    `ar_approximation.{norm, ug (with bias), d}`. Its conditionals equal the published formula, written out here."""
    import json

    from safetensors.torch import save_file

    target = tiny_target("llama")
    H, I = 64, 96
    config = {"architectures": ["TreeFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 96, "rms_norm_eps": 1e-6, "num_target_layers": 3, "block_size": 4,
              "rope_theta": 10000.0, "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]},
              "treeflash_config": {"ar_approximation": "swiglu", "candidate_tokens": 16}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "layers.0.input_layernorm.weight": (H,), "layers.0.post_attention_layernorm.weight": (H,),
              "layers.0.self_attn.q_proj.weight": (H, H), "layers.0.self_attn.k_proj.weight": (32, H),
              "layers.0.self_attn.v_proj.weight": (32, H), "layers.0.self_attn.o_proj.weight": (H, H),
              "layers.0.self_attn.q_norm.weight": (16,), "layers.0.self_attn.k_norm.weight": (16,),
              "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
              "layers.0.mlp.down_proj.weight": (H, I)}
    g = torch.Generator().manual_seed(0)
    state = {"model." + k: 1 + 0.1 * torch.randn(s, generator=g) if k.endswith("norm.weight")
             else 0.1 * torch.randn(s, generator=g) for k, s in shapes.items()}
    state |= {"ar_approximation.norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
              "ar_approximation.ug.weight": 0.1 * torch.randn(2 * I, 2 * H, generator=g),
              "ar_approximation.ug.bias": 0.1 * torch.randn(2 * I, generator=g),
              "ar_approximation.d.weight": 0.1 * torch.randn(H, I, generator=g)}
    save_file(state, str(tmp_path / "model.safetensors"))

    drafter = DFlashDrafter.from_pretrained(tmp_path).attach(target.model)
    assert drafter.config.ar_layer == {"kind": "swiglu", "prev_tokens": 1, "intermediate_size": I}
    h, prev = torch.randn(5, H, generator=g), torch.randint(0, 96, (5,), generator=g)
    ours = drafter.logits(drafter.ar_layer(h, drafter.norm(h), drafter.embed(prev[:, None])))
    # the published forward: h + d(silu(g) * u), u, g = ug([norm(e_prev), final_norm(h)]), then final norm, LM head
    final, ar = state["model.norm.weight"], {k.split(".", 1)[1]: v for k, v in state.items() if "ar_appr" in k}
    x = torch.cat([_rms(drafter.embed(prev), ar["norm.weight"]), _rms(h, final)], dim=-1)
    u, gate = (x @ ar["ug.weight"].T + ar["ug.bias"]).chunk(2, dim=-1)
    out = h + (torch.nn.functional.silu(gate) * u) @ ar["d.weight"].T
    reference = _rms(out, final) @ target.model.get_output_embeddings().weight.T
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    prompt = repetitive_prompt(random.Random(0), 96)
    assert generate(target, block_drafter(drafter, "treeflash"), prompt, 20, budget=6).tokens == \
        generate(target, make_drafter("ar"), prompt, 20).tokens


@pytest.mark.parametrize("prev,published", [(1, True), (2, False)])
def test_treeflash_round_trip(tmp_path, prev, published):
    """ours -> file -> ours: bit-equal weights and the same tree. A drafter the published layout can express is
    written in it; one it cannot (two previous tokens) in treeflash's own (config dict, `ar_layer.` names)."""
    import json

    from safetensors.torch import load_file

    target = tiny_target("llama")
    drafter = treeflash_drafter(target, prev=prev)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    config, keys = json.loads((tmp_path / "config.json").read_text()), load_file(str(tmp_path / "model.safetensors"))
    assert (config["treeflash_config"]["ar_approximation"] == "swiglu") == published
    assert (config["architectures"] == ["TreeFlashDraftModel"]) == published
    assert all(k.startswith(("model.", "ar_approximation.")) for k in keys) == published
    loaded = DFlashDrafter.from_pretrained(tmp_path).attach(target.model)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, atol=0, rtol=0)
    tokens, h = [5, 7], torch.randn(7, 64)
    trees = [block_drafter(m, "treeflash").tree(tokens, h, 12) for m in (drafter, loaded)]
    assert trees[0].tokens == trees[1].tokens and trees[0].parents == trees[1].parents


@pytest.mark.parametrize("kind,prev", [("swiglu", 1), ("swiglu", 2), ("linear", 1)])
def test_legacy_ar_layers_convert_to_the_same_function(kind, prev):
    """AR layers saved before the published layout ([state_norm(h), token_norm(e)] -> in_proj, no bias ->
    out_proj) load as the same function: the state columns are rescaled by state_norm / final_norm."""
    from treeflash.models.ar_layer import ARApproximation, from_legacy

    H, I = 64, 48
    g = torch.Generator().manual_seed(1)
    old = {"state_norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
           "token_norm.weight": 1 + 0.2 * torch.randn(H, generator=g)}
    width = (1 + prev) * H
    if kind == "swiglu":
        old |= {"in_proj.weight": 0.1 * torch.randn(2 * I, width, generator=g),
                "out_proj.weight": 0.1 * torch.randn(H, I, generator=g)}
    else:
        old["out_proj.weight"] = 0.1 * torch.randn(H, width, generator=g)
    final = 1 + 0.2 * torch.randn(H, generator=g)
    h, e = torch.randn(6, H, generator=g), torch.randn(6, prev, H, generator=g)
    x = torch.cat([_rms(h, old["state_norm.weight"]), _rms(e, old["token_norm.weight"]).flatten(-2)], dim=-1)
    if kind == "swiglu":
        u, gate = (x @ old["in_proj.weight"].T).chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * u
    expected = h + x @ old["out_proj.weight"].T  # the old layer, written out
    layer = ARApproximation(H, I, kind, prev)
    layer.load_state_dict(from_legacy(old, final))
    torch.testing.assert_close(layer(h, _rms(h, final), e), expected, atol=1e-5, rtol=1e-4)
