"""Tree verification on hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet + gated full attention).

Every node's logits equal a plain sequential forward along its path; verification writes nothing to the GDN
states; commit leaves the conv, recurrent and K/V caches that sequential decoding builds; generation is lossless.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import (DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)

from treeflash import DraftTree, Target, generate
from treeflash.drafters import make_drafter
from treeflash.tree import random_tree

from conftest import OracleTreeDrafter
from test_lossless import repetitive_prompt
from test_target import check_tree_logits, sequential_logits

HYBRID = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
              # larger weights than HF's default 0.02, so that the GDN layers move the logits visibly
              initializer_range=0.15, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
GDN_LAYERS = [0, 2, 3]


def tiny_hybrid(kind: str, seed: int = 0) -> Target:
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID))
    elif kind == "qwen3_next":  # a small mixture of experts, as the real model
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**HYBRID, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=32))
    else:
        raise ValueError(kind)
    return Target(model.float(), name=f"tiny-{kind}")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request) -> Target:
    return tiny_hybrid(request.param)


def gdn_states(target: Target) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(target.backend.cache.get_conv_state(i).clone(), target.backend.cache.get_recurrent_state(i).clone())
            for i in GDN_LAYERS]


def test_hybrid_target_wraps_its_gdn_layers(hybrid):
    assert hybrid.backend.gdn is not None and sorted(hybrid.backend.gdn.modules) == GDN_LAYERS
    assert Target(hybrid.model).backend.gdn is hybrid.backend.gdn  # installed once per model


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 24), prompt_len=st.integers(1, 20))
def test_tree_logits_equal_sequential(hybrid, seed, n, prompt_len):
    rng = random.Random(seed)
    prompt = [rng.randrange(96) for _ in range(prompt_len)]
    check_tree_logits(hybrid, prompt, random_tree(rng, 96, n), atol=5e-4)
    assert sorted(hybrid.backend.gdn.pending) == GDN_LAYERS  # the tree path ran on every GDN layer


def test_verify_writes_no_gdn_state(hybrid):
    rng = random.Random(5)
    hybrid.prefill([rng.randrange(96) for _ in range(6)])
    before = gdn_states(hybrid)
    for tree in (random_tree(rng, 96, 12), DraftTree.chain(7, [8, 9])):  # a chain takes the tree path too
        hybrid.verify(tree)
        for (conv, state), (conv0, state0) in zip(gdn_states(hybrid), before):
            assert torch.equal(conv, conv0) and torch.equal(state, state0)
        hybrid.commit([0])  # keep the root only: the states advance by one token
        before = gdn_states(hybrid)


def test_discard_keeps_no_trace(hybrid):
    """`paired` verifies trees it then discards: the next verification must see the committed state only."""
    rng = random.Random(6)
    prompt, tree = [rng.randrange(96) for _ in range(6)], random_tree(rng, 96, 10)
    hybrid.prefill(prompt)
    fresh = hybrid.verify(tree).logits
    hybrid.prefill(prompt)
    before = gdn_states(hybrid)
    hybrid.verify(random_tree(rng, 96, 12))
    hybrid.discard()
    assert all(torch.equal(a, b) for x, y in zip(gdn_states(hybrid), before) for a, b in zip(x, y))
    torch.testing.assert_close(hybrid.verify(tree).logits, fresh)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6))
def test_commit_leaves_the_sequential_cache(hybrid, seed):
    """Verify a branching tree, commit a random path, decode on: GDN states, K/V and logits equal sequential."""
    rng = random.Random(seed)
    prompt = [rng.randrange(96) for _ in range(rng.randint(1, 12))]
    tree = random_tree(rng, 96, rng.randint(2, 20))
    path = tree.path_to(rng.randrange(len(tree)))
    hybrid.prefill(prompt)
    hybrid.verify(tree)
    hybrid.commit(path)
    accepted = prompt + [tree.tokens[i] for i in path]
    committed = gdn_states(hybrid)
    nxt = DraftTree.chain(rng.randrange(96), [rng.randrange(96) for _ in range(3)])
    out = hybrid.verify(nxt)
    keys = hybrid.backend.cache.layers[1].keys.clone()

    hybrid.prefill(accepted)  # the sequential reference: HF's own (chunked) prefill
    for (conv, state), (conv_ref, state_ref) in zip(committed, gdn_states(hybrid)):
        torch.testing.assert_close(conv, conv_ref, atol=2e-4, rtol=0)
        torch.testing.assert_close(state, state_ref, atol=2e-4, rtol=0)
    ref = hybrid.verify(nxt)
    torch.testing.assert_close(out.logits, ref.logits, atol=5e-4, rtol=0)
    torch.testing.assert_close(keys, hybrid.backend.cache.layers[1].keys, atol=1e-4, rtol=0)
    full = accepted + list(nxt.tokens)
    torch.testing.assert_close(out.logits[-1], sequential_logits(hybrid, full), atol=5e-4, rtol=0)


def hf_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with HF's own cache and single-token GDN path (no tree code involved)."""
    cache, ids, out = DynamicCache(config=target.model.config), torch.tensor([prompt]), []
    with torch.inference_mode():
        for _ in range(n):
            token = int(target.model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("seed", range(2))
def test_methods_match_ar_on_hybrid_targets(hybrid, seed):
    rng = random.Random(seed)
    prompt = repetitive_prompt(rng, 96)
    ar = generate(hybrid, make_drafter("ar"), prompt, max_new_tokens=40).tokens
    assert ar == hf_greedy(hybrid, prompt, 40)
    for budget in (1, 4, 16):
        assert generate(hybrid, make_drafter("pld"), prompt, 40, budget=budget).tokens == ar
        oracle = OracleTreeDrafter(ar, len(prompt), 96, seed=seed)
        result = generate(hybrid, oracle, prompt, 40, budget=budget)
        assert result.tokens == ar
        if budget == 16:
            assert result.tau > 1.5  # true branches accepted deep in the tree, scattered node order


def test_briefly_trained_dflash_drafter_is_lossless_on_hybrids(hybrid):
    """A DFlash drafter trained for a few steps on the hybrid target's own outputs, as chain, DDTree and (with a
    random AR layer) TreeFlash: exactly the AR tokens."""
    from test_dflash import tiny_drafter
    from treeflash.drafters import block_drafter
    from treeflash.train.dflash import Sequence, dflash_loss, sample_anchors, target_view

    drafter = tiny_drafter(hybrid, seed=3)
    optim = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    prompts = [repetitive_prompt(random.Random(10 + i), 96) for i in range(3)]
    seqs = [Sequence(torch.tensor(p + generate(hybrid, make_drafter("ar"), p, 40).tokens), len(p)) for p in prompts]
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        seq = seqs[step % len(seqs)]
        view = target_view(hybrid.model, seq.tokens, drafter.config.target_layer_ids)
        loss, _ = dflash_loss(drafter, seq, view, sample_anchors(seq, 16, gen))
        optim.zero_grad()
        loss.backward()
        optim.step()
    prompt = repetitive_prompt(random.Random(99), 96)
    ar = generate(hybrid, make_drafter("ar"), prompt, 40).tokens
    for method in ("dflash", "ddtree"):
        for budget in (1, 8):
            assert generate(hybrid, block_drafter(drafter, method), prompt, 40, budget=budget).tokens == ar
    drafter.add_ar_layer("swiglu", 1)
    torch.nn.init.normal_(drafter.ar_layer.d.weight, std=0.3)
    assert generate(hybrid, block_drafter(drafter, "treeflash", top_m=4), prompt, 40, budget=8).tokens == ar
