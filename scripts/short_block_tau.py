"""τ with the DFlash drafter's block cut to budget + 1 positions, against its full block (issue #29, cheap drafting).

A drafting round's forward runs every position of the block (16 for the shipped drafter) although a tree of B nodes
reads only the first B. Cutting the block to B + 1 cuts the forward's rows, but the block attends to itself in both
directions, so the states of the first positions change too. This measures what that costs in τ (fp32, T = 0, plain
`generate` at a fixed budget; τ does not depend on timing), for the shipped drafter or one trained for short blocks
(`train dflash --short-blocks`, which drafts from B + 1 positions by default).

    python scripts/short_block_tau.py --dataset gsm8k --limit 5 --max-new-tokens 96 --out short-block-gsm8k.json
"""

from __future__ import annotations

import argparse
import json

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts


def tau_parser(description: str, limit: int, max_new_tokens: int, budgets: str) -> argparse.ArgumentParser:
    """The options of the τ scripts that compare a drafter variant with the drafter as trained."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=limit)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--budgets", default=budgets)
    p.add_argument("--drafter", help="a DFlash drafter folder (default: the shipped one)")
    p.add_argument("--out")
    return p


def mean_tau(results) -> float:
    """τ over every round of these `generate` results."""
    return sum(r.tau * len(r.rounds) for r in results) / sum(len(r.rounds) for r in results)


def main() -> None:
    args = tau_parser(__doc__.split("\n")[0], limit=5, max_new_tokens=96, budgets="2,4,8").parse_args()
    target = Target.load("smollm2-135m-instruct", dtype="float32")
    prompts = [target.encode_prompt(t) for t in load_prompts(args.dataset, limit=args.limit)]
    drafter = make_drafter("ddtree", target, args.drafter)
    config, rows = drafter.model.config, []
    trained_short = config.short_blocks
    for budget in map(int, args.budgets.split(",")):
        for short in (False, True):
            config.short_blocks = short  # the drafter reads it for the block's rows (DFlashDrafter.block_rows)
            block = drafter.model.block_rows(budget + 1)
            results = [generate(target, drafter, ids, args.max_new_tokens, budget=budget) for ids in prompts]
            config.short_blocks = trained_short
            tau = mean_tau(results)
            rows.append({"budget": budget, "block": block, "tau": tau})
            print(f"{args.dataset} ddtree budget {budget} block {block}: tau {tau:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter or "shipped", "dataset": args.dataset, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
