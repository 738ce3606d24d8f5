"""The DFlash block drafter: checkpoints (ours and the published layout), fit checks, context cache, losslessness."""

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from treeflash import generate
from treeflash.drafters import block_drafter, make_drafter
from treeflash.models.checkpoint import DrafterError
from treeflash.models.dflash import ContextCache, DFlashDrafter
from treeflash.models.dflash_config import DFlashConfig, tap_layers
from treeflash.trees import best_first_tree, chain_tree, top_marginals

from conftest import tiny_target
from test_lossless import repetitive_prompt


def tiny_drafter(target, seed=0, **kw) -> DFlashDrafter:
    """A tiny random drafter; its mask token is the target's last token id (mask_token_id=None: the deprecated
    learned mask embedding)."""
    torch.manual_seed(seed)
    kw.setdefault("mask_token_id", target.config.vocab_size - 1)
    config = DFlashConfig.for_target(target.config, num_layers=2, num_taps=2, block_size=kw.pop("block_size", 8),
                                     **kw)
    return DFlashDrafter(config).attach(target.model)


def test_tap_layers_match_dflash():
    assert tap_layers(36, 5) == [1, 9, 17, 25, 33]
    assert tap_layers(30, 1) == [15]


def test_save_and_load_round_trip(tmp_path):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    assert not any(k.startswith(("embed", "lm_head")) for k in drafter.state_dict())
    loaded = DFlashDrafter.from_pretrained(tmp_path).attach(target.model)
    kv = drafter.context_kv(drafter.fuse(torch.randn(5, 2, 64)), torch.arange(5))
    torch.testing.assert_close(loaded.draft_logits(3, 5, kv), drafter.draft_logits(3, 5, kv))


def test_published_layout_loads(tmp_path):
    """A checkpoint written the way published DFlash drafters are: Qwen3 config + dflash_config, a mask token,
    the target's embedding stored alongside (ignored)."""
    target = tiny_target("qwen3")
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 96, "rms_norm_eps": 1e-6, "num_target_layers": 3, "block_size": 4,
              "rope_theta": 10000.0, "dflash_config": {"mask_token_id": 95, "target_layer_ids": [0, 2]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,),
              "layers.0.input_layernorm.weight": (64,), "layers.0.post_attention_layernorm.weight": (64,),
              "layers.0.self_attn.q_proj.weight": (64, 64), "layers.0.self_attn.k_proj.weight": (32, 64),
              "layers.0.self_attn.v_proj.weight": (32, 64), "layers.0.self_attn.o_proj.weight": (64, 64),
              "layers.0.self_attn.q_norm.weight": (16,), "layers.0.self_attn.k_norm.weight": (16,),
              "layers.0.mlp.gate_proj.weight": (96, 64), "layers.0.mlp.up_proj.weight": (96, 64),
              "layers.0.mlp.down_proj.weight": (64, 96), "embed_tokens.weight": (96, 64)}
    save_file({k: torch.randn(s, dtype=torch.bfloat16) for k, s in shapes.items()}, str(tmp_path / "m.safetensors"))
    drafter = DFlashDrafter.from_pretrained(tmp_path)
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.rope_theta) == (4, 95, [0, 2], 10000.0)
    assert not hasattr(drafter, "mask_embedding")
    drafter.attach(target.model)
    prompt = repetitive_prompt(random.Random(0), 96)
    ar = generate(target, make_drafter("ar"), prompt, 20).tokens
    assert generate(target, block_drafter(drafter, "ddtree"), prompt, 20, budget=6).tokens == ar


