"""τ of a drafter with its linears rounded to 4 bits, against its trained weights (issue #29, cheap drafting).

Where the target multiplies 4-bit (its GGUF on a CPU), the drafter's linears are rounded to 4 bits too, so that its
products run on the same kernel (`drafters.load.load_drafter_model`). That changes the drafts, never the decoded
tokens; this measures what it costs in τ: fp32 target, T = 0, plain `generate` at fixed budgets (τ does not depend
on timing), each method with the dense drafter and the 4-bit one over the same prompts.

    python scripts/int4_drafter_tau.py --dataset gsm8k --out int4-tau-gsm8k.json
    python scripts/int4_drafter_tau.py --methods eagle3 --eagle3 data/stages/smollm2-135m-instruct-eagle3
"""

from __future__ import annotations

import json

from treeflash import Target, generate
from treeflash.drafters import block_drafter
from treeflash.drafters.load import default_drafter_path, load_drafter_model, load_eagle3_drafter
from treeflash.eval.datasets import load_prompts

from short_block_tau import mean_tau, tau_parser  # (scripts/)


def main() -> None:
    p = tau_parser(__doc__.split("\n")[0], limit=10, max_new_tokens=128, budgets="2,4,16")
    p.add_argument("--methods", default="dflash,ddtree,treeflash")
    p.add_argument("--treeflash", help="a TreeFlash drafter folder (default: the shipped one)")
    p.add_argument("--eagle3", help="an EAGLE-3 drafter folder (for method eagle3)")
    args = p.parse_args()
    target = Target.load("smollm2-135m-instruct", dtype="float32")
    prompts = [target.encode_prompt(t) for t in load_prompts(args.dataset, limit=args.limit)]
    rows = []
    for method in args.methods.split(","):
        kind = "treeflash" if method == "treeflash" else "dflash"
        path = (args.treeflash if kind == "treeflash" else args.drafter) or default_drafter_path(target.name, kind)
        for four_bit in (False, True):
            if method == "eagle3":
                drafter = load_eagle3_drafter(target, args.eagle3, int4_products=four_bit)
            else:
                drafter = block_drafter(load_drafter_model(target, path, int4_products=four_bit), method)
            for budget in map(int, args.budgets.split(",")):
                results = [generate(target, drafter, ids, args.max_new_tokens, budget=budget) for ids in prompts]
                tau = mean_tau(results)
                products = "4-bit" if four_bit else "dense"
                rows.append({"method": method, "budget": budget, "products": products, "tau": tau})
                print(f"{args.dataset} {method}@{budget} {products}: tau {tau:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter or "shipped", "treeflash": args.treeflash or "shipped",
                       "eagle3": args.eagle3,
                       "dataset": args.dataset, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
