"""The decoding loop shared by every method: draft -> tree -> verify -> commit.

`run_round` is one round of B sequences (batch-first: one sequence is B = 1), `generate` the loop around it for
one sequence (as gpt-fast's generate.py splits them); `batching.BatchEngine` runs the same round over a batch.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Callable, Protocol

import torch

from .clock import host as _host, now as _now
from .drafters.base import Drafter
from .runtime import Target, TargetOutput
from .runtime.transfer import upload
from .speculation import Policy, policy_for
from .tree import DraftTree
from .verify import Sampling, accept, expected_accepted

AUTO = "auto"
# the largest tree `--budget auto` drafts, by device: on 2-core CPUs 16 beat 32 (prompt lookup 1.50x vs 1.30x of
# AR at T = 0, bf16): larger trees cost more to build than they add; a GPU verifies 65 tokens of an 8 B target for
# little more than one (docs/results/gpu)
DEFAULT_MAX_BUDGET = 16
GPU_MAX_BUDGET = 64


def default_max_budget(device: torch.device | str) -> int:
    return GPU_MAX_BUDGET if torch.device(device).type == "cuda" else DEFAULT_MAX_BUDGET


@dataclass
class Round:
    accepted: int  # tokens this round committed to the output: accepted drafts + the bonus token, cut at EOS / limit
    tree_size: int  # draft nodes verified (root excluded); 0: a plain AR step
    draft_s: float
    verify_s: float  # verification, acceptance, commit and the round's bookkeeping
    expected: float  # E[accepted | tree] (verify.expected_accepted): equal to `accepted` at T = 0
    drafted: bool  # False: a plain AR step (method `ar`, or cost-aware speculation skipped the drafter)
    forward_s: float = 0.0  # of draft_s, the drafter's forward (block drafters; the rest is the tree build)
    adapter_calls: int = 0  # sequential AR-layer / Weaver calls in the tree build


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only
    prefill_s: float
    rounds: list[Round] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens committed per target forward in the decode rounds (AR: 1.0); the prefill is not counted."""
        return sum(r.accepted for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def expected_tau(self) -> float:
        """τ with every round's sampled count replaced by its expectation given the tree (same mean at T > 0)."""
        return sum(r.expected for r in self.rounds) / max(len(self.rounds), 1)

    @property
    def seconds(self) -> float:
        return self.prefill_s + sum(r.draft_s + r.verify_s for r in self.rounds)


@dataclass
class Sequence:
    tokens: list[int]  # prompt and committed tokens; the last one is the next root (not yet seen by the target)
    prefill_features: InitVar[torch.Tensor | None]  # the prompt's target taps (None: the drafter takes none)
    emitted: list[int] = field(default_factory=list)  # the new tokens (after the prompt)
    # target taps of the committed positions the drafter has not seen yet, one tensor per round: joined only when
    # the drafter reads them, so that a plain AR round never copies everything since the last drafting round
    chunks: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self, prefill_features: torch.Tensor | None) -> None:
        self.features = prefill_features

    @property
    def features(self) -> torch.Tensor | None:
        if len(self.chunks) > 1:
            self.chunks[:] = [torch.cat(self.chunks)]
        return self.chunks[0] if self.chunks else None

    @features.setter
    def features(self, value: torch.Tensor | None) -> None:
        self.chunks = [] if value is None else [value]

    def done(self, max_new_tokens: int, eos_ids) -> bool:
        return len(self.emitted) >= max_new_tokens or self.tokens[-1] in eos_ids

    def add_features(self, hidden: torch.Tensor | None, path: list[int]) -> None:
        """Keep the target's taps of a round's accepted path (hidden: the verified tree's), for the drafter."""
        if hidden is not None:  # a chain's path (every AR step's) is its first nodes: a view, no gather
            chain = path == list(range(len(path)))
            self.chunks.append(hidden[:len(path)] if chain else hidden[upload(torch.tensor(path), hidden.device)])

    def catch_up(self, drafter: Drafter) -> None:
        """The drafter reads the taps not read yet now (the prompt's, with the prefill), so that no round pays for
        reading the prompt: cost-aware speculation would take that time for what drafting costs."""
        if self.chunks:
            drafter.catch_up(self.tokens, self.features)
            self.features = None

    def extend(self, new: list[int], max_new_tokens: int, eos_ids) -> list[int]:
        """Append a round's new tokens, stopping exactly where sequential decoding would (after an EOS token, or
        at the limit). Returns the tokens kept."""
        kept = []
        for token in new:
            if self.done(max_new_tokens, eos_ids):
                break
            self.tokens.append(token)
            self.emitted.append(token)
            kept.append(token)
        return kept

    @classmethod
    def start(cls, prompt: list[int], prefill: TargetOutput, sampling: Sampling,
              generator: torch.Generator | None) -> "Sequence":
        """The sequence after its prefill: the first new token drawn from the prompt's last logits."""
        first = int(sampling.choose(prefill.logits[-1], generator))
        return cls(prompt + [first], prefill.hidden, [first])


