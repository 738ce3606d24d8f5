"""How far could a better Weaver lift TfM? TfM's tree with a perfect Weaver: every node it expands gets the
target's own conditional (softmax at T = 1, as the Weaver is trained to give) over its depth's top-K marginal
candidates, read from a verify of the tree built so far. Scored beside the shipped TfM and TreeFlash on the rounds
that `ddtree` drives (`treeflash paired`'s method: E[accepted] of every tree on one continuation). fp32, one thread.

- `oracle w=8` (`--widths 8`): TfM's schedule exactly (w nodes a call, the last batch grown on by the marginals);
- `root=marginal`: the root's children by the drafter's depth-1 marginal, every deeper call by the target: what
  conditioning on the realised parents alone can add (a Weaver's root call knows no more than the drafter);
- `oracle w=1`: best-first one node at a time on the true conditionals: the best tree of B nodes that a drafter
  restricted to the marginal's top-K candidates can build for a soft (T = 1) target (B - 1 verifies a round: slow).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/weaver_oracle.py --dataset chat-dev --out F.json
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
from treeflash.tree import DraftTree
from treeflash.trees.parallel import parallel_tree


class OracleWeave:
    """TfM's parallel best-first tree, each call scored by the target instead of a Weaver (counts its verifies)."""

    def __init__(self, target: Target, width: int, root: str = "target", top_k: int = 512):
        self.target, self.width, self.root, self.top_k = target, width, root, top_k
        self.verifies = 0

    def __call__(self, drafter, tokens, h, budget):
        cand_logits, _, candidates = drafter.model.top_tokens(h, self.top_k)
        marginals = torch.softmax(cand_logits, dim=-1)  # TfM's: the last batch grows on by the marginals

        def expand(nodes, tree_tokens, parents, depths):
            if nodes == [0] and self.root == "marginal":  # the depth-1 marginal: what conditioning cannot add to
                return [marginals[0]]
            self.verifies += 1
            logits = self.target.verify(DraftTree.from_parents(tree_tokens, parents)).logits
            self.target.discard()
            probs = torch.softmax(logits[nodes].float(), dim=-1)
            return [probs[i, candidates[depths[n]]] for i, n in enumerate(nodes)]

        return parallel_tree(tokens[-1], candidates, expand, budget, self.width, fallback=marginals), 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--drafter", help="DFlash backbone folder (default: the shipped one)")
    p.add_argument("--weaver", help="Weaver folder on that backbone (default: the shipped one)")
    p.add_argument("--treeflash", help="TreeFlash drafter folder on that backbone (default: the shipped one)")
    p.add_argument("--widths", default="8", help="oracle widths w (commas)")
    p.add_argument("--roots", default="target,marginal", help="what expands the root: target, marginal (commas)")
    p.add_argument("--compare", default="treeflash,tfm", help="shipped methods scored beside the oracles (commas; "
                   "ddtree always drives)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="float32")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    b = args.budget
    shipped = {"treeflash": lambda: make_drafter("treeflash", target, args.treeflash),
               "tfm": lambda: make_drafter("tfm", target, args.drafter, args.weaver, 8)}
    drafters = {f"ddtree@{b}": (make_drafter("ddtree", target, args.drafter), b)}
    drafters |= {f"{m}@{b}": (shipped[m](), b) for m in filter(None, args.compare.split(","))}
    oracles = {f"oracle w={w} root={r}": OracleWeave(target, w, r)
               for w in map(int, args.widths.split(",")) for r in args.roots.split(",")}
    for name, builder in oracles.items():  # a model each: drafters keep per-sequence state
        drafters[f"{name}@{b}"] = (BlockDrafter(make_drafter("ddtree", target, args.drafter).model, builder, "tfm"), b)
    report = run_paired(target, prompts, drafters, max_new_tokens=args.max_new_tokens, progress=True)
    report["oracle_verifies_per_round"] = {n: o.verifies / max(report["rounds"], 1) for n, o in oracles.items()}
    print(args.dataset)
    print(format_paired(report))
    print("oracle verifies a round:", {n: round(v, 2) for n, v in report["oracle_verifies_per_round"].items()})
    if args.out:
        report = {"dataset": args.dataset, "args": vars(args), **{k: v for k, v in report.items() if k != "outputs"}}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
