"""Do the plain AR rounds of a drafting engine cost what `ar`'s do? Every engine decodes the same prompts in one
process, interleaved prompt by prompt (same seeds); each AR round (no draft verified) is compared with `ar`'s round
at the same output position of the same prompt, whose context is as long. Drafting engines skip the drafter in
most rounds where it does not pay, so their AR stretches sit where drafting fails: comparing means over all AR
rounds mixes in the context's length. The rounds right after a drafting round are also reported apart: the
drafter's forward leaves the target's weights out of the caches. The engines take turns at going first.

`--never-draft`: the methods' policies never draft, and `ar+taps` (plain steps that keep the first method's
target taps, as the drafting engines do) joins them: what an AR round of a drafting engine costs above `ar`'s, and
how much of it the taps are.

    .venv/bin/python scripts/ar_round_costs.py --dataset chat-dev --temperature 1 --methods pld,dflash
    .venv/bin/python scripts/ar_round_costs.py --dataset gsm8k --temperature 0 --methods dflash,treeflash --never-draft
"""

import argparse
import json
import statistics
from pathlib import Path

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.engine import default_max_budget
from treeflash.speculation import policy_for
from treeflash.verify import Sampling


def ar_round_ms(result) -> dict[int, tuple[float, bool]]:
    """Milliseconds of each AR round, and whether a drafting round came just before it, by the output position
    it starts at."""
    position, table, after_drafting = 0, {}, False
    for r in result.rounds:
        if not r.drafted and r.tree_size == 0:
            table[position] = (1e3 * (r.draft_s + r.verify_s), after_drafting)
        position += r.accepted
        after_drafting = r.drafted
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--methods", default="pld,dflash")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--never-draft", action="store_true", help="the methods never draft; adds ar+taps")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="on")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    methods = args.methods.split(",")
    engines = {m: make_drafter(m, target) for m in ["ar"] + methods}
    if args.never_draft:
        for m in methods:  # the policy `generate` will use (budget auto)
            policy_for(target, engines[m], default_max_budget(target.device)).should_draft = lambda: False
        engines["ar+taps"] = make_drafter("ar", target)
        engines["ar+taps"].taps = engines[methods[0]].taps
        methods.append("ar+taps")
    # the cost ratios of each method's AR rounds: all, and those right after an AR round / a drafting round
    ratios = {(m, kind): [] for m in methods for kind in ("all", "after_ar", "after_drafting")}
    names = list(engines)
    for _ in range(args.repeats):
        for seed, prompt in enumerate(prompts):
            turn = seed % len(names)  # who goes first
            rounds = {m: ar_round_ms(generate(target, engines[m], prompt, args.max_new_tokens,
                                              Sampling(temperature=args.temperature), seed=seed))
                      for m in names[turn:] + names[:turn]}
            for m in methods:
                for j, (ms, after_drafting) in rounds[m].items():
                    if j in rounds["ar"]:
                        ratio = ms / rounds["ar"][j][0]
                        ratios[m, "all"].append(ratio)
                        ratios[m, "after_drafting" if after_drafting else "after_ar"].append(ratio)
    report = {m: {kind: {"rounds": len(v), "median_ratio": statistics.median(v), "mean_ratio": statistics.mean(v)}
                  for (method, kind), v in ratios.items() if method == m and v} for m in methods}
    for m, kinds in report.items():
        for kind, r in kinds.items():
            print(f"{m}, {kind.replace('_', ' ')}: {r['rounds']} AR rounds at ar's positions, their cost / ar's: "
                  f"median {r['median_ratio']:.4f}, mean {r['mean_ratio']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dataset": args.dataset, "temperature": args.temperature,
                                              "never_draft": args.never_draft, **report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
