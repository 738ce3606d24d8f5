"""Batched tree speculative decoding: B sequences, one drafter forward and one verify forward per round.

- `BatchTarget`: the target's fast path over a KV cache of `max_batch` slots, the batch in slots 0..B-1, each with
  its own length. B trees are verified in one forward, padded to the largest (a padded row sees only itself), and
  each sequence commits its own accepted path.
- `BatchDrafter`: one drafter per sequence (its own context), built from the method's drafter by a shallow copy
  (the weights are shared); block drafters (dflash, ddtree, treeflash, tfm) draft the whole batch in one forward,
  then grow each sequence's tree. Prompt lookup and AR need no forward.
- `BatchEngine`: continuous batching. `add` starts a sequence (its prefill runs alone), `step` runs one round for
  the whole batch (`engine.run_round`, the round `generate` runs for one sequence) and removes the sequences that
  ended; sequences join and leave between rounds.

Cost-aware speculation (`--budget auto`) chooses one tree size per round for the whole batch: the forward's cost
depends on the batch and on the largest tree (speculation.BatchCosts), its worth on every sequence's tree.

The single-sequence engine (`engine.generate`) is the reference: at T = 0 every sequence of a batch gets exactly
its tokens, and at T > 0 each is an exact sample, as acceptance runs per sequence in the same round.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .clock import now
from .drafters.base import Drafter
from .engine import AUTO, GenerationResult, Sequence, check_budget, run_round
from .runtime import Target, TargetError, TargetOutput
from .runtime.target import PREFILL_CHUNK, prefill_in_pieces
from .runtime.transfer import upload
from .speculation import COST_CONTEXT, BatchCosts, Policy, VerifyCosts, cost_context, policy_for
from .tree import DraftTree
from .verify import Sampling


class BatchTarget:
    """Several sequences over one target (which must have the static runtime), in slots 0..B-1 of their own cache."""

    def __init__(self, target: Target, max_batch: int, capacity: int = 1024):
        if target.static is None:
            raise TargetError(f"batched decoding needs the static runtime (llama, qwen2, qwen3); {target.name} "
                              f"runs on {target.runtime}: decode its sequences one at a time")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target, self.max_batch, self.device = target, max_batch, target.device
        self.cache = target.static.new_cache(max_batch, capacity)
        self.lengths: list[int] = []  # committed positions of each sequence
        self.taps: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.lengths)

    def add(self, ids: list[int], taps: tuple[int, ...] = ()) -> TargetOutput:
        """Prefill a new sequence into the next slot: the logits of its last position, the taps of every one."""
        if len(self) == self.max_batch:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.target.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the target's context is {self.target.context_length}")
        self.taps = tuple(taps)
        # room for the whole prompt now, keeping what every sequence holds (a forward keeps only its own start)
        self.cache.reserve(len(ids) + 1, keep=max(self.lengths, default=0))
        device, slot = self.target.device, len(self)

        def piece(piece_ids: torch.Tensor, positions: torch.Tensor, start: int) -> TargetOutput:
            logits, hidden = self.target.static.forward_batch(
                self.cache, slot, upload(piece_ids[None], device), upload(positions[None], device), [start], None,
                self.taps, slice(-1, None))
            return TargetOutput(logits[0].float(), None if hidden is None else hidden[0])
        out = prefill_in_pieces(ids, piece, PREFILL_CHUNK)
        self.lengths.append(len(ids))
        return out

    def room(self) -> int:
        """Draft nodes the longest sequence has room for: padded trees must fit too."""
        return self.target.context_length - max(self.lengths) - 1

    def remove(self, i: int) -> None:
        """Drop sequence i; the last one moves into its slot (the batch stays in slots 0..B-1)."""
        last = len(self) - 1
        if i != last:
            self.cache.move(last, i, self.lengths[last])
            self.lengths[i] = self.lengths[last]
        self.lengths.pop()

    @torch.inference_mode()
    def verify(self, trees: list[DraftTree]) -> list[TargetOutput]:
        """One forward over every sequence's tree (trees[b] after sequence b); their K/V stay pending until
        `commit`."""
        if len(trees) != len(self):
            raise ValueError(f"{len(trees)} trees for a batch of {len(self)}")
        n, device = max(len(t) for t in trees), self.target.device
        ids = torch.zeros(len(trees), n, dtype=torch.long)
        positions = torch.tensor(self.lengths)[:, None].repeat(1, n)
        allowed = torch.eye(n, dtype=torch.bool).repeat(len(trees), 1, 1)  # padding sees only itself
        for b, tree in enumerate(trees):
            ids[b, :len(tree)] = torch.tensor(tree.tokens)
            positions[b, :len(tree)] = tree.positions(self.lengths[b])
            allowed[b, :len(tree), :len(tree)] = tree.ancestor_mask()
        logits, hidden = self.target.static.forward_batch(self.cache, 0, upload(ids, device), upload(positions, device),
                                                        self.lengths, upload(allowed, device), self.taps)
        return [TargetOutput(logits[b, :len(t)].float(), None if hidden is None else hidden[b, :len(t)])
                for b, t in enumerate(trees)]

    @torch.inference_mode()
    def commit(self, paths: list[list[int]]) -> None:
        """Keep, for each sequence, the K/V of its accepted path (node indices into its last verified tree)."""
        for b, nodes in enumerate(paths):
            start = self.lengths[b]
            self.cache.keep(b, start, nodes)
            self.lengths[b] = start + len(nodes)


class BatchDrafter:
    """One `drafter` per sequence of the batch (its lanes). A drafter whose class has `propose_batch` (block
    drafters: one forward for the whole batch) drafts through it; any other, lane by lane."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.name, self.taps, self.drafts = drafter, drafter.name, drafter.taps, drafter.drafts
        self.adapts = getattr(drafter, "adapts", False)
        self.lanes: list[Drafter] = []

    def add(self) -> None:
        lane = copy.copy(self.drafter)  # shares the weights; reset() gives it its own context
        lane.reset()
        self.lanes.append(lane)

    def remove(self, i: int) -> None:
        self.lanes[i] = self.lanes[-1]
        self.lanes.pop()

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], budgets: list[int], adapter: bool = True) -> list[DraftTree]:
        batched = getattr(self.drafter, "propose_batch", None)
        if batched is None:  # (only block drafters have an adapter to skip)
            trees = [lane.propose(s.tokens, s.features, b) for lane, s, b in zip(self.lanes, seqs, budgets)]
        else:
            trees = batched(self.lanes, [s.tokens for s in seqs], [s.features for s in seqs], budgets, adapter)
        for s in seqs:
            s.features = None
        return trees

    def counters(self) -> tuple[float, int]:
        return sum(lane.forward_s for lane in self.lanes), sum(lane.adapter_calls for lane in self.lanes)