def test_mask_token_is_a_real_token():
    """The published format: the mask token is a token id of the target's vocabulary, never a stored vector."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from treeflash.models.dflash_config import choose_mask_token
    from treeflash.runtime import resolve

    smollm2 = AutoTokenizer.from_pretrained(resolve("smollm2-135m-instruct"))
    assert choose_mask_token(smollm2) == 16  # <empty_output>: special, and neither a turn marker nor EOS
    assert choose_mask_token(SimpleNamespace(mask_token_id=7)) == 7
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    assert "mask_embedding" not in drafter.state_dict()
    x = drafter.block_inputs(torch.tensor([3]))
    torch.testing.assert_close(x[1:], target.model.get_input_embeddings().weight[[95] * 7])  # the target's own row


def test_a_learned_mask_embedding_still_loads_with_a_warning(tmp_path):
    target = tiny_target("llama")
    legacy = tiny_drafter(target, mask_token_id=None)
    legacy.save_pretrained(tmp_path, dtype=torch.float32)
    with pytest.warns(FutureWarning, match="learned mask embedding"):
        loaded = DFlashDrafter.from_pretrained(tmp_path).attach(target.model)
    torch.testing.assert_close(loaded.mask_embedding, legacy.mask_embedding)


def test_a_drafter_that_does_not_fit_is_refused():
    target = tiny_target("llama")
    other = tiny_target("llama", vocab_size=80)
    drafter = tiny_drafter(other)
    with pytest.raises(DrafterError, match="vocabulary 80 vs the target's 96"):
        drafter.attach(target.model)
    config = DFlashConfig.for_target(target.config, num_layers=1, num_taps=2)
    config.target_layer_ids = [0, 7]
    with pytest.raises(DrafterError, match="taps layers"):
        DFlashDrafter(config).attach(target.model)


def test_context_cache_equals_a_fresh_context():
    """Appending accepted positions round by round gives the same K/V as computing the whole context at once."""
    target = tiny_target("llama")
    drafter = block_drafter(tiny_drafter(target), "dflash")
    feats = torch.randn(12, 2, 64)
    for a, b in ((0, 5), (5, 6), (6, 12)):
        drafter.observe(feats[a:b])
    whole = drafter.model.context_kv(drafter.model.fuse(feats), torch.arange(12))
    for (k, v), (k2, v2) in zip(drafter.context.layers(), whole):
        torch.testing.assert_close(k, k2)
        torch.testing.assert_close(v, v2)
    # drafting over the static buffers (block K/V written in place) equals drafting over concatenated copies
    torch.testing.assert_close(drafter.model.draft_states(3, 12, drafter.context),
                               drafter.model.draft_states(3, 12, whole))


def test_context_cache_grows():
    target = tiny_target("llama")
    model = tiny_drafter(target)
    cache, feats = ContextCache(model, capacity=4), torch.randn(30, 2, 64)
    for a in range(0, 30, 7):
        cache.append(*model.context_states(feats[a:a + 7], torch.arange(a, min(a + 7, 30)))[1:])
    whole = model.context_kv(model.fuse(feats), torch.arange(30))
    assert len(cache) == 30
    torch.testing.assert_close(model.draft_states(5, 30, cache), model.draft_states(5, 30, whole))


def test_tree_builders():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]]))
    assert chain_tree(7, *top_marginals(logits, 1), 2).tokens == (7, 0, 0)
    tree = best_first_tree(7, *top_marginals(logits, 4), 4)
    # best prefixes: [0] .6, [0,0] .3, [1] .3, [0,0,0] .27
    paths = {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}
    assert paths == {(0,), (0, 0), (1,), (0, 0, 0)}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_block_drafting_is_lossless(kind, method):
    target = tiny_target(kind)
    drafter = block_drafter(tiny_drafter(target, seed=1), method)
    for seed in range(3):
        prompt = repetitive_prompt(random.Random(seed), 96)
        ar = generate(target, make_drafter("ar"), prompt, 40).tokens
        for budget in (1, 5, 16):
            assert generate(target, drafter, prompt, 40, budget=budget).tokens == ar


def test_draft_vocabulary_scores_only_its_tokens(tmp_path):
    """FR-Spec: `data rank` writes the ranking, config.json's draft_vocab_size picks its prefix; the head's scores
    on those tokens are unchanged, every other token is -inf, and decoding stays lossless."""
    from treeflash.cli import main
    from treeflash.drafters.load import load_block_drafter
    from treeflash.train.store import AnswerStore

    target = tiny_target("llama")
    tiny_drafter(target, seed=1).save_pretrained(tmp_path / "d", dtype=torch.float32)
    data = tmp_path / "regen"
    AnswerStore(data).append([f"gsm8k/{i}" for i in range(40)], [[1]] * 40,
                             [[5, 5, 5, 7, 7, 9, i % 96] for i in range(40)], {"target": "tiny", "temperature": 0.0})
    assert main(["data", "rank", "--data", str(data), "--drafter", str(tmp_path / "d"), "--size", "24"]) == 0
    ranking = json.loads((tmp_path / "d" / "token_ranking.json").read_text())["ranking"]
    assert ranking[:3] == [5, 7, 9] and len(ranking) == 40

    full = load_block_drafter("ddtree", target, tmp_path / "d", draft_vocab_size=0)
    small = load_block_drafter("ddtree", target, tmp_path / "d")  # 24, from config.json
    assert full.model.draft_vocab is None and small.model.draft_vocab.tolist() == sorted(ranking[:24])
    h = torch.randn(3, 64)
    a, b = full.model.logits(h), small.model.logits(h)
    keep = small.model.draft_vocab
    torch.testing.assert_close(b[:, keep], a[:, keep])
    others = torch.ones(96, dtype=torch.bool)
    others[keep] = False
    assert torch.isinf(b[:, others]).all()
    for drafter in (full, small):  # the fast top-k tables equal the plain softmax-then-top-k of the full logits
        logits, probs, ids = drafter.model.top_tokens(h, 5)
        ref_probs, ref_ids = top_marginals(drafter.model.logits(h), 5)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(logits, drafter.model.logits(h).float().gather(-1, ids))
    prompt = repetitive_prompt(random.Random(2), 96)
    ar = generate(target, make_drafter("ar"), prompt, 30).tokens
    assert generate(target, small, prompt, 30, budget=8).tokens == ar
    with pytest.raises(DrafterError, match="ranks 40 tokens"):
        load_block_drafter("ddtree", target, tmp_path / "d", draft_vocab_size=50)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_gradient_checkpointing_recomputes_the_layers_for_the_same_gradients(kind):
    from treeflash.models.dflash2 import DFlash2Drafter

    drafter = tiny_drafter(tiny_target("qwen3"))
    if kind == "dflash2":
        drafter = DFlash2Drafter.from_dflash(drafter, conv_kernel_size=2, conv_group_size=16, selector_rank=4,
                                             selector_top_k=4)
    calls = []
    for layer in drafter.layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))  # (a recompute may stop before its end)
    g = torch.Generator().manual_seed(0)
    tokens, taps = torch.randint(96, (40,), generator=g), torch.randn(40, 2, 64, generator=g)
    anchors = torch.tensor([3, 10, 20])
    grads = []
    for on in (False, True):
        drafter.zero_grad()
        drafter.gradient_checkpointing = on
        calls.clear()
        drafter(anchors, tokens, taps).square().sum().backward()
        assert len(calls) == len(drafter.layers) * (2 if on else 1)  # recomputed in the backward pass
        grads.append([p.grad.clone() for p in drafter.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
