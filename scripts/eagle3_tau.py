"""τ of an EAGLE-3 drafter (method eagle3) beside the shipped DFlash drafter's ddtree, at fixed budgets on the same
prompts (fp32 target, T = 0: τ does not depend on timing), for issue 34's table.

    python scripts/eagle3_tau.py --drafter runs/eagle3/drafter --out docs/results/eagle3/tau.json
"""

from __future__ import annotations

import argparse
import json

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="the EAGLE-3 drafter folder")
    p.add_argument("--datasets", default="chat-dev,gsm8k,humaneval,mbpp")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="4,16")
    p.add_argument("--out")
    args = p.parse_args()
    target = Target.load("smollm2-135m-instruct", dtype="float32")
    drafters = {"ddtree": make_drafter("ddtree", target), "eagle3": make_drafter("eagle3", target, args.drafter)}
    rows = []
    for dataset in args.datasets.split(","):
        prompts = [target.encode_prompt(t) for t in load_prompts(dataset, limit=args.limit)]
        for budget in map(int, args.budgets.split(",")):
            for method, drafter in drafters.items():
                results = [generate(target, drafter, ids, args.max_new_tokens, budget=budget) for ids in prompts]
                tau = sum(r.tau * len(r.rounds) for r in results) / sum(len(r.rounds) for r in results)
                rows.append({"dataset": dataset, "budget": budget, "method": method, "tau": tau})
                print(f"{dataset:10s} B = {budget:2d} {method:7s} tau {tau:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                       "dtype": "float32", "temperature": 0.0, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
