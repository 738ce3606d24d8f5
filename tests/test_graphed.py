"""The fixed-shape forward behind CUDA graphs (models/graphed.py), run eagerly on the CPU against the static
runtime's own path and the HF runtime: buckets, padding, the device-built mask, taps, uneven batches, cache growth."""

from __future__ import annotations

import random

import pytest
import torch

from treeflash import generate
from treeflash.batching import BatchEngine, BatchTarget
from treeflash.drafters import make_drafter
from treeflash.runtime.graphed import TOKEN_BUCKETS, bucket
from treeflash.tree import random_tree

from conftest import OracleTreeDrafter, tiny_target
from test_lossless import repetitive_prompt

ATOL = 1e-5  # fp32: attention over the padded cache bucket sums in another order


def fixed_shape(target):
    target.static.use_graphs(capture=False)
    return target


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 16, 17, 18, 65, 257)] == [1, 2, 3, 5, 17, 17, 33, 65, 257]
    assert bucket(258) is None and list(TOKEN_BUCKETS) == sorted(TOKEN_BUCKETS)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fixed_shape_verification_equals_the_static_runtime(kind):
    plain, fixed = tiny_target(kind), fixed_shape(tiny_target(kind))
    rng, vocab = random.Random(0), plain.config.vocab_size
    history = [rng.randrange(vocab) for _ in range(50)]
    for t in (plain, fixed):
        t.prefill(history, taps=(0, 2))
    for size in (1, 2, 4, 17, 18, 40):
        tree = random_tree(rng, vocab, size)
        a, b = plain.verify(tree), fixed.verify(tree)
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(b.hidden, a.hidden, atol=ATOL, rtol=0)
        path = tree.path_to(rng.randrange(len(tree)))
        plain.commit(path)
        fixed.commit(path)
    shapes = {key[2] for key in fixed.static.cache.graphs}
    assert shapes <= set(TOKEN_BUCKETS) and len(shapes) >= 4  # one fixed-shape forward per bucket, reused


def test_every_method_keeps_ar_tokens_in_fixed_shapes():
    target = fixed_shape(tiny_target("qwen3"))
    prompt = repetitive_prompt(random.Random(1), 96)
    ar = generate(tiny_target("qwen3"), make_drafter("ar"), prompt, 40).tokens
    assert generate(target, make_drafter("ar"), prompt, 40).tokens == ar
    assert generate(target, make_drafter("pld"), prompt, 40, budget=8).tokens == ar
    oracle = generate(target, OracleTreeDrafter(ar, len(prompt), 96), prompt, 40, budget=16)
    assert oracle.tokens == ar and oracle.tau > 1.5


def test_uneven_batch_in_fixed_shapes_equals_each_sequence_alone():
    batch_target, single = fixed_shape(tiny_target("llama")), tiny_target("llama", runtime="hf")
    rng, vocab = random.Random(2), single.config.vocab_size
    histories = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 30, 61)]
    batch = BatchTarget(batch_target, 3, capacity=64)  # small: it grows mid-run, dropping its forwards
    for h in histories:
        batch.add(h)
    grown = False
    for _ in range(4):
        capacity = batch.cache.capacity
        trees = [random_tree(rng, vocab, rng.choice((1, 3, 9))) for _ in histories]
        outs, paths = batch.verify(trees), []
        grown |= batch.cache.capacity != capacity
        for h, tree, out in zip(histories, trees, outs):
            single.prefill(h)
            torch.testing.assert_close(out.logits, single.verify(tree).logits, atol=ATOL, rtol=0)
            paths.append(tree.path_to(rng.randrange(len(tree))))
            h += [tree.tokens[i] for i in paths[-1]]
        batch.commit(paths)
    assert grown and all(key[2] in TOKEN_BUCKETS for key in batch.cache.graphs)
    prompts = [repetitive_prompt(random.Random(s), vocab, n) for s, n in ((3, 20), (4, 45), (5, 33))]
    expected = [generate(single, make_drafter("ar"), p, 24).tokens for p in prompts]
    results = BatchEngine(batch_target, make_drafter("pld"), max_batch=2, budget=8).run(prompts, 24)
    assert [r.tokens for r in results] == expected


def test_graphs_need_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(ValueError, match="CUDA"):
        tiny_target("llama").static.use_graphs()
