"""Do the plain AR rounds of a drafting engine cost what `ar`'s do? Every engine decodes the same prompts in one
process, interleaved prompt by prompt (same seeds); each AR round (no draft verified) is compared with `ar`'s round
at the same output position of the same prompt, whose context is as long. Drafting engines skip the drafter in
most rounds where it does not pay, so their AR stretches sit where drafting fails: comparing means over all AR
rounds mixes in the context's length.

    .venv/bin/python scripts/ar_round_costs.py --dataset chat-dev --temperature 1 --methods pld,dflash
"""

import argparse
import json
import statistics
from pathlib import Path

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.verify import Sampling


def ar_round_ms(result) -> dict[int, float]:
    """Milliseconds of each AR round, by the output position it starts at."""
    position, table = 0, {}
    for r in result.rounds:
        if not r.drafted and r.tree_size == 0:
            table[position] = 1e3 * (r.draft_s + r.verify_s)
        position += r.accepted
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--methods", default="pld,dflash")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="on")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    methods = args.methods.split(",")
    engines = {m: make_drafter(m, target) for m in ["ar"] + methods}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for seed, prompt in enumerate(prompts):
            rounds = {m: ar_round_ms(generate(target, drafter, prompt, args.max_new_tokens,
                                              Sampling(temperature=args.temperature), seed=seed))
                      for m, drafter in engines.items()}
            for m in methods:
                ratios[m] += [ms / rounds["ar"][j] for j, ms in rounds[m].items() if j in rounds["ar"]]
    report = {m: {"rounds": len(v), "median_ratio": statistics.median(v), "mean_ratio": statistics.mean(v)}
              for m, v in ratios.items()}
    for m, r in report.items():
        print(f"{m}: {r['rounds']} AR rounds at ar's positions, their cost / ar's: median {r['median_ratio']:.4f}, "
              f"mean {r['mean_ratio']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dataset": args.dataset, "temperature": args.temperature,
                                              **report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
