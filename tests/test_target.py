"""Tree verification gives, at every node, the logits of a plain sequential forward along that node's path; after
commit the cache equals the one sequential decoding builds."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from treeflash import DraftTree, Target
from treeflash.tree import random_tree

from conftest import tiny_target


ATOL = 1e-5  # fp32: the same computation in another order
# SmolLM2's logits (|x| up to ~35) through 30 bf16 layers against fp32: measured at most 1.19 (mean 0.14) on trees
BF16_MAX_ATOL, BF16_MEAN_ATOL = 2.0, 0.25


def cached_keys(target: Target) -> torch.Tensor:
    """[layers, kv_heads, positions, head_dim]: the keys the target holds (committed and pending)."""
    n = target.length + target.pending
    if target.static is not None:
        return target.static.cache.k[:, 0, :, :n].clone()
    return torch.stack([layer.keys[0, :, :n] for layer in target.backend.cache.layers])


def sequential_logits(target: Target, ids: list[int]) -> torch.Tensor:
    """Reference: no cache, no mask tricks, the whole sequence at once; the last position's logits."""
    with torch.inference_mode():
        return target.model(torch.tensor([ids])).logits[0, -1].float()


def check_tree_logits(target: Target, prompt: list[int], tree: DraftTree, atol: float) -> None:
    target.prefill(prompt)
    out = target.verify(tree)
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in tree.path_to(i)]
        torch.testing.assert_close(out.logits[i], sequential_logits(target, prompt + path), atol=atol, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 24), prompt_len=st.integers(1, 20))
def test_tree_logits_equal_sequential(tiny, seed, n, prompt_len):
    rng = random.Random(seed)
    vocab = tiny.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    check_tree_logits(tiny, prompt, random_tree(rng, vocab, n), atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_taps_are_decoder_layer_outputs(kind):
    target = tiny_target(kind)
    prompt = [3, 1, 4, 1, 5]
    out = target.prefill(prompt, taps=(0, 2))
    with torch.inference_mode():
        ref = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[:, 0], ref[1][0])
    torch.testing.assert_close(out.hidden[:, 1], ref[3][0])
    assert out.hidden.shape == (len(prompt), 2, target.config.hidden_size)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6))
def test_commit_leaves_the_sequential_cache(tiny, seed):
    """Verify a tree, commit a random root-to-node path, then decode on: logits and K/V equal a sequential cache."""
    rng = random.Random(seed)
    vocab = tiny.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    tree = random_tree(rng, vocab, rng.randint(1, 20))
    path = tree.path_to(rng.randrange(len(tree)))
    tiny.prefill(prompt)
    tiny.verify(tree)
    tiny.commit(path)
    accepted = [tree.tokens[i] for i in path]
    nxt = DraftTree.chain(rng.randrange(vocab), [rng.randrange(vocab) for _ in range(3)])
    out = tiny.verify(nxt)
    mine = cached_keys(tiny)

    tiny.prefill(prompt + accepted)  # the sequential reference cache
    ref = tiny.verify(nxt)
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(mine, cached_keys(tiny), atol=ATOL, rtol=0)


def test_verify_refuses_an_uncommitted_tree(tiny):
    tiny.prefill([1, 2, 3])
    tiny.verify(DraftTree.chain(4, [5]))
    with pytest.raises(RuntimeError, match="commit"):
        tiny.verify(DraftTree.chain(4))


@pytest.mark.real
def test_smollm2_tree_logits_equal_sequential(smollm2):
    rng = random.Random(0)
    prompt = smollm2.encode_prompt("Name three prime numbers.")
    for n in (17, 9):
        check_tree_logits(smollm2, prompt, random_tree(rng, smollm2.config.vocab_size, n), atol=2e-3)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_static_runtime_equals_the_hf_reference(kind):
    """The fast path against the HF runtime on the same weights: prefill, tree verification, commit of a
    scattered path, decoding on (logits and taps), past the static cache's and the RoPE table's first length."""
    fast, ref = tiny_target(kind, runtime="static"), tiny_target(kind, runtime="hf")
    fast.static.cache._allocate(8, keep=0)  # a small cache, so that it must grow mid-sequence
    fast.static.cos, fast.static.sin = fast.static.cos[:8], fast.static.sin[:8]  # and so must the RoPE table
    rng = random.Random(1)
    vocab = fast.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(6)]
    outs = [t.prefill(prompt, taps=(0, 2)) for t in (fast, ref)]
    for _ in range(6):
        tree = random_tree(rng, vocab, rng.randint(1, 12))
        path = tree.path_to(rng.randrange(len(tree)))
        outs = [t.verify(tree) for t in (fast, ref)]
        torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(outs[0].hidden, outs[1].hidden, atol=ATOL, rtol=0)
        for t in (fast, ref):
            t.commit(path)
    assert fast.length == ref.length > 8
    torch.testing.assert_close(cached_keys(fast), cached_keys(ref), atol=ATOL, rtol=0)