class Verifier(Protocol):
    """What a round needs from the target: B trees verified in one forward (trees[b] after sequence b), then each
    sequence's accepted path committed. `BatchTarget` serves a batch, `OneSequence` the target's own sequence."""

    device: torch.device

    def room(self) -> int: ...  # draft nodes the longest sequence still has room for
    def verify(self, trees: list[DraftTree]) -> list[TargetOutput]: ...
    def commit(self, paths: list[list[int]]) -> None: ...


class Lanes(Protocol):
    """What a round needs from the drafter: B trees, one per sequence, each from the committed positions it has
    not seen yet (`Sequence.features`, cleared once read). `BatchDrafter` drafts a batch, `OneLane` one sequence.
    `counters`: the drafters' cumulative (forward seconds, adapter calls), as `Drafter` keeps them. `adapts`: the
    drafter's builder runs an adapter that `propose(..., adapter=False)` skips (`BlockDrafter.plain`)."""

    drafts: bool
    adapts: bool

    def propose(self, seqs: list[Sequence], budgets: list[int], adapter: bool = True) -> list[DraftTree]: ...
    def counters(self) -> tuple[float, int]: ...


class OneSequence:
    """The target's own (single) sequence as a batch of one."""

    def __init__(self, target: Target):
        self.target, self.device = target, target.device

    def room(self) -> int:
        return self.target.context_length - self.target.length - 1  # the tree (root + drafts) must fit

    def verify(self, trees: list[DraftTree]) -> list[TargetOutput]:
        return [self.target.verify(tree) for tree in trees]

    def commit(self, paths: list[list[int]]) -> None:
        (path,) = paths
        self.target.commit(path)


class OneLane:
    """One drafter for one sequence, as a batch of one."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.drafts = drafter, drafter.drafts
        self.adapts = getattr(drafter, "adapts", False)

    def propose(self, seqs: list[Sequence], budgets: list[int], adapter: bool = True) -> list[DraftTree]:
        (seq,), (budget,) = seqs, budgets
        args = seq.tokens, seq.features, budget
        tree = self.drafter.propose(*args) if adapter else self.drafter.propose(*args, adapter=False)
        seq.features = None
        return [tree]

    def counters(self) -> tuple[float, int]:
        return self.drafter.forward_s, self.drafter.adapter_calls


@dataclass
class Outcome:
    """One round of B sequences: each one's new tokens (accepted drafts + the bonus token, before the caller cuts
    them at EOS or its limit), verified tree and E[accepted | tree]; the round's times."""

    new: list[list[int]]
    trees: list[DraftTree]
    expected: list[float]
    draft_s: float
    verify_s: float  # verification, acceptance, commit and the round's bookkeeping
    drafted: bool
    forward_s: float = 0.0  # of draft_s, the drafters' forward
    adapter_calls: int = 0

    def record(self, b: int, kept: list[int]) -> Round:
        """Sequence b's Round, counting only the tokens it kept (τ counts committed tokens)."""
        return Round(len(kept), self.trees[b].size, self.draft_s, self.verify_s, min(self.expected[b], len(kept)),
                     self.drafted, self.forward_s, self.adapter_calls)


