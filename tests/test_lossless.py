"""Every method gives exactly the target's greedy tokens at T = 0 (fp32), against plain autoregressive decoding."""

import random

import pytest

from treeflash import Sampling, generate
from treeflash.drafters import PromptLookupDrafter, make_drafter
from treeflash.drafters.datastore import Datastore

from conftest import OracleTreeDrafter


def repetitive_prompt(rng: random.Random, vocab: int, n: int = 40) -> list[int]:
    """Prompts with repeated n-grams, so that prompt lookup finds (and disagrees between) matches."""
    motifs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 5))] for _ in range(4)]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(motifs) if rng.random() < 0.7 else [rng.randrange(vocab)]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_methods_match_ar_on_tiny_targets(tiny, seed):
    rng = random.Random(seed)
    vocab = tiny.config.vocab_size
    prompt = repetitive_prompt(rng, vocab)
    ar = generate(tiny, make_drafter("ar"), prompt, max_new_tokens=60).tokens
    assert len(ar) == 60
    # rest's datastore: the answer itself with a few tokens changed, and noise (right and wrong drafts both)
    wrong = [t if rng.random() < 0.9 else rng.randrange(vocab) for t in ar]
    noise = [[rng.randrange(vocab) for _ in range(50)] for _ in range(5)]
    rest = PromptLookupDrafter(datastore=Datastore.from_sequences([wrong] + noise, vocab))
    for budget in (1, 4, 16):
        assert generate(tiny, make_drafter("pld"), prompt, 60, budget=budget).tokens == ar
        result = generate(tiny, rest, prompt, 60, budget=budget)
        assert result.tokens == ar
        if budget == 4:
            assert result.tau > generate(tiny, make_drafter("pld"), prompt, 60, budget=4).tau  # the datastore drafted
        oracle = OracleTreeDrafter(ar, len(prompt), vocab, seed=seed)
        result = generate(tiny, oracle, prompt, 60, budget=budget)
        assert result.tokens == ar
        if budget == 16:
            assert result.tau > 1.5  # the oracle's true branches were accepted, deep in the tree


def test_eos_and_max_tokens_stop_where_ar_stops(tiny):
    prompt = repetitive_prompt(random.Random(7), tiny.config.vocab_size)
    ar = generate(tiny, make_drafter("ar"), prompt, 30).tokens
    stop = ar[11]
    tiny.eos_ids = frozenset({stop})
    try:
        expected = ar[: ar.index(stop) + 1]
        for method in ("ar", "pld"):
            assert generate(tiny, make_drafter(method), prompt, 30).tokens == expected
        assert generate(tiny, OracleTreeDrafter(ar, len(prompt), 96), prompt, 30, budget=16).tokens == expected
    finally:
        tiny.eos_ids = frozenset()
    for n in (1, 2, 7):
        assert generate(tiny, OracleTreeDrafter(ar, len(prompt), 96), prompt, n, budget=16).tokens == ar[:n]


def test_streaming_callback_sees_every_token_once(tiny):
    prompt = repetitive_prompt(random.Random(3), tiny.config.vocab_size)
    seen: list[int] = []
    result = generate(tiny, make_drafter("pld"), prompt, 40, on_token=seen.append)
    assert seen == result.tokens


def test_should_stop_ends_the_generation_between_rounds(tiny):
    prompt = repetitive_prompt(random.Random(4), tiny.config.vocab_size)
    full = generate(tiny, make_drafter("pld"), prompt, 40, budget=4).tokens
    asked = 0

    def stop_after_three_rounds() -> bool:
        nonlocal asked
        asked += 1
        return asked > 3

    result = generate(tiny, make_drafter("pld"), prompt, 40, budget=4, should_stop=stop_after_three_rounds)
    assert len(result.rounds) == 3 and asked == 4
    assert result.tokens == full[:len(result.tokens)] and len(result.tokens) < len(full)


@pytest.mark.real
def test_smollm2_pld_and_tree_drafter_match_ar(smollm2):
    prompts = ["Write a Python function that returns the sum of a list, then explain it.",
               "Janet has 3 apples and buys 5 more. How many apples does she have? Explain step by step."]
    for i, text in enumerate(prompts):
        prompt = smollm2.encode_prompt(text)
        ar = generate(smollm2, make_drafter("ar"), prompt, 48).tokens
        pld = generate(smollm2, make_drafter("pld"), prompt, 48, budget=16)
        assert pld.tokens == ar
        oracle = OracleTreeDrafter(ar, len(prompt), smollm2.config.vocab_size, seed=i)
        assert generate(smollm2, oracle, prompt, 48, budget=16).tokens == ar


def test_sampling_rejects_bad_numbers():
    for kwargs in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            Sampling(**kwargs)


@pytest.mark.real
def test_smollm2_shipped_drafter_matches_ar(smollm2):
    """The shipped drafters (DFlash as a chain and as a DDTree, TreeFlash, DFlash-TfM with its Weaver) reproduce
    greedy decoding exactly (fp32)."""
    prompt = smollm2.encode_prompt("Tom has 12 marbles and gives away 5. How many are left? Explain.")
    ar = generate(smollm2, make_drafter("ar"), prompt, 40).tokens
    for method, budget in (("dflash", 16), ("ddtree", 16), ("ddtree", 5), ("treeflash", 16), ("treeflash", 64),
                           ("tfm", 16)):
        result = generate(smollm2, make_drafter(method, smollm2), prompt, 40, budget=budget)
        assert result.tokens == ar, method
        assert result.tau > 1.0  # the trained drafter gets tokens accepted
