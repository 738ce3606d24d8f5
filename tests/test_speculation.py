"""Cost-aware speculation (--budget auto): its parts, and that whatever it decides stays lossless."""

import random

import pytest

from treeflash import DraftTree, Sampling, generate
from treeflash.drafters import BlockDrafter, make_drafter
from treeflash.speculation import BatchCosts, Calibration, Policy, VerifyCosts, policy_for

from conftest import OracleTreeDrafter, tiny_target
from test_dflash import tiny_drafter
from test_lossless import repetitive_prompt
from test_sampling import FixedTreeDrafter, chi_square_pvalue


def costs(per_token_ms: float, base_ms: float = 10.0) -> VerifyCosts:
    """Synthetic verification costs: base + per_token x n milliseconds."""
    return VerifyCosts({n: (base_ms + per_token_ms * n) / 1e3 for n in (1, 2, 4, 8, 16, 32, 64)})


def test_verify_costs_interpolate_and_refresh():
    c = costs(1.0)
    assert c(4) == pytest.approx(0.014) and c(12) == pytest.approx(0.022)  # measured, then linear in between
    assert c(128) == pytest.approx(0.074 * 2)  # past the last bucket: proportional
    for _ in range(50):
        c.observe(16, 0.052)  # the machine got slower at 16 tokens
    assert c(16) == pytest.approx(0.052, rel=0.01)  # an EMA: 50 observations at rate 0.1


def test_calibration_learns_the_observed_acceptance():
    cal = Calibration(prior=4.0)
    tree = DraftTree.chain(0, [1, 2], probs=[0.9, 0.9])  # the drafter says 0.9 at every depth
    assert cal.node_values(tree).tolist() == pytest.approx([0.9, 0.81])  # no data: its own numbers
    for i in range(400):  # the target takes depth 1 half the time and depth 2 always after it
        cal.observe(tree, [0, 1, 2] if i % 2 else [0])
    values = cal.node_values(tree)
    assert values[0] == pytest.approx(0.5, abs=0.01) and values[1] == pytest.approx(0.5, abs=0.01)


def test_policy_keeps_the_prefix_that_pays():
    tree = DraftTree.chain(0, list(range(1, 9)), probs=[0.9] * 8)
    cheap, dear = Policy(costs(0.01), 8), Policy(costs(100.0), 8)
    assert cheap.choose([tree])[0].size == 8  # verification almost free: every node pays
    assert dear.choose([tree])[0].size == 0  # each node costs ten AR steps: a plain AR step
    assert cheap.gain > 0 and dear.gain == 0


def test_policy_stops_drafting_when_it_does_not_pay_and_probes_again():
    """Probes that mislead (one drafted round, then AR again) come ever more rarely, up to the cap; a drafting
    stretch that lasts brings the probes back to the minimum interval."""
    policy = Policy(costs(100.0), 8)
    tree = DraftTree.chain(0, [1, 2], probs=[0.5, 0.5])

    def round_(force_gain: float | None = None) -> bool:
        drafted = policy.should_draft()
        if drafted:
            policy.choose([tree])[0]
            if force_gain is not None:
                policy.gain = force_gain
        policy.observe([DraftTree.chain(0)], [[0]], 1, 0.005 if drafted else 0.0, 0.01, drafted)
        return drafted

    assert round_()  # no data yet: draft
    first, cap = Policy.PROBE_EVERY
    expected = [2 ** i * first for i in range(1, 16) if 2 ** i * first < cap] + [cap, cap]
    decisions = [round_() for _ in range(sum(expected) + len(expected))]
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a - 1 for a, b in zip([-1] + probes, probes)]  # AR rounds before each probe
    assert gaps[:len(expected)] == expected  # each misleading probe doubles the interval, up to the cap
    policy.gain = 10.0  # the text became easy: a long stretch where drafting pays
    for _ in range(cap):
        assert round_(force_gain=10.0)
    policy.gain = 0.0  # then it stops paying: probes come early again
    assert not round_() and policy.probe_every == first


def test_a_probe_that_pays_resumes_drafting_at_once():
    """A probe judges the text as it is now (not the stale average of the rounds before the AR stretch), and its
    drafting time, which includes the context's catch-up, does not count as the drafter's cost."""
    policy = Policy(costs(1.0), 8)
    policy.gain, policy.draft_s = 0.0, 0.005  # drafting stopped paying
    while not policy.should_draft():
        policy.observe([DraftTree.chain(0)], [[0]], 1, 0.0, 0.011, False)
    easy = DraftTree.chain(0, list(range(1, 9)), probs=[0.99] * 8)
    assert policy.choose([easy])[0].size == 8 and policy.gain > policy.rate * policy.draft_s
    policy.observe([easy], [list(range(9))], 9, draft_s=0.5, verify_s=0.018, drafted=True)  # a slow catch-up
    assert policy.draft_s == 0.005 and policy.should_draft()


