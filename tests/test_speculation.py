"""Cost-aware speculation (--budget auto): its parts, and that whatever it decides stays lossless."""

import random
import weakref

import pytest

from treeflash import DraftTree, generate
from treeflash.drafters import block_drafter, make_drafter
from treeflash.speculation import BatchCosts, Calibration, Policy, VerifyCosts, policy_for

from conftest import OracleTreeDrafter, tiny_target
from test_dflash import tiny_drafter
from test_lossless import repetitive_prompt
from test_treeflash import treeflash_drafter


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


def test_verify_costs_grow_with_the_context():
    """Measured at 256 positions with a slope per bucket: linear in the context, never under half the cost at
    256, and an observation at a long context refreshes the table without counting the context twice."""
    c = VerifyCosts({1: 0.005, 8: 0.010}, context=256, slopes={1: 1e-6, 8: 8e-6})
    assert c(8) == c(8, 256) == pytest.approx(0.010)
    assert c(8, 1256) == pytest.approx(0.018) and c(1, 1256) == pytest.approx(0.006)
    assert c(4, 1256) == pytest.approx(c(4) + 1000 * (1e-6 + 3 / 7 * 7e-6))  # slopes interpolate as costs do
    assert c(8, 0) == pytest.approx(0.010 - 0.002048) and c(1, -10**6) == pytest.approx(0.0025)
    assert c.table(9, 1256) == pytest.approx([c(n, 1256) for n in range(1, 10)])
    for _ in range(20):
        c.observe(8, 0.018, 1256)  # as predicted there: nothing to learn
    assert c(8) == pytest.approx(0.010)
    flat = VerifyCosts({1: 0.005, 8: 0.010})  # no slopes: the same at every context
    assert flat(8, 5000) == flat(8) == pytest.approx(0.010)


def test_policy_drafts_smaller_trees_after_long_contexts():
    tree = DraftTree.chain(0, list(range(1, 9)), probs=[0.9] * 8)
    table = {n: (5.0 + 0.3 * n) / 1e3 for n in (1, 2, 4, 8, 16)}
    policy = Policy(VerifyCosts(table, 256, {n: n * 2e-6 for n in table}), 8)
    near, far = policy.choose([tree], 256)[0].size, policy.choose([tree], 4000)[0].size
    assert far < near


def test_the_policy_drafts_twice_what_it_chose_lately():
    """`reach`: the tree size a round drafts follows the prefixes chosen (at least MIN_REACH, at most max_budget),
    decaying towards twice the latest and doubling when a round chose all it drafted."""
    policy = Policy(costs(100.0), 32)  # each node costs ten AR steps: nothing pays
    assert policy.reach == 32  # nothing chosen yet: the largest tree
    reaches = []
    for _ in range(12):
        policy.choose([DraftTree.chain(0, list(range(1, policy.reach + 1)), probs=[0.9] * policy.reach)])
        reaches.append(policy.reach)
    assert reaches[:3] == [24, 18, 13] and reaches[-1] == Policy.MIN_REACH
    policy.costs = Policy(costs(0.01), 32).costs  # verification almost free: every node pays
    for expected in (8, 16, 32, 32):
        policy.choose([DraftTree.chain(0, list(range(1, policy.reach + 1)), probs=[0.9] * policy.reach)])
        assert policy.reach == expected


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


def probing(policy: Policy, rounds: int, probe_s: float, step_s: float, paying=lambda i: False) -> list[int]:
    """`rounds` rounds of a drafter whose drafting costs `probe_s` and whose drafts the target rejects, except in
    rounds where `paying(i)` (then it accepts them whole); an AR step takes `step_s`, a verified node 1 ms more.
    Returns the rounds that drafted."""
    tree = DraftTree.chain(0, [1, 2], probs=[0.5, 0.5])
    drafted_rounds = []
    for i in range(rounds):
        drafted = policy.should_draft()
        verified, path = DraftTree.chain(0), [0]
        if drafted:
            (verified,) = policy.choose([tree])
            drafted_rounds.append(i)
            if paying(i):
                policy.gain = 10.0  # as a tree the target accepts whole would have it
                path = list(range(len(verified)))
        verify_s = step_s + 0.001 * verified.size  # as costs(1.0) has it
        policy.observe([verified], [path], len(path), probe_s if drafted else 0.0, verify_s, drafted)
    return drafted_rounds


