"""`treeflash bench`: every method on the same prompts, interleaved, in one run; τ, speed and exactness.

A run can sweep budgets (numbers, or "auto": cost-aware speculation) and tfm widths: every (method, budget, width)
variant decodes every prompt in the same run, so their ratios share the same machine noise. `ar` is the reference
(speed and exactness) and runs once. The baselines of other engines (eval/baselines.py: `hf`, `hf-pld`,
`llamacpp`, `llamacpp-pld`) run in the same interleaving; one that cannot run here is reported as skipped. So does
`ar-eager` on a compiled target: `ar` on the eager layers.
"""

from __future__ import annotations

import itertools
import random
from contextlib import nullcontext
from dataclasses import dataclass, field

from tqdm import tqdm

from ..drafters import make_drafter
from ..engine import AUTO, DEFAULT_MAX_BUDGET, Round, generate
from ..runtime import Target
from ..verify import Sampling
from .baselines import BASELINES, BaselineUnavailable, make_baseline

# plain AR decoding on the eager layers of a compiled target (`--compile`): the compiled layers' same-run reference
EAGER = "ar-eager"


@dataclass(frozen=True)
class Variant:
    method: str
    budget: int | str  # a number of draft nodes, or "auto"
    width: int | None = None  # tfm only: nodes expanded per Weaver call

    def name(self, several_budgets: bool, several_widths: bool) -> str:
        name = self.method
        if several_budgets and self.method not in ("ar", EAGER, *BASELINES):
            name += f"@{self.budget}"
        if several_widths and self.width is not None:
            name += f"/w{self.width}"
        return name


def variants(methods: list[str], budgets: list[int], tfm_widths: list[int]) -> list[Variant]:
    """`ar` first and once (added if missing), the baselines once each; every other method at every budget (tfm
    at every width)."""
    out = [Variant("ar", budgets[0])]
    for m in methods:
        if m == "ar":
            continue
        if m in (*BASELINES, EAGER):
            out.append(Variant(m, budgets[0]))
            continue
        for b in budgets:
            out += [Variant(m, b, w) for w in tfm_widths] if m == "tfm" else [Variant(m, b)]
    return out


@dataclass
class Totals:
    new_tokens: int = 0
    seconds: float = 0.0
    round_tokens: int = 0  # tokens committed in decode rounds (τ's numerator)
    round_expected: float = 0.0  # their expectations given the trees (τ without acceptance noise at T > 0)
    rounds: int = 0
    drafted_nodes: int = 0  # draft nodes verified, over all rounds (the chosen tree sizes)
    ar_rounds: int = 0  # rounds that verified no draft node (cost-aware speculation found no tree that pays)
    draft_s: float = 0.0  # the drafter's whole turn: its forward and the tree build
    forward_s: float = 0.0  # of which the block drafter's forward
    verify_s: float = 0.0
    drafting_rounds: int = 0  # rounds in which the drafter ran (the others: AR steps that skipped it)
    drafting_draft_s: float = 0.0  # their drafting (with the drafter's catch-up after AR steps) ...
    drafting_verify_s: float = 0.0  # ... and verification, at the size they chose
    adapter_calls: int = 0  # sequential AR-layer / Weaver calls
    outputs: list[list[int]] = field(default_factory=list)
    per_prompt: list[tuple[int, float]] = field(default_factory=list)  # (new tokens, seconds) of each prompt


def speedup_interval(variant: Totals, ar: Totals, level: float = 0.9, resamples: int = 2000,
                     seed: int = 0) -> tuple[float, float]:
    """A `level` bootstrap interval of the speedup (tokens per second against `ar`'s), resampling the prompts:
    how far the figure could move on other prompts of the same kind, machine noise included. Both variants
    resample the same prompts, so what they share (a prompt's length, a slow minute) cancels in the ratio."""
    rng, n = random.Random(seed), len(ar.per_prompt)

    def rate(totals: Totals, picks: list[int]) -> float:  # tokens per second over the picked prompts
        return sum(totals.per_prompt[i][0] for i in picks) / sum(totals.per_prompt[i][1] for i in picks)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(rate(variant, picks) / rate(ar, picks))
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * (resamples - 1))], ratios[int((1 - tail) * (resamples - 1))]


