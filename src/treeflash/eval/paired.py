"""`treeflash paired`: tree builders compared on one shared continuation, by E[accepted | tree].

In `bench` every method samples its own continuation, so at T > 0 two methods' τ differ also by what they happened
to decode. Here the first variant drives decoding exactly as `generate` does (its tree is verified, accepted and
committed); at every round each other variant proposes its tree for the same context, which the target verifies
and then discards. Every tree is scored by verify.expected_accepted: paired ratios, free of both kinds of sampling
noise, for the cost of one extra verification per variant and round. Speed is not measured here (see `bench`).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from ..drafters import make_drafter
from ..engine import OneLane, OneSequence, Sequence, run_round
from ..runtime import Target
from ..verify import Sampling, expected_accepted
from .bench import variants


def run_paired(target: Target, prompts: list[list[int]], drafters: dict[str, tuple[object, int]],
               sampling: Sampling = Sampling(), max_new_tokens: int = 128, seed: int = 0,
               progress: bool = True) -> dict:
    """prompts: token ids; drafters: NAME -> (drafter, budget), one drafter object each (drafters keep
    per-sequence state); the first drives. Returns, per NAME, E[tau] and its ratio to the first's, and the driver's
    new tokens per prompt."""
    names = list(drafters)
    taps = {d.taps for d, _ in drafters.values()} - {()}
    if len(taps) > 1:
        raise ValueError("paired variants must tap the same target layers (one drafter backbone)")
    taps = taps.pop() if taps else ()
    totals, rounds, outputs, verifier = dict.fromkeys(names, 0.0), 0, [], OneSequence(target)
    # per prompt, each variant's summed E[accepted] and the rounds: what a bootstrap over prompts resamples
    prompt_totals, prompt_rounds = {n: [] for n in names}, []
    for i, prompt in enumerate(tqdm(prompts, desc="paired", unit="prompt", disable=not progress, leave=False)):
        start_totals, start_rounds = dict(totals), rounds
        generator = torch.Generator(device=target.device).manual_seed(seed + i)
        for drafter, _ in drafters.values():
            drafter.reset()
        seq = Sequence.start(prompt, target.prefill(prompt, taps=taps), sampling, generator)
        while not seq.done(max_new_tokens, target.eos_ids):
            room, wanted = verifier.room(), max_new_tokens - len(seq.emitted)
            for name in names[1:]:  # every other variant's tree, for the context the driver is about to extend
                drafter, budget = drafters[name]
                tree = drafter.propose(seq.tokens, seq.features, min(budget, room))
                totals[name] += min(expected_accepted(tree, target.verify(tree).logits, sampling), wanted)
                target.discard()
            driver, budget = drafters[names[0]]
            outcome = run_round(verifier, OneLane(driver), [seq], [sampling], [generator], budget)
            kept = seq.extend(outcome.new[0], max_new_tokens, target.eos_ids)  # stop where `generate` stops
            totals[names[0]] += outcome.record(0, kept).expected  # as `generate` counts τ
            rounds += 1
        outputs.append(seq.emitted)
        prompt_rounds.append(rounds - start_rounds)
        for n in names:
            prompt_totals[n].append(totals[n] - start_totals[n])
    base = totals[names[0]]
    return {"rounds": rounds, "outputs": outputs, "prompt_rounds": prompt_rounds,
            "methods": {n: {"expected_tau": totals[n] / max(rounds, 1), "ratio_to_first": totals[n] / base,
                            "prompt_totals": prompt_totals[n]} for n in names}}


def paired_drafters(target: Target, methods: list[str], budgets: list[int], tfm_widths: list[int],
                    drafter_path: str | None = None, weaver_paths: list[str] | None = None,
                    draft_vocab_size: int | None = None, datastore_path: str | None = None) -> dict:
    """One drafter per (method, budget, width) variant of `bench`'s sweep, `ar` left out. Several Weaver folders
    (checkpoints of one backbone) give every tfm variant once per Weaver, named with the suffix #1, #2, ... in the
    list's order; None: the shipped Weaver."""
    out = {}
    chosen = [v for v in variants(methods, budgets, tfm_widths) if v.method != "ar"]
    several_budgets, several_widths = len(set(budgets)) > 1, len(set(tfm_widths)) > 1
    weavers = list(weaver_paths or [None])
    for v in chosen:
        name = v.name(several_budgets, several_widths)
        for i, weaver in enumerate(weavers if v.method == "tfm" else [None], start=1):
            drafter = make_drafter(v.method, target, drafter_path, weaver, v.width or 8, draft_vocab_size,
                                   datastore_path)
            out[f"{name}#{i}" if v.method == "tfm" and len(weavers) > 1 else name] = (drafter, v.budget)
    return out


def format_paired(report: dict) -> str:
    names = list(report["methods"])
    width = max(16, *map(len, names))  # oracle variants' names are long
    lines = [f"{'variant':<{width}} {'E[tau]':>7} {'/ ' + names[0]:>16}", "-" * (width + 25)]
    for name, m in report["methods"].items():
        lines.append(f"{name:<{width}} {m['expected_tau']:>7.3f} {m['ratio_to_first']:>15.3f}x")
    return "\n".join(lines)