def test_a_drafter_that_never_pays_costs_at_most_its_allowance():
    """Probes that lose (here each one costs half an AR step and gains nothing) come as rarely as their loss
    over the allowance says: they take at most PROBE_SHARE of the run's time (the first drafting round, which pays
    for lazy initialisation, aside); yet the drafter is still probed."""
    step, probe = 0.011, 0.0055
    policy = Policy(costs(1.0), 8)
    rounds = 3000
    drafted = probing(policy, rounds, probe, step)
    spent = rounds * step + len(drafted) * probe
    assert spent - rounds * step <= Policy.PROBE_SHARE * spent + probe
    assert len(drafted) >= 0.8 * rounds * step * Policy.PROBE_SHARE / probe  # and probed as often as that allows


def test_a_cheap_drafter_probes_at_the_minimum_gap():
    """A probe of a drafter that costs a small share of a step (prompt lookup) is paid by the allowance of a few
    rounds: probes every PROBE_GAP rounds."""
    policy = Policy(costs(1.0), 8)
    drafted = probing(policy, 600, 0.00005, 0.011)
    gaps = [b - a - 1 for a, b in zip(drafted, drafted[1:])]
    assert gaps[-20:] == [Policy.PROBE_GAP] * 20  # once the calibration has seen the drafts fail


def test_a_paying_stretch_earns_probes():
    """After a stretch where drafting paid, the drafter drafts on (its calibration says it pays) while what the
    stretch saved lasts and its losses stay under the cap, then comes back as rarely as before the stretch."""
    step, probe = 0.011, 0.0055
    policy = Policy(costs(1.0), 8)
    drafted = probing(policy, 1800, probe, step, paying=lambda i: 1000 <= i < 1200)

    def probes(start: int, end: int) -> int:
        return sum(start <= i < end for i in drafted)
    assert probes(1000, 1200) > 130  # found by the next probe, then drafted throughout
    assert probes(1200, 1400) > 3 * probes(800, 1000) > 0
    assert probes(1600, 1800) <= probes(800, 1000) + 1


def test_drafting_predicted_to_pay_stops_after_losing_loss_cap_steps():
    """Rounds the policy predicts to pay but which lose (a stale cost or calibration): drafting stops once they
    have lost LOSS_CAP AR steps since their best point, and comes back as a probe, at the probes' pace."""
    step = 0.011
    policy = Policy(costs(1.0), 8)
    policy.gain, policy.draft_s, policy.credit = 10.0, 0.0001, 0.0  # predicted to pay, whatever happens
    tree = DraftTree.chain(0, [1], probs=[0.9])

    def round_(saved_steps: float) -> bool:
        drafted = policy.should_draft()
        seconds = (2 - saved_steps) * step if drafted else step
        policy.observe([tree if drafted else DraftTree.chain(0)], [[0, 1] if drafted else [0]], 2 if drafted else 1,
                       0.0, seconds, drafted)
        return drafted
    assert all(round_(+1.0) for _ in range(10))  # paying: no drawdown
    losing = 0
    while round_(-1.0):  # each round now loses an AR step
        losing += 1
    assert losing == Policy.LOSS_CAP  # it stopped at the cap, from its best point (the paying rounds do not count)
    assert policy.gain == 0.0 and not any(round_(-1.0) for _ in range(Policy.PROBE_GAP - 1))