def run_bench(target: Target, prompts: list[str], methods: list[str], budgets: list = (AUTO,),
              sampling: Sampling = Sampling(), max_new_tokens: int = 128, seed: int = 0,
              progress: bool = True, drafter_path: str | None = None, weaver_path: str | None = None,
              tfm_widths: list[int] = (8,), max_budget: int = DEFAULT_MAX_BUDGET,
              draft_vocab_size: int | None = None, datastore_path: str | None = None, repeats: int = 1) -> dict:
    """Run every variant of `methods` x `budgets` (x `tfm_widths` for tfm) on every prompt, interleaved, `repeats`
    times over the whole set (at T > 0 with new seeds each time). A prompt's repeats pool into one pair of
    (tokens, seconds) for the speedup's interval: one 10-prompt run spreads a ratio by a few %, more than the
    cost-aware policy's own ±1 % (docs/results/int4-drafter)."""
    runs, drafters, loaded, seen, skipped, stock = [], {}, {}, set(), {}, {}
    for v in variants(methods, list(budgets), list(tfm_widths)):
        if v.method in BASELINES:
            try:
                drafters[v] = make_baseline(v.method, target, stock)
                runs.append(v)
            except BaselineUnavailable as why:
                skipped[v.method] = str(why)
            continue
        if v.method == EAGER:
            if not target.compiled:
                skipped[v.method] = "the target is not compiled: ar is eager already"
            else:
                runs.append(v)
                drafters[v] = make_drafter("ar")
            continue
        if (v.method, v.width) not in loaded:  # one drafter per method and width, shared by every budget
            loaded[v.method, v.width] = make_drafter(v.method, target, drafter_path, weaver_path, v.width or 8,
                                                     draft_vocab_size, datastore_path)
        drafter = loaded[v.method, v.width]
        if hasattr(drafter, "synced_timing"):  # a block drafter: its forward's own time, in the table's split
            drafter.synced_timing = True
        chain = drafter.model.config.block_size - 1 if v.method == "dflash" else None
        key = (v.method, min(v.budget, chain) if chain and v.budget != AUTO else v.budget, v.width)
        if key not in seen:  # a chain never outgrows its block: larger budgets would draft the same trees
            seen.add(key)
            runs.append(v)
            drafters[v] = drafter

    def decode(v: Variant, prompt: list[int], tokens: int, seed: int) -> tuple[list[int], float, int, list[Round]]:
        """New tokens, seconds, target forwards after the prefill, and our rounds (none for a baseline)."""
        if v.method in BASELINES:
            return *drafters[v](prompt, tokens, sampling, seed), []
        with target.eager() if v.method == EAGER else nullcontext():
            r = generate(target, drafters[v], prompt, tokens, sampling, v.budget, seed=seed, max_budget=max_budget)
        return r.tokens, r.seconds, len(r.rounds), r.rounds

    encoded = [target.encode_prompt(p) for p in prompts]
    for v in runs:  # warm-up: first calls pay for allocations, lazy initialisation and the cost measurement
        decode(v, encoded[0], 8, seed)

    totals = {v: Totals(per_prompt=[(0, 0.0)] * len(encoded)) for v in runs}  # a prompt's repeats add up
    bar = tqdm(total=repeats * len(encoded) * len(runs), desc="bench", unit="run", disable=not progress, leave=False)
    for repeat, (i, prompt) in itertools.product(range(repeats), enumerate(encoded)):
        first = (repeat * len(encoded) + i) % len(runs)
        for v in runs[first:] + runs[:first]:  # interleaved, each first in turn: noise, and what the run before
            # leaves in the caches (llama.cpp's process evicts our weights), hit every variant alike
            t = totals[v]
            tokens, seconds, forwards, rounds = decode(v, prompt, max_new_tokens, seed + i + repeat * len(encoded))
            t.forward_s += sum(x.forward_s for x in rounds)
            t.adapter_calls += sum(x.adapter_calls for x in rounds)
            t.new_tokens += len(tokens)
            t.seconds += seconds
            t.outputs.append(tokens)
            n, s = t.per_prompt[i]
            t.per_prompt[i] = (n + len(tokens), s + seconds)
            t.rounds += forwards
            t.round_tokens += len(tokens) - 1  # every token but the prefill's came from a decode round
            t.round_expected += sum(x.expected for x in rounds) if rounds else len(tokens) - 1
            bar.update()
            t.drafted_nodes += sum(x.tree_size for x in rounds)
            t.ar_rounds += sum(x.tree_size == 0 for x in rounds)
            t.draft_s += sum(x.draft_s for x in rounds)
            t.verify_s += sum(x.verify_s for x in rounds)
            drafting = [x for x in rounds if x.drafted]
            t.drafting_rounds += len(drafting)
            t.drafting_draft_s += sum(x.draft_s for x in drafting)
            t.drafting_verify_s += sum(x.verify_s for x in drafting)
    bar.close()

    ar = totals[runs[0]]
    ar_tps = ar.new_tokens / ar.seconds
    several_budgets, several_widths = len(set(budgets)) > 1, len(set(tfm_widths)) > 1
    report = {}
    for v, t in totals.items():
        tps = t.new_tokens / t.seconds
        per_round = 1e3 / max(t.rounds, 1)
        report[v.name(several_budgets, several_widths)] = {
            "method": v.method, "budget": None if v.method in ("ar", EAGER, *BASELINES) else v.budget,
            "tfm_width": v.width,
            "tau": t.round_tokens / max(t.rounds, 1),
            # the same mean as tau at T > 0 (equal at T = 0), without the noise of the acceptance draws
            "expected_tau": t.round_expected / max(t.rounds, 1),
            "tokens_per_second": tps,
            "speedup_vs_ar": tps / ar_tps,
            "speedup_vs_ar_interval": list(speedup_interval(t, ar)),  # 90 %, bootstrap over the prompts
            "matches_ar": (t.outputs == ar.outputs) if sampling.greedy else None,
            # at T = 0: prompts whose output equals ar's in every repeat (bf16: batched rounding can flip a near-tie)
            "prompts_matching_ar": sum(t.outputs[i::len(encoded)] == ar.outputs[i::len(encoded)]
                                       for i in range(len(encoded))) if sampling.greedy else None,
            "new_tokens": t.new_tokens,
            "rounds": t.rounds,
            "mean_tree_size": t.drafted_nodes / max(t.rounds, 1),  # draft nodes verified per round
            "ar_round_share": t.ar_rounds / max(t.rounds, 1),  # rounds that verified no draft (AR steps)
            "draft_ms_per_round": t.draft_s * per_round,
            "drafter_forward_ms_per_round": t.forward_s * per_round,
            "tree_build_ms_per_round": (t.draft_s - t.forward_s) * per_round,
            "adapter_calls_per_round": t.adapter_calls / max(t.rounds, 1),
            "verify_ms_per_round": t.verify_s * per_round,
            # the rounds that ran the drafter (probes after AR steps included): what one costs, at the size chosen
            "drafting_round_share": t.drafting_rounds / max(t.rounds, 1),
            "draft_ms_per_drafting_round": 1e3 * t.drafting_draft_s / max(t.drafting_rounds, 1),
            "verify_ms_per_drafting_round": 1e3 * t.drafting_verify_s / max(t.drafting_rounds, 1),
            # [new tokens, seconds] of each prompt, its repeats added up: what the interval resamples (and where
            # a stalled prompt shows)
            "per_prompt": [list(pair) for pair in t.per_prompt],
        }
    for name, why in skipped.items():
        report[name] = {"method": name, "skipped": why}
    return report


