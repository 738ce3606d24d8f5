"""Cost-aware speculation: each round the engine verifies the draft-tree prefix that pays most, or none at all.

The engine knows its own costs (they differ by hardware, dtype and batch, so a fixed budget is wrong somewhere):
- `VerifyCosts`: seconds per target verification by tree size, bucketed, and linear in the context length (a tree's
  attention reads every cached position); measured once per target when the first auto-budget sequence starts, then
  refreshed online from every round;
- `Calibration`: the drafter's probability of each node given its parent, against the acceptances the target
  actually made (per depth and probability bin, shrunk towards the drafter's own number while data is scarce).

Every round, `Policy` values a tree by its calibrated expected committed tokens E(n) for each prefix of n nodes
(builders emit nodes best first) and keeps the n that maximises E(n) - λ cost(n), where λ is the tokens per second
the engine achieves (the renewal-reward rule: a round is worth its tokens minus what its time would have earned at
the current rate). Before drafting it also asks whether drafting pays at all: when the recent rounds' predicted
gain over a plain AR step falls short of λ x the drafting time, it runs AR steps and skips the drafter, probing
again as often as what probes lose allows (the drafter's context catches up at its next call). A drafter whose tree
builder runs an adapter (TreeFlash's AR layer, the Weaver) builds with it only where its extra time is worth what it
adds (`Policy.adapter_pays`), and otherwise from the backbone's marginals alone.

Lossless whatever it decides: the tree depends only on the drafter and on past rounds, never on this round's
target draws, and acceptance is the same exact rule on whatever tree is verified.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Callable

import torch

from .clock import now
from .tree import DraftTree

BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # verified tokens (root included)
# the dummy context that verification costs are measured on: about where short prompts decode. A tree's attention
# grows with its rows times the context, so costs taken at 128 made trees of 3-4 nodes look cheaper than they are
# there (prompt lookup on GSM8K: 1.15x ar with them, 1.20x with these, against 1.26x at a fixed budget of 2)
COST_CONTEXT = 256
# ... and one this many times longer, for how costs grow with the context: at 1,200 positions a 4-row SmolLM2
# verify costs twice what it costs at 200 (13.7 against 7.0 ms), and a policy that priced every tree at 256
# positions verified 10-node trees of prompt lookup from a datastore at 45-50 ms on long chat prompts
# (docs/results/rest)
LONG_COST_FACTOR = 4


def cost_context(target, context: int = COST_CONTEXT) -> int:
    """The dummy context to time verifications on: at most half the target's (a short-context model keeps room
    for the trees)."""
    return min(context, target.context_length // 2)


class VerifyCosts:
    """Seconds per verification of n tokens after `context` cached positions: a few buckets, linear in between;
    at another context, plus `slopes` (seconds per position, by bucket) times the difference. Refreshed by every
    round."""

    def __init__(self, seconds: dict[int, float], context: int = COST_CONTEXT,
                 slopes: dict[int, float] | None = None):
        self.sizes = sorted(seconds)
        self.seconds = [seconds[n] for n in self.sizes]
        self.context = context
        self.slopes = [max(slopes[n], 0.0) for n in self.sizes] if slopes else None

    @classmethod
    @torch.inference_mode()
    def measure(cls, target, max_tokens: int, context: int = COST_CONTEXT, repeats: int = 3) -> "VerifyCosts":
        """Time verifications of random trees on dummy contexts of two lengths (it starts a sequence: call before
        prefill)."""
        near, far = cost_context(target, context), cost_context(target, LONG_COST_FACTOR * context)
        costs = cls.timed(cls.verifier(target, near), target.device, target.config.vocab_size, max_tokens, repeats)
        if far <= near:  # a short-context model: costs at one length
            return costs
        longer = cls.timed(cls.verifier(target, far), target.device, target.config.vocab_size, max_tokens, repeats)
        slopes = {n: (b - a) / (far - near) for n, a, b in zip(costs.sizes, costs.seconds, longer.seconds)}
        return cls(dict(zip(costs.sizes, costs.seconds)), near, slopes)

    @staticmethod
    def verifier(target, context: int) -> Callable[[DraftTree], None]:
        """verify(tree) after a dummy context of `context` positions, the same every call."""
        vocab = target.config.vocab_size
        target.prefill(torch.randint(vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist())

        def verify(tree: DraftTree) -> None:
            target.verify(tree)
            target.discard()  # every measurement sees the same context
        return verify

    @classmethod
    def timed(cls, verify, device, vocab: int, max_tokens: int, repeats: int = 3) -> "VerifyCosts":
        """The best of `repeats` timings of `verify(tree)` on random bushy trees of each bucket's size."""
        sizes = [n for n in BUCKETS if n <= max_tokens] + [n for n in BUCKETS if n > max_tokens][:1]
        g = torch.Generator().manual_seed(0)
        best = {}
        for _ in range(repeats):
            for n in sizes:
                # a bushy tree; siblings are at most 3 nodes apart, so their tokens i % vocab differ
                parents = [-1] + [int(torch.randint(max(i - 3, 0), i, (), generator=g)) for i in range(1, n)]
                tree = DraftTree.from_parents([i % vocab for i in range(n)], parents)
                start = now(device)
                verify(tree)
                best[n] = min(best.get(n, float("inf")), now(device) - start)
        return cls(best)

    def __call__(self, n: int, context: int | None = None) -> float:
        """Predicted seconds to verify n tokens (after `context` positions; None: the measured context)."""
        return self._at(n, bisect.bisect_left(self.sizes, n), context)

    def table(self, up_to: int, context: int | None = None) -> list[float]:
        """[self(n, context) for n in 1..up_to], in one walk over the buckets (the policy asks every round)."""
        out, i = [], 0
        for n in range(1, up_to + 1):
            while i < len(self.sizes) and self.sizes[i] < n:
                i += 1
            out.append(self._at(n, i, context))
        return out

    def _at(self, n: int, i: int, context: int | None = None) -> float:
        """self(n, context), given i = bisect_left(self.sizes, n)."""
        base = self._interpolate(self.seconds, n, i)
        if context is None or self.slopes is None:
            return base
        # below the measured context, never under half the cost there (the products do not shrink)
        return max(base + self._interpolate(self.slopes, n, i) * (context - self.context), base / 2)

    def _interpolate(self, values: list[float], n: int, i: int) -> float:
        if i < len(self.sizes) and self.sizes[i] == n:
            return values[i]
        lo, hi = max(i - 1, 0), min(i, len(self.sizes) - 1)
        if lo == hi:  # outside the measured range: proportional to the nearest bucket
            return values[lo] * n / self.sizes[lo]
        w = (n - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        return (1 - w) * values[lo] + w * values[hi]

    def observe(self, n: int, seconds: float, context: int | None = None, rate: float = 0.1) -> None:
        """Move the nearest bucket towards an observed verification of n tokens after `context` positions (scaled
        to the bucket's size and the measured context)."""
        i = min(range(len(self.sizes)), key=lambda j: abs(self.sizes[j] - n))
        scaled = seconds * self.seconds[i] / max(self(n, context), 1e-9)
        self.seconds[i] += rate * (scaled - self.seconds[i])


class BatchCosts:
    """`VerifyCosts` by batch size (B trees of n tokens each, padded to the largest, in one forward): measured at a
    few batch sizes, linear in between, proportional beyond."""

    def __init__(self, tables: dict[int, VerifyCosts]):
        self.batches = sorted(tables)
        self.tables = [tables[b] for b in self.batches]

    def __call__(self, n: int, batch: int = 1, context: int | None = None) -> float:
        return sum(table(n, context) * a / b for table, a, b in self._blend(batch))

    def table(self, up_to: int, batch: int = 1, context: int | None = None) -> list[float]:
        """[self(n, batch, context) for n in 1..up_to]."""
        parts = [[c * a / b for c in table.table(up_to, context)] for table, a, b in self._blend(batch)]
        return [sum(costs) for costs in zip(*parts)]

    def _blend(self, batch: int) -> list[tuple[VerifyCosts, float, float]]:
        """The measured tables whose costs make `batch`'s, each times a / b: its own, two around it, or the
        nearest one scaled."""
        i = bisect.bisect_left(self.batches, batch)
        if i < len(self.batches) and self.batches[i] == batch:
            return [(self.tables[i], 1.0, 1.0)]
        lo, hi = max(i - 1, 0), min(i, len(self.batches) - 1)
        if lo == hi:
            return [(self.tables[lo], batch, self.batches[lo])]
        w = (batch - self.batches[lo]) / (self.batches[hi] - self.batches[lo])
        return [(self.tables[lo], 1 - w, 1.0), (self.tables[hi], w, 1.0)]

    def observe(self, n: int, seconds: float, batch: int = 1, context: int | None = None) -> None:
        """Refresh the table of the nearest measured batch size (scaled to it)."""
        i = min(range(len(self.batches)), key=lambda j: abs(self.batches[j] - batch))
        self.tables[i].observe(n, seconds * self(n, self.batches[i], context) / max(self(n, batch, context), 1e-9),
                               context)


class Calibration:
    """P(target accepts a node | it accepted the parent), as a function of depth and of the drafter's probability
    q of the node given its parent. Counts per (depth, q-bin); a bin with few observations leans on q itself
    (`prior` pseudo-observations), and a drafter without probabilities (prompt lookup) on 1/2."""

    def __init__(self, depths: int = 16, bins: int = 10, prior: float = 4.0):
        self.bins, self.prior = bins, prior
        self.seen = torch.zeros(depths, bins + 1)  # the last bin: nodes without a drafter probability
        self.hits = torch.zeros(depths, bins + 1)

    def _cells(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        depth = (torch.tensor(tree.depths[1:], dtype=torch.long) - 1).clamp(max=self.seen.shape[0] - 1)
        if tree.probs is None:
            q = torch.full((tree.size,), 0.5)
            b = torch.full((tree.size,), self.bins, dtype=torch.long)
        else:
            q = torch.tensor(tree.probs[1:], dtype=torch.float32).clamp(0, 1)
            b = (q * self.bins).long().clamp(max=self.bins - 1)
        return depth, b, q

    def node_values(self, tree: DraftTree) -> torch.Tensor:
        """Calibrated probability [size] that the target walks down to each draft node."""
        depth, b, q = self._cells(tree)
        rate = (self.hits[depth, b] + self.prior * q) / (self.seen[depth, b] + self.prior)
        values = [1.0]
        for node, r in enumerate(rate.tolist(), start=1):
            values.append(values[tree.parents[node]] * r)
        return torch.tensor(values[1:])

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        """Every child of an accepted node was a trial: accepted if it is on the path."""
        if tree.size == 0:
            return
        on_path = set(path)
        tried = [i for i in range(1, len(tree)) if tree.parents[i] in on_path]
        if not tried:
            return
        depth, b, _ = self._cells(tree)
        index = torch.tensor(tried, dtype=torch.long) - 1
        self.seen.index_put_((depth[index], b[index]), torch.ones(len(tried)), accumulate=True)
        hit = torch.tensor([float(i in on_path) for i in tried])
        self.hits.index_put_((depth[index], b[index]), hit, accumulate=True)


class Policy:
    """The per-(target, drafter) state of cost-aware speculation; `max_budget` caps the trees it drafts."""

    # Probes are held to account. `credit` is the time drafted rounds saved against the plain AR steps that would
    # have committed their tokens, plus an allowance of PROBE_SHARE of every round's time; a probe (drafting that is
    # not predicted to pay) runs only once the credit covers what probes lose. So a drafter that never pays costs
    # at most PROBE_SHARE of the time against plain decoding, and one that pays earns its own probes. A probe of
    # prompt lookup (~0.3 ms against a 5.5 ms step) comes every few rounds; a block drafter's (its catch-up, a
    # draft, a verify: ~17 ms) every few hundred (HumanEval T = 0: treeflash auto 0.91x ar, probing at a fixed
    # interval that grew 4x per misleading probe; 0.98-0.99x with the credit)
    PROBE_SHARE = 0.01
    PROBE_GAP = 4  # AR rounds at least between probes, however rich the credit
    # AR steps' time: a long paying stretch funds a few probes after it, not a long losing one
    CREDIT_CAP = 16
    # drafting that is predicted to pay stops once it has lost this many AR steps' time since its best point (a
    # calibration or a cost gone stale, a slow minute); drafting again is then a probe, judged afresh. (The credit
    # bound it before: 16 steps below zero, after up to 16 above, lost 1.5 % of treeflash's time on GSM8K T = 0.)
    LOSS_CAP = 4
    # `reach`, the tree size a round drafts: twice the largest prefix chosen lately, never under MIN_REACH. Drafting
    # max_budget nodes only to cut them to 2-4 made a CPU round's tree build 2-3x dearer (TreeFlash, TfM); a text
    # that gets easier doubles the reach every round that chooses all of it, and it decays by REACH_DECAY a round
    MIN_REACH = 4
    REACH_DECAY = 0.75
    # what an adapter (TreeFlash's AR layer, the Weaver) adds to a tree's expected tokens over the backbone's own
    # best-first tree of the same size: TreeFlash over DDTree 5-6 % at 4 nodes, 7-11 % at 8 (docs/results/
    # treeflash-top-n). A round builds with the adapter only when that is worth its build's extra time at the
    # achieved rate: on a 2-core CPU the AR layer's call costs a quarter of an AR step at 4 nodes, and never pays
    ADAPTER_GAIN = 0.06

    def __init__(self, costs: VerifyCosts | BatchCosts, max_budget: int):
        self.costs = costs if isinstance(costs, BatchCosts) else BatchCosts({1: costs})
        self.max_budget = max_budget
        self.reach = max_budget  # (see above)
        self.calibration = Calibration()
        self.draft_s: float | None = None  # EMA of the drafting time (forward + tree build)
        self.gain: float | None = None  # EMA of a drafted round's predicted gain over an AR step, in tokens
        self.tokens, self.seconds = 1.0, self.costs(1)  # EMAs whose ratio is λ, the achieved tokens per second
        self.skipped = 0  # AR rounds since the last drafting round
        self.credit = 0.0  # seconds (see above)
        self.drawdown = 0.0  # seconds the rounds predicted to pay lost since their best point (<= 0; see LOSS_CAP)
        self.step = self.costs(1)  # seconds of a plain AR step (of the last round's batch)
        self.probe_loss: float | None = None  # EMA of the seconds a probe lost against AR steps
        self.builds: dict[tuple[bool, int], float] = {}  # EMA seconds of a tree build, by (adapter, reach)
        self.round_tokens: float | None = None  # EMA of a drafted round's expected committed tokens (the batch's)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def should_draft(self) -> bool:
        if self.gain is None or self.draft_s is None:
            return True
        if self.gain > self.rate * self.draft_s:  # predicted to pay: drafts while its losses stay under the cap
            if self.drawdown > -self.LOSS_CAP * self.step:
                return True
            self.gain, self.drawdown = 0.0, 0.0  # it did not pay: the next drafting round is a probe
        # a probe: the text may have become easier to draft
        return self.skipped >= self.PROBE_GAP and self.credit >= max(self.probe_loss or 0.0, 0.0)

    def adapter_pays(self, reach: int) -> bool:
        """Whether a round that drafts `reach` nodes builds its tree with the drafter's adapter: when what the
        adapter adds (ADAPTER_GAIN of the round's expected tokens) is worth more, at the achieved rate, than the
        time its build takes over the backbone's own tree. Each build is timed at each reach first, the cheap one
        first (a dear first build would keep a CPU's policy from drafting long before it tried the other)."""
        adapted, plain = self.builds.get((True, reach)), self.builds.get((False, reach))
        if adapted is None or plain is None:
            return plain is not None
        return (adapted - plain) * self.rate < self.ADAPTER_GAIN * (self.round_tokens or 1.0)

    def observe_build(self, adapter: bool, reach: int, seconds: float) -> None:
        """A drafting round's tree build (with the adapter or without) of `reach` nodes took `seconds`."""
        if self.draft_s is not None:  # the first drafting round pays for lazy initialisation: not counted
            self.builds[adapter, reach] = _ema(self.builds.get((adapter, reach)), seconds)

    def choose(self, trees: list[DraftTree], context: int | None = None) -> list[DraftTree]:
        """The prefixes of `trees` (one per sequence of a batch, verified in one forward, padded to the largest,
        after `context` cached positions at most) that maximise E[committed tokens] - λ x verification time. A
        batch shares one size n (each tree cut to n): the forward's cost follows its largest tree."""
        # in Python floats: a round's trees are small, and a dozen tensor ops cost more than the arithmetic
        size = max(t.size for t in trees)
        expected = [0.0] * (size + 1)  # E(n) for n = 0..size, summed over the batch
        for tree in trees:
            values = [1.0]
            for v in self.calibration.node_values(tree).tolist():
                values.append(values[-1] + v)
            values += [values[-1]] * (size - tree.size)
            expected = [e + v for e, v in zip(expected, values)]
        rate = self.rate
        net = [e - rate * c for e, c in zip(expected, self.costs.table(size + 1, len(trees), context))]
        n = max(range(size + 1), key=net.__getitem__)  # the first of equal maxima, as argmax
        gain = net[n] - net[0]
        self.round_tokens = _ema(self.round_tokens, expected[n])
        self.reach = min(self.max_budget, max(self.MIN_REACH, 2 * n, int(self.REACH_DECAY * self.reach)))
        # a probe after AR rounds judges the text as it is now: the average of the drafted rounds is stale
        self.gain = gain if self.skipped else _ema(self.gain, gain)
        return [tree.prefix(min(n, tree.size)) for tree in trees]

    def observe(self, trees: list[DraftTree], paths: list[list[int]], committed: int, draft_s: float,
                verify_s: float, drafted: bool, context: int | None = None) -> None:
        """One round of the batch: its trees, their accepted paths, the tokens committed in all, its times, the
        context it verified after."""
        batch = len(trees)
        self.costs.observe(max(len(t) for t in trees), verify_s, batch, context)
        for tree, path in zip(trees, paths):
            self.calibration.observe(tree, path)
        self.step = self.costs(1, batch, context)  # refreshed by every AR round
        if drafted:
            if self.draft_s is not None:  # the first drafting round pays for lazy initialisation: not charged
                saved = committed / batch * self.step - (draft_s + verify_s)
                self.credit += saved
                if self.skipped:
                    self.probe_loss = _ema(self.probe_loss, -saved)
                self.drawdown = 0.0 if self.skipped else min(self.drawdown + saved, 0.0)
            if not self.skipped or self.draft_s is None:
                self.draft_s = _ema(self.draft_s, draft_s)
            else:  # a probe's time includes the context's catch-up after the AR rounds: an upper bound of the
                # drafting cost, which a stale average (a cold first call, a slower minute) must not exceed
                self.draft_s = min(self.draft_s, draft_s)
            self.skipped = 0
        else:
            self.skipped += 1
        self.credit = min(self.credit + self.PROBE_SHARE * (draft_s + verify_s), self.CREDIT_CAP * self.step)
        self.tokens = _ema(self.tokens, committed)
        self.seconds = _ema(self.seconds, draft_s + verify_s)


def _ema(old: float | None, new: float, rate: float = 0.2) -> float:
    return new if old is None else old + rate * (new - old)


# costs by target, then by batch limit (0: one sequence); policies by drafter, then by target, batch limit and max
# budget. Weak keys: a target or drafter that is dropped takes its entries along
_costs: "weakref.WeakKeyDictionary[object, dict[int, VerifyCosts | BatchCosts]]" = weakref.WeakKeyDictionary()
_policies: "weakref.WeakKeyDictionary[object, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()


def policy_for(target, drafter, max_budget: int, max_batch: int = 0,
               measure: Callable[[], VerifyCosts | BatchCosts] | None = None,
               policy_class: Callable[[VerifyCosts | BatchCosts, int], Policy] | None = None) -> Policy:
    """The policy of this drafter on this target, for one sequence or (`max_batch`) a batch, made on first use
    (an instance of `policy_class`, default `Policy`: an A/B passes another). The verification costs are the
    target's, measured once per batch limit (by `measure`; default: one sequence's) and shared by all its
    drafters."""
    costs = _costs.setdefault(target, {})
    if max_batch not in costs:
        costs[max_batch] = measure() if measure else VerifyCosts.measure(target, max_budget + 1)
    policies = _policies.setdefault(drafter, weakref.WeakKeyDictionary()).setdefault(target, {})
    if (max_batch, max_budget) not in policies:
        policies[max_batch, max_budget] = (policy_class or Policy)(costs[max_batch], max_budget)
    return policies[max_batch, max_budget]
