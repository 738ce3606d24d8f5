"""ms per eagle3 drafting round right after a target AR step (its catch-up of 1 position, then the tree), on the
longest of a data set's first prompts, at a few budgets: the command line's defaults for the target, medians; the
drafter 4-bit (as loaded where the target is) and dense.

    python scripts/eagle3_round.py [--drafter data/stages/smollm2-135m-instruct-eagle3] [--dataset chat-dev]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from treeflash import DraftTree, Target
from treeflash.drafters.load import load_eagle3_drafter
from treeflash.eval.datasets import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", default="data/stages/smollm2-135m-instruct-eagle3")
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--budgets", default="2,4,16")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--top-k", type=int, default=None, help="children per node and frontier width (the method's: 8)")
    p.add_argument("--out")
    args = p.parse_args()
    target = Target.load(dtype="auto", compile="auto")
    prompt = max((target.encode_prompt(t) for t in load_prompts(args.dataset, limit=10)), key=len)
    tokens, ms = prompt + [5], {}
    for products, four_bit in (("4-bit", True), ("dense", False)):  # the drafter's linears (4-bit: the default)
        if four_bit and not target.int4_products:
            continue
        drafter = load_eagle3_drafter(target, args.drafter, int4_products=four_bit)
        drafter.top_k = args.top_k or drafter.top_k
        taps = target.prefill(prompt, taps=drafter.taps).hidden
        with torch.no_grad():
            for budget in map(int, args.budgets.split(",")):
                times = []
                for _ in range(args.repeats):
                    drafter.reset()
                    drafter.observe(tokens, taps[:-1])  # every position but the last, as after a few AR steps
                    target.verify(DraftTree.chain(5))
                    target.discard()
                    start = time.perf_counter()
                    drafter.propose(tokens, taps[-1:], budget)
                    times.append(time.perf_counter() - start)
                ms[f"{products}@{budget}"] = 1e3 * statistics.median(times)
                print(f"context {len(prompt)}, {products} drafter, budget {budget}: "
                      f"{ms[f'{products}@{budget}']:.2f} ms a round", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": len(prompt), "top_k": drafter.top_k, "ms_per_round": ms, "repeats": args.repeats},
                      f, indent=1)


if __name__ == "__main__":
    main()
