"""`treeflash bench`: every method on the same prompts, interleaved, in one run; τ, speed and exactness."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from ..drafters import make_drafter
from ..engine import generate
from ..target import Target
from ..verify import Sampling


@dataclass
class MethodTotals:
    new_tokens: int = 0
    seconds: float = 0.0
    round_tokens: int = 0  # tokens committed in decode rounds (τ's numerator)
    rounds: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def run_bench(target: Target, prompts: list[str], methods: list[str], budget: int = 16,
              sampling: Sampling = Sampling(), max_new_tokens: int = 128, seed: int = 0,
              progress: bool = True, drafter_path: str | None = None, weaver_path: str | None = None,
              tfm_width: int = 8) -> dict:
    """Run `methods` (ar first, added if missing: it is the speed and exactness reference) on every prompt."""
    methods = ["ar"] + [m for m in methods if m != "ar"]
    drafters = {m: make_drafter(m, target, drafter_path, weaver_path, tfm_width) for m in methods}
    encoded = [target.encode_prompt(p) for p in prompts]
    for drafter in drafters.values():  # warm-up: first calls pay for allocations and lazy initialisation
        generate(target, drafter, encoded[0], max_new_tokens=8, sampling=sampling, budget=budget, seed=seed)

    totals = {m: MethodTotals() for m in methods}
    bar = tqdm(total=len(encoded) * len(methods), desc="bench", unit="run", disable=not progress, leave=False)
    for i, prompt in enumerate(encoded):
        for m in methods:  # interleaved, so that machine noise hits every method alike
            r = generate(target, drafters[m], prompt, max_new_tokens, sampling, budget, seed=seed + i)
            t = totals[m]
            t.new_tokens += len(r.tokens)
            t.seconds += r.seconds
            t.round_tokens += sum(x.accepted for x in r.rounds)
            t.rounds += len(r.rounds)
            t.draft_s += sum(x.draft_s for x in r.rounds)
            t.verify_s += sum(x.verify_s for x in r.rounds)
            t.outputs.append(r.tokens)
            bar.update()
    bar.close()

    ar = totals["ar"]
    ar_tps = ar.new_tokens / ar.seconds
    report = {}
    for m, t in totals.items():
        tps = t.new_tokens / t.seconds
        report[m] = {
            "tau": t.round_tokens / max(t.rounds, 1),
            "tokens_per_second": tps,
            "speedup_vs_ar": tps / ar_tps,
            "matches_ar": (t.outputs == ar.outputs) if sampling.greedy else None,
            "new_tokens": t.new_tokens,
            "rounds": t.rounds,
            "draft_ms_per_round": 1e3 * t.draft_s / max(t.rounds, 1),
            "verify_ms_per_round": 1e3 * t.verify_s / max(t.rounds, 1),
        }
    return report


def format_table(methods: dict) -> str:
    head = f"{'method':<10} {'tau':>6} {'tok/s':>8} {'speedup':>8} {'matches_ar':>10} {'new_tokens':>10}"
    lines = [head, "-" * len(head)]
    for name, m in methods.items():
        match = "-" if m["matches_ar"] is None else str(m["matches_ar"]).lower()
        lines.append(f"{name:<10} {m['tau']:>6.2f} {m['tokens_per_second']:>8.2f} {m['speedup_vs_ar']:>7.2f}x "
                     f"{match:>10} {m['new_tokens']:>10}")
    return "\n".join(lines)
