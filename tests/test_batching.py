"""Batched decoding: B sequences in one verify (and one drafter) forward give each sequence exactly what it gets
alone: the same logits, the greedy tokens of plain AR decoding at T = 0 (exact samples at T > 0:
test_exact_sequences)."""

import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import treeflash.batching
from treeflash import DraftTree, generate
from treeflash.batching import BatchEngine, BatchTarget
from treeflash.drafters import block_drafter, make_drafter
from treeflash.drafters.eagle3 import Eagle3Decoder
from treeflash.models.dflash import ContextCache
from treeflash.runtime import TargetError
from treeflash.tree import random_tree

from conftest import tiny_target
from test_dflash import tiny_drafter
from test_eagle3 import tiny_eagle3
from test_lossless import repetitive_prompt
from test_speculation import costs
from test_treeflash import treeflash_drafter
from test_weaver import tiny_weaver

ATOL = 1e-4  # fp32: the same computation, batched and padded, in another order


class Oracles:
    """OracleTreeDrafter for several prompts at once: trees holding (cut, sometimes wrong) pieces of each
    sequence's own AR continuation, behind a decoy, so accepted paths fork away from node order."""

    name, taps, drafts = "oracles", (), True
    forward_s, adapter_calls = 0.0, 0

    def __init__(self, references: dict[tuple, list[int]], vocab: int, seed: int = 0):
        self.references, self.vocab, self.rng = references, vocab, random.Random(seed)

    def reset(self) -> None:
        pass

    def follow(self, sampling, generator=None) -> None:
        pass

    def propose(self, tokens, features, budget) -> DraftTree:
        prompt = next(p for p in self.references if tuple(tokens[:len(p)]) == p)
        rng, done = self.rng, len(tokens) - len(prompt)
        truth = list(self.references[prompt][done:done + rng.randint(0, 10)])
        if truth and rng.random() < 0.3:
            truth[rng.randrange(len(truth))] = rng.randrange(self.vocab)
        decoy = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 3))]
        return DraftTree.from_paths(tokens[-1], [decoy, truth], budget=budget)


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [repetitive_prompt(rng, vocab, rng.randint(5, 60)) for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_batched_verify_equals_each_sequence_alone(kind):
    """Mixed lengths and tree sizes, committed paths that skip nodes, several rounds, a sequence leaving and one
    joining: every sequence's logits equal those of the single-sequence target on the same history."""
    batch, single = tiny_target(kind), tiny_target(kind)
    vocab, rng = batch.config.vocab_size, random.Random(1)
    histories = prompts(vocab, 3)  # the tokens in each sequence's cache
    roots = [rng.randrange(vocab) for _ in histories]  # each sequence's next token, not yet seen
    bt = BatchTarget(batch, max_batch=3, capacity=16)  # small: the cache must grow mid-run
    for h in histories:
        torch.testing.assert_close(bt.add(h).logits, single.prefill(h).logits, atol=ATOL, rtol=0)
    for round_ in range(6):
        if round_ == 3:  # the first sequence leaves (the last takes its slot), a new one joins
            bt.remove(0)
            histories[0], roots[0] = histories.pop(), roots.pop()
            histories.append(prompts(vocab, 1, seed=9)[0])
            roots.append(1)
            bt.add(histories[-1])
        trees = [random_tree(rng, vocab, rng.randint(1, 12)) for _ in histories]
        trees = [DraftTree((r, *t.tokens[1:]), t.parents) for r, t in zip(roots, trees)]
        outs = bt.verify(trees)
        paths = []
        for b, (h, tree, out) in enumerate(zip(histories, trees, outs)):
            single.prefill(h)
            torch.testing.assert_close(out.logits, single.verify(tree).logits, atol=ATOL, rtol=0)
            paths.append(tree.path_to(rng.randrange(len(tree))))
            h += [tree.tokens[i] for i in paths[-1]]
            roots[b] = rng.randrange(vocab)
        bt.commit(paths)
        assert bt.lengths == [len(h) for h in histories]


def test_a_long_prompt_joins_in_pieces_and_keeps_the_others(monkeypatch):
    """A prompt that outgrows the batch's cache joins in prefill pieces: the cache grows keeping every other
    sequence's K/V, and the newcomer's taps and logits equal a one-piece prefill alone."""
    monkeypatch.setattr("treeflash.batching.PREFILL_CHUNK", 7)
    batch, single = tiny_target("llama"), tiny_target("llama")
    rng, vocab = random.Random(4), single.config.vocab_size
    bt = BatchTarget(batch, max_batch=2, capacity=16)
    short, long = [rng.randrange(vocab) for _ in range(30)], [rng.randrange(vocab) for _ in range(45)]
    bt.add(short, taps=(0, 2))
    out = bt.add(long, taps=(0, 2))  # 45 tokens in 7 pieces; the cache (32 after the first) grows again
    alone = single.prefill(long, taps=(0, 2), chunk=len(long))
    torch.testing.assert_close(out.logits, alone.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, alone.hidden, atol=ATOL, rtol=0)
    trees = [random_tree(rng, vocab, 5) for _ in range(2)]
    for history, tree, got in zip((short, long), trees, bt.verify(trees)):
        single.prefill(history, taps=(0, 2))
        torch.testing.assert_close(got.logits, single.verify(tree).logits, atol=ATOL, rtol=0)


def test_batched_drafting_equals_each_sequence_alone():
    target = tiny_target("qwen3")
    model = tiny_drafter(target, seed=2)
    contexts, roots = [], []
    for i, n in enumerate((3, 17, 9)):
        ctx = ContextCache(model, capacity=4)
        features = torch.randn(n, 2, 64, generator=torch.Generator().manual_seed(i))
        ctx.append(*model.context_states(features, torch.arange(n))[1:])
        contexts.append(ctx)
        roots.append(5 + i)
    batched = model.draft_states_batch(roots, contexts)
    for b, (root, ctx) in enumerate(zip(roots, contexts)):
        torch.testing.assert_close(batched[b], model.draft_states(root, len(ctx), ctx), atol=ATOL, rtol=0)


def drafters(target, references):
    vocab = target.config.vocab_size
    yield make_drafter("ar")
    yield make_drafter("pld")
    yield Oracles(references, vocab)
    yield block_drafter(tiny_drafter(target, seed=1), "dflash")
    yield block_drafter(tiny_drafter(target, seed=1), "ddtree")
    yield block_drafter(treeflash_drafter(target, seed=1), "treeflash", top_m=4)
    model = tiny_drafter(target, seed=1)
    yield block_drafter(model, "tfm", weaver=tiny_weaver(model), width=2)
    yield Eagle3Decoder(tiny_eagle3(target, seed=1))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_every_method_batched_matches_ar(kind):
    """Mixed prompt lengths and limits, sequences that end early (EOS, limit), more prompts than slots (joins
    mid-run): each sequence's tokens are its own plain AR decoding."""
    target = tiny_target(kind)
    vocab = target.config.vocab_size
    ps = prompts(vocab, 5, seed=3)
    limits = [30, 7, 25, 1, 18]
    ar = [generate(target, make_drafter("ar"), p, n).tokens for p, n in zip(ps, limits)]
    target.eos_ids = frozenset({ar[2][9]})  # the third sequence (at least) ends at an EOS
    try:
        ar = [generate(target, make_drafter("ar"), p, n).tokens for p, n in zip(ps, limits)]
        assert len(ar[2]) < limits[2]
        for drafter in drafters(target, {tuple(p): a for p, a in zip(ps, ar)}):
            for budget in (3, 12):
                engine = BatchEngine(target, drafter, max_batch=3, budget=budget)
                waiting, got = list(range(5)), {}
                while waiting or len(engine):
                    while waiting and not engine.full:  # join between rounds, as a server does
                        i = waiting.pop(0)
                        engine.add(ps[i], limits[i]).data["i"] = i
                    for request in engine.step():
                        got[request.data["i"]] = request.result.tokens
                assert [got[i] for i in range(5)] == ar, (drafter.name, budget)
    finally:
        target.eos_ids = frozenset()


def test_run_keeps_the_prompts_order_and_counts_committed_tokens():
    target = tiny_target("llama")
    ps = prompts(target.config.vocab_size, 4, seed=5)
    ar = [generate(target, make_drafter("ar"), p, 20).tokens for p in ps]
    results = BatchEngine(target, make_drafter("pld"), max_batch=2, budget=8).run(ps, 20)
    assert [r.tokens for r in results] == ar
    assert all(sum(r.accepted for r in res.rounds) == len(res.tokens) - 1 for res in results)


@pytest.mark.parametrize("per_token_ms", [0.01, 100.0])
def test_auto_budget_batched_is_lossless(monkeypatch, per_token_ms):
    """Whatever one batch-wide size the policy picks (whole trees, prefixes, AR rounds, a tree built with the
    adapter or without), tokens are AR's."""
    target = tiny_target("qwen3")
    monkeypatch.setattr(treeflash.batching, "batch_costs",
                        lambda *a, **k: treeflash.speculation.BatchCosts({1: costs(per_token_ms)}))
    ps = prompts(target.config.vocab_size, 4, seed=6)
    ar = [generate(target, make_drafter("ar"), p, 24).tokens for p in ps]
    for drafter in (make_drafter("pld"), block_drafter(tiny_drafter(target, seed=1), "ddtree"),
                    block_drafter(treeflash_drafter(target, seed=1), "treeflash", top_m=4),  # (its plain tree first)
                    Oracles({tuple(p): a for p, a in zip(ps, ar)}, target.config.vocab_size)):
        results = BatchEngine(target, drafter, max_batch=3).run(ps, 24)
        assert [r.tokens for r in results] == ar
        sizes = [r.tree_size for res in results for r in res.rounds]
        if per_token_ms == 100.0:
            assert sizes.count(0) > len(sizes) // 2  # mostly AR rounds


class Reader:
    """A drafter with taps that records how many positions' taps each call reads; it drafts nothing."""

    name, drafts = "reader", True
    forward_s, adapter_calls = 0.0, 0

    def __init__(self, taps: tuple[int, ...]):
        self.taps, self.calls = taps, []

    def reset(self) -> None:
        pass

    def follow(self, sampling, generator=None) -> None:
        pass

    def catch_up(self, tokens, features) -> None:
        self.calls.append(("catch_up", len(tokens), len(features)))

    def propose(self, tokens, features, budget) -> DraftTree:
        self.calls.append(("propose", len(tokens), 0 if features is None else len(features)))
        return DraftTree.chain(tokens[-1])


def test_the_drafter_reads_the_prompt_with_the_prefill_not_in_a_round():
    """A round's time is what cost-aware speculation learns drafting costs from: the prompt's taps are read
    at prefill, so every round reads only the positions committed since the previous one."""
    target = tiny_target("llama")
    prompt = prompts(target.config.vocab_size, 1, seed=7)[0]
    alone = Reader((0, 1))
    generate(target, alone, prompt, 4, budget=2)
    batched = Reader((0, 1))
    BatchEngine(target, batched, max_batch=2, budget=2).run([prompt], 4)
    n = len(prompt)
    expected = [("catch_up", n + 1, n)] + [("propose", n + 1 + i, 0 if i == 0 else 1) for i in range(3)]
    assert alone.calls == expected
    assert batched.calls == expected


def test_batch_costs_are_measured_per_batch_size():
    target = tiny_target("llama")
    costs_ = treeflash.batching.batch_costs(target, max_batch=3, max_tokens=5)
    assert costs_.batches == [1, 2, 3]
    assert all(costs_(n, b) > 0 for n in (1, 4) for b in (1, 2, 3, 6))


def test_batching_needs_the_static_runtime():
    with pytest.raises(TargetError, match="static runtime"):
        BatchEngine(tiny_target("llama", runtime="hf"), make_drafter("ar"))


# ---- sequences joining and leaving at random ----------------------------------------------------------------------

class JoinAndLeave(RuleBasedStateMachine):
    """Sequences join between rounds, rounds run, callers stop sequences, the batch fills and empties: every sequence
    that ends is its own plain AR decoding (a prefix of it, when its caller stopped it)."""

    target = tiny_target("llama")
    drafter = block_drafter(tiny_drafter(target, seed=1), "ddtree")
    references: dict = {}

    def __init__(self):
        super().__init__()
        self.engine = BatchEngine(self.target, self.drafter, max_batch=3, budget=6)
        self.stopped: set[int] = set()
        self.joined = 0

    def reference(self, prompt: list[int], limit: int) -> list[int]:
        key = (tuple(prompt), limit)
        if key not in self.references:
            self.references[key] = generate(self.target, make_drafter("ar"), prompt, limit).tokens
        return self.references[key]

    def check(self, request) -> None:
        tokens, expected = request.result.tokens, self.reference(request.data["prompt"], request.data["limit"])
        if request.data["i"] in self.stopped:
            assert tokens == expected[:len(tokens)]
        else:
            assert tokens == expected

    @precondition(lambda self: not self.engine.full)
    @rule(seed=st.integers(0, 40), limit=st.integers(1, 24))
    def join(self, seed: int, limit: int) -> None:
        rng = random.Random(seed)
        prompt = repetitive_prompt(rng, self.target.config.vocab_size, rng.randint(3, 40))
        i, self.joined = self.joined, self.joined + 1
        request = self.engine.add(prompt, limit, should_stop=lambda: i in self.stopped)
        request.data.update(prompt=prompt, limit=limit, i=i)

    @rule()
    def round(self) -> None:
        for request in self.engine.step():
            self.check(request)

    @precondition(lambda self: len(self.engine) > 0)
    @rule(data=st.data())
    def stop(self, data) -> None:
        self.stopped.add(data.draw(st.sampled_from(self.engine.requests)).data["i"])

    def teardown(self) -> None:
        while len(self.engine):
            self.round()


TestJoinAndLeave = JoinAndLeave.TestCase
TestJoinAndLeave.settings = settings(max_examples=12, stateful_step_count=25, deadline=None)
