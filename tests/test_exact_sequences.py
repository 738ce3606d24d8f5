"""Whole sequences at T > 0: every method, with its real drafter class and random weights, single and batched,
draws its first L tokens from exactly the target's processed distribution.

The expected law is enumerated over all V^L sequences from plain forwards of the stock model and transformers' own
warpers (temperature, top-k, top-p), never from our `Sampling`, so a processor bug fails here too. L = 4 with trees
of at most 4 nodes: most samples take two rounds or more, so later rounds (a drafter that caught up, K/V compacted
after a rejection) are covered, not only the first. Four deliberately broken copies must fail the same test."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import treeflash.engine
import treeflash.verify
from treeflash import Sampling, generate
from treeflash.batching import BatchEngine
from treeflash.drafters import PromptLookupDrafter, block_drafter, make_drafter
from treeflash.drafters.datastore import Datastore
from treeflash.drafters.eagle3 import Eagle3Decoder

from conftest import tiny_target
from test_dflash import tiny_drafter
from test_dflash2 import dflash2_folder
from test_eagle3 import tiny_eagle3
from test_sampling import biased_accept, transformers_probs
from test_treeflash import treeflash_drafter
from test_weaver import tiny_weaver

VOCAB, L, BUDGET = 5, 4, 4  # a small vocabulary: random drafters hit the target's tokens often
PROMPT = [1, 4, 2, 3, 1, 4, 2, 3, 1]  # repeated: prompt lookup finds matches
SAMPLING = Sampling(temperature=0.9, top_k=3, top_p=0.8)  # all three processors, each cutting somewhere
SINGLE, BATCHED, BATCH = 400, 600, 50  # samples one sequence at a time, and in batches of BATCH
PASS_P, FAIL_P = 1e-3, 1e-6  # an exact method passes at 1e-3 (0.1 % false alarms per test); a control fails at 1e-6
METHODS = ("ar", "pld", "rest", "dflash", "ddtree", "treeflash", "tfm", "dflash2", "dflash2-tree", "eagle3")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3, vocab_size=VOCAB, logit_scale=2)  # most of the mass on ~60 sequences


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """Each method's own drafter class over random weights sized for the 5-token target."""
    backbone = tiny_drafter(target, seed=1, block_size=4)
    folder = str(dflash2_folder(tmp_path_factory.mktemp("dflash2") / "d", target, block_size=4, top_k=4))
    g = torch.Generator().manual_seed(2)  # a datastore of random answers: it drafts where the context does not
    datastore = Datastore.from_sequences(torch.randint(0, VOCAB, (8, 30), generator=g).tolist(), VOCAB)
    return {"ar": make_drafter("ar"), "pld": make_drafter("pld"), "rest": PromptLookupDrafter(datastore=datastore),
            "dflash": block_drafter(backbone, "dflash"), "ddtree": block_drafter(backbone, "ddtree"),
            "treeflash": block_drafter(treeflash_drafter(target), "treeflash", top_m=4, top_n=8),
            "tfm": block_drafter(backbone, "tfm", weaver=tiny_weaver(backbone, top_k=4), width=2),
            "dflash2": make_drafter("dflash2", target, folder),
            "dflash2-tree": make_drafter("dflash2-tree", target, folder),
            "eagle3": Eagle3Decoder(tiny_eagle3(target, seed=1, draft_vocab=VOCAB), top_k=2)}


@pytest.fixture(scope="module")
def exact(target) -> torch.Tensor:
    return exact_law(target)


def exact_law(target) -> torch.Tensor:
    """P(first L new tokens) [V^L], sequences in base-V order, from stock forwards and transformers' warpers."""
    joint = torch.ones(1, dtype=torch.float64)
    with torch.inference_mode():
        for depth in range(L):
            prefixes = torch.tensor([PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=depth)])
            probs = transformers_probs(target.model(prefixes).logits[:, -1], SAMPLING).double()  # [V^depth, V]
            joint = (joint[:, None] * probs).reshape(-1)
    return joint


def index(tokens: list[int]) -> int:
    assert len(tokens) == L
    return sum(t * VOCAB ** (L - 1 - i) for i, t in enumerate(tokens))