@dataclass
class Request:
    """One sequence of a batch: what was asked, and what it has produced so far."""

    seq: Sequence
    max_new_tokens: int
    sampling: Sampling
    generator: torch.Generator | None
    result: GenerationResult
    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    data: dict = field(default_factory=dict)  # the caller's own bookkeeping (a server's request id, ...)


class BatchEngine:
    """Continuous batching over one target and one method; `budget`: draft nodes per tree, or "auto"."""

    def __init__(self, target: Target, drafter: Drafter, max_batch: int = 8, budget: int | str = AUTO,
                 max_budget: int | None = None):
        max_budget = check_budget(budget, max_budget, target.device)  # None: the device's default
        self.target, self.slots, self.batch = target, BatchTarget(target, max_batch), BatchDrafter(drafter)
        self.requests: list[Request] = []
        self.budget = budget if budget != AUTO else max_budget
        self.rounds, self.draft_s, self.verify_s = 0, 0.0, 0.0  # cumulative, over the batch's rounds (for bench)
        self.policy = None
        if budget == AUTO and drafter.drafts:
            self.policy = batch_policy_for(target, drafter, max_batch, max_budget)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        return len(self) == self.slots.max_batch

    def add(self, prompt: list[int], max_new_tokens: int = 128, sampling: Sampling = Sampling(),
            seed: int | None = None, on_token: Callable[[int], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> Request:
        """Start a sequence (its prefill runs now, alone) that joins the batch at the next round."""
        generator = None if seed is None else torch.Generator(device=self.target.device).manual_seed(seed)
        max_new_tokens = min(max_new_tokens, self.target.context_length - len(prompt))
        t0 = now(self.target.device)
        seq = Sequence.start(prompt, self.slots.add(prompt, self.batch.taps), sampling, generator)
        self.batch.add()
        self.batch.lanes[-1].follow(sampling, generator)
        seq.catch_up(self.batch.lanes[-1])
        request = Request(seq, max_new_tokens, sampling, generator,
                          GenerationResult(seq.emitted, prefill_s=now(self.target.device) - t0),
                          on_token, should_stop)
        self.requests.append(request)
        if on_token:
            on_token(seq.emitted[0])
        return request

    def step(self) -> list[Request]:
        """One round for every sequence: draft, verify all trees in one forward, commit each accepted path.
        Returns the requests that ended (EOS, their limit, or should_stop), which have left the batch."""
        done = self._retire()  # those that ended at their prefill, or were stopped since the last round
        if not self.requests:
            return done
        rs = self.requests
        outcome = run_round(self.slots, self.batch, [r.seq for r in rs], [r.sampling for r in rs],
                            [r.generator for r in rs], self.budget, self.policy)
        self.rounds += 1
        self.draft_s, self.verify_s = self.draft_s + outcome.draft_s, self.verify_s + outcome.verify_s
        for b, r in enumerate(rs):
            kept = r.seq.extend(outcome.new[b], r.max_new_tokens, self.target.eos_ids)
            for token in kept if r.on_token else ():
                r.on_token(token)
            r.result.rounds.append(outcome.record(b, kept))
        return done + self._retire()

    def abort(self) -> list[Request]:
        """Remove every sequence from the batch (after a failure): the requests that were in it."""
        aborted, self.requests = self.requests, []
        self.slots.lengths.clear()
        self.batch.lanes.clear()
        return aborted

    def _retire(self) -> list[Request]:
        """Remove the sequences that ended (or whose caller asked to stop) from the batch."""
        done = []
        for i in reversed(range(len(self.requests))):
            r = self.requests[i]
            if r.seq.done(r.max_new_tokens, self.target.eos_ids) or (r.should_stop and r.should_stop()):
                done.append(r)
                self.slots.remove(i)
                self.batch.remove(i)
                self.requests[i] = self.requests[-1]
                self.requests.pop()
        return done[::-1]

    def stream(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: Sampling = Sampling(),
               seeds: list[int | None] | None = None) -> Iterator[Request]:
        """Decode every prompt, up to `max_batch` at a time: a finished sequence's slot goes to the next prompt
        between rounds. Yields each request as it ends (`data["index"]`: its prompt's); prompt i samples with
        seeds[i] (None: unseeded)."""
        waiting = list(range(len(prompts)))
        while waiting or self.requests:
            while waiting and not self.full:
                i = waiting.pop(0)
                request = self.add(prompts[i], max_new_tokens, sampling, None if seeds is None else seeds[i])
                request.data["index"] = i
            yield from self.step()

    def run(self, prompts: list[list[int]], max_new_tokens: int = 128, sampling: Sampling = Sampling(),
            seed: int | None = None) -> list[GenerationResult]:
        """`stream` to the end: the results in the prompts' order. Prompt i samples with seed + i (None: unseeded)."""
        results: list[GenerationResult | None] = [None] * len(prompts)
        seeds = None if seed is None else [seed + i for i in range(len(prompts))]
        for request in self.stream(prompts, max_new_tokens, sampling, seeds):
            results[request.data["index"]] = request.result
        return results  # type: ignore[return-value]


def batch_costs(target: Target, max_batch: int, max_tokens: int, context: int = COST_CONTEXT) -> BatchCosts:
    """Verification costs of the target by batch size (powers of two up to `max_batch`, and it), each timed on
    dummy sequences in a cache of their own (the batch in flight is not touched)."""
    sizes = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})
    vocab, context = target.config.vocab_size, cost_context(target, context)
    tables = {}
    for b in sizes:
        scratch = BatchTarget(target, b, capacity=context + 2 * max_tokens)
        g = torch.Generator().manual_seed(b)
        for _ in range(b):
            scratch.add(torch.randint(vocab, (context,), generator=g).tolist())

        def verify(tree: DraftTree, scratch=scratch, b=b) -> None:
            scratch.verify([tree] * b)  # nothing committed: every measurement sees the same contexts
        tables[b] = VerifyCosts.timed(verify, target.device, vocab, max_tokens)
    return BatchCosts(tables)


def batch_policy_for(target: Target, drafter: Drafter, max_batch: int, max_budget: int) -> Policy:
    """The batch policy of this drafter on this target (costs measured once per target and batch limit)."""
    return policy_for(target, drafter, max_budget, max_batch, lambda: batch_costs(target, max_batch, max_budget + 1))