def format_table(methods: dict) -> str:
    """τ (E[tau]: its expectation given the trees, less noisy at T > 0), speed, exactness, the chosen tree size and
    share of AR rounds, and the cost of a round: drafter forward, tree build (AR layer / Weaver calls included),
    target verification (with acceptance and commit), each per round; then the drafting rounds alone ("dr", the
    rounds that ran the drafter): their drafting and verification ms, at the tree size they chose. `90% CI`: the
    speedup's bootstrap interval over the prompts."""
    head = (f"{'method':<14} {'tau':>6} {'E[tau]':>6} {'tok/s':>7} {'speedup':>8} {'90% CI':>11} {'matches_ar':>10} "
            f"{'new_tok':>7} {'size':>5} {'AR %':>5} {'fwd ms':>7} {'tree ms':>7} {'calls':>6} {'verify ms':>9} "
            f"{'dr draft':>8} {'dr verify':>9}")
    lines = [head, "-" * len(head)]
    for name, m in methods.items():
        if "skipped" in m:
            lines.append(f"{name:<14} skipped: {m['skipped']}")
            continue
        match = "-" if m["matches_ar"] is None else str(m["matches_ar"]).lower()
        lo, hi = m["speedup_vs_ar_interval"]
        lines.append(f"{name:<14} {m['tau']:>6.2f} {m['expected_tau']:>6.2f} {m['tokens_per_second']:>7.2f} "
                     f"{m['speedup_vs_ar']:>7.2f}x {f'{lo:.2f}-{hi:.2f}':>11} {match:>10} {m['new_tokens']:>7} "
                     f"{m['mean_tree_size']:>5.1f} {100 * m['ar_round_share']:>5.1f} "
                     f"{m['drafter_forward_ms_per_round']:>7.1f} {m['tree_build_ms_per_round']:>7.1f} "
                     f"{m['adapter_calls_per_round']:>6.1f} {m['verify_ms_per_round']:>9.1f} "
                     f"{m['draft_ms_per_drafting_round']:>8.1f} {m['verify_ms_per_drafting_round']:>9.1f}")
    return "\n".join(lines)
