"""Does DDTree build better trees from recalibrated marginals? Variants of its best-first tree, each scored on the
rounds that plain `ddtree` drives (`treeflash paired`'s method: E[accepted] of every tree on one continuation):
a temperature T over the whole vocabulary, or a per-depth exponent p_d ** (1 - g * (d - 1)) (g > 0: deeper trees,
g < 0: wider). fp32, one thread, the shipped drafter, B = 16.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ddtree_calibration.py --dataset chat-dev --out F.json
"""

import argparse
import json
from pathlib import Path

import torch

from treeflash import Target
from treeflash.drafters import make_drafter
from treeflash.drafters.block import BlockDrafter
from treeflash.eval.datasets import load_prompts
from treeflash.eval.paired import format_paired, run_paired
from treeflash.trees import best_first_tree


class Recalibrated:
    """BestFirst over the marginals at temperature `temperature`, raised per depth to 1 - g * (depth - 1)."""

    def __init__(self, temperature: float = 1.0, g: float = 0.0):
        self.temperature, self.g = temperature, g

    def __call__(self, drafter, tokens, h, budget):
        scores = drafter.model.scores(h).float() / self.temperature
        logits, index = scores.topk(min(budget, scores.shape[-1]), dim=-1)
        exponent = 1 - self.g * torch.arange(h.shape[0], dtype=torch.float32)[:, None]
        probs = ((logits - scores.logsumexp(-1, keepdim=True)) * exponent).exp()
        ids = index if drafter.model.draft_vocab is None else drafter.model.draft_vocab[index]
        return best_first_tree(tokens[-1], probs, ids, budget), 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--temperatures", default="0.8,1.25")
    p.add_argument("--exponents", default="-0.05,0.05,0.1", help="values of g")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="float32")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    drafters = {"ddtree@16": (make_drafter("ddtree", target), 16)}
    builders = {f"T={t}": Recalibrated(temperature=float(t)) for t in args.temperatures.split(",")}
    builders |= {f"g={g}": Recalibrated(g=float(g)) for g in args.exponents.split(",")}
    for name, builder in builders.items():  # a model each: drafters keep per-sequence state
        drafters[name] = (BlockDrafter(make_drafter("ddtree", target).model, builder, "ddtree"), 16)
    report = run_paired(target, prompts, drafters, max_new_tokens=128, progress=False)
    print(args.dataset)
    print(format_paired(report))
    if args.out:
        report = {"dataset": args.dataset, **{k: v for k, v in report.items() if k != "outputs"}}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