def test_runtime_choice():
    assert tiny_target("llama").runtime == "static"
    assert tiny_target("llama", runtime="hf").runtime == "hf"
    with pytest.raises(Exception, match="runtime"):
        tiny_target("llama", runtime="fastest")


@pytest.mark.real
def test_bf16_tree_logits_lie_within_a_named_tolerance_of_fp32(smollm2):
    """The dense bf16 static runtime against fp32 on the real target, on trees of 1-33 random nodes: close within
    the named tolerances, and its greedy choice differs only where fp32's top two are a near tie (closer than twice
    the largest difference): the flips `bench` reports as prompts_matching_ar, never a wrong claim of equality."""
    bf16 = Target.load("smollm2-135m-instruct", dtype="bfloat16", quantize="none")
    ids = smollm2.encode_prompt("Janet has 3 apples and buys 5 more. How many apples does she have?")
    rng = random.Random(0)
    for size in (1, 5, 17, 33):
        tree = random_tree(rng, smollm2.config.vocab_size, size, root=ids[-1])
        exact, rounded = [], []
        for t, out in ((smollm2, exact), (bf16, rounded)):
            t.prefill(ids[:-1])
            out.append(t.verify(tree).logits)
            t.discard()
        (a,), (b,) = exact, rounded
        diff = (a - b).abs()
        assert diff.max() < BF16_MAX_ATOL and diff.mean() < BF16_MEAN_ATOL
        top2 = a.topk(2, dim=-1).values
        flipped = a.argmax(-1) != b.argmax(-1)
        assert ((top2[:, 0] - top2[:, 1])[flipped] < 2 * diff.max()).all()


@pytest.mark.parametrize("runtime", ["auto", "hf"])
def test_a_prefill_in_pieces_equals_one_forward(runtime):
    """Chunked prefill: the last logits and every position's taps as one forward gives them, on both runtimes."""
    target = tiny_target("qwen3", runtime=runtime)
    ids = [random.Random(1).randrange(96) for _ in range(40)]
    whole = target.prefill(ids, taps=(0, 2), chunk=len(ids))
    tree = random_tree(random.Random(2), 96, 6)
    after_whole = target.verify(tree).logits
    pieces = target.prefill(ids, taps=(0, 2), chunk=9)
    torch.testing.assert_close(pieces.logits, whole.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(pieces.hidden, whole.hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(target.verify(tree).logits, after_whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_prompt_from_position_zero_takes_sdpas_causal_kernel_with_the_masks_results(kind, monkeypatch):
    """A prefill from position 0 runs SDPA's causal kernel (no mask; grouped-query heads unfolded), and gives what
    the same tokens give under the explicit causal mask that every other forward of several tokens builds."""
    from treeflash.runtime import static_decoder

    target = tiny_target(kind, runtime="static")
    d, n = target.static, 20
    ids = torch.tensor([[random.Random(3).randrange(96) for _ in range(n)]])
    positions = torch.arange(n)[None]
    calls = []
    sdpa = static_decoder.F.scaled_dot_product_attention
    monkeypatch.setattr(static_decoder.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(kwargs.get("is_causal", False)) or sdpa(*args, **kwargs))
    causal = d.forward_batch(d.cache, 0, ids, positions, [0], None, taps=(0, 2))
    assert calls and all(calls)
    calls.clear()
    masked = d.forward_batch(d.cache, 0, ids, positions, [0], torch.ones(1, n, n, dtype=torch.bool).tril(),
                             taps=(0, 2))
    assert calls and not any(calls)
    for a, b in zip(causal, masked):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
