"""Sampling at T > 0: the processed distribution against transformers' own warpers, the sampler, and the expected
accepted count. That whole spec-decoded sequences are exact samples is test_exact_sequences'."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeflash import DraftTree, Sampling
from treeflash.verify import accept, expected_accepted

VOCAB = 10


class FixedTreeDrafter:
    """Always the same deterministic tree: 4 children under the root, 3 under each of them."""

    name, taps, drafts = "fixed-tree", (), True
    forward_s, adapter_calls = 0.0, 0

    def reset(self):
        pass

    def follow(self, sampling, generator=None):
        pass

    def propose(self, tokens, features, budget):
        return DraftTree.from_paths(tokens[-1], [[a, b] for a in (0, 1, 2, 3) for b in (0, 1, 2)], budget=budget)


def biased_accept(tree, logits, sampling, generator=None):
    """min(1, p/q) against the drafter's own (uniform) proposal, without the residual on rejection: biased."""
    probs, children, path = sampling.probs(logits), tree.children(), [0]
    while True:
        node = path[-1]
        for token, child in children[node].items():
            q = 1 / len(children[node])
            if torch.rand((), generator=generator) < min(1.0, probs[node, token].item() / q):
                path.append(child)
                break
        else:
            return path, int(torch.multinomial(probs[node], 1, generator=generator))


def test_processed_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.equal(Sampling(1.0, top_k=2).probs(logits)[0, 2:], torch.zeros(3))
    p = torch.softmax(logits[0], -1)  # 0.636, 0.234, 0.086, ...
    kept = Sampling(1.0, top_p=0.8).probs(logits)[0]
    torch.testing.assert_close(kept[:2], p[:2] / p[:2].sum())  # the token crossing 0.8 is kept
    assert kept[2:].sum() == 0
    assert Sampling(0.0).choose(logits).item() == 0


def test_tiny_temperatures_and_top_ps():
    """Found by fuzzing the server: a temperature or top_p of 1e-220 rounds to 0 in fp32, and the probabilities
    became NaN. A positive temperature that small is refused; a top_p that small keeps the most likely token."""
    from treeflash.verify import MIN_TEMPERATURE

    for bad in (1e-220, MIN_TEMPERATURE / 2, float("nan"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            Sampling(bad)
    logits = torch.tensor([[30.0, 29.0, -5.0]])
    probs = Sampling(MIN_TEMPERATURE).probs(logits)
    assert torch.isfinite(probs).all() and probs[0, 0] == 1
    assert Sampling(MIN_TEMPERATURE).choose(logits).item() == 0
    nucleus = Sampling(1.0, top_p=1e-220).probs(logits)  # a top_p that rounds to 0 keeps the most likely token
    assert nucleus.tolist() == [[1.0, 0.0, 0.0]]


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0), Sampling(temperature=1.0),
                                      Sampling(temperature=0.8, top_k=6, top_p=0.9)])
def test_expected_accepted_is_the_mean_of_accept(sampling):
    """E[accepted | tree] against the empirical mean of `accept` on the same verified logits."""
    tree = FixedTreeDrafter().propose([5], None, 16)
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    expected = expected_accepted(tree, logits, sampling)
    g = torch.Generator().manual_seed(1)
    counts = [len(accept(tree, logits, sampling, g)[0]) for _ in range(1 if sampling.greedy else 20000)]
    assert abs(sum(counts) / len(counts) - expected) < (1e-6 if sampling.greedy else 0.02)
    assert 1.0 <= expected <= 3.0


# ---- Sampling against transformers' own logits processors --------------------------------------------------------

PROCESSOR_TOL = dict(atol=1e-6, rtol=1e-5)  # fp32 softmaxes of the same masked logits


def transformers_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution `generate(do_sample=True)` samples from, over the last axis of `logits`: its warpers in its
    own order (temperature, top-k, top-p), then a softmax."""
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    rows = logits.reshape(-1, logits.shape[-1]).float().clone()
    return torch.softmax(warpers(None, rows), dim=-1).reshape(logits.shape)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(-6, 6), min_size=2, max_size=12),  # small integers: many exact ties
       scale=st.sampled_from([0.25, 0.5, 1.0, 2.0]),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
       top_k=st.integers(0, 12), top_p=st.sampled_from([0.1, 0.25, 0.5, 0.8, 0.9, 0.95, 1.0]))
def test_sampling_matches_transformers_processors(values, scale, temperature, top_k, top_p):
    """Temperature, top-k, top-p and their combinations give transformers' distribution. Where tied logits straddle
    a cut, both keep the same number of tokens and the same mass, and differ at most in which of the tied tokens
    they keep (each breaks ties by its own sort order)."""
    logits = scale * torch.tensor(values, dtype=torch.float32)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    ours, theirs = sampling.probs(logits), transformers_probs(logits, sampling)
    if torch.allclose(ours, theirs, **PROCESSOR_TOL):
        return
    differ = (ours > 0) != (theirs > 0)
    assert (ours > 0).sum() == (theirs > 0).sum()
    assert logits[differ].unique().numel() == 1, "only tokens tied at the cut may differ"
    torch.testing.assert_close(ours.sort().values, theirs.sort().values, **PROCESSOR_TOL)


@pytest.mark.parametrize("broken", ["top_p_after_renormalising", "top_k_off_by_one"])
def test_a_broken_processor_fails_the_comparison(broken, monkeypatch):
    """The control: Sampling with a wrong top-p (the crossing token dropped) or a wrong top-k (one token too few)
    disagrees with transformers on a plain case, so the comparison above can fail."""
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])
    sampling = Sampling(temperature=1.0, top_k=4 if broken == "top_k_off_by_one" else 0,
                        top_p=0.8 if broken == "top_p_after_renormalising" else 1.0)
    real = Sampling.probs

    def wrong(self, x):
        if broken == "top_k_off_by_one":
            return real(Sampling(self.temperature, self.top_k - 1, self.top_p), x)
        probs = torch.softmax(x.float() / self.temperature, -1)
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) < self.top_p  # drops the token that crosses top_p
        return torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep) / (sorted_probs * keep).sum()

    monkeypatch.setattr(Sampling, "probs", wrong)
    assert not torch.allclose(sampling.probs(logits), transformers_probs(logits, sampling), **PROCESSOR_TOL)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0, float("inf"), float("-inf"), float("nan")]),
                         min_size=1, max_size=12), min_size=1, max_size=4)
       .filter(lambda rows: len({len(r) for r in rows}) == 1),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_the_cpu_argmax_is_torchs_with_ties_infinities_and_nan(rows, dtype):
    """`verify.argmax` (NumPy's on the CPU) picks what torch's argmax picks: the first of equal maxima, NaN first."""
    from treeflash.verify import argmax

    logits = torch.tensor(rows, dtype=dtype)
    assert argmax(logits).tolist() == logits.argmax(-1).tolist()
    assert argmax(logits[:, ::2]).tolist() == logits[:, ::2].argmax(-1).tolist()  # a strided view
    assert argmax(logits[0]).tolist() == logits[0].argmax(-1).tolist()  # one row