def run_round(verifier: Verifier, lanes: Lanes, seqs: list[Sequence], samplings: list[Sampling],
              generators: list[torch.Generator | None], budget: int, policy: Policy | None = None) -> Outcome:
    """One round for B sequences: draft B trees of up to `budget` nodes (with a policy: the prefixes that pay, or
    plain AR steps when none does), verify them in one forward, commit each sequence's accepted path."""
    budget = max(min(budget, verifier.room()), 0)
    # host clock, no synchronisation: building the trees and accepting read the device's results, so t1 and t2
    # come after the work they time (only the commit's copies may still run, and count in the next round)
    t0 = _host()
    drafted = budget > 0 and lanes.drafts and (policy is None or policy.should_draft())
    counted = lanes.counters()
    context = max(len(s.tokens) for s in seqs)  # what the trees attend to (the policy prices their verification)
    if drafted:
        reach = min(budget, policy.reach) if policy else budget
        adapter = not (policy and lanes.adapts) or policy.adapter_pays(reach)
        trees = lanes.propose(seqs, [reach] * len(seqs), adapter)
        if policy:
            trees = policy.choose(trees, context)
    else:  # plain AR steps: the drafters' contexts catch up at their next call
        trees = [DraftTree.chain(s.tokens[-1]) for s in seqs]
    t1 = _host()
    forward_s, calls = (after - before for after, before in zip(lanes.counters(), counted))
    outs = verifier.verify(trees)
    picks = [accept(t, o.logits, s, g) for t, o, s, g in zip(trees, outs, samplings, generators)]
    paths = [path for path, _ in picks]
    verifier.commit(paths)
    t2 = _host()
    new = []
    for seq, tree, out, (path, bonus) in zip(seqs, trees, outs, picks):
        seq.add_features(out.hidden, path)
        new.append([tree.tokens[i] for i in path[1:]] + [bonus])
    if policy:
        if drafted and lanes.adapts:  # the tree build's time, without the drafter's forward
            policy.observe_build(adapter, reach, t1 - t0 - forward_s)
        policy.observe(trees, paths, sum(map(len, new)), t1 - t0, t2 - t1, drafted, context)
    t3 = _host()  # the round's bookkeeping is part of its time (what bench's tokens per second count)
    expected = [len(n) if s.greedy else expected_accepted(t, o.logits, s)  # a measure: not timed
                for n, t, o, s in zip(new, trees, outs, samplings)]
    return Outcome(new, trees, expected, t1 - t0, t3 - t1, drafted, forward_s, calls)


def check_budget(budget: int | str, max_budget: int | None, device: torch.device) -> int:
    """Refuse a budget or max_budget out of range; returns max_budget, None being the device's default."""
    if budget != AUTO and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be 'auto' or an integer >= 1, got {budget!r}")
    if max_budget is None:
        return default_max_budget(device)
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    return max_budget


def generate(
    target: Target,
    drafter: Drafter,
    prompt: list[int],
    max_new_tokens: int = 128,
    sampling: Sampling = Sampling(),
    budget: int | str = AUTO,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
    max_budget: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt`, stopping after an EOS token. Lossless for every drafter.

    `budget`: draft nodes per tree, or "auto": each round the tree prefix (up to `max_budget` nodes) that
    maximises expected tokens per second, or a plain AR step when no tree pays (speculation.Policy);
    `max_budget` None: the device's default (`default_max_budget`).
    `should_stop`, asked before every round, ends the generation early when it returns True (a server's client
    that left, a stop string seen, a deadline passed)."""
    max_budget = check_budget(budget, max_budget, target.device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(seed)
    max_new_tokens = min(max_new_tokens, target.context_length - len(prompt))
    policy = policy_for(target, drafter, max_budget) if budget == AUTO and drafter.drafts else None
    size = max_budget if budget == AUTO else budget  # the largest tree a round drafts
    drafter.reset()
    drafter.follow(sampling, generator)
    verifier, lanes = OneSequence(target), OneLane(drafter)

    t0 = _now(target.device)
    seq = Sequence.start(prompt, target.prefill(prompt, taps=drafter.taps), sampling, generator)
    seq.catch_up(drafter)
    result = GenerationResult(seq.emitted, prefill_s=_now(target.device) - t0)
    if on_token:
        on_token(seq.emitted[0])
    while not seq.done(max_new_tokens, target.eos_ids) and not (should_stop and should_stop()):
        outcome = run_round(verifier, lanes, [seq], [sampling], [generator], size, policy)
        kept = seq.extend(outcome.new[0], max_new_tokens, target.eos_ids)
        for token in kept if on_token else ():
            on_token(token)
        result.rounds.append(outcome.record(0, kept))
    return result