def test_a_cold_first_drafting_time_does_not_lock_drafting_out():
    """The first drafting round pays for lazy initialisation (here 20x the true cost); its time must not keep the
    policy at AR steps: a probe, whose time (catch-up included) bounds the drafting cost from above, lowers it."""
    policy = Policy(costs(1.0), 8)
    tree = DraftTree.chain(0, [1, 2], probs=[0.9, 0.9])  # worth about one token and a half a round
    policy.choose([tree])
    policy.observe([tree], [[0]], 1, draft_s=0.1, verify_s=0.012, drafted=True)  # cold (and nothing accepted)
    assert policy.draft_s == 0.1 and not policy.should_draft()  # 0.1 s of drafting: no such tree pays that
    while not policy.should_draft():  # AR steps until the probe
        policy.observe([DraftTree.chain(0)], [[0]], 1, 0.0, 0.011, False)
    policy.choose([tree])
    policy.observe([tree], [[0, 1, 2]], 3, draft_s=0.005, verify_s=0.013, drafted=True)  # warm, catch-up included
    assert policy.draft_s == 0.005 and policy.should_draft()


class ForcedPolicy:
    """Patch a drafter's policy to the cheap or the dear extreme, so that both code paths run."""

    @staticmethod
    def install(target, drafter, per_token_ms: float) -> Policy:
        policy = policy_for(target, drafter, 16)
        policy.costs = BatchCosts({1: costs(per_token_ms)})
        policy.tokens, policy.seconds = 1.0, policy.costs(1)
        return policy


@pytest.mark.parametrize("per_token_ms", [0.01, 1.0, 100.0])
def test_auto_budget_is_lossless(tiny, per_token_ms):
    """Whatever the policy decides (full trees, prefixes, AR rounds with the drafter skipped), the tokens are AR's."""
    vocab = tiny.config.vocab_size
    for seed in range(2):
        prompt = repetitive_prompt(random.Random(seed), vocab)
        ar = generate(tiny, make_drafter("ar"), prompt, 50).tokens
        for drafter in (make_drafter("pld"), OracleTreeDrafter(ar, len(prompt), vocab, seed=seed)):
            ForcedPolicy.install(tiny, drafter, per_token_ms)
            result = generate(tiny, drafter, prompt, 50, budget="auto", max_budget=16)
            assert result.tokens == ar
            sizes = [r.tree_size for r in result.rounds]
            if per_token_ms == 100.0:
                assert max(sizes[1:]) == 0 or sizes.count(0) > len(sizes) // 2  # mostly AR steps
            assert sum(r.accepted for r in result.rounds) == len(result.tokens) - 1  # τ counts committed tokens


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_auto_budget_block_drafter_catches_up_after_ar_rounds(method):
    """A drafter skipped for AR rounds gets every committed position's taps at its next call: still lossless."""
    target = tiny_target("qwen3")
    drafter = BlockDrafter(tiny_drafter(target, seed=1), method)
    policy = ForcedPolicy.install(target, drafter, 100.0)
    prompt = repetitive_prompt(random.Random(5), 96)
    ar = generate(target, make_drafter("ar"), prompt, 40).tokens
    policy.draft_s, policy.gain = 0.001, 0.0  # drafting looks unprofitable from the start: AR rounds and probes
    result = generate(target, drafter, prompt, 40, budget="auto", max_budget=16)
    assert result.tokens == ar
    assert sum(r.draft_s == 0 or r.tree_size == 0 for r in result.rounds) > 0


def test_auto_budget_sampling_is_exact():
    target = tiny_target("llama", seed=3, vocab_size=10, logit_scale=8)  # sharp: a biased rule shows
    drafter = FixedTreeDrafter()
    ForcedPolicy.install(target, drafter, 1.0)
    assert chi_square_pvalue(target, Sampling(temperature=1.0), drafter, budget="auto") > 1e-3


def test_budget_is_checked(tiny):
    for bad in (0, "big", -3):
        with pytest.raises(ValueError, match="budget"):
            generate(tiny, make_drafter("pld"), [1, 2, 3], 4, budget=bad)