def sample_single(target, drafter, budget: int | str = BUDGET) -> tuple[torch.Tensor, float]:
    counts, results = torch.zeros(VOCAB ** L, dtype=torch.float64), []
    for seed in range(SINGLE):
        results.append(generate(target, drafter, PROMPT, L, sampling=SAMPLING, budget=budget, seed=seed))
        counts[index(results[-1].tokens)] += 1
    return counts, tau(results)


def sample_batched(target, drafter, budget: int = BUDGET) -> tuple[torch.Tensor, float]:
    counts, results = torch.zeros(VOCAB ** L, dtype=torch.float64), []
    for start in range(0, BATCHED, BATCH):  # BATCH copies of the prompt, each with its own seed
        engine = BatchEngine(target, drafter, max_batch=BATCH, budget=budget)
        results += engine.run([PROMPT] * BATCH, L, SAMPLING, seed=start)
    for result in results:
        counts[index(result.tokens)] += 1
    return counts, tau(results)


def tau(results) -> float:
    """Tokens committed per round (drafts accepted + the bonus), over all samples."""
    return sum(r.accepted for x in results for r in x.rounds) / sum(len(x.rounds) for x in results)


def pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square of the observed sequences against the exact law; cells expected under 5 pooled into one."""
    if counts[exact == 0].sum() > 0:
        return 0.0  # a sequence outside the processed distribution's support
    expected = exact * counts.sum()
    keep = expected >= 5
    assert keep.sum() >= 15, "too few cells for the test to see much"
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs = torch.cat([obs, counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([exp, expected[~keep].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_samples_whole_sequences_exactly(target, drafters, exact, method, batched, monkeypatch):
    residuals = []  # draws after a rejected sampled draft (dflash2's chains)
    real = treeflash.verify.residual
    monkeypatch.setattr(treeflash.verify, "residual", lambda *a: residuals.append(1) or real(*a))
    counts, tau = (sample_batched if batched else sample_single)(target, drafters[method])
    assert pvalue(counts, exact) > PASS_P, method
    if method != "ar":
        assert tau > 1.1, f"{method}: almost no draft accepted, so the test saw little of its acceptance"
    if method == "dflash2":
        samples = BATCHED if batched else SINGLE
        assert len(residuals) > samples / 4, "few rejections: the residual, which this test checks, rarely ran"


# ---- the controls: each broken copy fails the same test ---------------------------------------------------------

def drafter_as_target(tree, logits, sampling, generator=None):
    """Acceptance that trusts the drafter's probability of each child where the target's should decide."""
    probs, children, path = sampling.probs(logits), tree.children(), [0]
    while True:
        for child in children[path[-1]].values():
            if torch.rand((), generator=generator) < tree.probs[child]:
                path.append(child)
                break
        else:
            return path, int(torch.multinomial(probs[path[-1]], 1, generator=generator))


def top_p_without_the_crossing_token(self, logits):
    """Top-p that keeps only the tokens strictly inside top_p (it drops the one that crosses it)."""
    probs = torch.softmax(logits.float() / self.temperature, -1)
    if self.top_k:
        kth = torch.topk(probs, self.top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    sorted_probs, order = probs.sort(-1, descending=True)
    keep = sorted_probs.cumsum(-1) < self.top_p
    keep[..., 0] = True
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("broken", ["biased-acceptance", "wrong-top-p", "drafter-as-target", "no-residual"])
def test_a_broken_copy_fails_the_same_test(target, drafters, exact, broken, monkeypatch):
    """Acceptance by min(1, p / q) against a uniform q without a residual; top-p that drops the crossing token;
    the drafter's probabilities deciding acceptance; after a rejected sampled draft, a draw from p instead of
    norm(max(0, p - q)). Run batched, the cheaper mode (both engines run `engine.run_round`)."""
    method = "dflash2" if broken == "no-residual" else "ddtree"
    if broken == "wrong-top-p":
        monkeypatch.setattr(Sampling, "probs", top_p_without_the_crossing_token)
    elif broken == "no-residual":
        monkeypatch.setattr(treeflash.verify, "residual", lambda p, ids, q: p)
    else:
        rule = biased_accept if broken == "biased-acceptance" else drafter_as_target
        monkeypatch.setattr(treeflash.engine, "accept", rule)
    counts, _ = sample_batched(target, drafters[method])
    p = pvalue(counts, exact)
    print(f"{broken}: p = {p:.2e}")
    assert p < FAIL_P