def test_a_probe_that_pays_resumes_drafting_at_once():
    """A probe judges the text as it is now (not the stale average of the rounds before the AR stretch), and its
    drafting time, which includes the context's catch-up, does not count as the drafter's cost."""
    policy = Policy(costs(1.0), 8)
    policy.gain, policy.draft_s = 0.0, 0.005  # drafting stopped paying
    while not policy.should_draft():
        policy.observe([DraftTree.chain(0)], [[0]], 1, 0.0, 0.011, False)
    easy = DraftTree.chain(0, list(range(1, 9)), probs=[0.99] * 8)
    assert policy.choose([easy])[0].size == 8 and policy.gain > policy.rate * policy.draft_s
    policy.observe([easy], [list(range(9))], 9, draft_s=0.1, verify_s=0.018, drafted=True)  # a slow catch-up
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


def test_an_adapter_builds_only_where_it_pays_for_its_time():
    """Each build is timed once at each reach (the first drafting round, cold, not counted); then the adapter runs
    where ADAPTER_GAIN of the round's expected tokens is worth more than its extra time at the achieved rate."""
    policy = Policy(costs(1.0), 16)
    policy.tokens, policy.seconds = 1.0, 0.01  # 100 tokens/s
    policy.choose([DraftTree.chain(0, [1, 2, 3], probs=[0.9] * 3)])  # about 3.2 tokens expected a round
    assert not policy.adapter_pays(4)  # nothing timed: the backbone's own tree first
    policy.observe_build(False, 4, 0.5)  # the first drafting round (lazy initialisation): not counted
    policy.draft_s = 0.001
    assert not policy.adapter_pays(4)
    policy.observe_build(False, 4, 0.001)
    assert policy.adapter_pays(4)  # then the adapter's
    policy.observe_build(True, 4, 0.0035)
    assert not policy.adapter_pays(4)  # 2.5 ms more at 100 tokens/s: 0.25 tokens, more than 6 % of 3.2
    assert not policy.adapter_pays(8)  # another reach is timed afresh
    policy.observe_build(False, 8, 0.001)
    policy.observe_build(True, 8, 0.0012)
    assert policy.adapter_pays(8)  # 0.2 ms more: 0.02 tokens, it pays


class FakeClock:
    """Time that moves only by a cost model: a verification of n tokens takes `verify_ms(n)`, a drafting call
    `draft_ms(verifications so far)`. The engine's and the policy's clocks read it, so that no decision of a
    test depends on the machine's speed (the verification costs are measured on it too: the caches start empty)."""

    def __init__(self, monkeypatch, target, drafter, verify_ms, draft_ms=lambda verified: 1.0):
        self.t, self.verified = 0.0, 0
        for clock in ("treeflash.engine._now", "treeflash.engine._host", "treeflash.speculation.now",
                      "treeflash.batching.now"):
            monkeypatch.setattr(clock, self.now)
        monkeypatch.setattr("treeflash.speculation._costs", weakref.WeakKeyDictionary())
        monkeypatch.setattr("treeflash.speculation._policies", weakref.WeakKeyDictionary())
        verify, propose = target.verify, drafter.propose

        def timed_verify(tree):
            self.t += verify_ms(len(tree)) / 1e3
            self.verified += 1
            return verify(tree)

        def timed_propose(*args, **kwargs):
            self.t += draft_ms(self.verified) / 1e3
            return propose(*args, **kwargs)
        monkeypatch.setattr(target, "verify", timed_verify)
        monkeypatch.setattr(drafter, "propose", timed_propose)

    def now(self, device=None) -> float:
        return self.t


NET_ATOL = 1e-5  # the policy sums in fp32, the brute force in fp64


def test_policy_chooses_the_prefix_a_brute_force_search_picks():
    """Policy.choose against every prefix valued from scratch: with no acceptance data yet, a node is reached
    with the product of the drafter's probabilities along its path; the best prefix maximises
    1 + sum of those - rate x cost(prefix + root)."""
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randrange(0, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n + 1)]
        probs = [1.0] + [rng.random() for _ in range(n)]
        tree = DraftTree.from_parents(list(range(n + 1)), parents, probs=probs)
        table = {k: (rng.uniform(1, 20) + rng.uniform(0, 5) * k) / 1e3 for k in (1, 2, 4, 8, 16)}
        policy = Policy(VerifyCosts(table), 16)
        policy.tokens, policy.seconds = rng.uniform(1, 4), rng.uniform(0.005, 0.05)
        reach = [1.0]
        for i in range(1, n + 1):
            reach.append(reach[parents[i]] * probs[i])
        net = [1 + sum(reach[1:k + 1]) - policy.rate * policy.costs(k + 1) for k in range(n + 1)]
        chosen = policy.choose([tree])[0].size
        assert net[chosen] >= max(net) - NET_ATOL, trial


def drafted_after_ar_rounds(rounds) -> int:
    """Rounds that verified a drafted tree right after plain AR steps (the drafter's context caught up first)."""
    return sum(r.drafted and r.tree_size > 0 and not before.drafted for before, r in zip(rounds, rounds[1:]))


def dear_then_cheap(verified: int) -> float:
    """Drafting ms that make the policy skip the drafter (AR steps) until 30 verifications (the measurement of
    the costs included), then pay again: the probe after that stretch verifies a tree after the catch-up."""
    return 1000.0 if verified < 30 else 0.1


# (verification ms per token, drafting ms): every node pays; some do; AR stretches, then drafting again
REGIMES = {"cheap": (0.01, lambda verified: 1.0), "middle": (1.0, lambda verified: 1.0),
           "ar-then-drafting": (0.01, dear_then_cheap)}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_auto_budget_is_lossless(tiny, regime, monkeypatch):
    """Whatever the policy decides (full trees, prefixes, AR rounds with the drafter skipped), the tokens are AR's."""
    per_token_ms, draft_ms = REGIMES[regime]
    vocab = tiny.config.vocab_size
    for seed in range(2):
        prompt = repetitive_prompt(random.Random(seed), vocab)
        ar = generate(tiny, make_drafter("ar"), prompt, 50).tokens
        for drafter in (make_drafter("pld"), OracleTreeDrafter(ar, len(prompt), vocab, seed=seed)):
            with monkeypatch.context() as patch:
                FakeClock(patch, tiny, drafter, lambda n: 10 + per_token_ms * n, draft_ms)
                result = generate(tiny, drafter, prompt, 50, budget="auto", max_budget=16)
            assert result.tokens == ar
            assert sum(r.accepted for r in result.rounds) == len(result.tokens) - 1  # τ counts committed tokens
            if isinstance(drafter, OracleTreeDrafter) and regime != "middle":
                assert max(r.tree_size for r in result.rounds) == 16  # whole trees pay
            if isinstance(drafter, OracleTreeDrafter) and regime == "ar-then-drafting":
                assert drafted_after_ar_rounds(result.rounds) >= 1


@pytest.mark.parametrize("extra_ms", [0.0, 5.0])
def test_auto_budget_builds_with_the_adapter_only_where_it_pays(extra_ms, monkeypatch):
    """A TreeFlash drafter under --budget auto, its AR layer free or dear, every round drafting: each build is
    tried at each reach, then the free one always runs and the dear one never does; the tokens are AR's either
    way."""
    target = tiny_target("qwen3")
    drafter = block_drafter(treeflash_drafter(target), "treeflash")
    prompt = repetitive_prompt(random.Random(5), 96)
    ar = generate(target, make_drafter("ar"), prompt, 60).tokens
    clock = FakeClock(monkeypatch, target, drafter, lambda n: 10 + 0.01 * n, lambda verified: 0.1)
    monkeypatch.setattr("treeflash.drafters.block.now", clock.now)  # the drafter's forward takes no time
    monkeypatch.setattr(Policy, "should_draft", lambda self: True)  # (a random drafter would not pay)
    builds, propose = [], drafter.propose

    def spy(tokens, features, budget, adapter=True):
        builds.append((budget, adapter))
        clock.t += extra_ms / 1e3 * adapter
        return propose(tokens, features, budget, adapter=adapter)
    monkeypatch.setattr(drafter, "propose", spy)
    result = generate(target, drafter, prompt, 60, budget="auto", max_budget=16)
    assert result.tokens == ar
    seen = {16: -1}  # the first round, cold, is not timed
    settled = []  # the builds after both were timed at their reach
    for budget, adapter in builds:
        seen[budget] = seen.get(budget, 0) + 1
        if seen[budget] > 2:
            settled.append(adapter)
    assert len(settled) >= 10 and all(settled) == (extra_ms == 0) and any(settled) == (extra_ms == 0)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_auto_budget_block_drafter_catches_up_after_ar_rounds(method, monkeypatch):
    """A drafter skipped for AR rounds gets every committed position's taps at its next call: still lossless."""
    target = tiny_target("qwen3")
    drafter = block_drafter(tiny_drafter(target, seed=1), method)
    prompt = repetitive_prompt(random.Random(5), 96)
    ar = generate(target, make_drafter("ar"), prompt, 40).tokens
    FakeClock(monkeypatch, target, drafter, lambda n: 10 + 0.01 * n, dear_then_cheap)
    result = generate(target, drafter, prompt, 40, budget="auto", max_budget=16)
    assert result.tokens == ar
    assert drafted_after_ar_rounds(result.rounds) >= 1


def test_auto_budget_sampling_is_exact(monkeypatch):
    """Whole sequences at T > 0 under --budget auto (test_exact_sequences' law and chi-square)."""
    import test_exact_sequences as exact

    target = tiny_target("llama", seed=3, vocab_size=exact.VOCAB, logit_scale=2)
    drafter = block_drafter(tiny_drafter(target, seed=1, block_size=4), "ddtree")
    FakeClock(monkeypatch, target, drafter, lambda n: 10 + 0.01 * n, lambda verified: 0.1)  # trees pay
    counts, tau = exact.sample_single(target, drafter, budget="auto")
    assert exact.pvalue(counts, exact.exact_law(target)) > exact.PASS_P and tau > 1.1


def test_budget_is_checked(tiny):
    for bad in (0, "big", -3):
        with pytest.raises(ValueError, match="budget"):
            generate(tiny, make_drafter("pld"), [1, 2, 3], 4, budget=bad)


def test_cost_tables_equal_the_costs_one_by_one():
    """`table` (one walk, what the policy reads every round) against the costs asked one size at a time, inside,
    between and beyond the measured sizes and batches."""
    one, two = costs(1.0), costs(3.0, base_ms=12.0)
    for table in (one, BatchCosts({1: one}), BatchCosts({1: one, 4: two})):
        for batch in (1, 2, 4, 7):
            if isinstance(table, VerifyCosts):
                want, got = [table(n) for n in range(1, 80)], table.table(79)
            else:
                want, got = [table(n, batch) for n in range(1, 80)], table.table(79, batch)
            assert got == pytest.approx(want, rel=1e-12)


def test_policy_for_makes_one_policy_per_drafter_of_the_class_asked():
    """Made on first use and kept (per drafter, target, batch limit and max budget); the target's costs are
    measured once and shared; an A/B (scripts/policy_ab.py) passes its own policy class."""
    class Other(Policy):
        pass

    class Key:  # weak-referenceable stand-ins for a target and two drafters
        pass

    target, a, b, measured = Key(), Key(), Key(), []

    def measure() -> VerifyCosts:
        measured.append(1)
        return costs(1.0)

    first = policy_for(target, a, 8, measure=measure)
    assert type(first) is Policy and policy_for(target, a, 8, measure=measure) is first
    other = policy_for(target, b, 8, measure=measure, policy_class=Other)
    assert type(other) is Other and len(measured) == 1
